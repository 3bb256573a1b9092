"""Exports of EAGLE3 drafts (sglang / speculators / gguf) on tiny random drafts.

Round trips give identical logits; names, shapes, keys and the aux-layer-id convention are pinned;
the GGUF is checked numerically with a reference forward that follows llama.cpp's eagle3 graph.
"""
from __future__ import annotations

import json
import shutil

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from drafthead.eagle3 import Eagle3Config, Eagle3Drafter
from drafthead.eagle3 import FAMILY as EAGLE3
from drafthead.export import ExportError, export
from drafthead.export.eagle3 import load_exported
from drafthead.export import eagle3_sglang as sglang_export
from drafthead.export import eagle3_speculators as spec_export
from drafthead.export import gguf as gguf_export
from drafthead.registry import save_draft
from drafthead.target import Target, capture, freeze
from drafthead.vocab import build_vocab_mapping

EXPORTERS = EAGLE3.exporters
V, H, LAYERS, N = 256, 64, 4, 128
AUX = [2, 1, 3]  # inputs of target layers 2, 1, 3 (order matters: fc reads them concatenated)


def tiny_target_config(**kw) -> LlamaConfig:
    base = dict(vocab_size=V, hidden_size=H, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-5)
    base.update(kw)
    return LlamaConfig(**base)


def write_target_gguf(path, vocab: int = V, hidden: int = H, layers: int = LAYERS) -> None:
    """A weightless target GGUF: only what exports read (dims + tokenizer metadata)."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_embedding_length(hidden)
    w.add_context_length(512)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"tok{i}" for i in range(vocab)])
    w.add_token_types([1] * vocab)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template("{{ messages }}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    torch.manual_seed(0)
    tcfg = tiny_target_config()
    target = freeze(Target(LlamaForCausalLM(tcfg).eval(), None, "tiny"))
    tdir = root / "target"
    tcfg.save_pretrained(tdir)
    write_target_gguf(tdir / "tiny.gguf")

    dcfg = Eagle3Config.from_target(tcfg, draft_vocab_size=N, aux_layer_ids=AUX)
    drafter = Eagle3Drafter(dcfg)
    emb = target.model.get_input_embeddings().weight.detach().clone()
    drafter.embed_tokens.weight.data.copy_(emb)
    counts = torch.randint(0, 1000, (V,))
    d2t, t2d = build_vocab_mapping(counts, N)
    drafter.d2t.copy_(d2t)
    drafter.t2d.copy_(t2d)
    with torch.no_grad():  # norms away from 1 so a swapped norm shows
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.add_(0.3 * torch.randn_like(p))
    drafter.eval()
    info = {"name_or_path": str(tdir), "gguf_file": "tiny.gguf", "architecture": "LlamaForCausalLM",
            "model_type": "llama", "num_hidden_layers": LAYERS, "hidden_size": H, "vocab_size": V}
    ddir = save_draft(drafter, root / "draft", info)
    return {"root": root, "tcfg": tcfg, "target": target, "tdir": tdir, "drafter": drafter, "draft": ddir,
            "emb": emb}


def decode_inputs(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (2, 7), generator=g)
    aux = torch.randn(2, 7, 3 * H, generator=g)
    pos = torch.arange(7).expand(2, 7)
    return ids, aux, pos


def draft_logits(drafter, seed: int = 1) -> torch.Tensor:
    ids, aux, pos = decode_inputs(seed)
    with torch.no_grad():
        return drafter.decode(ids, drafter.fuse(aux), pos)[0]


# ---------------------------------------------------------------------------------------------
# round trips

@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
def test_roundtrip_identical_logits(setup, tmp_path, fmt):
    out = export(setup["draft"], fmt, tmp_path / fmt, outtype="f32")  # fp32: the layout, bit for bit
    back = load_exported(out, embed_weight=setup["emb"])
    assert back.config.to_dict() == setup["drafter"].config.to_dict()
    assert torch.equal(draft_logits(back), draft_logits(setup["drafter"]))
    assert torch.equal(back.d2t, setup["drafter"].d2t) and torch.equal(back.t2d, setup["drafter"].t2d)


@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
def test_roundtrip_from_server_fields_only(setup, tmp_path, fmt):
    """Without our private `drafthead` section the config is rebuilt from the fields servers read."""
    out = export(setup["draft"], fmt, tmp_path / fmt, outtype="f32")
    cfg = json.loads((out / "config.json").read_text())
    del cfg["drafthead"]
    (out / "config.json").write_text(json.dumps(cfg))
    back = load_exported(out, embed_weight=setup["emb"])
    assert back.config.aux_layer_ids == AUX
    assert torch.equal(draft_logits(back), draft_logits(setup["drafter"]))


@pytest.fixture(scope="module")
def setup31(setup, tmp_path_factory):
    """The same draft with the EAGLE 3.1 norms on (fc_norm weights away from 1)."""
    dcfg = Eagle3Config(**{**setup["drafter"].config.to_dict(), "fc_norm": True, "norm_output": True})
    drafter = Eagle3Drafter(dcfg)
    drafter.load_state_dict(setup["drafter"].state_dict(), strict=False)
    with torch.no_grad():
        for norm in drafter.fc_norm:
            norm.weight.add_(0.3 * torch.randn_like(norm.weight))
    info = json.loads((setup["draft"] / "config.json").read_text())["target"]
    ddir = save_draft(drafter.eval(), tmp_path_factory.mktemp("export31") / "draft", info)
    return {"drafter": drafter, "draft": ddir}


@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
@pytest.mark.parametrize("own_section", [True, False])
def test_eagle31_roundtrip(setup, setup31, tmp_path, fmt, own_section):
    """fc_norm / norm_output travel as the fields servers read, with the `fc_norm.{i}.weight` tensors."""
    out = export(setup31["draft"], fmt, tmp_path / fmt, outtype="f32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["fc_norm"] is True and cfg["norm_output"] is True
    sd = load_file(str(out / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in sd.items() if "fc_norm" in k} == {f"fc_norm.{i}.weight": (H,)
                                                                            for i in range(3)}
    if not own_section:
        del cfg["drafthead"]
        (out / "config.json").write_text(json.dumps(cfg))
    back = load_exported(out, embed_weight=setup["emb"])
    assert back.config.fc_norm and back.config.norm_output
    assert torch.equal(draft_logits(back), draft_logits(setup31["drafter"]))
    assert not torch.equal(draft_logits(back), draft_logits(setup["drafter"]))  # the norms are in the math


def test_eagle31_plain_exports_say_false(setup, tmp_path):
    for fmt in ("sglang", "speculators"):
        cfg = json.loads((export(setup["draft"], fmt, tmp_path / fmt) / "config.json").read_text())
        assert cfg["fc_norm"] is False and cfg["norm_output"] is False


def test_eagle31_refused_where_it_cannot_be_expressed(setup, setup31, tmp_path):
    with pytest.raises(ExportError, match="EAGLE 3.1 fc_norm and norm_output.*llama.cpp"):
        export(setup31["draft"], "gguf", tmp_path / "o.gguf")
    assert_nothing_written(tmp_path / "o.gguf")
    out = export(setup["draft"], "speculators", tmp_path / "sp")
    cfg = json.loads((out / "config.json").read_text())
    del cfg["drafthead"]
    cfg["norm_before_fc"] = True  # speculators' gpt-oss norm over the concatenation: not ours
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ExportError, match="norm_before_fc"):
        load_exported(out)


def test_sglang_eagle_config_only_is_read_with_sglang_semantics(setup, tmp_path):
    """A third-party SGLang checkpoint with only eagle_config ids (SpecForge: output-of-layer, first id 1)."""
    out = export(setup["draft"], "sglang", tmp_path / "s")
    cfg = json.loads((out / "config.json").read_text())
    del cfg["drafthead"], cfg["eagle_aux_hidden_state_layer_ids"]
    (out / "config.json").write_text(json.dumps(cfg))
    assert load_exported(out).config.aux_layer_ids == AUX


@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
def test_serving_layouts_default_to_the_dtype_engines_serve(setup, tmp_path, fmt):
    """No outtype: bf16 (vLLM / SGLang cast nothing on load), fp16 beside a target whose checkpoint is fp16;
    outtype=f32 keeps the draft's fp32 weights."""
    def written(out):
        sd = load_file(str(out / "model.safetensors"))
        return sd["fc.weight"].dtype, json.loads((out / "config.json").read_text())["torch_dtype"]

    assert written(export(setup["draft"], fmt, tmp_path / "default")) == (torch.bfloat16, "bfloat16")
    assert written(export(setup["draft"], fmt, tmp_path / "f32", outtype="f32")) == (torch.float32, "float32")
    fp16 = tmp_path / "fp16_target"
    shutil.copytree(setup["tdir"], fp16)
    cfg = json.loads((fp16 / "config.json").read_text())
    (fp16 / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "float16"}))
    assert written(export(setup["draft"], fmt, tmp_path / "f16", target=str(fp16))) == (torch.float16, "float16")


def test_outtype_bf16_safetensors(setup, tmp_path):
    out = export(setup["draft"], "sglang", tmp_path / "bf", outtype="bf16")
    sd = load_file(str(out / "model.safetensors"))
    assert sd["fc.weight"].dtype == torch.bfloat16 and sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with pytest.raises(ExportError, match="q8_0.*not available for safetensors"):
        export(setup["draft"], "sglang", tmp_path / "q", outtype="q8_0")
    assert not (tmp_path / "q").exists()


# ---------------------------------------------------------------------------------------------
# layouts

def test_gguf_metadata_reader_matches_gguf_package(setup, tmp_path):
    from drafthead.export.gguf_meta import read_gguf_metadata

    path = export(setup["draft"], "gguf", tmp_path / "d.gguf")
    ours = read_gguf_metadata(path)
    r = gguf.GGUFReader(str(path))
    for f in r.fields.values():
        if f.name.startswith("GGUF."):
            continue
        vtype, sub, value = ours[f.name]
        assert vtype == f.types[0] and (sub is None) == (len(f.types) == 1)
        assert value == f.contents() or value == pytest.approx(f.contents()), f.name
    assert set(ours) == {f.name for f in r.fields.values() if not f.name.startswith("GGUF.")}
    with pytest.raises(ExportError, match="not a GGUF file"):
        read_gguf_metadata(setup["draft"] / "config.json")

SGLANG_NAMES = {
    "fc.weight": (H, 3 * H), "norm.weight": (H,), "lm_head.weight": (N, H), "d2t": (N,), "t2d": (V,),
    "midlayer.input_layernorm.weight": (H,), "midlayer.hidden_norm.weight": (H,),
    "midlayer.post_attention_layernorm.weight": (H,),
    "midlayer.self_attn.q_proj.weight": (64, 2 * H), "midlayer.self_attn.k_proj.weight": (32, 2 * H),
    "midlayer.self_attn.v_proj.weight": (32, 2 * H), "midlayer.self_attn.o_proj.weight": (H, 64),
    "midlayer.mlp.gate_proj.weight": (128, H), "midlayer.mlp.up_proj.weight": (128, H),
    "midlayer.mlp.down_proj.weight": (H, 128),
}


def test_sglang_layout(setup, tmp_path):
    out = export(setup["draft"], "sglang", tmp_path / "s")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    sd = load_file(str(out / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in sd.items()} == SGLANG_NAMES  # no embed_tokens
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 1 and cfg["vocab_size"] == V and cfg["draft_vocab_size"] == N
    assert cfg["target_hidden_size"] == H and cfg["norm_before_residual"] is False
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["head_dim"]) == (H, 128, 4, 2, 16)
    assert cfg["eagle_config"]["use_aux_hidden_state"] is True
    # vLLM / llama.cpp converter: top-level ids = inputs of layers; SGLang: eagle_config ids = outputs of layers
    assert cfg["eagle_aux_hidden_state_layer_ids"] == AUX
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in AUX]
    LlamaConfig(**{k: v for k, v in cfg.items() if k != "drafthead"})  # a valid HF llama config


# fields of speculators' Eagle3SpeculatorConfig / SpeculatorsConfig (reference notes B.5)
SPECULATORS_TOP = {"speculators_model_type", "speculators_version", "architectures", "draft_vocab_size",
                   "eagle_aux_hidden_state_layer_ids", "target_hidden_size", "norm_before_residual", "fc_norm",
                   "norm_output",
                   "transformer_layer_config", "speculators_config"}
LLAMA_FIELDS = {"model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "rope_theta",
                "max_position_embeddings", "vocab_size"}


def test_speculators_config_and_names(setup, tmp_path):
    out = export(setup["draft"], "speculators", tmp_path / "sp", num_speculative_tokens=4)
    cfg = json.loads((out / "config.json").read_text())
    assert SPECULATORS_TOP <= set(cfg)
    assert cfg["speculators_model_type"] == "eagle3" and cfg["architectures"] == ["Eagle3Speculator"]
    assert cfg["draft_vocab_size"] == N and cfg["target_hidden_size"] == H and cfg["norm_before_residual"] is False
    assert cfg["eagle_aux_hidden_state_layer_ids"] == AUX  # vLLM copies these through and captures layer inputs
    layer = cfg["transformer_layer_config"]
    assert LLAMA_FIELDS <= set(layer) and layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1
    assert layer["vocab_size"] == V  # speculators' target_vocab_size
    sc = cfg["speculators_config"]
    assert sc["algorithm"] == "eagle3" and sc["default_proposal_method"] == "greedy"
    assert sc["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": 4, "verifier_accept_k": 1,
                                       "accept_tolerance": 0.0}]
    assert sc["verifier"] == {"name_or_path": str(setup["tdir"]), "architectures": ["LlamaForCausalLM"]}
    assert isinstance(cfg["speculators_version"], str)
    sd = load_file(str(out / "model.safetensors"))
    want = {spec_export.rename_out(k): v for k, v in SGLANG_NAMES.items()}
    assert {k: tuple(v.shape) for k, v in sd.items()} == want
    assert "layers.0.hidden_norm.weight" in sd and not any(k.startswith("midlayer.") for k in sd)


# ---------------------------------------------------------------------------------------------
# GGUF

def read_gguf(path):
    r = gguf.GGUFReader(str(path))
    kv = {f.name: f.contents() for f in r.fields.values() if not f.name.startswith("GGUF.")}
    tensors = {t.name: t for t in r.tensors}
    return r, kv, tensors


def gguf_array(t) -> np.ndarray:
    """A reader tensor as float32/int64 numpy in torch orientation ([out, in])."""
    q = gguf.GGMLQuantizationType
    shape = tuple(int(x) for x in reversed(t.shape))
    if t.tensor_type in (q.F32, q.F16, q.I64):
        return np.asarray(t.data).reshape(shape).astype(np.int64 if t.tensor_type == q.I64 else np.float32)
    return gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(shape).astype(np.float32)


def test_gguf_metadata_and_tensors(setup, tmp_path):
    out = export(setup["draft"], "gguf", tmp_path / "d.gguf")
    r, kv, tensors = read_gguf(out)
    cfg = setup["drafter"].config
    assert kv["general.architecture"] == "eagle3"
    assert kv["eagle3.target_layers"] == AUX
    assert r.fields["eagle3.target_layers"].types == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32]
    assert kv["eagle3.target_hidden_size"] == H and kv["eagle3.block_count"] == 1
    assert kv["eagle3.embedding_length"] == H and kv["eagle3.feed_forward_length"] == 128
    assert kv["eagle3.attention.head_count"] == 4 and kv["eagle3.attention.head_count_kv"] == 2
    assert kv["eagle3.rope.dimension_count"] == 16 and kv["eagle3.context_length"] == 512
    assert kv["eagle3.rope.freq_base"] == pytest.approx(cfg.rope_theta)
    assert kv["eagle3.attention.layer_norm_rms_epsilon"] == pytest.approx(cfg.rms_norm_eps)
    assert kv["eagle3.norm_before_residual"] is False and kv["general.file_type"] == 0
    assert kv["tokenizer.ggml.tokens"] == [f"tok{i}" for i in range(V)]  # copied from the target GGUF
    assert kv["tokenizer.ggml.model"] == "gpt2" and kv["tokenizer.chat_template"] == "{{ messages }}"

    want = {"fc.weight": (H, 3 * H), "blk.0.attn_norm.weight": (H,), "blk.0.attn_norm_2.weight": (H,),
            "blk.0.attn_q.weight": (64, 2 * H), "blk.0.attn_k.weight": (32, 2 * H),
            "blk.0.attn_v.weight": (32, 2 * H), "blk.0.attn_output.weight": (H, 64),
            "blk.0.ffn_norm.weight": (H,), "blk.0.ffn_gate.weight": (128, H), "blk.0.ffn_up.weight": (128, H),
            "blk.0.ffn_down.weight": (H, 128), "output_norm.weight": (H,), "output.weight": (N, H), "d2t": (N,)}
    assert {n: tuple(int(x) for x in reversed(t.shape)) for n, t in tensors.items()} == want  # no t2d, no token_embd
    assert tensors["d2t"].tensor_type == gguf.GGMLQuantizationType.I64
    sd = setup["drafter"].state_dict()
    d2t_abs = gguf_array(tensors["d2t"])
    assert np.array_equal(d2t_abs, (sd["d2t"] + torch.arange(N)).numpy())  # absolute target ids
    assert np.array_equal(np.sort(d2t_abs), np.nonzero(sd["t2d"].numpy())[0])
    q = torch.from_numpy(gguf_array(tensors["blk.0.attn_q.weight"]))
    k = torch.from_numpy(gguf_array(tensors["blk.0.attn_k.weight"]))
    assert torch.equal(gguf_export.rope_unpermute(q, 4), sd["midlayer.self_attn.q_proj.weight"])
    assert torch.equal(gguf_export.rope_unpermute(k, 2), sd["midlayer.self_attn.k_proj.weight"])
    assert not torch.equal(q, sd["midlayer.self_attn.q_proj.weight"])  # it is permuted
    assert np.array_equal(gguf_array(tensors["blk.0.attn_norm_2.weight"]), sd["midlayer.hidden_norm.weight"].numpy())
    assert np.array_equal(gguf_array(tensors["blk.0.attn_norm.weight"]),
                          sd["midlayer.input_layernorm.weight"].numpy())


def llama_cpp_eagle3_forward(tensors, kv, ids, aux, emb) -> np.ndarray:
    """Reference forward following src/models/eagle3.cpp: NORM (adjacent-pair) rope, d2t scatter."""
    t = {n: gguf_array(x).astype(np.float64) for n, x in tensors.items()}
    eps, base = kv["eagle3.attention.layer_norm_rms_epsilon"], kv["eagle3.rope.freq_base"]
    nh, nkv, d = (kv["eagle3.attention.head_count"], kv["eagle3.attention.head_count_kv"],
                  kv["eagle3.rope.dimension_count"])

    def rms(x, w):
        return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps) * w

    T = ids.shape[0]
    g = aux @ t["fc.weight"].T  # [T, H] encoder: fc only
    e = rms(emb[ids], t["blk.0.attn_norm.weight"])
    gn = rms(g, t["blk.0.attn_norm_2.weight"])
    x = np.concatenate([e, gn], -1)
    qm, km, vm = (x @ t[f"blk.0.attn_{n}.weight"].T for n in "qkv")

    def rope(m, heads):  # llama.cpp NORM mode: rotate (x[2i], x[2i+1]) by pos * base^(-2i/d)
        m = m.reshape(T, heads, d // 2, 2)
        theta = np.arange(T)[:, None] * base ** (-np.arange(0, d, 2) / d)[None]  # [T, d/2]
        c, s = np.cos(theta)[:, None], np.sin(theta)[:, None]
        a, b = m[..., 0], m[..., 1]
        return np.stack([a * c - b * s, a * s + b * c], -1).reshape(T, heads, d)

    q, k, v = rope(qm, nh), rope(km, nkv), vm.reshape(T, nkv, d)
    rep = nh // nkv
    k, v = np.repeat(k, rep, 1), np.repeat(v, rep, 1)
    s = np.einsum("thd,shd->hts", q, k) / np.sqrt(d)
    s = np.where(np.tril(np.ones((T, T), bool))[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = np.einsum("hts,shd->thd", p, v).reshape(T, nh * d) @ t["blk.0.attn_output.weight"].T
    h = o + g  # norm_before_residual = false: the raw fused feature is the residual
    f = rms(h, t["blk.0.ffn_norm.weight"])
    silu = lambda z: z / (1 + np.exp(-z))  # noqa: E731
    h = h + (silu(f @ t["blk.0.ffn_gate.weight"].T) * (f @ t["blk.0.ffn_up.weight"].T)) @ t["blk.0.ffn_down.weight"].T
    draft = rms(h, t["output_norm.weight"]) @ t["output.weight"].T  # [T, N]
    full = np.full((T, emb.shape[0]), -np.inf)
    full[:, t["d2t"].astype(np.int64)] = draft
    return full


@pytest.mark.parametrize("outtype,tol", [("f32", 1e-4), ("f16", 2e-2), ("bf16", 1e-1), ("q8_0", 1e-1)])
def test_gguf_forward_matches_drafter(setup, tmp_path, outtype, tol):
    """The GGUF evaluated with llama.cpp's eagle3 math reproduces our drafter's logits."""
    out = export(setup["draft"], "gguf", tmp_path / f"d-{outtype}.gguf", outtype=outtype)
    _, kv, tensors = read_gguf(out)
    drafter = setup["drafter"]
    ids, aux, pos = decode_inputs(3)
    ours = draft_logits(drafter, 3)[0].double()  # [T, N] draft vocab
    ref = torch.from_numpy(llama_cpp_eagle3_forward(tensors, kv, ids[0].numpy(), aux[0].double().numpy(),
                                                    setup["emb"].double().numpy()))
    tgt = drafter.d2t + torch.arange(N)
    assert torch.isinf(ref[:, [i for i in range(V) if i not in set(tgt.tolist())]]).all()
    assert torch.allclose(ref[:, tgt], ours, atol=tol, rtol=0), (ref[:, tgt] - ours).abs().max()
    assert torch.equal(ref[:, tgt].argmax(-1), ours.argmax(-1)) or outtype != "f32"


def test_gguf_tensor_types(setup, tmp_path):
    q = gguf.GGMLQuantizationType
    expect = {"f32": q.F32, "f16": q.F16, "bf16": q.BF16, "q8_0": q.Q8_0}
    for outtype, qt in expect.items():
        _, kv, tensors = read_gguf(export(setup["draft"], "gguf", tmp_path / f"{outtype}.gguf", outtype=outtype))
        assert kv["general.file_type"] == gguf_export.FILE_TYPES[outtype]
        for name, t in tensors.items():
            if name == "d2t":
                assert t.tensor_type == q.I64
            elif len(t.shape) == 1:
                assert t.tensor_type == q.F32, name  # norms stay f32
            else:
                assert t.tensor_type == qt, (outtype, name)


# ---------------------------------------------------------------------------------------------
# the aux layer id convention

def test_layer_id_convention(setup, tmp_path):
    """drafthead id i = input of target layer i = HF hidden_states[i]; each format encodes that."""
    model = setup["target"].model
    ids = torch.randint(0, V, (1, 9))
    aux, _ = capture(model, ids, None, AUX)
    hs = model(ids, output_hidden_states=True).hidden_states
    assert torch.equal(aux, torch.cat([hs[i] for i in AUX], -1))
    # llama.cpp reads eagle3.target_layers from the draft and extracts the INPUT of those layers
    _, kv, _ = read_gguf(export(setup["draft"], "gguf", tmp_path / "d.gguf"))
    assert kv["eagle3.target_layers"] == AUX
    # vLLM (top-level ids, captured before layer i) and the speculators format
    s = json.loads((export(setup["draft"], "sglang", tmp_path / "s") / "config.json").read_text())
    assert s["eagle_aux_hidden_state_layer_ids"] == AUX
    sp = json.loads((export(setup["draft"], "speculators", tmp_path / "sp") / "config.json").read_text())
    assert sp["eagle_aux_hidden_state_layer_ids"] == AUX
    # SGLang: layers_to_capture = [id + 1] (all versions when the first id is 1), captured before the layer
    eagle_ids = s["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert eagle_ids[0] == 1 and [i + 1 for i in eagle_ids] == AUX
    # the default [2, N//2, N-3] of every server is the same list in our convention
    assert Eagle3Config.default_aux_layer_ids(30) == [2, 15, 27]
    assert sglang_export.sglang_aux_ids([2, 15, 27]) == [1, 14, 26]
    assert sglang_export.ours_from_sglang_ids([1, 14, 26]) == [2, 15, 27]
    assert sglang_export.ours_from_sglang_ids([3, 15, 27]) == [3, 15, 27]  # sglang >= PR #25454: literal


# ---------------------------------------------------------------------------------------------
# bad input: clear errors and nothing at `out`

def assert_nothing_written(out):
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


def broken_draft(setup, tmp_path, edit):
    d = tmp_path / "broken"
    d.mkdir()
    (d / "config.json").write_text((setup["draft"] / "config.json").read_text())
    sd = load_file(str(setup["draft"] / "model.safetensors"))
    edit(sd)
    save_file(sd, str(d / "model.safetensors"))
    return d


@pytest.mark.parametrize("fmt", sorted(EXPORTERS))
def test_missing_tensor(setup, tmp_path, fmt):
    d = broken_draft(setup, tmp_path, lambda sd: sd.pop("lm_head.weight"))
    out = tmp_path / ("o.gguf" if fmt == "gguf" else "o")
    with pytest.raises(ExportError, match=r"missing \['lm_head.weight'\]"):
        export(d, fmt, out)
    assert_nothing_written(out)


def test_misshapen_and_inconsistent_tensors(setup, tmp_path):
    d = broken_draft(setup, tmp_path, lambda sd: sd.__setitem__("fc.weight", torch.zeros(H, 2 * H)))
    with pytest.raises(ExportError, match=r"fc.weight has shape \(64, 128\), the config implies \(64, 192\)"):
        export(d, "sglang", tmp_path / "o")
    assert_nothing_written(tmp_path / "o")

    def dup(sd):
        sd["d2t"] = sd["d2t"].clone()
        sd["d2t"][1] = sd["d2t"][0] - 1  # draft ids 0 and 1 -> the same target id
    d2 = tmp_path / "dup"
    d2.mkdir()
    broken = broken_draft(setup, d2, dup)
    with pytest.raises(ExportError, match="same target id"):
        export(broken, "gguf", tmp_path / "o.gguf")
    assert_nothing_written(tmp_path / "o.gguf")


@pytest.mark.parametrize("fmt", sorted(EXPORTERS))
def test_target_mismatch(setup, tmp_path, fmt):
    out = tmp_path / ("o.gguf" if fmt == "gguf" else "o")
    g_vocab, g_hidden = tmp_path / "v.gguf", tmp_path / "h.gguf"
    write_target_gguf(g_vocab, vocab=V + 1)
    write_target_gguf(g_hidden, hidden=H * 2)
    with pytest.raises(ExportError, match=rf"target vocab size {V + 1} .* does not match the draft's {V}"):
        export(setup["draft"], fmt, out, target=str(g_vocab))
    with pytest.raises(ExportError, match=rf"target hidden size {2 * H} .* target_hidden_size {H}"):
        export(setup["draft"], fmt, out, target=str(g_hidden))
    hf = tmp_path / "hf"
    tiny_target_config(vocab_size=V * 2).save_pretrained(hf)
    with pytest.raises(ExportError, match="target vocab size 512"):
        export(setup["draft"], fmt, out, target=str(hf))
    shallow = tmp_path / "shallow.gguf"
    write_target_gguf(shallow, layers=2)
    with pytest.raises(ExportError, match=r"aux layer ids \[2, 3\] out of range .* 2 layers"):
        export(setup["draft"], fmt, out, target=str(shallow))
    with pytest.raises(ExportError, match="target 'nope/nothing' not found"):
        export(setup["draft"], fmt, out, target="nope/nothing")
    assert_nothing_written(out)


def test_unknown_format_and_options(setup, tmp_path):
    with pytest.raises(ExportError,
                       match=r"unknown export format to='onnx'; choose one of \['gguf', 'sglang', 'speculators'\]"):
        export(setup["draft"], "onnx", tmp_path / "o")
    with pytest.raises(ExportError, match="takes no option"):
        export(setup["draft"], "sglang", tmp_path / "o", num_speculative_tokens=3)
    with pytest.raises(ExportError, match="not a GGUF output type"):
        export(setup["draft"], "gguf", tmp_path / "o.gguf", outtype="q4_0")
    with pytest.raises(ExportError, match="must end in .gguf"):
        export(setup["draft"], "gguf", tmp_path / "o")
    assert_nothing_written(tmp_path / "o")
    assert_nothing_written(tmp_path / "o.gguf")


def test_gguf_needs_target_gguf(setup, tmp_path):
    hf = tmp_path / "hfonly"
    setup["tcfg"].save_pretrained(hf)
    with pytest.raises(ExportError, match="not a GGUF file: pass target=PATH.gguf"):
        export(setup["draft"], "gguf", tmp_path / "o.gguf", target=str(hf))
    assert_nothing_written(tmp_path / "o.gguf")
    # the same HF directory is enough for the safetensors formats
    assert (export(setup["draft"], "sglang", tmp_path / "s", target=str(hf)) / "config.json").is_file()


def test_formats_lists_what_the_family_exports_and_its_options(setup):
    from drafthead.export import formats

    assert formats(setup["draft"]) == {
        "sglang": ["outtype"], "gguf": ["outtype"],
        "speculators": ["outtype", "num_speculative_tokens", "verifier", "store_embedding"]}


def test_load_exported_checks_an_outside_checkpoint(setup, tmp_path):
    """A third-party SGLang/speculators directory goes through the same tensor checks as our drafts."""
    out = export(setup["draft"], "sglang", tmp_path / "s")
    sd = load_file(str(out / "model.safetensors"))
    save_file({k: v for k, v in sd.items() if k != "lm_head.weight"}, str(out / "model.safetensors"))
    with pytest.raises(ExportError,
                       match=r"draft tensors do not match its config \(eagle3\): missing \['lm_head.weight'\]"):
        load_exported(out)
    bad = dict(sd)
    bad["norm.weight"] = torch.full_like(sd["norm.weight"], float("nan"))
    save_file(bad, str(out / "model.safetensors"))
    with pytest.raises(ExportError, match="tensor norm.weight has NaN/inf values"):
        load_exported(out)


def test_existing_output_replaced_only_on_success(setup, tmp_path):
    out = tmp_path / "s"
    export(setup["draft"], "sglang", out)
    before = (out / "config.json").read_text()
    with pytest.raises(ExportError):
        export(setup["draft"], "sglang", out, target=str(tmp_path / "missing.gguf"))
    assert (out / "config.json").read_text() == before


def test_cli(setup, tmp_path, capsys):
    from drafthead.cli import main

    out = tmp_path / "c.gguf"
    assert main(["export", f"draft={setup['draft']}", "to=gguf", f"out={out}", "outtype=q8_0"]) == 0
    assert out.is_file() and "exported" in capsys.readouterr().out
    assert main(["export", f"draft={setup['draft']}", "to=tflite", f"out={tmp_path / 'x'}"]) == 2
    assert "unknown export format to='tflite'" in capsys.readouterr().err
    assert main(["export", "to=gguf"]) == 2
    assert "missing draft=, out=" in capsys.readouterr().err


@pytest.mark.parametrize("fmt", sorted(EXPORTERS))
def test_exports_get_default_permissions(setup, tmp_path, fmt):
    """Temp files/dirs are private (0600/0700); the published export gets what open/mkdir would give."""
    import os
    import stat

    mask = os.umask(0)
    os.umask(mask)
    out = export(setup["draft"], fmt, tmp_path / ("d.gguf" if fmt == "gguf" else "d"))
    files = [out] if fmt == "gguf" else [out / "config.json", out / "model.safetensors"]
    for f in files:
        assert stat.S_IMODE(f.stat().st_mode) == 0o666 & ~mask, f
    if fmt != "gguf":
        assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~mask

"""MTP drafter: shapes, depth semantics and causality, training/inference parity, recursive vs sequential
modules, frozen parts, block parity with HF Llama/Qwen3/Qwen3.5 layers, native-weight names, save/load,
train.py end to end, and greedy-lossless speculative decoding with the runtime. Tiny random models only."""
from __future__ import annotations

import importlib.util
import itertools
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen3Config, Qwen3ForCausalLM

from drafthead.family import OwnLayers
from drafthead.runtime.draft import CHAIN, TREE
from drafthead.layers import kv_cache
from drafthead.layers import shift as _shift
from drafthead.mtp import (FASTMTP_STEP_WEIGHTS, MtpConfig, MtpDrafter, MtpOptions, init_from_native,
                           init_from_target)
from drafthead.mtp_native import read_native, to_native, to_ours
from drafthead.registry import FAMILIES, NOT_SAVED, load_draft, read_draft_config, save_draft
from drafthead.runtime import SpecConfig, SpeculativeGenerator
from drafthead.target import Target, freeze, load_target

V, H = 96, 32
EOS = 2


def build_for_target(name: str, tcfg, options) -> nn.Module:
    fam = FAMILIES[name]
    return fam.model(fam.build(tcfg, options, None, None))


def init_for_target(drafter: nn.Module, target: Target, options) -> str:
    return FAMILIES[drafter.family].init(drafter, target, options)


def tiny_llama(vocab: int = V, seed: int = 0, dtype=torch.float32, **kw) -> LlamaForCausalLM:
    args = dict(vocab_size=vocab, hidden_size=H, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1,
                tie_word_embeddings=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**args, **kw})).eval().to(dtype)


def tiny_mtp(model: nn.Module, K: int = 3, recursive: bool = True, attention: str = "causal", seed: int = 1,
             perturb: bool = True, **kw) -> MtpDrafter:
    torch.manual_seed(seed)
    d = MtpDrafter(MtpConfig.from_target(model.config, num_draft_tokens=K, recursive=recursive, attention=attention,
                                         **kw))
    init_from_target(d, model)
    if perturb:
        _perturb_norms(d)
    return d.to(next(model.parameters()).dtype).eval()


def _perturb_norms(module: nn.Module) -> None:
    """Norm weights away from their init, so that a wrongly applied or wrongly copied norm shows."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))


def batch(B: int = 2, T: int = 12, seed: int = 2, vocab: int = V):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, T), generator=g)
    last = torch.randn(B, T, H, generator=g)
    teacher = torch.randn(B, T, vocab, generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    return ids, last, teacher.softmax(-1), teacher.argmax(-1), mask


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ---- config --------------------------------------------------------------------------------------
def test_config_from_targets_and_step_weights():
    c = MtpConfig.from_target(LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2), num_draft_tokens=3)
    assert (c.head_dim, c.qk_norm, c.attention_bias, c.attn_output_gate, c.norm_unit_offset) == (8, False, False,
                                                                                                 False, False)
    assert c.draft_vocab_size == c.vocab_size == V and c.stored_modules == 1 and c.native_layers == 0
    w = [0.8 ** i for i in range(3)]
    assert c.step_weights == pytest.approx([x / sum(w) for x in w]) and sum(c.step_weights) == pytest.approx(1)
    assert MtpConfig.from_target(Qwen3Config(vocab_size=V, hidden_size=H, num_attention_heads=4, head_dim=16)).qk_norm
    assert MtpConfig.from_target(Qwen2Config(vocab_size=V, hidden_size=H, num_attention_heads=4)).attention_bias
    from transformers import Qwen3_5TextConfig

    q = MtpConfig.from_target(Qwen3_5TextConfig(vocab_size=V, hidden_size=H, num_attention_heads=4, head_dim=16,
                                                num_hidden_layers=4, mtp_num_hidden_layers=1))
    assert q.attn_output_gate and q.norm_unit_offset and q.qk_norm and q.partial_rotary_factor == 0.25
    assert q.native_layers == 1
    f = MtpConfig.from_target(tiny_llama().config, num_draft_tokens=3, step_weights=FASTMTP_STEP_WEIGHTS,
                              recursive=False)
    assert f.step_weights == [0.51, 0.31, 0.18] and f.stored_modules == 3
    with pytest.raises(ValueError, match="MTP step_weights: 2 weights for num_draft_tokens=3"):
        MtpConfig.from_target(tiny_llama().config, num_draft_tokens=3, step_weights=[0.5, 0.5])
    with pytest.raises(ValueError, match="attention: 'tree'"):
        MtpConfig.from_target(tiny_llama().config, attention="tree")
    with pytest.raises(ValueError, match="SwiGLU"):
        MtpConfig.from_target(LlamaConfig(hidden_act="gelu"))


# ---- training forward ----------------------------------------------------------------------------
@pytest.mark.parametrize("recursive", [True, False])
def test_forward_counts_loss_and_mask(recursive: bool):
    d = tiny_mtp(tiny_llama(), K=3, recursive=recursive)
    ids, last, teacher, tgt, mask = batch(B=2, T=10)
    mask[:, :5] = 0
    out = d(ids, last, teacher, tgt, mask)
    # depth k counts positions t with mask[t+2+k] == 1: t in 3..7, 2..6, 1..5 -> 5 per row each
    assert out["count"].tolist() == [10, 10, 10]
    assert out["step_loss"].shape == (3,) and torch.isfinite(out["loss"])
    w = d.config.step_weights
    assert out["loss"].item() == pytest.approx(sum(wi * li for wi, li in zip(w, out["step_loss"].tolist())), rel=1e-5)
    assert (0 <= out["correct"]).all() and (out["correct"] <= out["count"]).all()
    mask2 = mask.clone()
    mask2[:, -1] = 0
    assert d(ids, last, teacher, tgt, mask2)["count"].tolist() == [8, 8, 8]
    # depth k at t is scored against the teacher row t+1+k: a teacher equal to the draft's own logits there
    # makes the argmax right everywhere
    for k, out_k in enumerate(d.depth_hidden(ids, last)):
        m = d.layers[d.module_for(k)]
        logits = m.shared_head.head(m.shared_head.norm(out_k))  # [B, T, V]
        teach_k = torch.zeros_like(teacher)
        teach_k[:, 1 + k:] = logits[:, : 10 - 1 - k]
        res = d(ids, last, teach_k.detach().softmax(-1), teach_k.argmax(-1), mask)
        assert res["correct"][k] == res["count"][k], f"depth {k}"
    with pytest.raises(ValueError, match="full target vocab"):
        d(ids, last, teacher[..., :50], tgt, mask)


@pytest.mark.parametrize("attention", ["causal", "chain"])
def test_future_tokens_and_hidden_do_not_leak(attention: str):
    d = tiny_mtp(tiny_llama(), K=3, recursive=False, attention=attention)
    ids, last, *_ = batch(B=1, T=14)
    a = d.depth_hidden(ids, last)
    ids2, last2 = ids.clone(), last.clone()
    ids2[:, 9:] = (ids2[:, 9:] + 7) % V
    last2[:, 9:] += 1.0
    b = d.depth_hidden(ids2, last2)
    for k in range(3):  # depth k at t reads tokens up to t+1+k and target hidden states up to t
        safe = 9 - 2 - k
        assert torch.allclose(a[k][0, : safe + 1], b[k][0, : safe + 1], atol=1e-6), f"depth {k} leaks"
        assert not torch.allclose(a[k][0, safe + 2:], b[k][0, safe + 2:])


def _chain_reference(d: MtpDrafter, ids, last, t: int, K: int) -> list[torch.Tensor]:
    """What the runtime chain computes for position t: prefix entries s <= t per module (from (x_{s+1}, h_s)),
    then chain step k in module k % M, which also sees its own earlier chain entries."""
    M = d.chain_modules
    kv, outs = {}, []
    for m in range(M):
        _, out, kv[m] = d.decode(ids[:, 1: t + 2], last[:, : t + 1], torch.arange(t + 1)[None], module=m)
        if m == 0:
            h = out[:, -1:]
            outs.append(out[0, -1])
    for k in range(1, K):
        m = k % M
        _, h, kv[m] = d.decode(ids[:, t + 1 + k: t + 2 + k], h, torch.tensor([[t + k]]), kv=kv[m], module=m)
        outs.append(h[0, 0])
    return outs


@pytest.mark.parametrize("recursive", [True, False])
def test_chain_attention_training_equals_runtime_chain(recursive: bool):
    """attention=chain: depth k at t == chain step k of the KV-cached decode path (recursive and sequential)."""
    d = tiny_mtp(tiny_llama(), K=3, recursive=recursive, attention="chain")
    ids, last, *_ = batch(B=1, T=12)
    deep = d.depth_hidden(ids, last)
    for t in (0, 4, 8):
        ref = _chain_reference(d, ids, last, t, 3)
        for k in range(3):
            m = d.layers[d.module_for(k)]
            torch.testing.assert_close(m.shared_head.norm(deep[k][0, t]), ref[k], atol=1e-5, rtol=1e-5,
                                       msg=lambda s, k=k, t=t: f"depth {k}, t {t}: {s}")


def test_causal_attention_depth0_equals_decode_and_depth_k_is_a_shifted_sequence():
    d = tiny_mtp(tiny_llama(), K=2, recursive=False, attention="causal")
    ids, last, *_ = batch(B=2, T=9)
    deep = d.depth_hidden(ids, last)
    pos = torch.arange(9).expand(2, 9)
    _, h0, _ = d.decode(_shift(ids, 1), last, pos, module=0)
    torch.testing.assert_close(d.layers[0].shared_head.norm(deep[0]), h0, atol=1e-5, rtol=1e-5)
    _, h1, _ = d.decode(_shift(ids, 2), h0, pos + 1, module=1)  # depth 1: causal over its own sequence
    torch.testing.assert_close(d.layers[1].shared_head.norm(deep[1]), h1, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attention", ["causal", "chain"])
def test_recursive_equals_sequential_with_tied_weights(attention: str):
    model = tiny_llama()
    rec = tiny_mtp(model, K=3, recursive=True, attention=attention)
    seq = tiny_mtp(model, K=3, recursive=False, attention=attention, seed=5)
    n_rec = sum(p.numel() for p in rec.parameters() if p.requires_grad)
    n_seq = sum(p.numel() for p in seq.parameters() if p.requires_grad)
    assert len(rec.layers) == 1 and len(seq.layers) == 3 and n_seq == 3 * n_rec
    assert {k.split(".")[1] for k in seq.state_dict() if k.startswith("layers.")} == {"0", "1", "2"}
    ids, last, teacher, tgt, mask = batch()
    assert not torch.allclose(rec(ids, last, teacher, tgt, mask)["loss"], seq(ids, last, teacher, tgt, mask)["loss"])
    for m in seq.layers:
        m.load_state_dict(rec.layers[0].state_dict())
    a, b = rec(ids, last, teacher, tgt, mask), seq(ids, last, teacher, tgt, mask)
    for key in ("loss", "step_loss", "correct", "count"):
        torch.testing.assert_close(a[key], b[key], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("train_head", [False, True])
def test_gradients_reach_only_trainable_parts(train_head: bool):
    d = tiny_mtp(tiny_llama(), K=2, recursive=False, train_head=train_head).train()
    d(*batch())["loss"].backward()
    assert d.embed_tokens.weight.grad is None
    for m in d.layers:
        for name, p in m.named_parameters():
            if name.startswith("shared_head.") and not train_head:
                assert not p.requires_grad and p.grad is None, name
            else:
                assert p.requires_grad and p.grad is not None and p.grad.abs().sum() > 0, name


# ---- block parity with the target architectures ---------------------------------------------------
def _block(m, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Our decoder block alone (causal over x)."""
    a = m.self_attn
    xn = m.input_layernorm(x)
    q, gate = a.q(xn, pos)
    k, v = a.kv(xn, pos)
    o = F.scaled_dot_product_attention(q, a.expand_kv(k), a.expand_kv(v), is_causal=True)
    return m.finish(x, a.out(o, gate))


def _qwen35(layers: int = 4, mtp: int = 1):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    c = Qwen3_5TextConfig(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_key_head_dim=8,
                          linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                          max_position_embeddings=256, mtp_num_hidden_layers=mtp)
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(c).eval()
    _perturb_norms(model)  # zero-centred norms start at 0: move them so the (1 + w) form is exercised
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_5"])
def test_block_copied_from_target_matches_its_last_layer(arch: str):
    if arch == "llama":
        model = tiny_llama()
    elif arch == "qwen3":
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, head_dim=16)).eval()
    else:
        model = _qwen35()
    _perturb_norms(model)
    d = tiny_mtp(model, K=1, perturb=False)
    layer = model.model.layers[-1]
    x = torch.randn(2, 7, H)
    pos = torch.arange(7).expand(2, 7)
    with torch.no_grad():
        want = layer(x, position_embeddings=model.model.rotary_emb(x, pos), position_ids=pos)
        want = want[0] if isinstance(want, tuple) else want
        got = _block(d.layers[0], x, pos)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(d.layers[0].shared_head.norm(x), model.model.norm(x), atol=1e-6, rtol=1e-6)
    assert torch.equal(d.layers[0].shared_head.head.weight, model.lm_head.weight)
    assert torch.equal(d.embed_tokens.weight, model.get_input_embeddings().weight)


def test_qwen35_native_mtp_matches_transformers_mtp_layer():
    """Native Qwen3.5 `mtp.*` weights loaded by name == transformers' own MtpLayer on the same tensors."""
    from transformers.modeling_layers import MtpLayer
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

    model = _qwen35()
    c = model.config
    ref = MtpLayer(c, Qwen3_5DecoderLayer, Qwen3_5RMSNorm, layer_idx=3).eval()  # layer 3 is full attention
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    sd = ref.state_dict()
    native = {"mtp.fc.weight": sd["eh_proj.weight"], "mtp.pre_fc_norm_embedding.weight": sd["enorm.weight"],
              "mtp.pre_fc_norm_hidden.weight": sd["hnorm.weight"], "mtp.norm.weight": sd["post_norm.weight"],
              **{f"mtp.layers.0.{k[len('mtp_block.'):]}": v for k, v in sd.items() if k.startswith("mtp_block.")},
              "model.layers.0.mlp.up_proj.weight": torch.zeros(1)}  # non-MTP keys are ignored
    d = tiny_mtp(model, K=2)  # recursive: one module applied twice
    assert init_from_native(d, native, c) == 1
    emb_ids = torch.randint(0, V, (1, 6))
    prev = torch.randn(1, 6, H)
    pos = torch.arange(6)[None]
    with torch.no_grad():
        want = ref(model.get_input_embeddings()(emb_ids), prev, model.model.rotary_emb(prev, pos), None, pos, None)
        _, got, _ = d.decode(emb_ids, prev, pos)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(d.layers[0].shared_head.head.weight, model.lm_head.weight)  # Qwen shares the lm_head


# ---- native weight names --------------------------------------------------------------------------
def _randomise(d: MtpDrafter, seed: int = 7) -> MtpDrafter:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in d.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return d


def test_nextn_layout_round_trip_deepseek_glm_names():
    tcfg = tiny_llama().config
    tcfg.num_nextn_predict_layers = 2  # DeepSeek / GLM style: extra layers model.layers.{N+i}.*
    src = _randomise(MtpDrafter(MtpConfig.from_target(tcfg, num_draft_tokens=2, recursive=False)))
    assert src.config.native_layers == 2
    ours = {k: v for k, v in src.state_dict().items() if k not in NOT_SAVED}
    native = to_native(ours, tcfg)
    assert set(native) == {f"model.layers.{2 + int(k.split('.')[1])}.{k.split('.', 2)[2]}" for k in ours}
    assert "model.layers.2.eh_proj.weight" in native and "model.layers.3.shared_head.head.weight" in native
    assert "model.layers.3.self_attn.q_proj.weight" in native and "model.layers.2.enorm.weight" in native
    ckpt = {**native, "model.layers.2.embed_tokens.weight": torch.zeros(V, H),  # DeepSeek's per-layer copy
            "model.layers.1.mlp.up_proj.weight": torch.zeros(1), "lm_head.weight": torch.zeros(1)}
    assert to_ours(ckpt, tcfg).keys() == ours.keys()
    dst = MtpDrafter(MtpConfig.from_target(tcfg, num_draft_tokens=2, recursive=False))
    assert init_from_native(dst, ckpt, tcfg) == 2
    for k, v in ours.items():
        assert torch.equal(dst.state_dict()[k], v), k
    # more depths than native layers: modules cycle over them (vLLM's spec_step_idx % n)
    three = MtpDrafter(MtpConfig.from_target(tcfg, num_draft_tokens=3, recursive=False))
    init_from_native(three, ckpt, tcfg)
    assert torch.equal(three.layers[2].eh_proj.weight, ours["layers.0.eh_proj.weight"])
    # MoE / MLA layers do not fit the dense block: named in the error
    moe = {**ckpt, "model.layers.2.mlp.experts.0.gate_proj.weight": torch.zeros(1)}
    with pytest.raises(ValueError, match=r"layer 0 has tensors the dense MTP block cannot hold.*experts"):
        init_from_native(MtpDrafter(MtpConfig.from_target(tcfg, num_draft_tokens=1)), moe, tcfg)
    gone = {k: v for k, v in ckpt.items() if "hnorm" not in k}
    with pytest.raises(ValueError, match=r"layer 0 lacks \['hnorm.weight'\]"):
        init_from_native(MtpDrafter(MtpConfig.from_target(tcfg, num_draft_tokens=1)), gone, tcfg)
    with pytest.raises(ValueError, match="no MTP layer tensors"):
        init_from_native(dst, {"lm_head.weight": torch.zeros(1)}, tcfg)


def test_qwen35_layout_round_trip():
    model = _qwen35(mtp=2)
    c = model.config
    src = _randomise(MtpDrafter(MtpConfig.from_target(c, num_draft_tokens=2, recursive=False)))
    with torch.no_grad():  # the Qwen layout shares fc / pre-norms / norm between its MTP layers
        for name in ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
            src.layers[1].get_parameter(name).copy_(src.layers[0].get_parameter(name))
    ours = {k: v for k, v in src.state_dict().items() if k not in NOT_SAVED}
    native = to_native(ours, c)
    assert {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
            "mtp.norm.weight", "mtp.layers.1.self_attn.q_norm.weight"} <= set(native)
    assert not any("shared_head" in k or ".eh_proj" in k for k in native)  # the head is the target's lm_head
    assert native["mtp.layers.0.self_attn.q_proj.weight"].shape == (2 * 4 * 16, H)  # q and gate per head
    back = to_ours(native, c)
    assert back.keys() == {k for k in ours if "shared_head.head" not in k}
    assert all(torch.equal(back[k], ours[k]) for k in back)
    with torch.no_grad():
        src.layers[1].eh_proj.weight.add_(1.0)
    with pytest.raises(ValueError, match="shares mtp.fc.weight across layers, but layer 1 differs"):
        to_native({k: v for k, v in src.state_dict().items() if k not in NOT_SAVED}, c)


def _target_dir_with_native_mtp(folder: Path, n: int = 1) -> tuple[Path, dict[str, torch.Tensor]]:
    """A tiny Llama checkpoint whose safetensors also hold DeepSeek-style MTP layers (config declares them)."""
    model = tiny_llama()
    model.config.num_nextn_predict_layers = n
    model.save_pretrained(folder)
    tcfg = model.config
    mtp = _randomise(MtpDrafter(MtpConfig.from_target(tcfg, num_draft_tokens=n, recursive=False)), seed=11)
    native = to_native({k: v for k, v in mtp.state_dict().items() if k not in NOT_SAVED}, tcfg)
    sd = load_file(str(folder / "model.safetensors"))
    save_file({**sd, **{k: v.contiguous() for k, v in native.items()}}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    return folder, native


def test_read_native_and_init_for_target(tmp_path):
    folder, native = _target_dir_with_native_mtp(tmp_path / "tgt")
    target = freeze(Target(LlamaForCausalLM.from_pretrained(folder), None, str(folder)))
    got = read_native(str(folder), target.config)
    assert got.keys() == native.keys() and all(torch.equal(got[k], native[k]) for k in got)
    opts = MtpOptions(num_draft_tokens=2, recursive=True, init="auto")
    d = build_for_target("mtp", target.config, opts)
    assert init_for_target(d, target, opts).startswith("native (1 MTP layer")
    assert torch.equal(d.layers[0].eh_proj.weight, native["model.layers.2.eh_proj.weight"])
    assert torch.equal(d.embed_tokens.weight, target.model.get_input_embeddings().weight)
    # a target without MTP layers: auto falls back to its last decoder layer, native is an error
    plain = Target(tiny_llama(), None, "plain")
    d = build_for_target("mtp", plain.config, opts)
    assert init_for_target(d, plain, opts) == "target (last decoder layer)"
    assert torch.equal(d.layers[0].mlp.up_proj.weight, plain.model.model.layers[-1].mlp.up_proj.weight)
    with pytest.raises(ValueError, match="drafter.mtp.init=native: target 'plain' has no native MTP weights"):
        init_for_target(d, plain, MtpOptions(num_draft_tokens=2, init="native"))
    with pytest.raises(ValueError, match="init: 'bogus'"):
        MtpOptions(init="bogus").validate()


# ---- save / load ------------------------------------------------------------------------------------
def test_save_load_round_trip(tmp_path):
    model = tiny_llama()
    d = tiny_mtp(model, K=2, recursive=False, attention="chain", step_weights=[0.7, 0.3])
    save_draft(d, tmp_path / "draft", {"name_or_path": "tiny"})
    meta = read_draft_config(tmp_path / "draft")
    assert meta["family"] == "mtp" and meta["draft"]["num_draft_tokens"] == 2 and meta["draft"]["recursive"] is False
    assert meta["draft"]["step_weights"] == [0.7, 0.3] and meta["draft"]["attention"] == "chain"
    saved = load_file(str(tmp_path / "draft" / "model.safetensors"))
    assert "embed_tokens.weight" not in saved and "layers.1.shared_head.head.weight" in saved
    back = load_draft(tmp_path / "draft", embed_weight=model.get_input_embeddings().weight)
    assert back.family == "mtp" and back.config == d.config
    for k, v in d.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    ids, last, teacher, tgt, mask = batch()
    torch.testing.assert_close(back(ids, last, teacher, tgt, mask)["loss"], d(ids, last, teacher, tgt, mask)["loss"])
    assert not back.layers[0].shared_head.head.weight.requires_grad  # frozen again after loading


# ---- train.py end to end ----------------------------------------------------------------------------
_spec = importlib.util.spec_from_file_location("train_script", Path(__file__).resolve().parent.parent / "train.py")
train = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train)


def train_args(run_dir: Path, target_dir: Path, data: Path, **over) -> list[str]:
    kv = {"target.name_or_path": target_dir, "target.dtype": "float32", "data.dataset": data,
          "data.max_samples": "null", "data.num_holdout": 4, "data.max_length": 96, "data.overlong": "truncate",
          "data.regenerate.enabled": "false", "drafter.family": "mtp", "drafter.mtp.num_draft_tokens": 2,
          "drafter.mtp.recursive": "false", "capture.mode": "online", "capture.layer_ids": "null",
          "capture.dtype": "bfloat16", "train.epochs": 1, "train.batch_size": 2, "train.batch_tokens": "null",
          "train.grad_accum": 1, "train.max_steps": 4, "train.save_every": 0, "train.eval_every": 0,
          "train.lr": 1e-3, "train.dtype": "float32", "train.deepspeed": "null", "logging.wandb": "false",
          "logging.progress": "false", "logging.log_every": 1, "budget.minutes": "null",
          "train.choose_serving": "false", "output_dir": run_dir, **over}
    return [f"{k}={v}" for k, v in kv.items()]


@pytest.mark.parametrize("mode", ["online", "offline"])
def test_train_end_to_end(mode: str, tiny_llama_dir, tiny_sharegpt, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DRAFTHEAD_CACHE", str(tmp_path / "cache"))
    run = tmp_path / "run"
    over = {} if mode == "online" else {"capture.mode": "offline", "drafter.mtp.recursive": "true",
                                        "drafter.mtp.attention": "chain", "drafter.mtp.step_weights": "[0.6,0.4]"}
    if mode == "offline":  # `drafthead capture` first: it must capture what train.py reads (no aux layers)
        from drafthead.trainer.commands import capture as capture_main

        assert capture_main(train_args(run, tiny_llama_dir, tiny_sharegpt, **over)) == 0
        stamps = {p.name: p.stat().st_mtime_ns for p in (run / "capture").glob("shard_*.safetensors")}
    final = train.main(train_args(run, tiny_llama_dir, tiny_sharegpt, **over))
    out = capsys.readouterr().out
    assert "draft vocab" not in out and "2 depths" in out and "init target (last decoder layer)" in out
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3, 4]
    assert all(r["loss"] > 0 and 0 <= r["acc_0"] <= 1 and 0 <= r["acc_1"] <= 1 for r in train_rows)
    assert "acc_2" not in train_rows[0] and {"eval/acc_0", "eval/acc_1", "eval/sim_accept_len"} <= set(rows[-1])
    meta = read_draft_config(final)
    assert meta["family"] == "mtp" and meta["draft"]["num_draft_tokens"] == 2
    assert meta["draft"]["recursive"] is (mode == "offline")
    target = load_target(str(tiny_llama_dir), dtype="float32")
    draft = load_draft(final, embed_weight=target.model.get_input_embeddings().weight)
    target.model.double()  # float64: "speculative == plain greedy" exactly, no near-tie argmax flips
    draft.double()
    # the frozen shared head is still the target's; the block moved away from its init (the target's layer)
    assert torch.equal(draft.layers[0].shared_head.head.weight, target.model.lm_head.weight)
    assert not torch.equal(draft.layers[0].mlp.up_proj.weight, target.model.model.layers[-1].mlp.up_proj.weight)
    if mode == "offline":
        m = json.loads((run / "capture" / "manifest.json").read_text())
        assert m["complete"] and m["layer_ids"] == []
        assert {p.name: p.stat().st_mtime_ns for p in (run / "capture").glob("shard_*.safetensors")} == stamps
    # and the trained draft decodes losslessly
    gen = SpeculativeGenerator(target, draft)
    prompt = target.tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True)
    prompt = prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt
    ar = gen.generate([list(prompt)], 12, SpecConfig(mode="ar"))[0].tokens
    assert gen.generate([list(prompt)], 12, SpecConfig(mode="chain", num_speculative_tokens=3))[0].tokens == ar


def test_config_rejects_bad_mtp_settings():
    from drafthead.trainer.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"'drafter.mtp.step_weights': 2 weights for num_draft_tokens=3"):
        load_config(["drafter.family=mtp", "drafter.mtp.num_draft_tokens=3", "drafter.mtp.step_weights=[0.5,0.5]"])
    with pytest.raises(ConfigError, match=r"'drafter.family': 'medusa'"):
        load_config(["drafter.family=medusa"])
    with pytest.raises(ConfigError, match=r"'drafter.eagle3.init': 'native' \(choose from auto, random\)"):
        load_config(["drafter.eagle3.init=native"])
    cfg = load_config(["recipe=mtp_smollm2"])
    assert cfg.drafter.family == "mtp" and cfg.drafter.mtp.num_draft_tokens >= 2


# ---- runtime ------------------------------------------------------------------------------------------
def runtime_target(seed: int = 0) -> Target:
    model = tiny_llama(vocab=128, seed=seed, dtype=torch.float64)
    return freeze(Target(model, None, "tiny-llama"))


def reference_greedy(target: Target, prompt: list[int], n: int) -> list[int]:
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            t = int(target.model(torch.tensor([ids])).logits[0, -1].argmax())
            out.append(t)
            ids.append(t)
            if t == EOS:
                break
    return out


def prompts(n: int, seed: int, lo: int = 2, hi: int = 10) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [[1] + torch.randint(3, 128, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


RUNTIME = [SpecConfig(mode="chain", num_speculative_tokens=k) for k in (1, 3, 5)] + [
    SpecConfig(mode="chain", num_speculative_tokens=4, adaptive=True, batch_size=3),
    SpecConfig(mode="chain", num_speculative_tokens=3, ngram=True, batch_size=2),
]
TREES = [SpecConfig(mode="tree", num_speculative_tokens=3, tree_nodes=6, topk=2),
         SpecConfig(mode="tree", num_speculative_tokens=4, tree_nodes=8, topk=2, adaptive=True, batch_size=3)]


@pytest.mark.parametrize("recursive", [True, False])
def test_greedy_is_lossless_with_random_mtp_drafter(recursive: bool):
    target = runtime_target()
    d = tiny_mtp(target.model, K=3, recursive=recursive)
    gen = SpeculativeGenerator(target, d)
    ps = prompts(3, seed=3)
    want = [reference_greedy(target, p, 16) for p in ps]
    for spec in RUNTIME + (TREES if recursive else []):
        got = gen.generate(ps, 16, spec)
        assert [r.tokens for r in got] == want, spec
    if not recursive:
        with pytest.raises(ValueError, match="spec mode 'tree': this mtp draft drafts chain only"):
            gen.generate(ps, 4, TREES[0])


def test_sampling_with_sequential_mtp_runs_and_respects_budget():
    target = runtime_target()
    gen = SpeculativeGenerator(target, tiny_mtp(target.model, K=2, recursive=False))
    res = gen.generate(prompts(2, seed=4), 10, SpecConfig(mode="chain", num_speculative_tokens=3, temperature=0.8,
                                                          batch_size=2))
    assert all(1 <= len(r.tokens) <= 10 for r in res)
    assert all(0 <= a <= 3 for r in res for a in r.accept_lens)


class OracleMtp(OwnLayers, nn.Module):
    """Predicts exactly what the target predicts. Speaks the MTP inference API: its "KV" entries hold the
    token x_{t+1} of each entry; prompts start with token 1, so the visible sequence is (1, x_1, ...)."""

    family, features, draft_modes = "mtp", "last", {"chain": CHAIN, "tree": TREE}  # the `Drafter` protocol

    def capture_layer_ids(self) -> list[int]:
        return []

    def check_target(self, tcfg) -> list[str]:
        return []

    def draft_state(self, batch: int, capacity: int, device: torch.device):
        from drafthead.runtime.draft import DraftRunner

        return DraftRunner(self, batch, capacity, device)

    def __init__(self, target: Target) -> None:
        super().__init__()
        c = target.config
        self.target = target.model
        self.config = SimpleNamespace(hidden_size=c.hidden_size, vocab_size=c.vocab_size, draft_vocab_size=c.vocab_size,
                                      num_key_value_heads=1, head_dim=1)
        self.anchor = nn.Parameter(torch.zeros(1, dtype=torch.float64))

    def fuse(self, last):
        return last

    def draft_to_target(self, idx):
        return idx

    def decode(self, input_ids, hidden, positions, kv=None, attn_mask=None, logits_at=None, module=0):
        B, T = input_ids.shape
        new = input_ids[:, None, :, None].to(torch.float64)  # [B, 1, T, 1]
        cache, attn_mask = kv_cache(kv, new, new, attn_mask)  # [B, 2, S, 1]
        attn_mask = attn_mask.expand(B, 1, T, cache.shape[2])
        logits = torch.zeros(B, T, self.config.vocab_size, dtype=torch.float64)
        for b, i in itertools.product(range(B), range(T)):
            vis = attn_mask[b, 0, i].nonzero()[:, 0]
            seq = [1] + [int(t) for t in cache[b, 0, vis, 0]]
            with torch.no_grad():
                top = self.target(torch.tensor([seq])).logits[0, -1].argmax()
            logits[b, i, top] = 50.0
        if logits_at is not None:
            logits = logits[torch.arange(B), logits_at][:, None]
        return logits, hidden, cache


def test_oracle_mtp_accepts_every_draft():
    target = runtime_target()
    gen = SpeculativeGenerator(target, OracleMtp(target))
    k, rounds = 3, 3
    ps = [p for p in prompts(6, seed=9) if EOS not in reference_greedy(target, p, 1 + rounds * (k + 1))][:2]
    assert ps
    for r in gen.generate(ps, 1 + rounds * (k + 1), SpecConfig(mode="chain", num_speculative_tokens=k)):
        assert r.accept_lens == [k] * rounds


def test_runtime_rejects_mismatched_mtp_draft():
    target = runtime_target()
    other = tiny_llama(vocab=128, hidden_size=48, dtype=torch.float64)
    with pytest.raises(ValueError, match="draft/target mismatch: hidden size: MTP draft has hidden_size=48"):
        SpeculativeGenerator(target, tiny_mtp(other, K=1))


# ---- export: to=hf / to=gguf (the target checkpoint with the MTP layers added) ---------------------------
def _mtp_draft_for(model: nn.Module, target_dir: Path, draft_dir: Path, K: int = 2, recursive: bool = False,
                   seed: int = 13, **kw) -> tuple[Path, dict[str, torch.Tensor]]:
    """A random MTP draft for the target saved at `target_dir` (recorded as its target); returns (dir, weights)."""
    d = _randomise(MtpDrafter(MtpConfig.from_target(model.config, num_draft_tokens=K, recursive=recursive, **kw)), seed)
    info = {"name_or_path": str(target_dir), "gguf_file": None, "num_hidden_layers": model.config.num_hidden_layers,
            "hidden_size": model.config.hidden_size, "vocab_size": model.config.vocab_size}
    save_draft(d, draft_dir, info)
    return draft_dir, {k: v for k, v in d.state_dict().items() if k not in NOT_SAVED}


def test_export_hf_nextn_layout_round_trip(tmp_path):
    """A llama target (no MTP convention of its own) gets DeepSeek/GLM-style layers model.layers.{N+i}.*."""
    from transformers import AutoConfig

    from drafthead.export import export
    from drafthead.export.mtp import read_native_export

    model = tiny_llama()
    tdir = tmp_path / "target"
    model.save_pretrained(tdir)
    ddir, ours = _mtp_draft_for(model, tdir, tmp_path / "draft", K=2, recursive=False)
    out = export(ddir, "hf", tmp_path / "out")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 2 and cfg["num_hidden_layers"] == 2
    original = json.loads((tdir / "config.json").read_text())
    assert {k: v for k, v in cfg.items() if k != "num_nextn_predict_layers"} == original
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    mtp = load_file(str(out / "model-mtp.safetensors"))
    block = {k.split(".", 2)[2] for k in ours if k.startswith("layers.0.")}
    assert set(mtp) == {f"model.layers.{2 + i}.{n}" for i in (0, 1) for n in block | {"embed_tokens.weight"}}
    assert {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "shared_head.head.weight",
            "self_attn.q_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight"} <= block
    assert all(index[k] == "model-mtp.safetensors" for k in mtp)
    assert torch.equal(mtp["model.layers.3.embed_tokens.weight"], model.model.embed_tokens.weight)  # DeepSeek's copy
    # the target's own weights are there unchanged: transformers loads the export as the same model
    back = LlamaForCausalLM.from_pretrained(out).eval()
    x = torch.randint(0, V, (1, 7))
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, model(x).logits, atol=0, rtol=0)
    # round trip: the native loader (drafter.init=native) reads back exactly the draft's tensors
    config, got = read_native_export(out)
    assert got.keys() == ours.keys() and all(torch.equal(got[k], ours[k]) for k in ours)
    dst = MtpDrafter(MtpConfig.from_target(config, num_draft_tokens=2, recursive=False))
    assert dst.config.native_layers == 2 and init_from_native(dst, read_native(str(out), config), config) == 2
    assert all(torch.equal(dst.state_dict()[k], ours[k]) for k in ours)
    # and out/draft is the draft in drafthead's own format
    again = load_draft(out / "draft", embed_weight=model.get_input_embeddings().weight)
    assert all(torch.equal(again.state_dict()[k], ours[k]) for k in ours)
    # a second export onto a target that already has MTP layers replaces them (no stale tensors)
    ddir1, ours1 = _mtp_draft_for(model, out, tmp_path / "draft1", K=1, recursive=True, seed=3)
    out1 = export(ddir1, "hf", tmp_path / "out1", outtype="bf16")
    assert json.loads((out1 / "config.json").read_text())["num_nextn_predict_layers"] == 1
    names = json.loads((out1 / "model.safetensors.index.json").read_text())["weight_map"]
    assert not any(k.startswith("model.layers.3.") for k in names) and "model.layers.2.eh_proj.weight" in names
    config1, got1 = read_native_export(out1)
    assert got1["layers.0.eh_proj.weight"].dtype == torch.bfloat16
    assert torch.equal(got1["layers.0.eh_proj.weight"], ours1["layers.0.eh_proj.weight"].bfloat16())
    assert AutoConfig.from_pretrained(out1).num_nextn_predict_layers == 1


def test_export_hf_mimo_layout_for_a_llama_target(tmp_path):
    """layout=mimo: a llama target written as MiMo (a Qwen2 config, architecture MiMoForCausalLM, q/k/v biases of
    zero), our layers as model.mtp_layers.{i}.* under MiMo's names with input_proj's halves swapped ([hidden;
    embedding]) and no head (MiMo reads the target's lm_head); transformers loads it as the same model, the native
    loader reads back exactly the draft, and a draft built on the exported target (its zero biases) is the same."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from drafthead.export import ExportError, export
    from drafthead.export.mtp import read_native_export

    model = tiny_llama(tie_word_embeddings=True)
    tdir = tmp_path / "target"
    model.save_pretrained(tdir)
    torch.manual_seed(0)
    d = MtpDrafter(MtpConfig.from_target(model.config, num_draft_tokens=3))  # recursive: one stored module
    init_from_target(d, model)  # the shared head is the target's lm_head, as MiMo's layout requires
    _perturb_norms(d)
    info = {"name_or_path": str(tdir), "num_hidden_layers": 2, "hidden_size": H, "vocab_size": V}
    save_draft(d, tmp_path / "draft", info)
    ours = {k: v for k, v in d.state_dict().items() if k not in NOT_SAVED}
    out = export(tmp_path / "draft", "hf", tmp_path / "out", layout="mimo")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "qwen2" and cfg["architectures"] == ["MiMoForCausalLM"]
    assert cfg["num_nextn_predict_layers"] == 1
    assert cfg["drafthead_converted_from"] == "llama" and "attention_bias" not in cfg
    mtp = load_file(str(out / "model-mtp.safetensors"))
    p = "model.mtp_layers.0."
    assert set(mtp) == {p + n for n in ("token_layernorm.weight", "hidden_layernorm.weight", "input_proj.weight",
                                        "final_layernorm.weight", "input_layernorm.weight",
                                        "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                                        "mlp.down_proj.weight")
                        + tuple(f"self_attn.{x}_proj.weight" for x in "qkvo")
                        + tuple(f"self_attn.{x}_proj.bias" for x in "qkv")}
    eh = ours["layers.0.eh_proj.weight"]  # [H, 2H]: [embedding; hidden] columns
    assert torch.equal(mtp[p + "input_proj.weight"], torch.cat([eh[:, H:], eh[:, :H]], dim=1))
    assert torch.equal(mtp[p + "token_layernorm.weight"], ours["layers.0.enorm.weight"])
    assert torch.equal(mtp[p + "hidden_layernorm.weight"], ours["layers.0.hnorm.weight"])
    assert torch.equal(mtp[p + "final_layernorm.weight"], ours["layers.0.shared_head.norm.weight"])
    assert not mtp[p + "self_attn.q_proj.bias"].any()
    bias = load_file(str(out / "model-mimo-bias.safetensors"))
    assert set(bias) == {f"model.layers.{j}.self_attn.{x}_proj.bias" for j in (0, 1) for x in "qkv"}
    assert not any(v.any() for v in bias.values())
    back, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(back).__name__ == "Qwen2ForCausalLM" and not info["missing_keys"]  # the zero biases are read
    back.eval()
    x = torch.randint(0, V, (1, 7))
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, model(x).logits, atol=1e-6, rtol=1e-6)
    config, got = read_native_export(out)
    assert got.keys() == {k for k in ours if "shared_head.head" not in k}
    assert all(torch.equal(got[k], ours[k]) for k in got)
    dst = MtpDrafter(MtpConfig.from_target(AutoConfig.from_pretrained(out), num_draft_tokens=3))
    assert dst.config.attention_bias and init_from_native(dst, read_native(str(out), config), config) == 1
    assert all(torch.equal(dst.state_dict()[k], ours[k]) for k in got)
    # served = MiMo for a llama target; a target MiMo cannot hold is named
    served = export(tmp_path / "draft", "hf", tmp_path / "served", layout="served")
    assert json.loads((served / "config.json").read_text()) == cfg
    with pytest.raises(ExportError, match=r"layout='nope': choose one of auto, mimo, served"):
        export(tmp_path / "draft", "hf", tmp_path / "bad", layout="nope")
    two, _ = _mtp_draft_for(model, tdir, tmp_path / "two", K=2, recursive=False)
    with pytest.raises(ExportError, match=r"MiMo MTP run the first MTP layer .* this draft stores 2"):
        export(two, "hf", tmp_path / "bad", layout="mimo")
    biased = tiny_llama(attention_bias=True)  # Qwen2 takes q/k/v biases, but the llama's o_proj bias has no place
    biased.save_pretrained(tmp_path / "biased")
    bd, _ = _mtp_draft_for(biased, tmp_path / "biased", tmp_path / "bdraft", K=1, recursive=True)
    with pytest.raises(ExportError, match=r"has attention_bias=true, which a Qwen2 \(MiMo\) block cannot hold"):
        export(bd, "hf", tmp_path / "bad", layout="mimo")
    q3 = Qwen3ForCausalLM(Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)).eval()
    q3.save_pretrained(tmp_path / "q3")
    q3d, _ = _mtp_draft_for(q3, tmp_path / "q3", tmp_path / "q3draft", K=1, recursive=True)
    with pytest.raises(ExportError, match=r"a qwen3 target .* cannot be written as MiMo"):
        export(q3d, "hf", tmp_path / "bad", layout="served")
    assert not (tmp_path / "bad").exists()


def test_export_hf_qwen35_layout_round_trip(tmp_path):
    """Qwen3.5: shared mtp.fc / mtp.pre_fc_norm_* / mtp.norm, mtp.layers.{i}.*, mtp_num_hidden_layers, no head."""
    from drafthead.export import ExportError, export
    from drafthead.export.mtp import read_native_export

    model = _qwen35(mtp=1)
    tdir = tmp_path / "target"
    model.save_pretrained(tdir)
    torch.manual_seed(0)
    d = MtpDrafter(MtpConfig.from_target(model.config, num_draft_tokens=3))  # recursive: one stored module
    init_from_target(d, model)  # the shared head is the target's lm_head, as the Qwen layout requires
    _perturb_norms(d)
    info = {"name_or_path": str(tdir), "num_hidden_layers": 4, "hidden_size": H, "vocab_size": V}
    save_draft(d, tmp_path / "draft", info)
    ours = {k: v for k, v in d.state_dict().items() if k not in NOT_SAVED}
    out = export(tmp_path / "draft", "hf", tmp_path / "out")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["mtp_num_hidden_layers"] == 1 and "num_nextn_predict_layers" not in cfg
    mtp = load_file(str(out / "model-mtp.safetensors"))
    assert {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight",
            "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.self_attn.q_norm.weight",
            "mtp.layers.0.mlp.gate_proj.weight", "mtp.layers.0.post_attention_layernorm.weight"} <= set(mtp)
    assert not any("shared_head" in k or "eh_proj" in k or "embed_tokens" in k for k in mtp)
    assert torch.equal(mtp["mtp.pre_fc_norm_hidden.weight"], ours["layers.0.hnorm.weight"])
    _, got = read_native_export(out)
    assert got.keys() == {k for k in ours if "shared_head.head" not in k}
    assert all(torch.equal(got[k], ours[k]) for k in got)
    # a trained head cannot go into a layout whose head is the target's lm_head
    with torch.no_grad():
        d.layers[0].shared_head.head.weight.add_(0.1)
    save_draft(d, tmp_path / "draft_head", info)
    with pytest.raises(ExportError, match=r"no head of its own .* layers.0.shared_head.head differs"):
        export(tmp_path / "draft_head", "hf", tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_export_rejects_bad_drafts_targets_and_formats(tmp_path):
    from drafthead.eagle3 import Eagle3Config, Eagle3Drafter
    from drafthead.export import ExportError, export, main

    model = tiny_llama()
    tdir = tmp_path / "target"
    model.save_pretrained(tdir)
    ddir, _ = _mtp_draft_for(model, tdir, tmp_path / "draft", K=1, recursive=True)
    # llama / qwen2 / qwen3 targets: llama.cpp has no MTP graph for them, one clear line naming the supported ones
    with pytest.raises(ExportError, match=r"^to=gguf: llama.cpp cannot run MTP layers for a llama target .*"
                                          r"qwen3_5/qwen3_5_text = llama.cpp qwen35") as e:
        export(ddir, "gguf", tmp_path / "x.gguf")
    assert "\n" not in str(e.value)
    from transformers import Qwen2ForCausalLM

    for cls, conf in ((Qwen3ForCausalLM, Qwen3Config(vocab_size=V, hidden_size=H, num_attention_heads=4,
                                                     num_key_value_heads=2, head_dim=16, num_hidden_layers=2)),
                      (Qwen2ForCausalLM, Qwen2Config(vocab_size=V, hidden_size=H, num_attention_heads=4,
                                                     num_key_value_heads=2, num_hidden_layers=2))):
        m = cls(conf)
        folder = tmp_path / conf.model_type
        m.save_pretrained(folder)
        with pytest.raises(ExportError, match=rf"cannot run MTP layers for a {conf.model_type} target"):
            export(ddir, "gguf", tmp_path / "x.gguf", target=str(folder))
    with pytest.raises(ExportError, match=r"cannot run MTP layers for a llama target \(smollm2-135m-instruct\)"):
        export(ddir, "gguf", tmp_path / "x.gguf", target="smollm2-135m-instruct")  # read from the GGUF's metadata
    with pytest.raises(ExportError, match=r"unknown export format to='sglang'; choose one of \['gguf', 'hf'\] "
                                          r"\(the formats of mtp drafts"):
        export(ddir, "sglang", tmp_path / "x")
    with pytest.raises(ExportError, match=r"to=hf takes no option\(s\) \['verifier'\]"):
        export(ddir, "hf", tmp_path / "x", verifier="y")
    # an EAGLE3 draft is not an MTP draft
    e3 = Eagle3Drafter(Eagle3Config.from_target(model.config, draft_vocab_size=V))
    save_draft(e3, tmp_path / "eagle", {"name_or_path": str(tdir)})
    with pytest.raises(ExportError, match=r"unknown export format to='hf'; .* \(the formats of eagle3 drafts; "
                                          r".*\bhf\b.* export other families\)"):
        export(tmp_path / "eagle", "hf", tmp_path / "x")
    # missing / misshapen tensors, a draft sized for another target, a target that is not there
    sd = load_file(str(ddir / "model.safetensors"))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((ddir / "config.json").read_text())
    save_file({k: v for k, v in sd.items() if k != "layers.0.hnorm.weight"}, str(broken / "model.safetensors"))
    with pytest.raises(ExportError, match=r"draft tensors do not match its config \(mtp\): missing \['layers.0.hnorm"):
        export(broken, "hf", tmp_path / "x")
    save_file({**sd, "layers.0.hnorm.weight": torch.ones(H + 1)}, str(broken / "model.safetensors"))
    with pytest.raises(ExportError, match=r"layers.0.hnorm.weight has shape \(33,\), the config implies \(32,\)"):
        export(broken, "hf", tmp_path / "x")
    wide, _ = _mtp_draft_for(model, tdir, tmp_path / "wide", K=1, intermediate_size=96)
    with pytest.raises(ExportError, match=r"does not fit target .*intermediate_size=96 \(target 64\)"):
        export(wide, "hf", tmp_path / "x")
    with pytest.raises(ExportError, match=r"target '/nonexistent' not found"):
        export(ddir, "hf", tmp_path / "x", target="/nonexistent")
    with pytest.raises(ExportError, match=r"outtype='q4' is not available for to=hf"):
        export(ddir, "hf", tmp_path / "x", outtype="q4")
    assert not (tmp_path / "x").exists() and not (tmp_path / "x.gguf").exists()
    # qwen3.5: llama.cpp's graph runs one MTP block
    q = _qwen35(mtp=1)
    q.save_pretrained(tmp_path / "qwen35")
    qd, _ = _mtp_draft_for(q, tmp_path / "qwen35", tmp_path / "qd", K=2, recursive=False)
    with pytest.raises(ExportError, match=r"llama.cpp's qwen35 graph runs 1 MTP layer, this draft stores 2"):
        export(qd, "gguf", tmp_path / "q.gguf")
    # the CLI
    assert main([f"draft={ddir}", "to=hf", f"out={tmp_path / 'cli'}"]) == 0
    assert json.loads((tmp_path / "cli" / "config.json").read_text())["num_nextn_predict_layers"] == 1


@pytest.mark.slow
def test_export_hf_default_smollm2_target(tmp_path):
    """The built-in GGUF target (llama): its weights as transformers dequantizes them, the nextn layout added;
    transformers loads the result as the same model and the native loader reads the layers back."""
    from transformers import AutoModelForCausalLM

    from drafthead.export import export
    from drafthead.export.mtp import read_native_export

    target = load_target("smollm2-135m-instruct", dtype="float32")  # logits compared at 1e-5 with the export's
    d = tiny_mtp(target.model, K=1)
    save_draft(d, tmp_path / "draft", target.info())
    out = export(tmp_path / "draft", "hf", tmp_path / "out")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1 and cfg["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in cfg and (out / "tokenizer.json").is_file()
    back = AutoModelForCausalLM.from_pretrained(out).eval()
    x = torch.tensor([[1, 50, 300, 7000]])
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, target.model(x).logits, atol=1e-5, rtol=1e-5)
    _, got = read_native_export(out)
    ours = {k: v for k, v in d.state_dict().items() if k not in NOT_SAVED}
    assert got.keys() == ours.keys() and all(torch.equal(got[k], ours[k]) for k in ours)

"""EAGLE3 exports as outside engines read them: fields SGLang cannot express, and offline speculators loading.

- `to=sglang` refuses a draft trained with `norm_before_residual=true` (SGLang's reader has no such field
  and would silently run the other residual); `to=speculators` carries it.
- `to=speculators store_embedding=true verifier=LOCAL_DIR` writes the target's embedding as
  `embed_tokens.weight` and names the local verifier, so the export loads without a model hub. When the
  PyPI package `speculators` is importable, its own `from_pretrained` loads the export with HF_HUB_OFFLINE=1
  and its draft logits are compared with ours.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from drafthead.eagle3 import Eagle3Config, Eagle3Drafter
from drafthead.export import ExportError, export, main
from drafthead.export import eagle3_sglang as sglang_export
from drafthead.registry import save_draft
from drafthead.vocab import build_vocab_mapping

from drafthead.export.eagle3 import load_exported

AUX = [2, 1, 3]  # inputs of target layers 2, 1, 3 (the tiny targets have 4 layers)


def target_embedding(tdir) -> torch.Tensor:
    return load_file(str(tdir / "model.safetensors"))["model.embed_tokens.weight"]


def make_draft(tdir, folder, norm_before_residual: bool, seed: int = 0, eagle31: bool = False):
    """A tiny random EAGLE3 draft for the HF target in `tdir`, saved with drafthead's own format."""
    torch.manual_seed(seed)
    tcfg = AutoConfig.from_pretrained(tdir)
    n = tcfg.vocab_size // 2
    cfg = Eagle3Config.from_target(tcfg, draft_vocab_size=n, aux_layer_ids=AUX,
                                   norm_before_residual=norm_before_residual, fc_norm=eagle31, norm_output=eagle31)
    drafter = Eagle3Drafter(cfg)
    drafter.embed_tokens.weight.data.copy_(target_embedding(tdir))
    d2t, t2d = build_vocab_mapping(torch.randint(0, 1000, (tcfg.vocab_size,)), n)
    drafter.d2t.copy_(d2t)
    drafter.t2d.copy_(t2d)
    with torch.no_grad():  # norms away from 1 and a residual that matters, so a swapped norm shows
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.add_(0.3 * torch.randn_like(p))
    drafter.eval()
    info = {"name_or_path": str(tdir), "gguf_file": None, "architecture": "LlamaForCausalLM", "model_type": "llama",
            "num_hidden_layers": tcfg.num_hidden_layers, "hidden_size": tcfg.hidden_size,
            "vocab_size": tcfg.vocab_size}
    return drafter, save_draft(drafter, folder, info)


@pytest.fixture(scope="module")
def drafts(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("engines")
    out = {"tdir": tiny_llama_dir}
    for nbr in (False, True):
        out[nbr] = make_draft(tiny_llama_dir, root / f"draft_nbr{int(nbr)}", nbr)
    out["eagle31"] = make_draft(tiny_llama_dir, root / "draft_eagle31", False, eagle31=True)
    return out


def decode_inputs(cfg: Eagle3Config, T: int = 6, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (1, T), generator=g)
    aux = torch.randn(1, T, len(cfg.aux_layer_ids) * cfg.target_hidden_size, generator=g)
    return ids, aux, torch.arange(T).unsqueeze(0)


def our_logits(drafter, seed: int = 1) -> torch.Tensor:
    ids, aux, pos = decode_inputs(drafter.config, seed=seed)
    with torch.no_grad():
        return drafter.decode(ids, drafter.fuse(aux), pos)[0]  # [1, T, N]


# ---------------------------------------------------------------------------------------------
# (a) norm_before_residual: SGLang cannot express it

def test_sglang_refuses_norm_before_residual(drafts, tmp_path):
    _, ddir = drafts[True]
    out = tmp_path / "sglang"
    with pytest.raises(ExportError, match=r"norm_before_residual.*to=speculators"):
        export(ddir, "sglang", out)
    assert not out.exists() and list(tmp_path.iterdir()) == []
    # the default (norm_before_residual=false) still exports
    assert (export(drafts[False][1], "sglang", tmp_path / "ok") / "model.safetensors").is_file()


def test_speculators_carries_norm_before_residual(drafts, tmp_path):
    drafter, ddir = drafts[True]
    out = export(ddir, "speculators", tmp_path / "spec", outtype="f32")  # fp32: our logits bit for bit
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["norm_before_residual"] is True
    del cfg["drafthead"]  # only the fields servers read
    (out / "config.json").write_text(json.dumps(cfg))
    back = load_exported(out, embed_weight=target_embedding(drafts["tdir"]))
    assert back.config.norm_before_residual is True
    assert torch.equal(our_logits(back), our_logits(drafter))


def test_sglang_reader_still_reads_norm_before_residual(drafts, tmp_path):
    """Third-party SGLang-layout files with `norm_before_residual: true` are still read as such."""
    out = export(drafts[False][1], "sglang", tmp_path / "s")
    cfg = json.loads((out / "config.json").read_text())
    del cfg["drafthead"]
    cfg["norm_before_residual"] = True
    kw, _ = sglang_export.to_internal(cfg, load_file(str(out / "model.safetensors")))
    assert kw["norm_before_residual"] is True
    (out / "config.json").write_text(json.dumps(cfg))
    assert load_exported(out).config.norm_before_residual is True


# ---------------------------------------------------------------------------------------------
# (b) store_embedding + a local verifier: an export that loads offline

@pytest.mark.parametrize("nbr", [False, True])
def test_store_embedding_local_verifier(drafts, tmp_path, nbr):
    drafter, ddir = drafts[nbr]
    tdir = drafts["tdir"]
    out = export(ddir, "speculators", tmp_path / "spec", verifier=str(tdir), store_embedding=True, outtype="f32")
    sd = load_file(str(out / "model.safetensors"))
    emb = target_embedding(tdir)
    assert torch.equal(sd["embed_tokens.weight"], emb)
    assert "layers.0.hidden_norm.weight" in sd and not any(k.startswith("midlayer.") for k in sd)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == str(tdir)
    assert cfg["embed_requires_grad"] is False and cfg["norm_before_residual"] is nbr
    # read back with the stored embedding only: the same draft
    back = load_exported(out, embed_weight=sd["embed_tokens.weight"])
    assert torch.equal(back.embed_tokens.weight, emb)
    assert torch.equal(our_logits(back), our_logits(drafter))


def test_store_embedding_default_off_and_outtype(drafts, tmp_path):
    ddir = drafts[False][1]
    sd = load_file(str(export(ddir, "speculators", tmp_path / "plain") / "model.safetensors"))
    assert "embed_tokens.weight" not in sd and sd["fc.weight"].dtype == torch.bfloat16  # what vLLM serves
    sd = load_file(str(export(ddir, "speculators", tmp_path / "bf", outtype="bf16", store_embedding=True)
                       / "model.safetensors"))
    assert sd["embed_tokens.weight"].dtype == torch.bfloat16
    assert torch.equal(sd["embed_tokens.weight"], target_embedding(drafts["tdir"]).to(torch.bfloat16))


def test_store_embedding_needs_loadable_target(drafts, tmp_path):
    """A target directory with config.json but no weights: one clear error, nothing at `out`."""
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((drafts["tdir"] / "config.json").read_text())
    out = tmp_path / "spec"
    with pytest.raises(ExportError, match="store_embedding=true.*could not be loaded"):
        export(drafts[False][1], "speculators", out, target=str(bare), store_embedding=True)
    assert not out.exists()
    with pytest.raises(ExportError, match="store_embedding"):
        export(drafts[False][1], "speculators", out, store_embedding="yes")
    assert not out.exists()


def test_cli_store_embedding(drafts, tmp_path):
    """`store_embedding=true` on the command line arrives as a bool (OmegaConf) and is accepted; the embedding is
    cast with the rest (bf16 by default)."""
    out = tmp_path / "spec"
    assert main([f"draft={drafts[False][1]}", "to=speculators", f"out={out}", f"verifier={drafts['tdir']}",
                 "store_embedding=true"]) == 0
    assert torch.equal(load_file(str(out / "model.safetensors"))["embed_tokens.weight"],
                       target_embedding(drafts["tdir"]).to(torch.bfloat16))


# ---------------------------------------------------------------------------------------------
# speculators' own loader, offline

def speculators_model(drafts, key, tmp_path, monkeypatch):
    """Our export of draft `key`, loaded offline by speculators' own `Eagle3DraftModel.from_pretrained`
    (the `speculators_models` fixture has put the package on the path)."""
    import huggingface_hub.constants as hub_constants
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    drafter, ddir = drafts[key]
    tdir = drafts["tdir"]
    out = export(ddir, "speculators", tmp_path / "spec", verifier=str(tdir), store_embedding=True, outtype="f32")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    config = Eagle3SpeculatorConfig.from_pretrained(out)
    config.transformer_layer_config._attn_implementation = "eager"  # flex attention needs a compiler on CPU
    return drafter, Eagle3DraftModel.from_pretrained(out, config=config).float().eval()


def test_speculators_runs_eagle31_as_we_do(drafts, tmp_path, monkeypatch, speculators_models):
    """fc_norm and norm_output as speculators' model reads them: its TTT step 1 at the last row (inputs: the
    step-0 hidden and the pad id 0 its teacher forcing puts there) equals our KV-cached chain step."""
    drafter, model = speculators_model(drafts, "eagle31", tmp_path, monkeypatch)
    assert model.config.fc_norm is True and model.config.norm_output is True
    for i, norm in enumerate(drafter.fc_norm):
        assert torch.equal(model.fc_norm[i].weight, norm.weight)
    ids, aux, pos = decode_inputs(drafter.config)
    logits = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: logits.append(o))
    with torch.no_grad():
        model(hidden_states=aux, input_ids=ids, document_ids=torch.zeros_like(ids), position_ids=pos, ttt_steps=2)
        ours0, out, kv = drafter.decode(ids, drafter.fuse(aux), pos)
        ours1, _, _ = drafter.decode(torch.zeros_like(ids[:, -1:]), out[:, -1:], pos[:, -1:] + 1, kv=kv)
    hook.remove()
    assert len(logits) == 2
    torch.testing.assert_close(logits[0], ours0, rtol=0, atol=1e-5)
    torch.testing.assert_close(logits[1][:, -1:], ours1, rtol=0, atol=1e-5)


@pytest.mark.parametrize("nbr", [False, True])
def test_speculators_from_pretrained_offline(drafts, tmp_path, monkeypatch, nbr, speculators_models):
    drafter, model = speculators_model(drafts, nbr, tmp_path, monkeypatch)
    tdir = drafts["tdir"]
    assert model.config.norm_before_residual is nbr
    assert torch.equal(model.embed_tokens.weight, target_embedding(tdir))
    assert torch.equal(model.d2t, drafter.d2t) and torch.equal(model.t2d, drafter.t2d)

    ids, aux, pos = decode_inputs(drafter.config)
    logits = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: logits.append(o))
    with torch.no_grad():
        model(hidden_states=aux, input_ids=ids, document_ids=torch.zeros_like(ids), position_ids=pos, ttt_steps=1)
    hook.remove()
    assert len(logits) == 1
    torch.testing.assert_close(logits[0], our_logits(drafter), rtol=0, atol=1e-5)

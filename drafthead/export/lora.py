"""Exports of the LoRA self-drafter.

- `to=peft`: the adapters as a peft adapter directory (`adapter_config.json` + `adapter_model.safetensors`)
  for the truncated target (its first E+n layers; `truncation.json` says so): load it with
  `AutoModelForCausalLM.from_pretrained(TARGET, num_hidden_layers=E+n)` then `PeftModel.from_pretrained`.
- `to=hf`: the merged standalone draft, an ordinary HF causal LM of the target's architecture with E+n
  layers (the adapters merged into the exit block), the target's norm, head and tokenizer: what vLLM
  (`draft_model`), SGLang (standalone draft) and HF assisted generation (`assistant_model=`) take.
- `to=gguf`: that standalone model as a llama GGUF (llama.cpp's classic `-md` draft), tokenizer metadata
  copied from the target's GGUF so both share one vocabulary.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from drafthead.export.common import GGUF_FINGERPRINT_KEY, ExportError, check_gguf_out, default_mode, target_fingerprint
from drafthead.registry import LoadedDraft

PEFT_PREFIX = "base_model.model."
GGUF_OUTTYPES = ("f32", "f16", "bf16", "q8_0")


def _target(draft: LoadedDraft, target: str | None) -> Any:
    """The target (fp32: exports hold exact copies of its tensors), by `target=` or the draft's record."""
    from drafthead.target import load_target

    rec = draft.meta.get("target") or {}
    name = target or rec.get("name_or_path")
    if not name:
        raise ExportError("no target: pass target=NAME_OR_PATH (the draft's config.json names none)")
    try:
        tgt = load_target(name, None if target else rec.get("gguf_file"), dtype="float32")
    except (OSError, ValueError) as e:
        raise ExportError(f"target {name!r} could not be loaded: {e}") from None
    model_type = draft.config.target_config["model_type"]
    if tgt.config.model_type != model_type or tgt.config.hidden_size != draft.config.hidden_size:
        raise ExportError(f"target {name!r} ({tgt.config.model_type}, hidden {tgt.config.hidden_size}) is not the "
                          f"one the draft was trained for ({model_type}, hidden {draft.config.hidden_size})")
    return tgt


def merged_drafter(draft: LoadedDraft, target_model: torch.nn.Module) -> Any:
    """The draft rebuilt on the target's tensors (copies) with its adapters merged."""
    drafter = draft.family.model(draft.config)
    drafter.load_state_dict(draft.state, strict=False)
    drafter.attach_target(target_model)
    return drafter.merged().float().eval()


def standalone_model(draft: LoadedDraft, target_model: torch.nn.Module) -> torch.nn.Module:
    """The target's architecture cut to E+n layers: layers < E the target's, the exit block merged."""
    import copy

    from transformers import AutoModelForCausalLM

    from drafthead.target import decoder_layers

    c = draft.config
    n_layers = c.exit_layer + c.num_exit_layers
    cfg = copy.deepcopy(target_model.config)
    cfg.num_hidden_layers = n_layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = list(cfg.layer_types)[:n_layers]
    if c.lora_head:
        cfg.tie_word_embeddings = False
    merged = merged_drafter(draft, target_model)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    state = {k: v for k, v in target_model.state_dict().items()
             if not k.startswith("model.layers.") or int(k.split(".")[2]) < c.exit_layer}
    for j, layer in enumerate(merged.layers):
        state.update({f"model.layers.{c.exit_layer + j}.{k}": v for k, v in layer.state_dict().items()})
    state["model.norm.weight"] = merged.norm.weight
    state["lm_head.weight"] = merged.target_lm_head.weight
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing or unexpected:
        raise ExportError(f"standalone draft: tensors missing {missing[:6]}, unexpected {unexpected[:6]}")
    assert len(decoder_layers(model)) == n_layers
    return model.eval()


def export_hf(draft: LoadedDraft, out: str | os.PathLike, target: str | None = None) -> Path:
    """The merged standalone draft model + the target's tokenizer, in `out` (a directory, written atomically)."""
    from drafthead.io import atomic_dir

    tgt = _target(draft, target)
    model = standalone_model(draft, tgt.model)
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        if tgt.tokenizer is not None:
            tgt.tokenizer.save_pretrained(tmp)
        default_mode(tmp, directory=True)
    return Path(out)


def _peft_name(ours: str, exit_layer: int) -> str:
    """Our adapter name -> peft's (adapter name dropped, as peft saves): layers.j.X.lora_A.default.weight ->
    base_model.model.model.layers.{E+j}.X.lora_A.weight; target_lm_head.* -> base_model.model.lm_head.*"""
    name = ours.replace(".default.", ".")
    if name.startswith("layers."):
        j, rest = name.split(".", 2)[1:]
        return f"{PEFT_PREFIX}model.layers.{exit_layer + int(j)}.{rest}"
    if name.startswith("target_lm_head."):
        return PEFT_PREFIX + "lm_head." + name.split(".", 1)[1]
    raise ExportError(f"unexpected adapter tensor {ours!r}")


def export_peft(draft: LoadedDraft, out: str | os.PathLike, target: str | None = None) -> Path:
    """A peft adapter directory for the truncated target (see the module docstring)."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    from drafthead.io import atomic_dir

    c = draft.config
    rec = draft.meta.get("target") or {}
    layers = "|".join(str(c.exit_layer + j) for j in range(c.num_exit_layers))
    pattern = rf"model\.layers\.({layers})\.(self_attn|mlp)\.({'|'.join(c.target_modules)})"
    pattern += r"|lm_head" if c.lora_head else ""
    cfg = LoraConfig(r=c.rank, lora_alpha=c.alpha, lora_dropout=c.dropout, bias="none", task_type="CAUSAL_LM",
                     target_modules=pattern, base_model_name_or_path=target or rec.get("name_or_path"))
    tensors = {_peft_name(k, c.exit_layer): v.contiguous() for k, v in draft.state.items()}
    with atomic_dir(out) as tmp:
        cfg.save_pretrained(str(tmp))
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        (tmp / "truncation.json").write_text(json.dumps(
            {"base_model": target or rec.get("name_or_path"), "gguf_file": None if target else rec.get("gguf_file"),
             "num_hidden_layers": c.exit_layer + c.num_exit_layers, "exit_layer": c.exit_layer,
             "note": "load the base with num_hidden_layers set to this value, then PeftModel.from_pretrained"},
            indent=2) + "\n")
        default_mode(tmp, directory=True)
    return Path(out)


def read_peft(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """A `to=peft` directory -> our adapter tensor names (the contract test's round trip)."""
    from safetensors.torch import load_file

    path = Path(path)
    E = json.loads((path / "truncation.json").read_text())["exit_layer"]
    out = {}
    for k, v in load_file(str(path / "adapter_model.safetensors")).items():
        name = k.removeprefix(PEFT_PREFIX)
        if name.startswith("model.layers."):
            i, rest = name.split(".", 3)[2:]
            ours = f"layers.{int(i) - E}.{rest}"
        else:
            ours = "target_lm_head." + name.split(".", 1)[1]
        a, b = ours.rsplit(".", 1)
        out[f"{a.replace('.lora_A', '.lora_A.default').replace('.lora_B', '.lora_B.default')}.{b}"] = v
    return out


# ---------------------------------------------------------------------------------------------
# to=gguf: the standalone model as a llama GGUF
LLAMA_NAMES = {  # HF layer tensor -> llama.cpp blk tensor
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """llama.cpp names and layout of a HF Llama model (q/k rows permuted to llama.cpp's rope order)."""
    from drafthead.export.gguf import rope_permute

    c = model.config
    out = {"token_embd.weight": model.model.embed_tokens.weight, "output_norm.weight": model.model.norm.weight}
    if not c.tie_word_embeddings:
        out["output.weight"] = model.lm_head.weight
    for i, layer in enumerate(model.model.layers):
        for k, v in layer.state_dict().items():
            if k == "self_attn.q_proj.weight":
                v = rope_permute(v, c.num_attention_heads)
            elif k == "self_attn.k_proj.weight":
                v = rope_permute(v, c.num_key_value_heads)
            out[f"blk.{i}.{LLAMA_NAMES[k]}"] = v
    return {k: v.detach().float() for k, v in out.items()}


def export_gguf(draft: LoadedDraft, out: str | os.PathLike, target: str | None = None,
                outtype: str | None = None) -> Path:
    """The standalone draft as a llama GGUF (f32 by default), tokenizer from the target's GGUF."""
    import gguf

    from drafthead.export.target_info import export_target_info
    from drafthead.export.gguf import add_model_keys, copy_tokenizer, write_atomic, write_tensors

    outtype = outtype or "f32"
    out = check_gguf_out(out, outtype, GGUF_OUTTYPES)
    c = draft.config
    if c.model_type != "llama":
        raise ExportError(f"to=gguf writes llama-architecture drafts (llama.cpp's `-md` draft); this target is "
                          f"{c.model_type!r}: export to=hf and convert it with llama.cpp's convert_hf_to_gguf.py")
    info = export_target_info(target, draft.meta)
    if info.gguf_path is None:
        raise ExportError(f"to=gguf copies the tokenizer from the target's GGUF, but target {info.name_or_path!r} "
                          f"({info.source}) has none: pass target=PATH.gguf")
    model = standalone_model(draft, _target(draft, target).model)
    hf = model.config
    rope = getattr(hf, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise ExportError(f"to=gguf: rope scaling {rope.get('rope_type')!r} is not written (plain rope only)")
    cfg = SimpleNamespace(  # the fields add_model_keys reads (transformers 5 keeps rope_theta in rope_parameters)
        max_position_embeddings=hf.max_position_embeddings, hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size, num_attention_heads=hf.num_attention_heads,
        num_key_value_heads=hf.num_key_value_heads, rms_norm_eps=hf.rms_norm_eps, vocab_size=hf.vocab_size,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        rope_theta=rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0)), num_hidden_layers=hf.num_hidden_layers)

    def write(tmp: Path) -> None:
        w = gguf.GGUFWriter(str(tmp), "llama")
        add_model_keys(w, cfg, f"{Path(info.name_or_path).name} LoRA self-draft, exit after layer "
                               f"{c.exit_layer + c.num_exit_layers - 1} (drafthead)", cfg.num_hidden_layers, outtype)
        if fp := target_fingerprint(draft.meta):
            w.add_string(GGUF_FINGERPRINT_KEY, fp)
        copy_tokenizer(info.gguf_path, w)
        write_tensors(w, gguf_tensors(model), outtype)

    return write_atomic(out, write)


__all__ = ["export_gguf", "export_hf", "export_peft", "read_peft", "standalone_model"]

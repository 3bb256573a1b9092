"""EAGLE3 exports: the family's entry points for `to=sglang|speculators|gguf`, the check they share (the
draft against its target), and `load_exported`, which rebuilds a drafter from an SGLang or speculators
checkpoint (ours or third-party)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file

from drafthead.eagle3 import FAMILY, Eagle3Config, Eagle3Drafter
from drafthead.export import eagle3_gguf, eagle3_sglang, eagle3_speculators
from drafthead.export.common import ExportError, TargetInfo
from drafthead.export.target_info import export_target_info
from drafthead.registry import NOT_SAVED, LoadedDraft, attach_embedding, check_state


def prepare(draft: LoadedDraft, target: str | None) -> TargetInfo:
    """The checks every EAGLE3 export makes before writing: three aux layers, a target that fits."""
    cfg: Eagle3Config = draft.config
    if len(cfg.aux_layer_ids) != 3:
        raise ExportError(f"{draft.path}: EAGLE3 export needs exactly 3 aux layer ids (SGLang/vLLM/llama.cpp), "
                          f"got {cfg.aux_layer_ids}")
    tinfo = export_target_info(target, draft.meta)
    check_target(cfg, tinfo)
    return tinfo


def to_sglang(draft: LoadedDraft, out: str | os.PathLike, target: str | None = None,
              outtype: str | None = None) -> Path:
    return eagle3_sglang.export(draft, prepare(draft, target), out, outtype=outtype)


def to_speculators(draft: LoadedDraft, out: str | os.PathLike, target: str | None = None,
                   outtype: str | None = None, num_speculative_tokens: int = 3, verifier: str | None = None,
                   store_embedding: bool = False) -> Path:
    return eagle3_speculators.export(draft, prepare(draft, target), out, outtype=outtype,
                                     num_speculative_tokens=num_speculative_tokens, verifier=verifier,
                                     store_embedding=store_embedding)


def to_gguf(draft: LoadedDraft, out: str | os.PathLike, target: str | None = None,
            outtype: str | None = None) -> Path:
    return eagle3_gguf.export(draft, prepare(draft, target), out, outtype=outtype)


def check_target(cfg: Eagle3Config, t: TargetInfo) -> None:
    if t.vocab_size != cfg.vocab_size:
        raise ExportError(f"target vocab size {t.vocab_size} ({t.source}) does not match the draft's "
                          f"{cfg.vocab_size}: the draft was trained for another target")
    if t.hidden_size != cfg.target_hidden_size:
        raise ExportError(f"target hidden size {t.hidden_size} ({t.source}) does not match the draft's "
                          f"target_hidden_size {cfg.target_hidden_size}")
    bad = [i for i in cfg.aux_layer_ids if not 0 <= i < t.num_hidden_layers]
    if bad:
        raise ExportError(f"aux layer ids {bad} out of range for a target with {t.num_hidden_layers} layers")


def load_exported(path: str | os.PathLike, embed_weight: torch.Tensor | None = None,
                  device: str | torch.device = "cpu") -> Eagle3Drafter:
    """Rebuild an `Eagle3Drafter` from an SGLang or speculators export (ours or third-party)."""
    path = Path(path)
    cfg_file, weights = path / "config.json", path / "model.safetensors"
    if not cfg_file.is_file() or not weights.is_file():
        raise FileNotFoundError(f"{path}: expected config.json and model.safetensors")
    config = json.loads(cfg_file.read_text())
    state = load_file(str(weights))
    fmt = eagle3_speculators if "speculators_model_type" in config else eagle3_sglang
    kw, state = fmt.to_internal(config, state)
    stored_embedding = state.pop("embed_tokens.weight", None)
    cfg = Eagle3Config(**{FAMILY.renamed_keys.get(k, k): v for k, v in kw.items()})  # older exports: old names
    if "t2d" not in state and "d2t" in state:  # e.g. ModelOpt exports carry d2t only
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[state["d2t"] + torch.arange(state["d2t"].numel())] = True
        state["t2d"] = t2d
    check_state(state, FAMILY, cfg, str(path), ExportError)
    drafter = Eagle3Drafter(cfg)
    drafter.load_state_dict(state, strict=False)
    attach_embedding(drafter, embed_weight if embed_weight is not None else stored_embedding, ExportError)
    return drafter.to(device).eval()


def read_back(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """An SGLang or speculators export -> our tensor names (the stored embedding, if any, left out)."""
    return {k: v for k, v in load_exported(path).state_dict().items() if k not in NOT_SAVED}

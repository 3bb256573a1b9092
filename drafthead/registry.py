"""Drafter families and the on-disk draft format (`run_dir/final/`).

A draft directory holds:
- `config.json`: {"family": str, "draft": <family config dict>, "target": {name_or_path, gguf_file,
  architecture, num_hidden_layers, hidden_size, vocab_size}, "drafthead_version": str}
- `model.safetensors`: the family's trainable weights and buffers. The token embedding is a frozen copy
  of the target's and is not saved (as in SGLang/vLLM EAGLE3 checkpoints); `load_draft` takes it from
  the target.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from drafthead.eagle3 import Eagle3Config, Eagle3Drafter
from drafthead.io import atomic_dir

DRAFTERS: dict[str, tuple[type, type]] = {
    "eagle3": (Eagle3Config, Eagle3Drafter),
}
NOT_SAVED = ("embed_tokens.weight",)
FORMAT_VERSION = "drafthead-0.1"


def build_drafter(family: str, config: Any) -> torch.nn.Module:
    if family not in DRAFTERS:
        raise ValueError(f"unknown drafter family {family!r}; known: {sorted(DRAFTERS)}")
    cfg_cls, model_cls = DRAFTERS[family]
    if isinstance(config, dict):
        config = cfg_cls(**config)
    return model_cls(config)


def draft_state_dict(drafter: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().contiguous() for k, v in drafter.state_dict().items() if k not in NOT_SAVED}


def save_draft(drafter: torch.nn.Module, path: str | os.PathLike, target_info: dict,
               extra: dict | None = None) -> Path:
    """Write the draft atomically (temp dir + rename)."""
    with atomic_dir(path) as tmp:
        save_file(draft_state_dict(drafter), str(tmp / "model.safetensors"))
        meta = {"family": drafter.family, "drafthead_version": FORMAT_VERSION,
                "draft": drafter.config.to_dict(), "target": target_info, **(extra or {})}
        (tmp / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
    return Path(path)


def read_draft_config(path: str | os.PathLike) -> dict:
    p = Path(path) / "config.json"
    if not p.is_file():
        raise FileNotFoundError(f"{path} is not a draft directory: no config.json")
    meta = json.loads(p.read_text())
    if "family" not in meta or "draft" not in meta:
        raise ValueError(f"{p}: not a drafthead draft config (needs 'family' and 'draft')")
    return meta


def load_draft(path: str | os.PathLike, embed_weight: torch.Tensor | None = None,
               device: str | torch.device = "cpu") -> torch.nn.Module:
    """Rebuild a drafter from `path`. `embed_weight` is the target's token embedding [V, H]."""
    meta = read_draft_config(path)
    drafter = build_drafter(meta["family"], meta["draft"])
    sd = load_file(str(Path(path) / "model.safetensors"))
    expected = set(draft_state_dict(drafter))
    missing, unexpected = expected - set(sd), set(sd) - expected
    if missing or unexpected:
        raise ValueError(f"{path}: draft weights do not match family {meta['family']!r}: "
                         f"missing {sorted(missing)}, unexpected {sorted(unexpected)}")
    own = drafter.state_dict()
    for k, v in sd.items():
        if own[k].shape != v.shape:
            raise ValueError(f"{path}: tensor {k} has shape {tuple(v.shape)}, config implies {tuple(own[k].shape)}")
    drafter.load_state_dict(sd, strict=False)
    if embed_weight is not None:
        if tuple(embed_weight.shape) != tuple(drafter.embed_tokens.weight.shape):
            raise ValueError(f"target embedding {tuple(embed_weight.shape)} does not match the draft's "
                             f"{tuple(drafter.embed_tokens.weight.shape)} (vocab, hidden)")
        with torch.no_grad():
            drafter.embed_tokens.weight.copy_(embed_weight)
    return drafter.to(device).eval()

"""Drafter families and the on-disk draft format (`run_dir/final/`).

A draft directory holds:
- `config.json`: {"family": str, "draft": <family config dict>, "target": {name_or_path, gguf_file,
  architecture, num_hidden_layers, hidden_size, vocab_size}, "drafthead_version": str}
- `model.safetensors`: the family's weights and buffers. The token embedding is a frozen copy of the
  target's and is not saved (as in SGLang/vLLM EAGLE3 checkpoints); `load_draft` takes it from the
  target. MTP's shared head (a copy of the target's final norm + lm_head, frozen by default) is saved:
  it is part of the layout MTP exports to.
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
from drafthead.mtp import MtpConfig, MtpDrafter

DRAFTERS: dict[str, tuple[type, type]] = {
    "eagle3": (Eagle3Config, Eagle3Drafter),
    "mtp": (MtpConfig, MtpDrafter),
}
NOT_SAVED = ("embed_tokens.weight",)  # every family's frozen copy of the target's token embedding
REDUCED_VOCAB = ("eagle3",)  # families that predict over a draft vocabulary (d2t / t2d)
INITS = {"eagle3": ("auto", "random"), "mtp": ("auto", "native", "target", "random")}
FORMAT_VERSION = "drafthead-0.1"


def build_drafter(family: str, config: Any) -> torch.nn.Module:
    if family not in DRAFTERS:
        raise ValueError(f"unknown drafter family {family!r}; known: {sorted(DRAFTERS)}")
    cfg_cls, model_cls = DRAFTERS[family]
    if isinstance(config, dict):
        config = cfg_cls(**config)
    return model_cls(config)


def build_for_target(family: str, target_config: Any, options: Any, aux_layer_ids: list[int] | None = None,
                     draft_vocab_size: int | None = None) -> torch.nn.Module:
    """A fresh drafter sized for the target. `options` is the recipe's `drafter` section (any object with
    its fields: intermediate_size, ttt_steps, step_decay, num_modules, recursive, step_weights, ...)."""
    if family == "eagle3":
        cfg: Any = Eagle3Config.from_target(target_config, draft_vocab_size, aux_layer_ids,
                                            intermediate_size=options.intermediate_size,
                                            ttt_steps=options.ttt_steps, step_decay=options.step_decay,
                                            feature_loss_weight=options.feature_loss_weight,
                                            hard_label_weight=options.hard_label_weight)
    elif family == "mtp":
        cfg = MtpConfig.from_target(target_config, intermediate_size=options.intermediate_size,
                                    num_modules=options.num_modules, recursive=options.recursive,
                                    step_weights=options.step_weights, train_head=options.train_head,
                                    attention=options.attention)
    else:
        raise ValueError(f"unknown drafter family {family!r}; known: {sorted(DRAFTERS)}")
    return build_drafter(family, cfg)


def num_steps(config: Any) -> int:
    """Draft depths one training forward reports (`correct` / `count` length)."""
    return config.ttt_steps if isinstance(config, Eagle3Config) else config.num_modules


def init_for_target(drafter: torch.nn.Module, target: Any, options: Any, d2t: torch.Tensor | None = None,
                    t2d: torch.Tensor | None = None) -> str:
    """Copy what the drafter shares with the target and initialise the rest; returns what was done.
    `options` is the recipe's `drafter` section (`init`, `init_head_from_target`).

    EAGLE3: the d2t/t2d vocabulary mapping, the embedding and, with `init_head_from_target`, the head rows
    and final norm (the rest stays random).
    MTP: the embedding and the shared head always; the block from `init`: "native" (the checkpoint's own
    MTP layers), "target" (its last decoder layer), "random", or "auto" (native when present, else target).
    """
    from drafthead.target import final_norm_weight, lm_head_weight, resolve_target

    family, init = drafter.family, getattr(options, "init", "auto")
    if init not in INITS[family]:
        raise ValueError(f"drafter.init={init!r} for family {family!r}: choose from {', '.join(INITS[family])}")
    if family == "eagle3":
        with torch.no_grad():
            drafter.d2t.copy_(d2t)
            drafter.t2d.copy_(t2d)
        head_init = getattr(options, "init_head_from_target", False)
        drafter.init_from_target(target.model.get_input_embeddings().weight,
                                 lm_head_weight(target.model) if head_init else None,
                                 final_norm_weight(target.model) if head_init else None)
        return "head from target" if head_init else "random"
    from drafthead.mtp import init_from_native, init_from_target
    from drafthead.mtp_native import read_native

    native = None
    if init in ("auto", "native"):
        path, gguf = resolve_target(target.name_or_path, target.gguf_file)
        native = None if gguf else read_native(path, target.config)
        if native is None and init == "native":
            raise ValueError(f"drafter.init=native: target {target.name_or_path!r} has no native MTP weights "
                             f"(needs a safetensors checkpoint declaring num_nextn_predict_layers / "
                             f"mtp_num_hidden_layers with those tensors)")
    init_from_target(drafter, target.model, block=init in ("auto", "target") and native is None)
    if native is not None:
        n = init_from_native(drafter, native, target.config)
        return f"native ({n} MTP layer{'s' if n > 1 else ''} from the checkpoint)"
    return "target (last decoder layer)" if init in ("auto", "target") else "random"


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
    attach_embedding(drafter, embed_weight)
    return drafter.to(device).eval()


def attach_embedding(drafter: torch.nn.Module, embed_weight: torch.Tensor | None,
                     error: type[ValueError] = ValueError) -> None:
    """Copy the target's token embedding [V, H] into the draft (drafts are saved without it)."""
    if embed_weight is None:
        return
    if tuple(embed_weight.shape) != tuple(drafter.embed_tokens.weight.shape):
        raise error(f"target embedding {tuple(embed_weight.shape)} does not match the draft's "
                    f"{tuple(drafter.embed_tokens.weight.shape)} (vocab, hidden)")
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(embed_weight)

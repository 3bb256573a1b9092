"""Export a trained draft for serving: SGLang/vLLM (`sglang`), vLLM speculators (`speculators`), llama.cpp (`gguf`).

EAGLE3 drafts: `sglang`, `speculators`, `gguf` (a separate draft file). MTP drafts (`drafthead.export.mtp`):
`hf` (the target checkpoint with the MTP layers added) and `gguf` (that checkpoint converted by llama.cpp).

    from drafthead.export import export, load_exported
    export("runs/x/final", to="gguf", out="draft.gguf", outtype="q8_0")
    export("runs/mtp/final", to="hf", out="exports/target_with_mtp", target="path/to/target")
    drafter = load_exported("exports/sglang_dir", embed_weight=target_embedding)

Each export validates the draft (tensor names/shapes, d2t/t2d) and the target (vocab, hidden size,
layer count) before writing anything, and writes atomically (temp name + rename): a failed export
leaves nothing at `out`.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from drafthead.export import gguf, mtp, sglang, speculators
from drafthead.export.common import ExportError, check_state, check_target, load_source, resolve_target
from drafthead.registry import attach_embedding, read_draft_config

EXPORTERS: dict[str, Callable[..., Path]] = {
    "sglang": sglang.export,
    "speculators": speculators.export,
    "gguf": gguf.export,
}
# options each format takes beyond (draft, to, out, target)
OPTIONS: dict[str, set[str]] = {
    "sglang": {"outtype"},
    "speculators": {"outtype", "num_draft_tokens", "verifier"},
    "gguf": {"outtype"},
}
MTP_OPTIONS = {"outtype"}  # to=hf|gguf of an MTP draft


def export(draft_dir: str | os.PathLike, to: str, out: str | os.PathLike, target: str | None = None,
           **kw: Any) -> Path:
    """Export the draft in `draft_dir` as format `to` to `out`; returns `out`. The draft's family picks the
    exporter: MTP drafts go to `drafthead.export.mtp` (to=hf|gguf), EAGLE3 drafts to the formats above."""
    if _family(draft_dir) == "mtp":
        unknown = set(kw) - MTP_OPTIONS
        if unknown:
            raise ExportError(f"MTP to={to} takes no option(s) {sorted(unknown)}; it takes {sorted(MTP_OPTIONS)}")
        return mtp.export(draft_dir, to, out, target=target, **{k: v for k, v in kw.items() if v is not None})
    if to == "hf":
        raise ExportError(f"to=hf exports MTP drafts (the target checkpoint with MTP layers); {draft_dir} is an "
                          f"EAGLE3 draft: choose one of {sorted(EXPORTERS)}")
    if to not in EXPORTERS:
        raise ExportError(f"unknown export format to={to!r}; choose one of {sorted(EXPORTERS)} (MTP drafts: "
                          f"{'|'.join(mtp.FORMATS)})")
    unknown = set(kw) - OPTIONS[to]
    if unknown:
        raise ExportError(f"to={to} takes no option(s) {sorted(unknown)}; it takes {sorted(OPTIONS[to])}")
    kw = {k: v for k, v in kw.items() if v is not None}
    src = load_source(draft_dir)
    tinfo = resolve_target(target, src.meta)
    check_target(src.config, tinfo)
    return EXPORTERS[to](src, tinfo, out, **kw)


def _family(draft_dir: str | os.PathLike) -> str | None:
    """The draft's family from its config.json; None when unreadable (`load_source` then says why)."""
    try:
        return read_draft_config(draft_dir).get("family")
    except (OSError, ValueError):
        return None


def load_exported(path: str | os.PathLike, embed_weight: torch.Tensor | None = None,
                  device: str | torch.device = "cpu") -> torch.nn.Module:
    """Rebuild an `Eagle3Drafter` from an SGLang or speculators export (ours or third-party)."""
    from drafthead.eagle3 import Eagle3Config, Eagle3Drafter

    path = Path(path)
    cfg_file, weights = path / "config.json", path / "model.safetensors"
    if not cfg_file.is_file() or not weights.is_file():
        raise FileNotFoundError(f"{path}: expected config.json and model.safetensors")
    config = json.loads(cfg_file.read_text())
    state = load_file(str(weights))
    fmt = speculators if "speculators_model_type" in config else sglang
    kw, state = fmt.to_internal(config, state)
    state.pop("embed_tokens.weight", None)
    cfg = Eagle3Config(**kw)
    if "t2d" not in state and "d2t" in state:  # e.g. ModelOpt exports carry d2t only
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[state["d2t"] + torch.arange(state["d2t"].numel())] = True
        state["t2d"] = t2d
    check_state(state, cfg, str(path))
    drafter = Eagle3Drafter(cfg)
    drafter.load_state_dict(state, strict=False)
    attach_embedding(drafter, embed_weight, ExportError)
    return drafter.to(device).eval()


def main(argv: list[str]) -> int:
    """`drafthead export draft=DIR to=sglang|speculators|gguf|hf out=PATH [target=..] [outtype=..]`."""
    from omegaconf import OmegaConf

    bad = [a for a in argv if "=" not in a]
    if bad:
        raise ExportError(f"arguments must be key=value, got {bad}")
    args = OmegaConf.to_container(OmegaConf.from_dotlist(list(argv)))
    missing = [k for k in ("draft", "to", "out") if args.get(k) in (None, "")]
    if missing:
        raise ExportError(f"missing {', '.join(k + '=' for k in missing)}; usage: drafthead export draft=DIR "
                          f"to={'|'.join(sorted(EXPORTERS))} (EAGLE3) | hf|gguf (MTP) out=PATH "
                          f"[target=NAME_OR_PATH] [outtype=f32|f16|bf16|q8_0]")
    draft, to, out, target = (args.pop(k, None) for k in ("draft", "to", "out", "target"))
    kw = {k: (str(v) if k in ("outtype", "verifier") else v) for k, v in args.items()}
    path = export(str(draft), str(to), str(out), target=None if target is None else str(target), **kw)
    print(f"exported {draft} as {to} to {path}")
    return 0


__all__ = ["EXPORTERS", "ExportError", "export", "load_exported", "main"]

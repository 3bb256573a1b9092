"""Export a trained draft for serving. The draft's family names its formats (`Family.exporters`):

    drafthead export draft=DIR to=FORMAT out=PATH [target=NAME_OR_PATH] [option=value ...]

    from drafthead.export import export, formats
    formats("runs/x/final")                 # {format: options} this draft's family exports to
    export("runs/x/final", to="gguf", out="draft.gguf", outtype="q8_0")

Every export reads the draft through the one validating loader (`drafthead.registry.read_draft`), checks
the target before writing anything, and writes atomically (temp name + rename): a failed export leaves
nothing at `out`. docs/export.md lists the formats per family and the engines each is proven in.
"""
from __future__ import annotations

import dataclasses
import inspect
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from drafthead import options as opts
from drafthead.export.common import ExportError
from drafthead.family import Family, resolve
from drafthead.registry import FAMILIES, LoadedDraft, family, read_draft, read_draft_config

log = logging.getLogger(__name__)
FIXED = ("draft", "out", "target")  # every exporter's own arguments; the rest are its options


def options(spec: str) -> list[str]:
    """The keyword options an exporter ("module:function") takes beyond (draft, out, target)."""
    return [p for p in inspect.signature(resolve(spec)).parameters if p not in FIXED]


def _family_of(draft_dir: str | os.PathLike | LoadedDraft) -> Family:
    """The draft's family from its config.json alone (the weights are read only for a format it has)."""
    if isinstance(draft_dir, LoadedDraft):
        return draft_dir.family
    try:
        meta = read_draft_config(draft_dir)
    except (FileNotFoundError, ValueError) as e:
        raise ExportError(str(e)) from None
    return family(meta["family"], ExportError)


def formats(draft_dir: str | os.PathLike) -> dict[str, list[str]]:
    """{format: its options} for the draft in `draft_dir`."""
    return {fmt: options(spec) for fmt, spec in _family_of(draft_dir).exporters.items()}


def check_target(draft: LoadedDraft, target: str | None, allow_mismatch: bool = False) -> str | None:
    """The export's target (`target=`, else the one the draft records) against the fingerprint the draft
    recorded: a TargetMismatch unless `allow_mismatch`. Returns a note when it could not be checked (no
    fingerprint recorded, or the target is not on this machine) or the mismatch was allowed."""
    from drafthead.fingerprint import compare
    from drafthead.target import local_target_fingerprint

    recorded = draft.meta.get("target") or {}
    if not recorded.get("fingerprint"):
        return compare(None, {}, allow_mismatch, f"draft {draft.path}", "allow_target_mismatch")
    name = target or recorded.get("name_or_path")
    if not name:
        return "the draft names no target: its fingerprint was not checked"
    actual, why = local_target_fingerprint(name, None if target else recorded.get("gguf_file"))
    if actual is None:
        return f"{why}: its fingerprint was not checked"
    try:
        return compare(recorded["fingerprint"], actual, allow_mismatch, f"draft {draft.path}", "allow_target_mismatch")
    except ValueError as e:
        raise ExportError(str(e)) from None


def export(draft_dir: str | os.PathLike | LoadedDraft, to: str, out: str | os.PathLike, target: str | None = None,
           allow_target_mismatch: bool = False, **kw: Any) -> Path:
    """Export the draft in `draft_dir` as format `to` to `out`; returns `out`. The target must be the one the
    draft was trained on (its fingerprint), unless `allow_target_mismatch`."""
    fam = _family_of(draft_dir)
    if to not in fam.exporters:
        others = sorted({f for other in FAMILIES.values() for f in other.exporters} - set(fam.exporters))
        raise ExportError(f"unknown export format to={to!r}; choose one of {sorted(fam.exporters)} (the formats of "
                          f"{fam.name} drafts" + (f"; {', '.join(others)} export other families)" if others else ")"))
    spec = fam.exporters[to]
    takes = options(spec)
    unknown = sorted(set(kw) - set(takes))
    if unknown:
        raise ExportError(f"to={to} takes no option(s) {unknown}; it takes {sorted(takes)}")
    draft = draft_dir if isinstance(draft_dir, LoadedDraft) else read_draft(draft_dir, ExportError)
    note = check_target(draft, target, allow_target_mismatch)
    if note:
        log.warning("%s", note)
    return resolve(spec)(draft, out, target=target, **{k: v for k, v in kw.items() if v is not None})


@dataclass
class ExportConfig:
    """`drafthead export`'s options; each format takes the fixed five and those of its own it names (`formats`)."""

    draft: str | None = None  # the trained draft's folder (<run_dir>/final)
    to: str | None = None  # the format; the draft's family names its own (listed below)
    out: str | None = None  # the file or folder to write (atomically: nothing there after an error)
    target: str | None = None  # the target to check the draft against and read from (default: the draft's own)
    allow_target_mismatch: bool = False  # export for a target whose fingerprint is not the one the draft was
    # trained on (the same model in another format, say); the mismatch is still printed
    outtype: str | None = None  # the weights' type in the file: f32 | f16 | bf16 (| q8_0 for GGUF); default: bf16
    # for the vLLM / SGLang layouts (fp16 beside an fp16 target), f32 for GGUF, the target's own for MTP's hf
    verifier: str | None = None  # speculators: the verifier the config names (default: the target's public id);
    # offline, a local HF directory of the target
    num_speculative_tokens: int | None = None  # speculators (EAGLE3, P-EAGLE): the draft length the config proposes
    # to engines, its `speculative_tokens` (default 3; P-EAGLE: the K it was trained with, at most that)
    store_embedding: bool | None = None  # speculators (EAGLE3, P-EAGLE): also write the target's token embedding
    # (false)
    layout: str | None = None  # MTP's hf: auto (the target's own MTP layout) | mimo (a llama / qwen2 target written
    # as MiMo, whose MTP layers vLLM and SGLang serve) | served (the target's own where an engine serves it, else mimo)


COMMAND_KEYS = ("draft", "to", "out", "target", "allow_target_mismatch")  # the rest are the formats' own options
FORMAT_OPTIONS = [f.name for f in dataclasses.fields(ExportConfig) if f.name not in COMMAND_KEYS]


def help_text(argv: list[str]) -> str:
    per_family = "\n".join(f"  {name}: " + ", ".join(f"to={fmt}" + (f" [{' '.join(options(spec))}]" if options(spec)
                                                                   else "") for fmt, spec in fam.exporters.items())
                           for name, fam in FAMILIES.items())
    return opts.help_text("drafthead export draft=DIR to=FORMAT out=PATH [key=value ...]", __doc__, ExportConfig(),
                          f"formats by family [the options each takes]:\n{per_family}")


def main(argv: list[str]) -> int:
    """`drafthead export draft=DIR to=FORMAT out=PATH [target=..] [option=value ...]`."""
    pairs = opts.key_values(list(argv), ExportError)
    cfg: ExportConfig = opts.parse(ExportConfig, pairs, ExportError)
    missing = [k for k in ("draft", "to", "out") if getattr(cfg, k) in (None, "")]
    if missing:
        per_family = "; ".join(f"{name}: {'|'.join(fam.exporters)}" for name, fam in FAMILIES.items())
        raise ExportError(f"missing {', '.join(k + '=' for k in missing)}; usage: drafthead export draft=DIR "
                          f"to=FORMAT out=PATH [target=NAME_OR_PATH] [option=value ...] (formats by family: "
                          f"{per_family})")
    kw = {k: getattr(cfg, k) for k in FORMAT_OPTIONS if k in pairs}  # only those given: each format's defaults
    path = export(str(cfg.draft), str(cfg.to), str(cfg.out), target=cfg.target,
                  allow_target_mismatch=cfg.allow_target_mismatch, **kw)
    print(f"exported {cfg.draft} as {cfg.to} to {path}")
    return 0


__all__ = ["ExportConfig", "ExportError", "export", "formats", "help_text", "main"]

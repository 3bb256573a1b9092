"""The target and its draft loaded as `drafthead eval` and `drafthead bench` run them: the draft on the target's
embedding and head, in the target's dtype, the target's identity checked against the draft's record."""
from __future__ import annotations

from typing import Any

import torch


# the runtime settings when neither the command nor the draft's "serving" record names them
DEFAULTS = {"num_speculative_tokens": 2, "tree_nodes": 8, "topk": 4}


def served(draft: str | None) -> dict[str, Any]:
    """The settings the trainer chose for the draft (final/config.json "serving", trainer/serving.py), {} if none."""
    from drafthead.registry import read_draft_config

    rec = read_draft_config(draft).get("serving", {}) if draft else {}
    return rec if "num_speculative_tokens" in rec else {}


def runtime_settings(mode: str, given: dict[str, int | None], draft: str | None) -> tuple[dict[str, int], str]:
    """The draft length and tree shape to run `mode` with, and where they come from: each given value, else the
    draft's serving record where it was chosen for this mode (a chain also takes the chain length a tree-serving
    draft recorded), else DEFAULTS."""
    rec = served(draft)
    if rec.get("mode") == mode:
        chosen = {k: int(rec[k]) for k in DEFAULTS if k in rec}
    elif mode == "chain" and "chain_length" in rec:
        chosen = {"num_speculative_tokens": int(rec["chain_length"])}
    else:
        chosen = {}
    out = {k: given[k] if given.get(k) is not None else chosen.get(k, DEFAULTS[k]) for k in DEFAULTS}
    used = [k for k in DEFAULTS if given.get(k) is None and k in chosen]
    source = "the draft's serving record" if used else "given" if all(given.get(k) is not None for k in DEFAULTS) \
        else "the command and the defaults"
    return out, source


def resolve_device(device: str) -> str:
    return ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device


def load_models(draft: str | None, target: str | None, gguf_file: str | None, device: str,
                dtype: str = "auto", allow_target_mismatch: bool = False) -> tuple[Any, Any, str | None]:
    """The target (given, or named by the draft's config.json) and the drafter on top of its embedding,
    both in `dtype` (the drafter follows the target's), and a note when the target's identity could not be
    confirmed. A target whose fingerprint is not the one the draft recorded is an error (TargetMismatch)
    unless `allow_target_mismatch`; then the note says so."""
    from drafthead.fingerprint import compare
    from drafthead.registry import load_draft, read_draft_config
    from drafthead.target import lm_head_weight, load_target

    meta = read_draft_config(draft) if draft else {}
    if draft and target is None:
        target, gguf_file = meta["target"]["name_or_path"], gguf_file or meta["target"].get("gguf_file")
    tgt = load_target(target, gguf_file, dtype=dtype, device=device)
    note = compare(meta["target"].get("fingerprint"), tgt.fingerprint, allow_target_mismatch, f"draft {draft}",
                   "allow_target_mismatch") if draft else None
    if note:
        print(f"warning: {note}")
    weight = tgt.model.get_input_embeddings().weight
    drafter = load_draft(draft, embed_weight=weight, device=device, head_weight=lm_head_weight(tgt.model),
                         target=tgt.model).to(weight.dtype) if draft else None
    return tgt, drafter, note

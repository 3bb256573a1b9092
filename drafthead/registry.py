"""Drafter families and the on-disk draft format (`run_dir/final/`).

A draft directory holds:
- `config.json`: {"family": str, "draft": <family config dict>, "target": {name_or_path, gguf_file,
  architecture, num_hidden_layers, hidden_size, vocab_size}, "drafthead_version": str}
- `model.safetensors`: the family's weights and buffers. The token embedding is a frozen copy of the
  target's and is not saved (as in SGLang/vLLM EAGLE3 checkpoints), nor is a family's frozen copy of the
  target's head (`target_lm_head`); `load_draft` takes both from the target. Everything else a family keeps
  (MTP's copy of the target's head, say) is saved when it is part of the layout the family exports to.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from drafthead import dflash, domino, dspark, eagle3, lora, mtp, peagle
from drafthead.family import Family
from drafthead.io import atomic_dir
from drafthead.vocab import draft_ids

# one line per family (its file ends in `FAMILY = Family(...)`)
FAMILIES: dict[str, Family] = {
    "eagle3": eagle3.FAMILY,
    "mtp": mtp.FAMILY,
    "dflash": dflash.FAMILY,
    "dspark": dspark.FAMILY,
    "lora": lora.FAMILY,
    "peagle": peagle.FAMILY,
    "domino": domino.FAMILY,
}
# frozen copies of the target's tensors, taken back from the target on load: every family's token
# embedding, and the output head of families that read through the target's own (DFlash)
NOT_SAVED = ("embed_tokens.weight", "target_lm_head.weight")
FORMAT_VERSION = "drafthead-0.1"


def family(name: str, error: type[ValueError] = ValueError) -> Family:
    if name not in FAMILIES:
        raise error(f"unknown drafter family {name!r}; known: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def make_config(name: str, draft: dict, error: type[ValueError] = ValueError) -> Any:
    """The family's config from a saved "draft" dict (keys renamed since it was written are read too)."""
    fam = family(name, error)
    draft = {fam.renamed_keys.get(k, k): v for k, v in draft.items()}
    try:
        return fam.config(**draft)
    except (TypeError, ValueError) as e:
        raise error(f"bad 'draft' section for family {name!r}: {e}") from None


def not_saved(drafter: torch.nn.Module) -> set[str]:
    """State names taken back from the target on load: NOT_SAVED and the family's `target_tensors()`."""
    return set(NOT_SAVED) | set(drafter.target_tensors())


def draft_state_dict(drafter: torch.nn.Module) -> dict[str, torch.Tensor]:
    skip = not_saved(drafter)
    return {k: v.detach().cpu().contiguous() for k, v in drafter.state_dict().items() if k not in skip}


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


@dataclass
class LoadedDraft:
    """A draft directory read and checked: what the runtime, eval and every exporter start from."""

    path: Path
    family: Family
    config: Any
    state: dict[str, torch.Tensor]  # every saved tensor (no embedding: it is the target's)
    meta: dict  # config.json as written


def read_draft(path: str | os.PathLike, error: type[ValueError] = ValueError) -> LoadedDraft:
    """Read `path` (a `run_dir/final/`) and check its weights against the module its config describes
    (built on the meta device: names and shapes, no memory): missing, unexpected, misshapen or
    non-finite tensors, and a d2t / t2d pair that does not describe one vocabulary, are errors."""
    path = Path(path)
    if not path.is_dir():
        raise error(f"draft directory not found: {path}")
    try:
        meta = read_draft_config(path)
    except (FileNotFoundError, ValueError) as e:
        raise error(str(e)) from None
    fam = family(meta["family"], error)
    config = make_config(fam.name, meta["draft"], error)
    weights = path / "model.safetensors"
    if not weights.is_file():
        raise error(f"{path}: no model.safetensors")
    state = {k: v for k, v in load_file(str(weights)).items() if k not in NOT_SAVED}
    check_state(state, fam, config, str(path), error)
    return LoadedDraft(path, fam, config, state, meta)


def check_state(state: dict[str, torch.Tensor], fam: Family, config: Any, where: str,
                error: type[ValueError] = ValueError) -> None:
    """Saved tensors (the embedding left out) against the module `config` describes, built on the meta
    device: missing, unexpected, misshapen or non-finite tensors, and a d2t / t2d pair that does not describe
    one vocabulary, are errors. Our draft directories and outside checkpoints (`load_exported`) alike."""
    with torch.device("meta"):
        module = fam.model(config)
        skip = not_saved(module)
        want = {k: tuple(v.shape) for k, v in module.state_dict().items() if k not in skip}
    missing, unexpected = sorted(set(want) - set(state)), sorted(set(state) - set(want))
    if missing or unexpected:
        more = lambda xs: f"{xs[:6]}{' ...' if len(xs) > 6 else ''}"  # noqa: E731
        raise error(f"{where}: draft tensors do not match its config ({fam.name}): missing {more(missing)}, "
                    f"unexpected {more(unexpected)}")
    for k, shape in want.items():
        if tuple(state[k].shape) != shape:
            raise error(f"{where}: tensor {k} has shape {tuple(state[k].shape)}, the config implies {shape}")
        if state[k].is_floating_point() and not bool(torch.isfinite(state[k]).all()):
            raise error(f"{where}: tensor {k} has NaN/inf values")
    if "d2t" in want:  # a draft vocabulary (EAGLE3 always, DFlash when its recipe chose one)
        check_vocab(state["d2t"], state["t2d"], where, error)


def check_vocab(d2t: torch.Tensor, t2d: torch.Tensor, where: str, error: type[ValueError] = ValueError) -> None:
    """d2t (int64 offsets) and t2d (bool) must describe the same draft vocabulary inside the target's."""
    if d2t.dtype != torch.int64:
        raise error(f"{where}: d2t must be int64 offsets, got {d2t.dtype}")
    if t2d.dtype != torch.bool:
        raise error(f"{where}: t2d must be bool, got {t2d.dtype}")
    ids = draft_ids(d2t)
    if bool(((ids < 0) | (ids >= t2d.numel())).any()):
        raise error(f"{where}: d2t maps draft ids outside the target vocabulary 0..{t2d.numel() - 1}")
    if ids.unique().numel() != ids.numel():
        raise error(f"{where}: d2t maps two draft ids to the same target id")
    if int(t2d.sum()) != d2t.numel() or not bool(t2d[ids].all()):
        raise error(f"{where}: t2d (marks {int(t2d.sum())} target ids) does not agree with d2t "
                    f"({d2t.numel()} draft ids)")


def load_draft(path: str | os.PathLike, embed_weight: torch.Tensor | None = None,
               device: str | torch.device = "cpu", head_weight: torch.Tensor | None = None,
               target: torch.nn.Module | None = None) -> torch.nn.Module:
    """Rebuild a drafter from `path`. `embed_weight` is the target's token embedding [V, H], `head_weight`
    its output head [V, H] (read by families that keep a `target_lm_head`); `target` the target model
    itself, which a family built from the target's own layers needs (and which gives the other two)."""
    draft = read_draft(path)
    drafter = draft.family.model(draft.config)
    drafter.load_state_dict(draft.state, strict=False)  # the target's tensors are not saved
    if drafter.shares_target_layers:
        if target is None:
            raise ValueError(f"a {drafter.family} draft is built from the target's own layers: pass target")
        drafter.attach_target(target)  # the embedding and head too
        return drafter.to(device).eval()
    if target is not None:
        from drafthead.target import lm_head_weight

        embed_weight = target.get_input_embeddings().weight if embed_weight is None else embed_weight
        head_weight = lm_head_weight(target) if head_weight is None else head_weight
    attach_embedding(drafter, embed_weight)
    attach_head(drafter, head_weight)
    return drafter.to(device).eval()


def attach_head(drafter: torch.nn.Module, head_weight: torch.Tensor | None,
                error: type[ValueError] = ValueError) -> None:
    """Copy the target's output head [V, H] into a draft that reads through it (no-op for the others): the rows
    `head_rows()` names where the draft predicts over a draft vocabulary."""
    if not drafter.reads_target_head:
        return
    head = drafter.target_lm_head
    if head_weight is None:
        raise error(f"a {drafter.family} draft reads through the target's output head: pass head_weight")
    rows = drafter.head_rows()
    if rows is not None:
        if int(rows.max()) >= head_weight.shape[0]:
            raise error(f"the draft's vocabulary reaches target id {int(rows.max())}, the target's head has "
                        f"{head_weight.shape[0]} rows")
        head_weight = head_weight[rows.to(head_weight.device)]
    if tuple(head_weight.shape) != tuple(head.weight.shape):
        raise error(f"target head {tuple(head_weight.shape)} does not match the draft's {tuple(head.weight.shape)}")
    with torch.no_grad():
        head.weight.copy_(head_weight)


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

"""Reduced draft vocabulary: the N most frequent loss-masked target tokens.

SGLang/vLLM/EAGLE convention: `d2t[i] = target_id(i) - i` (int64 offsets, target = draft + d2t[draft])
and `t2d[j] = j is in the draft vocab` (bool over the target vocab). Draft ids are sorted by target id.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch


def count_tokens(samples: Iterable[tuple[torch.Tensor, torch.Tensor]], vocab_size: int) -> torch.Tensor:
    """Frequency of each target token over loss-masked positions. samples: (input_ids [T], loss_mask [T])."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids, mask in samples:
        ids = torch.as_tensor(ids)[torch.as_tensor(mask).bool()]
        counts += torch.bincount(ids.long(), minlength=vocab_size)[:vocab_size]
    return counts


def build_vocab_mapping(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-N tokens by count (ties broken by lower id; unseen ids fill up from 0). Returns (d2t, t2d)."""
    vocab_size = counts.numel()
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size={draft_vocab_size} must be in 1..{vocab_size} (target vocab)")
    # stable sort on -count keeps lower ids first among equal counts, which pads with 0..N as SpecForge does
    order = torch.sort(-counts, stable=True).indices[:draft_vocab_size]
    used = torch.sort(order).values  # [N] target ids, ascending
    d2t = used - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    return d2t.long(), t2d


def draft_ids(d2t: torch.Tensor) -> torch.Tensor:
    """Target id of each draft id. [N]"""
    return d2t + torch.arange(d2t.numel(), device=d2t.device)


def target_to_draft(t2d: torch.Tensor) -> torch.Tensor:
    """Map target id -> draft id (-1 if absent). [V]"""
    out = torch.full((t2d.numel(),), -1, dtype=torch.long, device=t2d.device)
    idx = t2d.nonzero(as_tuple=True)[0]
    out[idx] = torch.arange(idx.numel(), device=t2d.device)
    return out

"""Memory: what a rank holds before activations (printed at the start; `train.dry_run=true` prints it from the
configs alone, no weights), and the host heap: glibc keeps freed memory between steps (no page faults for the
big loss tensors every step) and hands it back when the heap has grown past a slack.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Callable

import torch


def retain_freed_memory() -> bool:
    """Ask glibc to keep freed memory instead of handing it back to the OS after every step.

    Big activations (the [rows, draft vocab] fp32 loss tensors are tens of MB) are otherwise mmap'd fresh
    and page-faulted in on each use, a large share of a CPU step (docs/experiment_log.md). Linux/glibc only;
    `DRAFTHEAD_MALLOC_RETAIN=0` turns it off. Returns whether it took effect."""
    if os.environ.get("DRAFTHEAD_MALLOC_RETAIN", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return False
    M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4
    global _LIBC
    if libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1) and libc.mallopt(M_TOP_PAD, 64 << 20):
        _LIBC = libc
    return _LIBC is not None


_LIBC = None  # glibc, once retain_freed_memory took effect


def trim_freed_memory() -> bool:
    """Hand the retained free memory back to the OS now (glibc `malloc_trim`). Batches of varying shapes
    fragment a heap that never shrinks (the default run's peak RSS: docs/experiment_log.md). The trainer calls
    it after each evaluation and checkpoint, so the next step's page faults are paid once per
    hundred steps rather than every step. No-op unless `retain_freed_memory` took effect."""
    return _LIBC is not None and bool(_LIBC.malloc_trim(0))


def resident_bytes() -> int:
    """This process's resident memory now (Linux: /proc/self/statm; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


HEAP_SLACK_BYTES = 2 << 30  # retained free heap allowed above the live set before it is handed back


class HeapCap:
    """Hand the retained heap back once the process has grown HEAP_SLACK_BYTES past its size one step after
    the last trim (that size includes the step's own working set, which the heap is meant to keep). Why:
    with `retain_freed_memory`, batches of varying shapes fragment a heap that never shrinks; trimming only
    at evaluations let a LoRA or DFlash run double its resident memory within minutes, and two such runs on
    a 24 GB machine thrashed (docs/experiment_log.md, row P60). A check is one read of /proc/self/statm per
    step; a trim costs the page faults of one step."""

    def __init__(self, slack_bytes: int = HEAP_SLACK_BYTES) -> None:
        self.slack = slack_bytes
        self.base: int | None = None  # measured at the first call after a trim
        self.trims = 0

    def __call__(self) -> bool:
        """Call once per step; trims if the heap grew past the slack and returns whether it did."""
        if _LIBC is None:
            return False
        rss = resident_bytes()
        if self.base is None:
            self.base = rss
            return False
        if rss - self.base < self.slack:
            return False
        self.trim()
        return True

    def trim(self) -> None:
        """Hand the freed heap back now (also at evaluations and checkpoints); the next call measures the
        new base."""
        trim_freed_memory()
        self.base = None
        self.trims += 1


GIB = 2 ** 30


OPTIMIZER_BYTES = 16  # a trainable parameter: fp32 weight + fp32 grad + AdamW's two fp32 moments


def memory_per_rank(target_params: int, target_dtype_bytes: int, tp: int, draft_trainable: int,
                    draft_frozen_bytes: int) -> dict[str, float]:
    """GiB a rank holds before activations: its 1/tp of the target (every weight is split by the tp plan),
    the draft replicated with fp32 grads and AdamW states, and the draft's frozen copies of target rows."""
    target = target_params * target_dtype_bytes / tp / GIB
    draft = (draft_trainable * OPTIMIZER_BYTES + draft_frozen_bytes) / GIB
    return {"target_gib": round(target, 2), "target_whole_gib": round(target * tp, 2),
            "draft_gib": round(draft, 2), "total_gib": round(target + draft, 2)}


def draft_params(drafter: torch.nn.Module) -> tuple[int, int]:
    """(trainable parameters, bytes of the frozen ones) as the drafter holds them: its frozen copies of target
    rows stay in the drafter's own dtype (fp32 when built), whatever the target's is."""
    trainable = sum(p.numel() for p in drafter.parameters() if p.requires_grad)  # the families freeze their copies
    frozen = sum(p.numel() * p.element_size() for p in drafter.parameters() if not p.requires_grad)
    return trainable, frozen


def memory_line(target: Any, drafter: torch.nn.Module, d: Any) -> str:
    """One line for the log: what this rank holds before activations."""
    tparams = sum(p.numel() for p in target.model.parameters())
    tbytes = next(target.model.parameters()).element_size()
    trainable, frozen = draft_params(drafter)
    m = memory_per_rank(tparams, tbytes, d.tp, trainable, frozen)
    split = f"1/{d.tp} of {m['target_whole_gib']:.1f}" if d.tp > 1 else "whole"
    return (f"memory per rank before activations: {m['total_gib']:.1f} GiB = target {m['target_gib']:.1f} GiB "
            f"({split}) + draft {m['draft_gib']:.1f} GiB ({trainable / 1e6:.0f}M trainable with fp32 grads and "
            f"AdamW states)")


def dry_run(cfg: Any, log: Callable = print) -> dict[str, float]:
    """The memory per rank of a recipe from the target's config alone: target and drafter are built on the
    meta device, so a 70B target needs no weights and no GPU (`drafthead train recipe=NAME train.dry_run=true`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from drafthead.hardware import resolve_dtype_name
    from drafthead.registry import family
    from drafthead.target import resolve_target

    path, _ = resolve_target(cfg.target.name_or_path, cfg.target.gguf_file)
    tcfg = AutoConfig.from_pretrained(path)
    dtype = getattr(torch, resolve_dtype_name(cfg.target.dtype, torch.device("cuda"), quiet=True))
    fam = family(cfg.drafter.family)
    options = getattr(cfg.drafter, fam.name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tcfg, dtype=dtype)
        vocab = options.draft_vocab_size if fam.predicts_draft_vocab(options) else None  # a draft vocabulary sizes it
        drafter = fam.model(fam.build(tcfg, options, cfg.capture.layer_ids, vocab and min(vocab, tcfg.vocab_size)))
    tparams = sum(p.numel() for p in model.parameters())
    trainable, frozen = draft_params(drafter)  # built in fp32 on the meta device, as train.py builds it
    tp = cfg.target.tensor_parallel
    m = memory_per_rank(tparams, dtype.itemsize, tp, trainable, frozen)
    log(f"dry run: {cfg.target.name_or_path}, {tparams / 1e9:.1f}B params in {str(dtype).removeprefix('torch.')}, "
        f"drafter {fam.name} {trainable / 1e6:.0f}M trainable; tensor_parallel={tp}: memory per rank before "
        f"activations {m['total_gib']:.1f} GiB = target {m['target_gib']:.1f} GiB "
        f"(1/{tp} of {m['target_whole_gib']:.1f}) + draft {m['draft_gib']:.1f} GiB")
    return {**m, "target_params": tparams, "draft_trainable": trainable, "tensor_parallel": tp}

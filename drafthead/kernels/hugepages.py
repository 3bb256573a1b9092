"""Transparent huge pages for the packed weights: a decode step streams every weight once, and on 4 KB pages the
TLB misses of that stream cost bandwidth. Whether Linux gives them, in words for logs, and an allocator that lays
tensors out on them in the order a forward reads them."""
from __future__ import annotations

import functools
import math
import mmap
import os
import re
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20  # bytes of an x86 transparent huge page


@functools.cache
def _thp_setting() -> str | None:
    """Linux's transparent-huge-page setting, e.g. "always [madvise] never" (read once; None where absent)."""
    try:
        return Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    except OSError:
        return None


def huge_pages() -> str | None:
    """None where packed weights go on transparent huge pages (`HugePages`), else why not, in words."""
    if os.environ.get("DRAFTHEAD_HUGE_PAGES", "1") == "0":
        return "DRAFTHEAD_HUGE_PAGES=0"
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return "this OS has no madvise(MADV_HUGEPAGE)"
    setting = _thp_setting()
    if setting is None:
        return "no /sys/kernel/mm/transparent_hugepage/enabled"
    mode = re.search(r"\[(\w+)\]", setting)
    if mode is None or mode.group(1) == "never":
        return f"transparent huge pages are off ({setting})"
    return None


def pages() -> str:
    """The pages packed weights (and `drafthead bench`'s read buffer) lie on, in words, for logs and reports."""
    why = huge_pages()
    return "2 MB pages" if why is None else f"4 KB pages: {why}"


def huge_page_bytes(t: torch.Tensor) -> int:
    """Bytes of the mapping holding `t` that Linux backs with transparent huge pages now (AnonHugePages in
    /proc/self/smaps; 0 where that file or the mapping is missing): what `HugePages` asked for, as Linux gave it."""
    addr = t.data_ptr()
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return 0
    inside = False
    for line in lines:
        head = line.split(" ", 1)[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0


class HugePages:
    """Copies of tensors in anonymous memory advised for transparent huge pages (2 MB), one after another in chunks
    of `chunk` bytes, each copy on a 64-byte boundary.

    Why: a decode step streams every packed weight once, and on 4 KB pages each 4 KB of it costs a TLB miss and a
    page walk that the stream waits on. The same pass over SmolLM2's packed bf16 projections and head at one row
    took 7.78 ms on 2 MB pages against 9.21 ms on 4 KB pages (median of 20 alternating rounds, AVX512-BF16 EPYC,
    docs/experiment_log.md). Weights laid out in the order a forward reads them also make one stream. Where
    huge pages are off (`huge_pages()` says why) `put` returns the tensor as it is; the bits are the same either
    way. A chunk is freed when no tensor in it is left."""

    def __init__(self, chunk: int = 64 << 20) -> None:
        self.chunk = chunk
        self._buf: mmap.mmap | None = None
        self._at = self._end = 0  # byte offsets of the free part of the current chunk

    def put(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of `t` on huge pages (`t` itself where they are off or `t` is not on the CPU)."""
        if huge_pages() is not None or t.device.type != "cpu" or t.numel() == 0:
            return t
        return self.empty(t.shape, t.dtype).copy_(t)

    def empty(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised CPU tensor on huge pages (on ordinary pages where they are off)."""
        numel = math.prod(shape)
        if huge_pages() is not None or numel == 0:
            return torch.empty(shape, dtype=dtype)
        nbytes = numel * dtype.itemsize
        if self._buf is None or self._at + nbytes > self._end:
            size = max(self.chunk, -(-nbytes // HUGE_PAGE) * HUGE_PAGE) + HUGE_PAGE  # + room to align the start
            self._buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self._buf.madvise(mmap.MADV_HUGEPAGE)
            base = torch.frombuffer(self._buf, dtype=torch.uint8, count=1).data_ptr()
            self._at, self._end = -base % HUGE_PAGE, size
        # frombuffer keeps the chunk alive as long as a tensor in it lives
        out = torch.frombuffer(self._buf, dtype=dtype, count=numel, offset=self._at).view(shape)
        self._at += -(-nbytes // 64) * 64
        return out

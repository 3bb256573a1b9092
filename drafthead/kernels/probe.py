"""The bf16 decode kernel tuned to the machine: which tile path runs it (AMX or AVX512-BF16) and how it prefetches
the weights it streams (hint and distance), chosen by timing every candidate here, once, and cached.

Why: the setting that streams weights fastest differs by CPU, and code tuned on one class is slow on another.
Non-temporal prefetches 32 k-pairs ahead won on the AVX512-BF16 EPYC the kernel was written on; on the 2-core AMX
Xeon they made every row count ~1.8x slower than T0 prefetches, and there the AMX tiles win from 8 rows up.
So the runtime asks `tuned()` before its first bf16 decode: the first call on a machine times the candidates on
random weights of the default target's shapes (~190 MB, past the caches) at 1, 4 and 16 rows, in alternating
rounds, and writes the winner to `<kernel cache>/kernel_probe/<key>.json` (the key: CPU model and flags,
torch version and threads, the kernel's source); later processes read it.

The tile path is one choice for every row count, not one per row count: AMX's `tdpbf16ps` and AVX512's
`vdpbf16ps` round a sum differently (15 of 65,536 outputs of a [16, 576] x [576, 4096] product differ in their last
bf16 bit), and a row must get the same bits in a verify block as alone (greedy losslessness). So the path is
scored over the row counts together, each row count's time relative to its fastest candidate. The prefetch
settings never change bits. The AMX path also runs the bf16 attention of generated tokens on AMX tiles
(`extension.amx`); the probe times the projections alone, most of a forward's time.

`DRAFTHEAD_KERNEL_PROBE=0` keeps the built-in setting (AVX512-BF16 tiles, streamed weights non-temporal 32
k-pairs ahead); `DRAFTHEAD_AMX=1` or `0` forces the path and the probe tunes the prefetches for it.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import statistics
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from drafthead import hardware
from drafthead.kernels import extension

PATHS = ("avx512", "amx")
AHEAD = (16, 32, 64, 128)  # k-pairs ahead a tile prefetches
ROWS = (1, 4, 16)  # an AR step, a chain's verify block, a tree's or a block drafter's
SHAPES = ((1536, 576), (576, 1536))  # (N, K): the default target's FFN projections
PROBE_MB = 192  # weights a pass streams: past the last-level cache share a 2-core machine gets
ROUNDS = 3
VERSION = 1  # bump when the candidates or the scoring change: old cache files are then measured again


@dataclass(frozen=True)
class Setting:
    path: str = "avx512"  # "avx512" | "amx"
    hint: str = "nta"  # prefetch hint of streamed weights: "nta" | "t0" | "t1"
    ahead: int = 32  # k-pairs ahead

    def name(self) -> str:
        return f"{'AMX' if self.path == 'amx' else 'AVX512-BF16'} tiles, {self.hint.upper()} {self.ahead} ahead"


BUILT_IN = Setting()
_applied: Setting | None = None
_report: dict | None = None


def apply(s: Setting) -> None:
    """Switch the bf16 kernel to `s`. Plain weights (a draft's) take the same distance, with T0 in place of NTA:
    they are read again next step and should stay cached."""
    extension.amx(s.path == "amx")
    extension.prefetch(plain=("t0" if s.hint == "nta" else s.hint, s.ahead), stream=(s.hint, s.ahead))


def cpu_paths() -> list[str]:
    """The tile paths this CPU can run: AMX where the CPU has it and Linux grants the tile state (a VM or an old
    kernel may refuse it; `amx_refused()` says why)."""
    return [p for p in PATHS if p == "avx512" or amx_refused() is None]


@functools.lru_cache(maxsize=1)
def amx_refused() -> str | None:
    """Why the AMX tiles cannot run here (None: they can), asked once by turning them on and back (`extension.amx`
    names a CPU without AMX and a refused tile state alike)."""
    if not extension.available("bf16"):
        return f"bf16 kernel unavailable: {extension.unavailable_reason('bf16')}"
    was = extension.amx()
    try:
        extension.amx(True)
    except RuntimeError as e:
        return str(e)
    finally:
        with contextlib.suppress(RuntimeError):
            extension.amx(was)
    return None


def candidates() -> list[Setting]:
    forced = os.environ.get("DRAFTHEAD_AMX")
    paths = cpu_paths()
    if forced == "1" and "amx" in paths:
        paths = ["amx"]
    elif forced == "1":
        warnings.warn(f"drafthead: DRAFTHEAD_AMX=1 but {amx_refused()}; the AVX512-BF16 tiles run", stacklevel=2)
    elif forced == "0":
        paths = ["avx512"]
    return [Setting(p, h, a) for p in paths for h in extension.HINTS for a in AHEAD]


def cache_key() -> str:
    """CPU model and the flags that pick code, torch version and threads, the kernel's source, this file's scoring."""
    src = Path(extension._SOURCES["bf16"]).read_bytes()
    parts = [hardware.cpu_model(), hardware.cpu_class(), torch.__version__, str(torch.get_num_threads()),
             os.environ.get("DRAFTHEAD_AMX", ""), str(VERSION), hashlib.sha256(src).hexdigest()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def cache_path() -> Path:
    from drafthead.assets import kernel_cache_dir
    return kernel_cache_dir() / "kernel_probe" / f"bf16-{cache_key()}.json"


def measure(cands: list[Setting], rows: tuple[int, ...] = ROWS, probe_mb: int = PROBE_MB, rounds: int = ROUNDS,
            timer=None) -> dict:
    """Time one pass over `probe_mb` MB of packed random weights at each row count with each candidate, in
    `rounds` rounds whose candidate order rotates (so drift in the machine's speed spreads over all of them);
    the median per candidate and row count. `timer(setting, rows) -> ms` replaces the timing (tests)."""
    if timer is None:
        timer = _pass_timer(probe_mb)
    ms: dict[Setting, dict[int, list[float]]] = {c: {r: [] for r in rows} for c in cands}
    for rnd in range(rounds):
        order = cands[rnd % len(cands):] + cands[:rnd % len(cands)]
        for c in order:
            for r in rows:
                ms[c][r].append(timer(c, r))
    return {c: {r: statistics.median(v) for r, v in by.items()} for c, by in ms.items()}


def choose(ms: dict[Setting, dict[int, float]]) -> tuple[Setting, dict]:
    """The candidate with the least sum over row counts of its time / the fastest candidate's at that row count;
    also each row count's fastest candidate and what the choice costs against it (for reports)."""
    rows = sorted(next(iter(ms.values())))
    best = {r: min(ms, key=lambda c: ms[c][r]) for r in rows}
    score = {c: sum(ms[c][r] / ms[best[r]][r] for r in rows) for c in ms}
    pick = min(ms, key=lambda c: (score[c], c != BUILT_IN))
    per_rows = {str(r): {"fastest": best[r].name(), "fastest_ms": round(ms[best[r]][r], 3),
                         "chosen_ms": round(ms[pick][r], 3), "built_in_ms": round(ms[BUILT_IN][r], 3)
                         if BUILT_IN in ms else None} for r in rows}
    return pick, per_rows


def _pass_timer(probe_mb: int):
    from drafthead.kernels import cpu_linear
    g = torch.Generator().manual_seed(0)
    per = sum(n * k * 2 for n, k in SHAPES)
    weights = []
    for _ in range(max(1, probe_mb * 2**20 // per)):
        for n, k in SHAPES:
            w = (torch.rand(n, k, generator=g) - 0.5).to(torch.bfloat16)
            weights.append((cpu_linear.pack(w), n, k))
    xs = {(r, k): (torch.rand(r, k, generator=g) - 0.5).to(torch.bfloat16) for r in ROWS for _, k in SHAPES}

    def run(r: int) -> None:
        for p, n, k in weights:
            cpu_linear.linear(xs[(r, k)], p, n, stream=True)

    def timer(s: Setting, r: int) -> float:
        apply(s)
        run(r)  # the first pass after a switch warms the instruction paths; not timed
        t0 = time.perf_counter()
        run(r)
        return (time.perf_counter() - t0) * 1e3
    return timer


def tuned() -> Setting:
    """The bf16 kernel's setting for this machine, applied: from the cache, else measured now (a few seconds, once)
    and cached. BUILT_IN where the probe is off or the bf16 kernel is unavailable."""
    global _applied
    if _applied is not None:
        apply(_applied)  # again: a test or an earlier run may have switched the kernel since
        return _applied
    if not extension.available("bf16") or os.environ.get("DRAFTHEAD_KERNEL_PROBE", "1") == "0":
        _applied = BUILT_IN
        if extension.available("bf16"):
            apply(BUILT_IN)
        return _applied
    path = cache_path()
    s = _read(path)
    if s is None:
        # one process measures at a time (two timing each other's load would cache a choice made on a busy machine);
        # the others wait, then read what it wrote
        with contextlib.ExitStack() as held:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                fcntl.flock(held.enter_context(open(path.parent / ".lock", "w")), fcntl.LOCK_EX)
            except OSError:  # a read-only cache: measure without the lock (and say so when writing)
                pass
            s = _read(path) or _measure_and_cache(path)
    apply(s)
    _applied = s
    return s


def _read(path: Path) -> Setting | None:
    """The cached choice, or None where there is none, it does not parse, or it is not a candidate here."""
    global _report
    try:
        report = json.loads(path.read_text())
        s = Setting(**report["chosen"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if s not in candidates():
        return None
    _report = report
    return s


def _measure_and_cache(path: Path) -> Setting:
    global _report
    t0 = time.perf_counter()
    cands = candidates()
    threads = torch.get_num_threads()
    ms = measure(cands)
    s, per_rows = choose(ms)
    _report = {"chosen": asdict(s), "name": s.name(), "cpu_class": hardware.cpu_class(),
               "cpu_model": hardware.cpu_model(), "threads": threads,
               "seconds": round(time.perf_counter() - t0, 1), "rows": per_rows,
               "candidates": {c.name(): {str(r): round(v, 3) for r, v in by.items()} for c, by in ms.items()}}
    from drafthead.io import atomic_write_json
    try:
        atomic_write_json(path, _report)
    except OSError as e:  # a read-only cache costs a probe per process, not the run
        warnings.warn(f"drafthead: the kernel probe's choice could not be cached ({path}: {e})", stacklevel=2)
    return s


@contextlib.contextmanager
def use(s: Setting):
    """Run with `s` in place of the tuned setting, then put back what ran before (tests force each path the CPU
    has: greedy speculative output must equal AR on every path the probe can pick)."""
    global _applied
    was, amx, pf = _applied, extension.amx(), extension.prefetch()
    apply(s)
    _applied = s
    try:
        yield s
    finally:
        _applied = was
        extension.amx(amx)
        extension.prefetch(**pf)


def report() -> dict | None:
    """What `tuned()` chose and measured (None before it ran or where the probe is off)."""
    return _report


def describe() -> str:
    """The applied setting in words, for `paths()` and bench reports."""
    s = _applied or BUILT_IN
    how = "built in" if _report is None else f"probed here, {cache_path()}"
    return f"{s.name()} ({how})"

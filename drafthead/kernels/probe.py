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

The fp32 kernel (every x86 class with AVX2/FMA) is tuned the same way (`fp32_tuned`, at the end): how far ahead
its lone row prefetches and whether its multi-row tiles run K in chunks; its cache files are `fp32-<key>.json`.
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
from typing import Any

import torch

from drafthead import hardware
from drafthead.kernels import extension

PATHS = ("avx512", "amx")
AHEAD = (16, 32, 64, 128)  # k-pairs ahead a tile prefetches
ROWS = (1, 4, 16)  # an AR step, a chain's verify block, a tree's or a block drafter's
SHAPES = ((1536, 576), (576, 1536))  # (N, K): the default target's FFN projections
PROBE_MB = 192  # weights a pass streams: past the last-level cache share a 2-core machine gets
ROUNDS = 3
# the built-in setting stays unless a candidate's sum over the row counts beats its own by this much. The probe's
# passes stream weights alone; a forward also keeps its activations, norms and KV cache in L1/L2, which a T0/T1
# prefetch of the streamed weights evicts and an NTA one spares. On the AVX512-BF16 EPYC the probe chose T1 64 ahead
# by 0.8% of its sum, and whole forwards of 1-4 tokens then ran 12-20% slower than on the built-in setting (AR 7%);
# where a setting truly wins (AMX tiles with T0 prefetches on the AMX Xeon: about 2x) the margin changes nothing
BF16_MARGIN = 0.10
VERSION = 2  # bump when the candidates or the scoring change: old cache files are then measured again


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


def cache_key(kind: str = "bf16", *extra: str) -> str:
    """CPU model and the flags that pick code, torch version and threads, `extra` (what else picks code: the bf16
    kernel's forced path), the kernel's source, this file's scoring."""
    if kind == "bf16" and not extra:
        extra = (os.environ.get("DRAFTHEAD_AMX", ""),)
    src = Path(extension._SOURCES[kind]).read_bytes()
    parts = [hardware.cpu_model(), hardware.cpu_class(), torch.__version__, str(torch.get_num_threads()),
             *extra, str(VERSION), hashlib.sha256(src).hexdigest()]
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


def choose(ms: dict, built_in=BUILT_IN, margin: float = 0.0) -> tuple:
    """The candidate with the least sum over row counts of its time / the fastest candidate's at that row count;
    `built_in` stays unless that sum beats its own by more than `margin` (a fraction: the timing's noise). Also each
    row count's fastest candidate and what the choice costs against it (for reports)."""
    rows = sorted(next(iter(ms.values())))
    best = {r: min(ms, key=lambda c: ms[c][r]) for r in rows}
    score = {c: sum(ms[c][r] / ms[best[r]][r] for r in rows) for c in ms}
    pick = min(ms, key=lambda c: (score[c], c != built_in))
    if built_in in score and score[built_in] <= score[pick] * (1 + margin):
        pick = built_in
    per_rows = {str(r): {"fastest": best[r].name(), "fastest_ms": round(ms[best[r]][r], 3),
                         "chosen_ms": round(ms[pick][r], 3), "built_in_ms": round(ms[built_in][r], 3)
                         if built_in in ms else None} for r in rows}
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
    return _second_pass_timer(apply, run)


def _second_pass_timer(apply_, run):
    """timer(setting, rows) -> ms of `run(rows)` with `setting` applied, the pass after a first untimed one (which
    warms the instruction paths and caches for the switch)."""
    def timer(s: Any, r: int) -> float:
        apply_(s)
        run(r)
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
    s = _cached_or_measured(cache_path(), _read, _measure_and_cache)
    apply(s)
    _applied = s
    return s


def _cached_or_measured(path: Path, read, measure_and_cache):
    """`read(path)`, else `measure_and_cache(path)` by one process at a time (two timing each other's load would
    cache a choice made on a busy machine): the others wait on the cache's lock, then read what it wrote."""
    s = read(path)
    if s is None:
        with contextlib.ExitStack() as held:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                fcntl.flock(held.enter_context(open(path.parent / ".lock", "w")), fcntl.LOCK_EX)
            except OSError:  # a read-only cache: measure without the lock (and say so when writing)
                pass
            s = read(path) or measure_and_cache(path)
    return s


def _read(path: Path) -> Setting | None:
    """The cached choice, or None where there is none, it does not parse, or it is not a candidate here."""
    global _report
    got = _read_choice(path, Setting, candidates())
    if got is None:
        return None
    _report = got[1]
    return got[0]


def _read_choice(path: Path, kind: type, cands: list) -> tuple[Any, dict] | None:
    """(the cached choice as a `kind`, its report), or None where there is none, it does not parse or is not one of
    `cands` (a file from another version of the candidates)."""
    try:
        report_ = json.loads(path.read_text())
        s = kind(**report_["chosen"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return (s, report_) if s in cands else None


def _measure_and_cache(path: Path) -> Setting:
    global _report
    t0 = time.perf_counter()
    ms = measure(candidates())
    s, per_rows = choose(ms, BUILT_IN, BF16_MARGIN)
    _report = _probe_report(s, per_rows, ms, t0)
    _write(path, _report)
    return s


def _probe_report(s: Any, per_rows: dict, ms: dict, t0: float, **extra: Any) -> dict:
    """What a probe chose and measured, as cached and printed by `drafthead bench`."""
    return {"chosen": asdict(s), "name": s.name(), **extra, "cpu_class": hardware.cpu_class(),
            "cpu_model": hardware.cpu_model(), "threads": torch.get_num_threads(),
            "seconds": round(time.perf_counter() - t0, 1), "rows": per_rows,
            "candidates": {c.name(): {str(r): round(v, 3) for r, v in by.items()} for c, by in ms.items()}}


def _write(path: Path, report_: dict) -> None:
    from drafthead.io import atomic_write_json
    try:
        atomic_write_json(path, report_)
    except OSError as e:  # a read-only cache costs a probe per process, not the run
        warnings.warn(f"drafthead: the kernel probe's choice could not be cached ({path}: {e})", stacklevel=3)


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


# ---- the fp32 kernel's stream ----------------------------------------------------------------------------------
# Why: the fp32 kernel (AVX2/FMA, every x86 class) streamed with one distance and whole-K tiles chosen on the
# AVX512-BF16 EPYC it was written on. Its lone row prefetches `ahead` k on, and its 8-lane tiles of 2+ rows may
# run K in chunks so that each chunk of weights is read by every row tile while it is in L1 (`kc`; the AVX-512
# tiles take 8 rows a pass and no chunks). Neither changes bits, so they are chosen like the bf16 prefetches: every
# candidate timed here on random weights of the default target's shapes at 1, 4 and 16 rows, once, and cached.
FP32_AHEAD = (16, 32, 64, 128)  # k a lone row prefetches ahead
FP32_KC = (0, 64, 128, 256)  # k per chunk of the 8-lane multi-row tiles (0: the whole K)
# the built-in stream stays unless a candidate is this much faster over the row counts: on the AVX2 EPYC every
# candidate timed within 2-3% of it, the spread of repeated timings of one setting
FP32_MARGIN = 0.03


@dataclass(frozen=True)
class Fp32Stream:
    ahead: int = 32
    kc: int = 0

    def name(self) -> str:
        tiles = "whole-K tiles" if not self.kc else f"tiles in {self.kc}-k chunks"
        return f"fp32 stream: 1 row {self.ahead} k ahead, {tiles}"


FP32_BUILT_IN = Fp32Stream()
# by weight storage: each streams other bytes per k and has its own cache file; the kernel holds one stream setting
# per process, the one the last `fp32_tuned` applied
_fp32_applied: dict[str, Fp32Stream] = {}
_fp32_report: dict[str, dict] = {}


def fp32_apply(s: Fp32Stream) -> None:
    extension.fp32_stream(ahead=s.ahead, kc=s.kc)


def fp32_candidates() -> list[Fp32Stream]:
    kcs = (0,) if extension.avx512_tiles() else FP32_KC
    return [Fp32Stream(a, c) for a in FP32_AHEAD for c in kcs]


def fp32_cache_path(weights: str = "fp32") -> Path:
    """Per CPU, torch, threads, the fp32 kernel's source and the stored weights' type (their bytes per k differ)."""
    from drafthead.assets import kernel_cache_dir
    key = cache_key("fp32", hardware.cpu_capability(), weights)
    return kernel_cache_dir() / "kernel_probe" / f"fp32-{key}.json"


def _fp32_pass_timer(probe_mb: int, weights: str = "fp32"):
    from drafthead.kernels import cpu_linear
    g = torch.Generator().manual_seed(0)
    per = sum(n * k for n, k in SHAPES) * {"fp32": 4, "bf16": 2, "int8": 1}[weights]
    packed = []
    for _ in range(max(1, probe_mb * 2**20 // per)):
        for n, k in SHAPES:
            stored, scale, _ = cpu_linear.compress(torch.rand(n, k, generator=g) - 0.5, weights)
            packed.append((cpu_linear.pack_fp32(stored), scale, n, k))
    xs = {(r, k): torch.rand(r, k, generator=g) - 0.5 for r in ROWS for _, k in SHAPES}

    def run(r: int) -> None:
        for p, scale, n, k in packed:
            cpu_linear.linear_fp32(xs[(r, k)], p, n, scale)
    return _second_pass_timer(fp32_apply, run)


def fp32_tuned(weights: str = "fp32") -> Fp32Stream:
    """The fp32 kernel's stream for this machine and weight storage, applied: from the cache, else measured now
    (a few seconds, once) and cached. FP32_BUILT_IN where the probe is off or the fp32 kernel is unavailable."""
    if weights in _fp32_applied:
        fp32_apply(_fp32_applied[weights])
        return _fp32_applied[weights]
    if not extension.available("fp32") or os.environ.get("DRAFTHEAD_KERNEL_PROBE", "1") == "0":
        _fp32_applied[weights] = FP32_BUILT_IN
        if extension.available("fp32"):
            fp32_apply(FP32_BUILT_IN)
        return FP32_BUILT_IN

    def read(path: Path) -> Fp32Stream | None:
        got = _read_choice(path, Fp32Stream, fp32_candidates())
        if got is None:
            return None
        _fp32_report[weights] = got[1]
        return got[0]

    def measure_and_cache(path: Path) -> Fp32Stream:
        t0 = time.perf_counter()
        ms = measure(fp32_candidates(), timer=_fp32_pass_timer(PROBE_MB, weights))
        s, per_rows = choose(ms, FP32_BUILT_IN, FP32_MARGIN)
        _fp32_report[weights] = _probe_report(s, per_rows, ms, t0, weights=weights)
        _write(path, _fp32_report[weights])
        return s

    s = _cached_or_measured(fp32_cache_path(weights), read, measure_and_cache)
    fp32_apply(s)
    _fp32_applied[weights] = s
    return s


def fp32_report(weights: str = "fp32") -> dict | None:
    """What `fp32_tuned(weights)` chose and measured (None before it ran or where the probe is off)."""
    return _fp32_report.get(weights)


def fp32_describe(weights: str = "fp32") -> str:
    s = _fp32_applied.get(weights, FP32_BUILT_IN)
    return f"{s.name()} ({'probed here' if weights in _fp32_report else 'built in'})"

"""The CPU decode kernels' extensions: which kinds exist, built with `torch.utils.cpp_extension` into
`<kernel cache>/torch_extensions` on first use (about 35 s each, once per machine and torch installation;
`assets.kernel_cache_dir`), whether this CPU runs them,
and the process-wide switches of their tile paths (AMX; the fp32 kernel's AVX-512 tiles and bf16 ops).
`DRAFTHEAD_CPU_KERNEL=0` turns them off; without a compiler, without the CPU features or when a build fails,
`available(kind)` is False (with one warning naming why) and callers use oneDNN. The ops are `cpu_linear`."""
from __future__ import annotations

import hashlib
import os
import warnings
from pathlib import Path
from types import ModuleType

import torch

from drafthead import hardware

_SOURCES = {"bf16": Path(__file__).with_name("cpu_linear.cpp"),
            "fp32": Path(__file__).with_name("cpu_linear_avx2.cpp")}
# -ffp-contract=off: GCC otherwise fuses the int8 path's scale multiply and bias add into an FMA in some
# tile shapes and not others, and a row's bits then depended on the row count
# -fopenmp: at::parallel_for is OpenMP inlined from ATen's headers; compiled without it, every call runs on one
# thread whatever torch.set_num_threads says. The extension then shares torch's own libgomp (same soname,
# already loaded).
_CFLAGS = {"bf16": ["-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"],
           "fp32": ["-O3", "-fopenmp", "-mavx2", "-mfma", "-ffp-contract=off"]}
KINDS = tuple(_SOURCES)
_state: dict[str, ModuleType | str] = {}  # kind -> built module, or the reason it is unavailable


def _cpu_has_avx512_bf16() -> bool:
    """AVX512-BF16 in the CPU *and* in torch's dispatch level, so `ATEN_CPU_CAPABILITY=avx2` emulates an
    AVX2-only machine here too."""
    flags = hardware.cpu_flags()
    return hardware.cpu_class() in hardware.NATIVE_BF16_CLASSES and {"avx512_bf16", "avx512bw"} <= flags


def _cpu_has_avx2_fma() -> bool:
    return {"avx2", "fma"} <= hardware.cpu_flags()


def _check_kind(kind: str) -> None:
    if kind not in _SOURCES:
        raise ValueError(f"unknown CPU kernel kind {kind!r}; kinds: {', '.join(KINDS)}")


def load(kind: str = "bf16") -> ModuleType | None:
    _check_kind(kind)
    got = _state.get(kind)
    if got is not None:
        return got if isinstance(got, ModuleType) else None
    why = None
    if os.environ.get("DRAFTHEAD_CPU_KERNEL", "1") == "0":
        why = "DRAFTHEAD_CPU_KERNEL=0"
    elif kind == "bf16" and not _cpu_has_avx512_bf16():
        why = f"CPU class {hardware.cpu_class()} has no AVX512-BF16"
    elif kind == "fp32" and not _cpu_has_avx2_fma():
        why = "the CPU has no AVX2 and FMA"
    else:
        try:
            from torch.utils.cpp_extension import load

            from drafthead.assets import kernel_cache_dir

            build = kernel_cache_dir() / "torch_extensions" / build_name(kind)
            build.mkdir(parents=True, exist_ok=True)
            prune_orphan_builds(build, torch_dir())
            clear_stale_lock(build / "lock")
            ext = load(f"drafthead_{_SOURCES[kind].stem}", [str(_SOURCES[kind])], build_directory=str(build),
                       extra_cflags=_CFLAGS[kind], extra_ldflags=["-fopenmp"], verbose=False)
            if kind == "fp32" and not hardware.cpu_capability().startswith("AVX512"):
                # torch dispatches below AVX-512 (ATEN_CPU_CAPABILITY=avx2 measures the AVX2 class on a newer
                # CPU): the extension's AVX-512 code, which the CPU alone would choose, stays off too
                ext.avx512_tiles(False)
                ext.avx512_bf16(False)
            _state[kind] = ext
            if kind == "bf16" and os.environ.get("DRAFTHEAD_AMX") == "1":
                try:
                    amx(True)
                except RuntimeError as e:
                    warnings.warn(f"drafthead: DRAFTHEAD_AMX=1 but {e}; the AVX512-BF16 tiles run", stacklevel=3)
            return ext
        except Exception as e:  # no compiler / ninja, or a failed build: fall back, but say so
            why = f"building the extension failed: {type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}"
    _state[kind] = why
    if why != "DRAFTHEAD_CPU_KERNEL=0":
        warnings.warn(f"drafthead: {kind} CPU decode kernel unavailable ({why}); using oneDNN (slower at 1-16 "
                      f"rows)", stacklevel=3)
    return None


def build_name(kind: str) -> str:
    """The build folder of a kind: per torch version, torch installation and source file. Two installations with
    one cache (a checkout and a wheel installed elsewhere, two venvs) compile different paths, and sharing one
    folder made each rebuild the other's build in turn (ninja sees the paths in its build file change)."""
    where = hashlib.sha256(f"{torch_dir()}\n{_SOURCES[kind].resolve()}".encode())
    return f"{_SOURCES[kind].stem}-torch{torch.__version__.split('+')[0]}-{where.hexdigest()[:8]}"


def torch_dir() -> Path:
    return Path(torch.__file__).resolve().parent


def prune_orphan_builds(build: Path, torch_at: Path) -> list[Path]:
    """Record in `build` which torch it compiles against, and remove the sibling builds whose torch is gone (a CI
    run's throwaway venv leaves one build folder behind each time). Returns the removed folders."""
    import shutil

    record = build / "torch_dir"
    if not record.is_file() or record.read_text() != str(torch_at):  # atomic: another process may read it now
        tmp = build / f"torch_dir.{os.getpid()}"
        tmp.write_text(str(torch_at))
        os.replace(tmp, record)
    gone = []
    for other in build.parent.iterdir():
        theirs = other / "torch_dir"
        if other != build and theirs.is_file() and not Path(theirs.read_text().strip()).is_dir():
            shutil.rmtree(other, ignore_errors=True)
            gone.append(other)
    return gone


STALE_LOCK_S = 600.0  # a build takes about a minute; a lock older than this was left by a killed process


def clear_stale_lock(lock: Path, stale_s: float = STALE_LOCK_S) -> bool:
    """torch's extension loader takes `<build>/lock` even to load a current build and waits, without a word
    and without end, while the file exists: a process killed mid-load leaves one that hangs every later
    process. Wait for a live builder up to `stale_s` after the lock was made, then remove it (saying so).
    Returns whether a lock was removed."""
    import time

    def age() -> float | None:
        try:
            return time.time() - lock.stat().st_mtime
        except FileNotFoundError:  # no lock, or the builder just finished
            return None

    a = age()
    if a is None:
        return False
    if a < stale_s:
        warnings.warn(f"drafthead: waiting up to {stale_s - a:.0f} s for another process's kernel build ({lock})",
                      stacklevel=3)
        while (a := age()) is not None and a < stale_s:
            time.sleep(0.5)
        if a is None:
            return False
    lock.unlink(missing_ok=True)
    warnings.warn(f"drafthead: removed a stale kernel build lock ({lock}, {a:.0f} s old): a process was killed "
                  f"while loading the extension", stacklevel=3)
    return True


def available(kind: str = "bf16") -> bool:
    """True when the kernel of this kind is built (or builds now) and this CPU can run it."""
    return load(kind) is not None


def unavailable_reason(kind: str = "bf16") -> str | None:
    load(kind)
    got = _state.get(kind)
    return got if isinstance(got, str) else None


def ext(kind: str) -> ModuleType:
    """The built extension of this kind, or a RuntimeError naming why there is none."""
    ext = load(kind)
    if ext is None:
        raise RuntimeError(f"{kind} CPU decode kernel unavailable: {unavailable_reason(kind)}")
    return ext


def amx(on: bool | None = None) -> bool:
    """Whether bf16 projections whose K is a multiple of 32, and the bf16 attention of generated tokens (head_dim a
    multiple of 32), run AMX tiles (`tdpbf16ps`) instead of AVX512-BF16 code; `on` turns the path on or off first.
    Off when the extension loads; the runtime turns it on where `kernels/probe.py` measured it faster
    (DRAFTHEAD_AMX=1 / 0 forces it). Switch it only between runs: the two paths round differently, and a row must
    get the same bits in a verify block as alone. Turning it on where the CPU has no AMX, or where Linux refuses the
    tile state, raises a RuntimeError naming why, and the path stays off."""
    mod = ext("bf16")
    if on is not None:
        if on:
            missing = {"amx_bf16", "amx_tile"} - hardware.cpu_flags()
            if missing:
                raise RuntimeError(f"AMX tiles: this CPU (class {hardware.cpu_class()}) lacks "
                                   f"{', '.join(sorted(missing))} in /proc/cpuinfo")
        why = mod.amx_set(bool(on))
        if not why and available("fp32"):  # the bf16 attention takes the same path as the projections
            why = ext("fp32").amx_attention_set(bool(on))
            if why:
                mod.amx_set(False)
        if why:
            raise RuntimeError(f"AMX tiles: {why}")
    return bool(mod.amx_on())


HINTS = ("nta", "t0", "t1")  # prefetch hints of the bf16 kernel's weight streams, in the extension's numbering


def prefetch(plain: tuple[str, int] | None = None, stream: tuple[str, int] | None = None
             ) -> dict[str, tuple[str, int]]:
    """How the bf16 kernel prefetches weights: (hint, k-pairs ahead) for plain weights (a draft's) and for streamed
    ones (a target's, read once a forward); given ones are set first. `kernels/probe.py` picks them on the machine;
    the bits never depend on them."""
    mod = ext("bf16")
    ph, pa, sh, sa = mod.stream_get()
    now = {"plain": (HINTS[ph], int(pa)), "stream": (HINTS[sh], int(sa))}
    if plain is None and stream is None:
        return now
    new = {"plain": plain or now["plain"], "stream": stream or now["stream"]}
    for name, (hint, ahead) in new.items():
        if hint not in HINTS or not 1 <= int(ahead) <= 1024:
            raise ValueError(f"prefetch {name}=({hint!r}, {ahead}): the hint is one of {', '.join(HINTS)}, "
                             f"ahead 1..1024 k-pairs")
    mod.stream_set(HINTS.index(new["plain"][0]), int(new["plain"][1]), HINTS.index(new["stream"][0]),
                   int(new["stream"][1]))
    return new


def avx512_tiles(on: bool | None = None) -> bool:
    """Whether fp32-kernel projections of 2+ rows run their AVX-512 tiles (16 lanes, up to 8 rows a pass over the
    weights): the CPU has AVX-512 and they are not turned off. `on` turns them on or off for the process (tests
    run both). The same bits either way: every output is the same FMA sequence over k."""
    return bool(ext("fp32").avx512_tiles(on))


def avx512_bf16_ops(on: bool | None = None) -> bool:
    """Whether bf16 attention and elementwise ops (SiLU, RMSNorm, RoPE; in the fused layers also the adds and the
    attention output's rounding) run their AVX512-BF16 code: the CPU has it and it is not turned off. `on`
    turns it on or off for the process (tests run both paths). The choice never depends on the row count, so
    either way a token gets the same bits alone or in a block."""
    return bool(ext("fp32").avx512_bf16(on))


def fp32_stream(ahead: int | None = None, kc: int | None = None) -> dict[str, int]:
    """How the fp32 kernel streams weights: `ahead` k a lone row prefetches ahead into L1, `kc` k per chunk of its
    8-lane multi-row tiles (0: the whole K); given ones are set first. `kernels/probe.py` picks them on the machine;
    the bits never depend on them."""
    mod = ext("fp32")
    a, c = mod.stream_get()
    if ahead is not None or kc is not None:
        a, c = (a if ahead is None else int(ahead)), (c if kc is None else int(kc))
        if not 1 <= a <= 1024 or c < 0:
            raise ValueError(f"fp32 stream ahead={a}, kc={c}: ahead is 1..1024 k, kc >= 0 (0: the whole K)")
        mod.stream_set(a, c)
    return {"ahead": int(a), "kc": int(c)}

"""Row-invariant bf16 projections for CPU decoding (`cpu_linear.cpp`, AVX512-BF16, compiled on first use).

Why: a decode step or a verify block multiplies 1-5 rows by every weight of the target. oneDNN's bf16
matmul does that at ~5 GMAC/s on the 2-core AMX Xeon measured (its AMX tiles are built for many rows) and
the same step in fp32 is faster, so bf16 decoding lost to HF `generate` in fp32. The packed kernel streams
the weights once per call at ~28 GMAC/s for 1-4 rows and computes each output element with one fixed
instruction sequence, so a row's bits do not depend on how many rows share the call: a verify block gives
the same logits as decoding its tokens one by one (what greedy losslessness needs). Beyond ~8 rows oneDNN's
AMX path is faster, so prompts (prefill) keep using it; generated tokens always go through this kernel.

The extension is built with `torch.utils.cpp_extension` into `<drafthead cache>/torch_extensions` (about
35 s, once per machine). `DRAFTHEAD_CPU_KERNEL=0` turns it off; without a compiler, without AVX512-BF16 or
when the build fails, `available()` is False (with one warning naming why) and callers use oneDNN.
"""
from __future__ import annotations

import copy
import os
import warnings
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

from drafthead import hardware

_SOURCE = Path(__file__).with_name("cpu_linear.cpp")
_state: dict[str, ModuleType | str | None] = {}  # "ext": module, or "why": reason it is unavailable


def _cpu_has_avx512_bf16() -> bool:
    """AVX512-BF16 in the CPU *and* in torch's dispatch level, so `ATEN_CPU_CAPABILITY=avx2` emulates an
    AVX2-only machine here too."""
    flags = hardware.cpu_flags()
    return hardware.cpu_class() in hardware.NATIVE_BF16_CLASSES and {"avx512_bf16", "avx512bw"} <= flags


def _load() -> ModuleType | None:
    if "ext" in _state or "why" in _state:
        return _state.get("ext")  # type: ignore[return-value]
    why = None
    if os.environ.get("DRAFTHEAD_CPU_KERNEL", "1") == "0":
        why = "DRAFTHEAD_CPU_KERNEL=0"
    elif not _cpu_has_avx512_bf16():
        why = f"CPU class {hardware.cpu_class()} has no AVX512-BF16"
    else:
        try:
            from torch.utils.cpp_extension import load

            from drafthead.assets import cache_dir

            build = cache_dir() / "torch_extensions" / f"cpu_linear-torch{torch.__version__.split('+')[0]}"
            build.mkdir(parents=True, exist_ok=True)
            clear_stale_lock(build / "lock")
            _state["ext"] = load("drafthead_cpu_linear", [str(_SOURCE)], build_directory=str(build),
                                 extra_cflags=["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"],
                                 verbose=False)
            return _state["ext"]  # type: ignore[return-value]
        except Exception as e:  # no compiler / ninja, or a failed build: fall back, but say so
            why = f"building the extension failed: {type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}"
    _state["why"] = why
    if why != "DRAFTHEAD_CPU_KERNEL=0":
        warnings.warn(f"drafthead: bf16 CPU decode kernel unavailable ({why}); using oneDNN (slower at 1-8 rows)",
                      stacklevel=3)
    return None


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


def available() -> bool:
    """True when the kernel is built (or builds now) and this CPU can run it."""
    return _load() is not None


def unavailable_reason() -> str | None:
    _load()
    return _state.get("why")  # type: ignore[return-value]


def pack(weight: torch.Tensor) -> torch.Tensor:
    """bf16 weight [N, K] (K even) -> packed [ceil(N/16), K/2, 16, 2], made once per weight."""
    ext = _load()
    if ext is None:
        raise RuntimeError(f"bf16 CPU decode kernel unavailable: {unavailable_reason()}")
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.shape[1] % 2:
        raise ValueError(f"pack needs a bf16 [N, K] weight with K even, got {weight.dtype} {tuple(weight.shape)}")
    return ext.pack(weight.detach().cpu())


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] bf16 @ packed weight (+ bias, added in fp32 before the one rounding) -> [..., out_features]."""
    ext = _load()
    if ext is None:
        raise RuntimeError(f"bf16 CPU decode kernel unavailable: {unavailable_reason()}")
    if x.dtype != torch.bfloat16:
        raise ValueError(f"x must be bf16, got {x.dtype}")
    y = ext.linear(x.reshape(-1, x.shape[-1]), packed, out_features, bias)  # [rows, N]
    return y.view(*x.shape[:-1], out_features)


class PackedLinear(nn.Module):
    """Inference-only stand-in for a bf16 `nn.Linear` on CPU that runs through the packed kernel.

    Keeps `weight` (and `bias`) as they were, so code that reads `.weight.dtype` still works."""

    def __init__(self, lin: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = lin.in_features, lin.out_features
        self.weight, self.bias = lin.weight, lin.bias
        self.register_buffer("packed", pack(lin.weight), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.packed, self.out_features, self.bias)


def with_packed_linears(module: nn.Module) -> nn.Module:
    """A copy of `module` (inference only) whose bf16 CPU `nn.Linear` layers use the packed kernel; the module
    itself when there is nothing to replace or the kernel is unavailable. Used for drafters at decode time,
    where each draft step multiplies one row per request by every draft weight."""
    def fits(m: nn.Module) -> bool:
        return (type(m) is nn.Linear and m.weight.dtype == torch.bfloat16 and m.weight.device.type == "cpu"
                and m.in_features % 2 == 0)

    if not any(fits(m) for m in module.modules()) or not available():
        return module
    out = copy.deepcopy(module)
    for parent in list(out.modules()):
        for name, child in list(parent.named_children()):
            if fits(child):
                setattr(parent, name, PackedLinear(child))
    return out

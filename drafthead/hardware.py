"""What this machine computes fast, and the one dtype decision every entry point shares.

Machines of one kind differ in CPU: a Xeon with AMX, an EPYC with AVX512-BF16, an EPYC with AVX2 only.
On the first two a bf16 matmul runs ~3.5-4x faster than fp32; on the last, bf16 is emulated and runs
~7x *slower* (a [512x576]x[576x1536] matmul measured 13 GFLOP/s in bf16 vs 91 in fp32). So `auto` means
bf16 on CUDA and on CPUs with native bf16, fp32 elsewhere, and a forced bf16 on a CPU without it says so.

The CPU class follows torch's dispatch capability (`torch.backends.cpu.get_cpu_capability()`), which
`ATEN_CPU_CAPABILITY=avx2` lowers: with `ONEDNN_MAX_CPU_ISA=AVX2` as well, a newer CPU then behaves like
an AVX2-only one (dtype, kernels and oneDNN alike), which is how the slow class is measured on a fast one.
"""
from __future__ import annotations

import functools
import platform
import sys
from pathlib import Path

import torch

DTYPES = ("auto", "float32", "bfloat16")
NATIVE_BF16_CLASSES = ("AMX", "AVX512-BF16")
EMULATED_BF16_SLOWDOWN = 7  # bf16 / fp32 matmul time on an AVX2-only EPYC (13 vs 91 GFLOP/s, docs/benchmarks.md)


@functools.lru_cache(maxsize=1)
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty off Linux), read once."""
    if platform.system() != "Linux":
        return {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    info: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            break
        key, _, value = line.partition(":")
        info[key.strip()] = value.strip()
    return info


def cpu_flags() -> frozenset[str]:
    """x86 feature flags from /proc/cpuinfo (empty elsewhere)."""
    return frozenset(_cpuinfo().get("flags", "").split())


def cpu_capability() -> str:
    """torch's CPU dispatch level: DEFAULT, AVX2, AVX512, ... (lowered by ATEN_CPU_CAPABILITY)."""
    return torch.backends.cpu.get_cpu_capability()


def cpu_class() -> str:
    """AMX | AVX512-BF16 | AVX512 | AVX2 | torch's capability name: the class every figure is reported with."""
    cap = cpu_capability()
    if cap.startswith("AVX512"):
        flags = cpu_flags()
        if "amx_bf16" in flags:
            return "AMX"
        if "avx512_bf16" in flags:
            return "AVX512-BF16"
        return "AVX512"
    return cap


def native_bf16(device: str | torch.device = "cpu") -> bool:
    """True where bf16 matmuls run in hardware: CUDA, or a CPU of an AMX / AVX512-BF16 class."""
    return torch.device(device).type == "cuda" or cpu_class() in NATIVE_BF16_CLASSES


def describe(device: str | torch.device = "cpu") -> dict:
    """For reports and bench output: the CPU class and what it implies."""
    return {"cpu_capability": cpu_capability(), "cpu_class": cpu_class(), "native_bf16": native_bf16(device),
            "cpu_model": cpu_model()}


def cpu_model() -> str:
    """The CPU's model name (reports; the kernel probe's cache key)."""
    return _cpuinfo().get("model name") or platform.processor() or platform.machine()


_said: set[str] = set()


def _say(msg: str, warn: bool = False) -> None:
    """Each decision is said once per process, however many loaders ask."""
    if msg in _said:
        return
    _said.add(msg)
    print(("warning: " if warn else "") + msg, file=sys.stderr if warn else sys.stdout, flush=True)


def resolve_dtype(name: str, device: str | torch.device = "cpu", what: str = "", quiet: bool = False
                  ) -> torch.dtype:
    """`auto` | `float32` | `bfloat16` -> a torch dtype for `device`, with one line saying why.

    `auto` is bf16 where bf16 is native (see the module docstring), fp32 elsewhere. An explicit bf16 on a
    CPU without native bf16 still runs, with a warning that it will be several times slower. `what` names
    the user of the dtype in the log line (target, train, eval)."""
    check_dtype(name)
    dev = torch.device(device)
    native = native_bf16(dev)
    if name == "auto":
        dtype = torch.bfloat16 if native else torch.float32
        if not quiet:
            _say(f"{what + ' ' if what else ''}dtype: {str(dtype).removeprefix('torch.')} ({_why(dev)})")
        return dtype
    dtype = getattr(torch, name)
    if dtype == torch.bfloat16 and not native:
        _say(f"{what + ' ' if what else ''}dtype bfloat16 was asked for on a CPU without native bf16 "
             f"({_why(dev)}): bf16 matmuls run ~{EMULATED_BF16_SLOWDOWN}x slower than float32 here; "
             f"dtype=auto picks float32", warn=True)
    return dtype


def check_dtype(name: str) -> None:
    """The `dtype` keys (recipes, eval, bench): one of DTYPES, checked before anything loads."""
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; valid: {', '.join(DTYPES)}")


def _why(dev: torch.device) -> str:
    """The reason a dtype decision names (built only when it is said)."""
    if dev.type == "cuda":
        return "CUDA"
    return f"CPU capability {cpu_capability()}, " + (
        f"{cpu_class()}: native bf16" if native_bf16(dev) else "no native bf16")


def resolve_dtype_name(name: str, device: str | torch.device = "cpu", what: str = "", quiet: bool = False) -> str:
    return str(resolve_dtype(name, device, what, quiet)).removeprefix("torch.")

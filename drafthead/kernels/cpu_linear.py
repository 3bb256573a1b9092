"""Row-invariant projections for CPU decoding, compiled on first use: `cpu_linear.cpp` (bf16, AVX512-BF16) and
`cpu_linear_avx2.cpp` (fp32 activations on AVX2/FMA, with fp32, bf16 or int8 weights, in 16-lane tiles for 2+ rows
where the CPU has AVX-512; also the attention, RMSNorm, RoPE and SiLU-and-multiply of generated fp32 and bf16
tokens, one call each, and `decode_layer`, a whole decoder layer of generated tokens in one call).

Why: a decode step or a verify block multiplies 1-16 rows by every weight of the target, so its cost is the
time to stream the weights once. oneDNN does not reach that at these row counts: its bf16 matmul ran at
~5 GMAC/s on the 2-core AMX Xeon measured (its AMX tiles are built for many rows), its fp32 matmul streamed
SmolLM2's weights at 4.5-6.8 GB/s on a 2-core AVX2 EPYC that reads memory at ~22 GB/s, and both change
kernels with the row count. These kernels stream the weights once per call and compute each output element
with one fixed instruction sequence, so a row's bits do not depend on how many rows share the call: a verify
block gives the same logits as decoding its tokens one by one (what greedy losslessness needs). Generated
tokens always go through the kernel of the run's dtype, and prompts too except on AMX CPUs, which keep oneDNN's
tiles for them (`TargetModel.prompt_kernel`).

Kinds: "bf16" (bf16 activations and weights; CPUs with AVX512-BF16) and "fp32" (fp32 activations and
accumulation; any CPU with AVX2 and FMA; weights stored as fp32, or compressed to bf16 or int8 with
`weights=`, which halves or quarters the bytes each step streams).

The extensions are built with `torch.utils.cpp_extension` into `<drafthead cache>/torch_extensions` (about
35 s each, once per machine). `DRAFTHEAD_CPU_KERNEL=0` turns them off; without a compiler, without the CPU
features or when a build fails, `available(kind)` is False (with one warning naming why) and callers use
oneDNN.
"""
from __future__ import annotations

import copy
import functools
import math
import mmap
import os
import re
import warnings
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

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
WEIGHTS = ("fp32", "bf16", "int8")  # how the fp32 kernel stores the weights it streams
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


def _load(kind: str = "bf16") -> ModuleType | None:
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

            from drafthead.assets import cache_dir

            stem = _SOURCES[kind].stem
            build = cache_dir() / "torch_extensions" / f"{stem}-torch{torch.__version__.split('+')[0]}"
            build.mkdir(parents=True, exist_ok=True)
            clear_stale_lock(build / "lock")
            ext = load(f"drafthead_{stem}", [str(_SOURCES[kind])], build_directory=str(build),
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
    return _load(kind) is not None


def unavailable_reason(kind: str = "bf16") -> str | None:
    _load(kind)
    got = _state.get(kind)
    return got if isinstance(got, str) else None


def _ext(kind: str) -> ModuleType:
    """The built extension of this kind, or a RuntimeError naming why there is none."""
    ext = _load(kind)
    if ext is None:
        raise RuntimeError(f"{kind} CPU decode kernel unavailable: {unavailable_reason(kind)}")
    return ext


def kind_for(dtype: torch.dtype) -> str | None:
    """The kernel kind that runs generated tokens of this dtype on CPU (None: no kernel, oneDNN)."""
    return {torch.bfloat16: "bf16", torch.float32: "fp32"}.get(dtype)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """bf16 weight [N, K] (K even) -> packed [ceil(N/16), K/2, 16, 2] (blocks of 16 outputs, stored in groups of 4
    blocks side by side per k-pair; cpu_linear.cpp), made once per weight."""
    ext = _ext("bf16")
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.shape[1] % 2:
        raise ValueError(f"pack needs a bf16 [N, K] weight with K even, got {weight.dtype} {tuple(weight.shape)}")
    return ext.pack(weight.detach().cpu())


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None,
           stream: bool = False) -> torch.Tensor:
    """x [..., K] bf16 @ packed weight (+ bias, added in fp32 before the one rounding) -> [..., out_features].
    stream: the weight is read once a forward (a target's), so its lines are prefetched non-temporally and do not
    evict what is read again (KV cache, activations, a draft's weights); the bits are the same either way."""
    ext = _ext("bf16")
    if x.dtype != torch.bfloat16:
        raise ValueError(f"x must be bf16, got {x.dtype}")
    y = ext.linear(x.reshape(-1, x.shape[-1]), packed, out_features, bias, stream)  # [rows, N]
    return y.view(*x.shape[:-1], out_features)


def amx(on: bool | None = None) -> bool:
    """Whether bf16 projections whose K is a multiple of 32 run AMX tiles (`tdpbf16ps`) instead of the AVX512-BF16
    tiles; `on` turns the path on or off first. Off by default: it is not yet measured or checked for bits on an
    AMX machine (DRAFTHEAD_AMX=1 turns it on when the extension loads). Turning it on where the CPU has no AMX, or
    where Linux refuses the tile state, raises a RuntimeError naming why, and the path stays off."""
    ext = _ext("bf16")
    if on is not None:
        if on:
            missing = {"amx_bf16", "amx_tile"} - hardware.cpu_flags()
            if missing:
                raise RuntimeError(f"AMX tiles: this CPU (class {hardware.cpu_class()}) lacks "
                                   f"{', '.join(sorted(missing))} in /proc/cpuinfo")
        why = ext.amx_set(bool(on))
        if why:
            raise RuntimeError(f"AMX tiles: {why}")
    return bool(ext.amx_on())


def peak_macs(kind: str, seconds: float = 0.3) -> float:
    """Multiply-adds a second the kernel's multiply instruction sustains from registers on torch's threads
    (`vdpbf16ps` for bf16; 16-lane FMAs for fp32 where its AVX-512 tiles are on, else 8-lane): the compute side of
    the roofline a forward of n tokens is compared with. The best of three timings of about `seconds` each, after
    one that lets the clocks settle."""
    ext = _ext(kind)
    iters = 100_000
    while True:  # calibrate: each call should run about `seconds`
        rate = ext.peak_macs(iters)
        per_iter = 24 * (32 if kind == "bf16" else (16 if avx512_tiles() else 8)) * torch.get_num_threads()
        if iters * per_iter / rate >= seconds / 4 or iters > 1 << 32:
            break
        iters *= 4
    iters = max(1, int(iters * seconds / (iters * per_iter / rate)))
    return max(ext.peak_macs(iters) for _ in range(3))


def tile_path(kind: str, rows: int) -> str:
    """Which tile path the projections of a `rows`-row call take in the kernel of this kind (for reports)."""
    ext = _ext(kind)
    if kind == "bf16":
        if amx():
            return (f"bf16 AMX, {min(rows, 16)}-row tiles x 64 outputs over K chunks of 32 (weights with K % 32 == 0;"
                    f" others as without AMX)")
        if rows <= ext.ROWS:
            return f"bf16 AVX512-BF16, one {rows}-row tile x 64 outputs over K"
        if rows <= 2 * ext.ROWS:
            return f"bf16 AVX512-BF16, two tiles of <= {ext.ROWS} rows sharing K chunks"
        return f"bf16 AVX512-BF16, {ext.ROWS}-row tiles one after another over K"
    if rows == 1:
        return "fp32, 1 row x 48 outputs in 8 lanes"
    if avx512_tiles():
        return "fp32, 16-lane tiles of <= 8 rows x 48 outputs"
    return "fp32, 8-lane tiles of <= 4 rows x 24 outputs, next item prefetched into L2"


def compress(weight: torch.Tensor, weights: str) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """fp32 weight [N, K] -> (stored [N, K] for `pack_fp32`, per-output scale [N] or None, the fp32 weight
    the stored form stands for). bf16: round to nearest even; int8: symmetric per output row, 127 levels.
    The runtime writes the third back into the model, so prompts, HF `generate` and the kernel all run
    the same weights."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights={weights!r}: use one of {', '.join(WEIGHTS)}")
    w = weight.detach().float()
    if weights == "fp32":
        return w, None, w
    if weights == "bf16":
        b = w.to(torch.bfloat16)
        return b.view(torch.int16), None, b.float()
    scale = w.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127  # [N]
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)  # [N, K]
    return q, scale, q.float() * scale[:, None]


def pack_fp32(stored: torch.Tensor) -> torch.Tensor:
    """Stored weight [N, K] from `compress` -> packed [ceil(N/8), K, 8] (blocks of 8 outputs, stored in groups of 3
    blocks side by side per k; cpu_linear_avx2.cpp), made once per weight."""
    ext = _ext("fp32")
    if stored.dim() != 2 or stored.dtype not in (torch.float32, torch.int16, torch.int8):
        raise ValueError(f"pack_fp32 needs a [N, K] float32, int16 (bf16 bits) or int8 weight from compress(), "
                         f"got {stored.dtype} {tuple(stored.shape)}")
    return ext.pack(stored.detach().cpu().contiguous())


def linear_fp32(x: torch.Tensor, packed: torch.Tensor, out_features: int, scale: torch.Tensor | None = None,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] fp32 @ packed weight (* scale, int8 only) (+ bias) -> [..., out_features] fp32."""
    ext = _ext("fp32")
    if x.dtype != torch.float32:
        raise ValueError(f"x must be float32, got {x.dtype}")
    y = ext.linear(x.reshape(-1, x.shape[-1]), packed, out_features, scale, bias)  # [rows, N]
    return y.view(*x.shape[:-1], out_features)


def attention_fp32(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
                   ) -> torch.Tensor:
    """Attention of generated tokens, each query over the keys its mask allows (row-invariant: a
    token's output does not depend on how many queries share the call or on the cache capacity), in fp32.
    q [B, h, T, D] (D a multiple of 8); k, v [B, kvh, S, D] (views of the cache), all fp32 or all bf16;
    mask [B, 1, T, S] bool. Returns fp32 [B, h, T, D]; bf16 callers round it once. fp32 math; bf16 inputs on a
    CPU with AVX512-BF16 (head_dim <= 128) go through `vdpbf16ps`, the probabilities as bf16 pairs (~2^-17), see
    `avx512_bf16_ops`."""
    return _ext("fp32").attention(q, k, v, mask, scale)


def avx512_tiles(on: bool | None = None) -> bool:
    """Whether fp32-kernel projections of 2+ rows run their AVX-512 tiles (16 lanes, up to 8 rows a pass over the
    weights): the CPU has AVX-512 and they are not turned off. `on` turns them on or off for the process (tests
    run both). The same bits either way: every output is the same FMA sequence over k."""
    return bool(_ext("fp32").avx512_tiles(on))


def avx512_bf16_ops(on: bool | None = None) -> bool:
    """Whether bf16 attention and elementwise ops (SiLU, RMSNorm, RoPE; in the fused layers also the adds and the
    attention output's rounding) run their AVX512-BF16 code: the CPU has it and it is not turned off. `on`
    turns it on or off for the process (tests run both paths). The choice never depends on the row count, so
    either way a token gets the same bits alone or in a block."""
    return bool(_ext("fp32").avx512_bf16(on))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF RMSNorm of generated tokens in one call: x [..., H], weight [H] (both fp32 or both bf16) -> x's dtype.
    fp32 statistics per row in a fixed order; bf16 rounds the normalized x, then its product with the weight."""
    return _ext("fp32").rms_norm(x, weight, eps)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of generated tokens in one call: x [B, T, heads, D] (a view whose rows are contiguous),
    cos, sin [B, T, D] or [B, 1, T, D] -> contiguous [B, T, heads, D]; rounds where HF's
    `x * cos + rotate_half(x) * sin` does (fp32: the same bits)."""
    return _ext("fp32").rope(x, cos, sin)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of generated tokens in one call, from the joined gate/up output [..., 2I] -> [..., I]."""
    return _ext("fp32").silu_mul(gate_up)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Index of each row's first largest value over the last dim, as torch.argmax (a NaN counts as the largest):
    x [..., N] float32 or bf16 on CPU -> int64 [...], one vector scan per row."""
    return _ext("fp32").argmax(x)


def decode_layer(index: int, heads: int, kv_heads: int, head_dim: int, scaling: float, in_norm: nn.Module | None,
                 post_norm: nn.Module, qkv: PackedLinear, o: PackedLinear, gate_up: PackedLinear, down: PackedLinear,
                 q_norm: nn.Module | None = None, k_norm: nn.Module | None = None, stream: bool = False):
    """A generated token's whole Llama / Qwen2 / Qwen3 decoder layer in one call (`cpu_linear_avx2.cpp`,
    DecodeLayer): `.forward(h [B, T, H], cos, sin, cache, slots [B, T], mask [B, 1, T, S])` -> [B, T, H], writing
    the tokens' K/V at their slots of layer `index`. The same bits as running the layer op by op with this module's
    kernels and small ops (TargetModel.block); what it saves is the Python and dispatch between them.
    qkv and gate_up are the joined packed projections (`concat`); norms are RMSNorms (`weight` and HF's
    `variance_epsilon` or drafthead's `eps`); q_norm / k_norm are Qwen3's per-head norms.
    With `in_norm` None the layer runs by `.forward_input(x, residual, cos, sin, cache, slots, mask)`: x [B, T, K]
    is the attention's input as the caller made it (a draft's [norm(embedding); norm(hidden)]), residual [B, T, H]
    what the attention's output adds to; float32 cos / sin then give a bf16 layer a draft's fp32 RoPE.
    stream: bf16 weights are prefetched non-temporally (`linear`'s stream; a target's layers)."""
    ext = _ext("fp32")
    cap = _ext("bf16").LINEAR if qkv.kind == "bf16" else None

    def eps(norm: nn.Module | None) -> float:
        return 0.0 if norm is None else float(getattr(norm, "variance_epsilon", getattr(norm, "eps", None)))

    def weight(norm: nn.Module | None) -> torch.Tensor | None:
        return None if norm is None else norm.weight.detach()

    def proj(p: PackedLinear) -> tuple:
        return p.packed, p.out_features, p.scale, p.bias

    return ext.DecodeLayer(index, heads, kv_heads, head_dim, float(scaling), weight(in_norm), eps(in_norm),
                           weight(post_norm), eps(post_norm), weight(q_norm), weight(k_norm), eps(q_norm),
                           proj(qkv), proj(o), proj(gate_up), proj(down), cap, stream)


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


def packed_bytes(module: nn.Module) -> int:
    """Bytes of packed weight (and scales) a forward through `module`'s PackedLinears streams."""
    return sum(m.packed.numel() * m.packed.element_size() + (m.scale.numel() * 4 if m.scale is not None else 0)
               for m in module.modules() if isinstance(m, PackedLinear))


class PackedLinear(nn.Module):
    """Inference-only stand-in for a CPU `nn.Linear` (bf16 or fp32) that runs through the packed kernel of its
    dtype. Keeps `weight` (and `bias`) as they were, so code that reads `.weight.dtype` still works.

    `weights` (fp32 layers only): how the kernel stores the weight it streams. With bf16 or int8 the kernel
    computes with the compressed weight, not `lin.weight`: `compress` gives the fp32 weight that stands for it.
    `compressed`: (stored, scale) from `compress(lin.weight, weights)` when the caller made it already."""

    def __init__(self, lin: nn.Linear, weights: str = "fp32",
                 compressed: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = lin.in_features, lin.out_features
        self.weight, self.bias = lin.weight, lin.bias
        self.kind = kind_for(lin.weight.dtype)
        if self.kind == "bf16":
            if weights != "fp32":
                raise ValueError(f"weights={weights!r} needs fp32 layers (this one is bf16)")
            self.register_buffer("packed", pack(lin.weight), persistent=False)
            self.register_buffer("scale", None, persistent=False)
        elif self.kind == "fp32":
            stored, scale = compressed if compressed is not None else compress(lin.weight, weights)[:2]
            self.register_buffer("packed", pack_fp32(stored), persistent=False)
            self.register_buffer("scale", scale, persistent=False)
        else:
            raise ValueError(f"no CPU decode kernel for {lin.weight.dtype} layers")

    stream = False  # set by the owner of a weight read once a forward (the target): see `linear`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "bf16":
            return linear(x, self.packed, self.out_features, self.bias, self.stream)
        return linear_fp32(x, self.packed, self.out_features, self.scale, self.bias)


LANES = {"bf16": 16, "fp32": 8}  # outputs per packed block of each kernel


def _ungroup(packed: torch.Tensor, kind: str) -> torch.Tensor:
    """A packed weight with its blocks one after the other ([NB, ...], each block's bytes together) instead of in
    the kernel's groups of `GROUP` blocks side by side per k (the extension's kGroup)."""
    g, per = _ext(kind).GROUP, packed[0].numel()
    flat, out = packed.reshape(-1), []
    for b0 in range(0, packed.shape[0], g):
        w = min(g, packed.shape[0] - b0)
        out.append(flat[b0 * per: (b0 + w) * per].view(packed.shape[1], w, *packed.shape[2:]).transpose(0, 1))
    return torch.cat(out)


def _group(blocks: torch.Tensor, kind: str) -> torch.Tensor:
    """The inverse of `_ungroup`: blocks [NB, ...] -> the kernel's packed layout (same shape, group order)."""
    g = _ext(kind).GROUP
    parts = [blocks[b0: b0 + g].transpose(0, 1).reshape(-1) for b0 in range(0, blocks.shape[0], g)]
    return torch.cat(parts).view(blocks.shape)


def can_concat(parts: list[PackedLinear]) -> bool:
    """Whether `concat` can join these: one kind, input width and storage; every output count a whole number of
    packed blocks (so the packed tensors join with no padding between them); biases on all or none."""
    p0 = parts[0]
    return all(p.kind == p0.kind and p.in_features == p0.in_features and p.packed.dtype == p0.packed.dtype
               and p.out_features % LANES[p.kind] == 0 and (p.scale is None) == (p0.scale is None)
               and (p.bias is None) == (p0.bias is None) for p in parts)


def concat(parts: list[PackedLinear]) -> PackedLinear:
    """One PackedLinear computing the parts' outputs side by side (q/k/v, gate/up: one call instead of three or
    two, so a decode step makes fewer calls into the kernel). Each output is computed as in its part, bit for
    bit: the kernels compute every output on its own, whatever the tile it falls in."""
    if not can_concat(parts):
        raise ValueError("concat needs parts of one kernel kind, input width, storage and bias presence, with "
                     "output counts that are whole packed blocks: "
                     + ", ".join(f"{p.kind} {p.in_features}->{p.out_features}" for p in parts))
    out = PackedLinear.__new__(PackedLinear)
    nn.Module.__init__(out)
    out.kind, out.in_features = parts[0].kind, parts[0].in_features
    out.out_features = sum(p.out_features for p in parts)
    out.weight = None  # the parts' weights stay with their own modules
    out.bias = torch.cat([p.bias.detach() for p in parts]) if parts[0].bias is not None else None
    blocks = torch.cat([_ungroup(p.packed, out.kind) for p in parts])  # a part's end may split a group
    out.register_buffer("packed", _group(blocks, out.kind), persistent=False)
    out.register_buffer("scale", torch.cat([p.scale for p in parts]) if parts[0].scale is not None else None,
                        persistent=False)
    return out


def joined(*parts: nn.Module) -> PackedLinear | None:
    """The parts' one joined PackedLinear (`concat`), made on first use and kept on the first part; None unless
    every part is a PackedLinear and they join. A draft step's q/k/v and gate/up then take one kernel call each
    (SmolLM2's EAGLE3 draft: k and v were 192 outputs each, 12 blocks over 2 threads)."""
    if not all(isinstance(p, PackedLinear) for p in parts):
        return None
    cache = parts[0].__dict__.setdefault("_joined", {})  # plain attribute: not a submodule, not in state dicts
    key = tuple(id(p) for p in parts)
    if key not in cache:
        cache[key] = concat(list(parts)) if can_concat(list(parts)) else None
    return cache[key]


def with_packed_linears(module: nn.Module) -> nn.Module:
    """A copy of `module` (inference only) whose bf16 or fp32 CPU `nn.Linear` layers use the packed kernel of
    their dtype; the module itself when there is nothing to replace or the kernel is unavailable. Used for
    drafters at decode time, where each draft step multiplies one row per request by every draft weight."""
    def fits(m: nn.Module) -> bool:
        kind = kind_for(m.weight.dtype) if type(m) is nn.Linear else None
        return (kind is not None and m.weight.device.type == "cpu" and available(kind)
                and (kind == "fp32" or m.in_features % 2 == 0))

    if not any(fits(m) for m in module.modules()):
        return module
    out = copy.deepcopy(module)
    pages = HugePages()  # a draft's head is tens of MB, past the caches: streamed as a target's weights are
    for parent in list(out.modules()):
        for name, child in list(parent.named_children()):
            if fits(child):
                packed = PackedLinear(child)
                packed.packed = pages.put(packed.packed)
                setattr(parent, name, packed)
    return out

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

Building and gating the extensions is `kernels/extension.py`; `PackedLinear` and the one-call layers are
`kernels/packing.py`; the 2 MB pages the packed weights lie on are `kernels/hugepages.py`.
"""
from __future__ import annotations

import torch

from drafthead.kernels import extension

WEIGHTS = ("fp32", "bf16", "int8")  # how the fp32 kernel stores the weights it streams


def kind_for(dtype: torch.dtype) -> str | None:
    """The kernel kind that runs generated tokens of this dtype on CPU (None: no kernel, oneDNN)."""
    return {torch.bfloat16: "bf16", torch.float32: "fp32"}.get(dtype)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """bf16 weight [N, K] (K even) -> packed [ceil(N/16), K/2, 16, 2] (blocks of 16 outputs, stored in groups of 4
    blocks side by side per k-pair; cpu_linear.cpp), made once per weight."""
    ext = extension.ext("bf16")
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.shape[1] % 2:
        raise ValueError(f"pack needs a bf16 [N, K] weight with K even, got {weight.dtype} {tuple(weight.shape)}")
    return ext.pack(weight.detach().cpu())


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None,
           stream: bool = False) -> torch.Tensor:
    """x [..., K] bf16 @ packed weight (+ bias, added in fp32 before the one rounding) -> [..., out_features].
    stream: the weight is read once a forward (a target's), so its lines are prefetched non-temporally and do not
    evict what is read again (KV cache, activations, a draft's weights); the bits are the same either way."""
    ext = extension.ext("bf16")
    if x.dtype != torch.bfloat16:
        raise ValueError(f"x must be bf16, got {x.dtype}")
    y = ext.linear(x.reshape(-1, x.shape[-1]), packed, out_features, bias, stream)  # [rows, N]
    return y.view(*x.shape[:-1], out_features)


def peak_macs(kind: str, seconds: float = 0.3) -> float:
    """Multiply-adds a second the kernel's multiply instruction sustains from registers on torch's threads
    (`vdpbf16ps` for bf16; 16-lane FMAs for fp32 where its AVX-512 tiles are on, else 8-lane): the compute side of
    the roofline a forward of n tokens is compared with. The best of three timings of about `seconds` each, after
    one that lets the clocks settle."""
    ext = extension.ext(kind)
    iters = 100_000
    while True:  # calibrate: each call should run about `seconds`
        rate = ext.peak_macs(iters)
        per_iter = 24 * (32 if kind == "bf16" else (16 if extension.avx512_tiles() else 8)) * torch.get_num_threads()
        if iters * per_iter / rate >= seconds / 4 or iters > 1 << 32:
            break
        iters *= 4
    iters = max(1, int(iters * seconds / (iters * per_iter / rate)))
    return max(ext.peak_macs(iters) for _ in range(3))


def tile_path(kind: str, rows: int) -> str:
    """Which tile path the projections of a `rows`-row call take in the kernel of this kind (for reports)."""
    ext = extension.ext(kind)
    if kind == "bf16":
        hint, ahead = extension.prefetch()["stream"]
        pf = f"; a target's weights prefetched {hint.upper()} {ahead} k-pairs ahead"
        if extension.amx():
            return (f"bf16 AMX, {min(rows, 16)}-row tiles x 64 outputs over K chunks of 32 (weights with K % 32 == 0;"
                    f" others as without AMX){pf}")
        if rows <= ext.ROWS:
            return f"bf16 AVX512-BF16, one {rows}-row tile x 64 outputs over K{pf}"
        if rows <= 2 * ext.ROWS:
            return f"bf16 AVX512-BF16, two tiles of <= {ext.ROWS} rows sharing K chunks{pf}"
        return f"bf16 AVX512-BF16, {ext.ROWS}-row tiles one after another over K{pf}"
    st = extension.fp32_stream()
    if rows == 1:
        return f"fp32, 1 row x 48 outputs in 8 lanes, {st['ahead']} k prefetched ahead"
    if extension.avx512_tiles():
        return "fp32, 16-lane tiles of <= 8 rows x 48 outputs"
    chunks = f" in {st['kc']}-k chunks of K" if st["kc"] else ""
    return f"fp32, 8-lane tiles of <= 4 rows x 24 outputs{chunks}, next item prefetched into L2"


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
    ext = extension.ext("fp32")
    if stored.dim() != 2 or stored.dtype not in (torch.float32, torch.int16, torch.int8):
        raise ValueError(f"pack_fp32 needs a [N, K] float32, int16 (bf16 bits) or int8 weight from compress(), "
                         f"got {stored.dtype} {tuple(stored.shape)}")
    return ext.pack(stored.detach().cpu().contiguous())


def linear_fp32(x: torch.Tensor, packed: torch.Tensor, out_features: int, scale: torch.Tensor | None = None,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] fp32 @ packed weight (* scale, int8 only) (+ bias) -> [..., out_features] fp32."""
    ext = extension.ext("fp32")
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
    return extension.ext("fp32").attention(q, k, v, mask, scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF RMSNorm of generated tokens in one call: x [..., H], weight [H] (both fp32 or both bf16) -> x's dtype.
    fp32 statistics per row in a fixed order; bf16 rounds the normalized x, then its product with the weight."""
    return extension.ext("fp32").rms_norm(x, weight, eps)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of generated tokens in one call: x [B, T, heads, D] (a view whose rows are contiguous),
    cos, sin [B, T, D] or [B, 1, T, D] -> contiguous [B, T, heads, D]; rounds where HF's
    `x * cos + rotate_half(x) * sin` does (fp32: the same bits)."""
    return extension.ext("fp32").rope(x, cos, sin)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of generated tokens in one call, from the joined gate/up output [..., 2I] -> [..., I]."""
    return extension.ext("fp32").silu_mul(gate_up)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Index of each row's first largest value over the last dim, as torch.argmax (a NaN counts as the largest):
    x [..., N] float32 or bf16 on CPU -> int64 [...], one vector scan per row."""
    return extension.ext("fp32").argmax(x)

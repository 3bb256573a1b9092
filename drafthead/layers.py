"""Small building blocks shared by drafter families: RMSNorm, RoPE, SwiGLU, soft cross-entropy, the
training-time-test attention pattern and the attention of a KV-cached draft step.

Kept minimal and HF-compatible (same parameter names as transformers' Llama) so that weights copied
from a target layer, and the files we export, line up with what SGLang / vLLM / llama.cpp expect.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from drafthead.kernels import cpu_linear, extension, packing


def decoder_layer_shape(tcfg: Any) -> dict[str, Any]:
    """One decoder layer of the target, as the families size their own layers from it (EAGLE3, MTP and DFlash
    all draft with layers shaped like the target's): widths, heads, vocab, norm epsilon, RoPE base, context."""
    heads = tcfg.num_attention_heads
    rope = getattr(tcfg, "rope_parameters", None) or {}
    return dict(
        hidden_size=tcfg.hidden_size,
        intermediate_size=tcfg.intermediate_size,
        num_attention_heads=heads,
        num_key_value_heads=getattr(tcfg, "num_key_value_heads", heads) or heads,
        head_dim=getattr(tcfg, "head_dim", None) or tcfg.hidden_size // heads,
        vocab_size=tcfg.vocab_size,
        target_num_layers=tcfg.num_hidden_layers,
        rms_norm_eps=float(tcfg.rms_norm_eps),
        rope_theta=float(rope.get("rope_theta", getattr(tcfg, "rope_theta", 10000.0))),
        max_position_embeddings=int(getattr(tcfg, "max_position_embeddings", 2048)),
    )


def given(overrides: dict[str, Any]) -> dict[str, Any]:
    """The overrides a recipe set (None: keep the value sized from the target)."""
    return {k: v for k, v in overrides.items() if v is not None}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.device.type == "cpu" and not torch.is_grad_enabled() and x.dtype == self.weight.dtype
                and x.dtype in (torch.float32, torch.bfloat16) and extension.available("fp32")):
            # a draft step on CPU: one extension call (the same formula, fp32 statistics) instead of ~8 operators:
            # 4.4 against 15.2 us a call on a bf16 [1, 1, 576] row (AVX512-BF16 EPYC), four calls a draft step
            return cpu_linear.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


EXP_FLOOR = -60.0  # exp(-60) ~ 9e-27: terms below it are floored there, never underflow to denormals


def softmax_floored(x: torch.Tensor) -> torch.Tensor:
    """fp32 softmax over the last dim whose terms below exp(EXP_FLOOR) of the row's largest are floored
    there instead of underflowing to denormal floats: x86 computes on denormals ~100x slower, and wide
    logit rows (a vocabulary's tail) are full of them. The floor changes a row by < 1e-22 of its mass."""
    e = x.float() - x.float().amax(-1, keepdim=True)  # [.., N]
    e = e.clamp_min_(EXP_FLOOR).exp_()
    return e.div_(e.sum(-1, keepdim=True))


class _SoftCrossEntropy(torch.autograd.Function):
    """Per-row soft-label cross-entropy with a hand-written backward (softmax(logits) - p), so the [M, N]
    rows are walked a few times instead of through log_softmax, mul and their autograd copies (the loss is a
    large share of a CPU training step: docs/experiment_log.md, "Figures behind code choices")."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        lf = logits.float()  # [M, N] a copy unless logits are fp32 already
        m = lf.amax(-1, keepdim=True)  # [M, 1]
        dot = torch.linalg.vecdot(lf, probs)  # [M]  <p, logits>
        e = (lf - m) if lf.data_ptr() == logits.data_ptr() else lf.sub_(m)  # never overwrite the caller's logits
        e = e.clamp_min_(EXP_FLOOR).exp_()  # [M, N]  exp(logits - max), floored as in softmax_floored
        s = e.sum(-1, keepdim=True)  # [M, 1]
        ctx.save_for_backward(e, s, probs)
        ctx.in_dtype = logits.dtype
        return (m + s.log()).squeeze(-1) - dot  # logsumexp - <p, logits> (sum p = 1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        e, s, probs = ctx.saved_tensors
        g = e.div_(s).sub_(probs).mul_(grad[:, None])  # [M, N]  (softmax - p) * dL/dce (e is not needed again)
        return g.to(ctx.in_dtype), None


def soft_cross_entropy(logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Soft-label cross-entropy -(probs * log_softmax(logits)).sum(-1) -> [M].

    `probs` [M, N] is the teacher distribution (fp32, rows sum to 1, no gradient); `logits` [M, N] any
    float dtype (the math runs in fp32, the gradient comes back in the logits' dtype)."""
    if logits.shape != probs.shape:
        raise ValueError(f"soft_cross_entropy: logits {tuple(logits.shape)} vs probs {tuple(probs.shape)}")
    return _SoftCrossEntropy.apply(logits, probs.float())


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        joined = None if torch.is_grad_enabled() else packing.joined(self.gate_proj, self.up_proj)
        if joined is not None:
            # a packed draft step on CPU: silu(gate) * up in one call, as the one-call layer computes it
            return self.down_proj(cpu_linear.silu_mul(joined(x)))
        gate, up = project(x, self.gate_proj, self.up_proj)
        return self.down_proj(F.silu(gate) * up)


def project(x: torch.Tensor, *projs: nn.Module) -> list[torch.Tensor]:
    """[p(x) for p in projs]; packed CPU projections (a draft step, `with_packed_linears`) run as one joined kernel
    call (`packing.joined`), each output with the bits of its own projection."""
    fused = packing.joined(*projs) if len(projs) > 1 else None
    if fused is None:
        return [p(x) for p in projs]
    return list(fused(x).split([p.out_features for p in projs], dim=-1))


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for integer positions [B, T] -> ([B, 1, T, D], [B, 1, T, D]) (HF 'default' rope), fp32.

    On CPU, rows of a table kept per (head_dim, theta) and doubled when a position passes its end: a draft step
    then indexes two rows instead of running ~10 operators (a tenth of a small draft step on CPU). The table
    holds what the formula gives for each position: every element is computed on its own, by the same operators.
    Elsewhere (CUDA training) the formula runs directly: sizing a table would read the largest position back to
    the host every call."""
    if positions.device.type != "cpu":
        cos, sin = _rope_rows(positions.float(), head_dim, theta)  # [B, T, D] each
        return cos[:, None], sin[:, None]
    key = (head_dim, float(theta))
    top = int(positions.max()) + 1 if positions.numel() else 1
    table = _ROPE_TABLES.get(key)
    if table is None or table.shape[1] < top:
        n = max(1024, 1 << (top - 1).bit_length())
        _ROPE_TABLES.pop(key, None)
        while len(_ROPE_TABLES) >= ROPE_TABLES_KEPT:  # a process that meets many geometries keeps the newest
            _ROPE_TABLES.pop(next(iter(_ROPE_TABLES)))
        table = _ROPE_TABLES[key] = torch.stack(_rope_rows(torch.arange(n, dtype=torch.float32), head_dim, theta))
    cos_sin = table[:, positions]  # [2, B, T, D]
    return cos_sin[0][:, None], cos_sin[1][:, None]


def _rope_rows(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 positions [...] -> (cos, sin) [..., D]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions[..., None] * inv_freq  # [..., D/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [..., D]
    return emb.cos(), emb.sin()


_ROPE_TABLES: dict[tuple, torch.Tensor] = {}  # (head_dim, theta) -> [2, positions, D], oldest first
ROPE_TABLES_KEPT = 8


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE as in HF Llama. x: [B, h, T, D]."""
    if (x.device.type == "cpu" and not torch.is_grad_enabled() and cos.dtype == sin.dtype == torch.float32
            and x.dtype in (torch.float32, torch.bfloat16) and cos.dim() == 4 and cos.shape[:2] == (x.shape[0], 1)
            and cos.shape[2:] == x.shape[2:] and sin.shape == cos.shape and x.shape[-1] % 2 == 0
            and extension.available("fp32")):
        # a draft step on CPU: the math below in one extension call (x widened exactly, each product and the sum
        # rounded in fp32, then once to x's dtype: the same bits) instead of ~7 operators
        return cpu_linear.rope(x.float().transpose(1, 2), cos, sin).transpose(1, 2).to(x.dtype)
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rot * sin).to(x.dtype)


def write_kv(dst: torch.Tensor, new: torch.Tensor, slots: torch.Tensor, start: int | None) -> None:
    """dst [B, kvh, S, D] <- new [B, kvh, T, D] at per-request slots [B, T] (a slice when aligned)."""
    if start is not None:
        dst[:, :, start: start + new.shape[2]] = new
    else:
        rows = torch.arange(dst.shape[0], device=dst.device)[:, None]  # [B, 1]
        dst[rows, :, slots] = new.transpose(1, 2)  # indexed view is [B, T, kvh, D]


def take_rows(x: torch.Tensor, at: torch.Tensor | None) -> torch.Tensor:
    """x [B, T, ...] -> x[b, at[b]] as [B, 1, ...] (the one row per request whose logits are wanted), or with
    at [B, n] the n rows x[b, at[b, j]] as [B, n, ...]; x if at is None."""
    if at is None:
        return x
    rows = torch.arange(x.shape[0], device=x.device)
    return x[rows, at][:, None] if at.dim() == 1 else x[rows[:, None], at]


def kv_cache(kv: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None, k: torch.Tensor, v: torch.Tensor,
             mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Put a draft step's new keys and values into its KV cache; returns (cache, mask) to attend with.

    A cache is [B, 2*kvh, S, D]: keys, then values. kv:
    - (cache, slots [B, T]): the runtime's cache, written in place at the slots; mask [B or 1, 1, T, S] required;
    - a cache tensor returned by an earlier decode: the new entries are appended (a copy);
    - None: a cache of the new entries alone.
    Without a mask the new entries see every earlier entry and, among themselves, causally.
    k, v [B, kvh, T, D].
    """
    B, kvh, T, _ = k.shape
    if isinstance(kv, tuple):
        cache, slots = kv
        if mask is None:
            raise ValueError("decode into a KV cache at slots needs the attention mask over the cache")
        write_kv(cache[:, :kvh], k.to(cache.dtype), slots, None)
        write_kv(cache[:, kvh:], v.to(cache.dtype), slots, None)
        return cache, mask
    new = torch.cat([k, v], dim=1)  # [B, 2*kvh, T, D]
    cache = new if kv is None else torch.cat([kv, new], dim=2)  # [B, 2*kvh, S, D]
    if mask is None:
        S = cache.shape[2]
        mask = torch.ones(T, S, dtype=torch.bool, device=k.device).tril(S - T)[None, None]  # [1, 1, T, S]
    return cache, mask


def one_call_layer(owner: nn.Module, heads: int, kv_heads: int, head_dim: int, post_norm: nn.Module,
                   q_proj: nn.Module, k_proj: nn.Module, v_proj: nn.Module, o_proj: nn.Module, mlp: SwiGLU):
    """The CPU one-call decoder layer (`packing.decode_layer`, run by `forward_input`) for a draft layer whose
    projections are packed (`packing.with_packed_linears`), made on first use and kept on `owner`; None where
    they are not packed or do not join (the layer then runs op by op, with the same bits). Softmax scale
    head_dim^-0.5, as `cached_attention`."""
    cache = owner.__dict__.setdefault("_one_call", {})  # plain attribute: not a submodule, not in state dicts
    if "layer" not in cache:
        qkv = packing.joined(q_proj, k_proj, v_proj)
        gate_up = packing.joined(mlp.gate_proj, mlp.up_proj)
        packed = all(isinstance(p, packing.PackedLinear) for p in (o_proj, mlp.down_proj))
        joins = qkv is not None and gate_up is not None and packed
        kinds = {p.kind for p in (qkv, gate_up, o_proj, mlp.down_proj)} if joins else set()
        ok = (kinds in ({"bf16"}, {"fp32"}) and head_dim % 8 == 0 and extension.available("fp32")
              and post_norm.weight.dtype == (torch.bfloat16 if kinds == {"bf16"} else torch.float32))
        cache["layer"] = packing.decode_layer(0, heads, kv_heads, head_dim, head_dim ** -0.5, None, post_norm, qkv,
                                                 o_proj, gate_up, mlp.down_proj) if ok else None
    return cache["layer"]


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Attention of a draft step's new positions over a KV cache, GQA without copying K/V per query head.

    q [B, h, T, D], k/v [B, kvh, S, D], mask bool [B or 1, 1, T, S] (True = may attend) -> [B, h, T, D], q's dtype.
    On CPU, outside autograd, this is the decode kernel's attention (`cpu_linear.attention_fp32`, fp32 math):
    SDPA over K/V expanded per head copies K/V per query head and made a draft step a third slower
    (docs/experiment_log.md, "Figures behind code choices"). Elsewhere (CUDA, training, no kernel) it is SDPA
    with enable_gqa.
    """
    B, _, T, D = q.shape
    if (q.device.type == "cpu" and D % 8 == 0 and q.dtype in (torch.float32, torch.bfloat16)
            and k.dtype == q.dtype == v.dtype and not (q.requires_grad or k.requires_grad or v.requires_grad)
            and extension.available("fp32")):
        mask = mask.expand(B, 1, T, k.shape[2])
        return cpu_linear.attention_fp32(q, k, v, mask, D ** -0.5).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def ttt_attention(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, diag_k: list[torch.Tensor],
                  diag_v: list[torch.Tensor], causal: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Training-time-test attention (EAGLE3's TTT): what a KV-cached draft chain attends to at depth
    len(diag_k), for every position at once. Row t attends causally to the step-0 entries (k0, v0), built
    from the target's features, and to row t alone of each later step's entries (diag_k / diag_v), the
    draft's own earlier outputs along that row's chain.

    q [B, h, T, D]; k0, v0 [B, h, T, D] (kv heads already expanded); diag_k / diag_v lists of [B, h, T, D];
    causal [T, T] bool; scale defaults to D^-0.5. Returns [B, h, T, D]. Softmax in fp32.
    """
    T = k0.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s0 = (q @ k0.transpose(-1, -2)) * scale  # [B, h, T, T]
    s0 = s0.masked_fill(~causal, float("-inf"))
    sd = [(q * kj).sum(-1, keepdim=True) * scale for kj in diag_k]  # [B, h, T, 1] each
    p = torch.cat([s0, *sd], dim=-1).float().softmax(-1).to(q.dtype)  # [B, h, T, T+n]
    o = p[..., :T] @ v0  # [B, h, T, D]
    for j, vj in enumerate(diag_v):
        o = o + p[..., T + j: T + j + 1] * vj
    return o


def shift(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[:, t] <- x[:, t+n], zero-filled on the right (the targets of draft depth n-1 at row t)."""
    if n == 0:
        return x
    out = torch.zeros_like(x)
    if n < x.shape[1]:
        out[:, : x.shape[1] - n] = x[:, n:]
    return out

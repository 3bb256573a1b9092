"""Sampling distributions shared by the target and the draft.

Both sides go through `probs` with the same temperature and top-p, so the distribution the verifier
preserves is exactly the one plain autoregressive sampling draws from.
"""
from __future__ import annotations

import torch

from drafthead.kernels import cpu_linear, extension


def probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """logits [..., V] -> fp32 probabilities [..., V] after temperature and top-p (nucleus) filtering."""
    p = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return p
    sorted_p, order = p.sort(dim=-1, descending=True)
    # keep the smallest prefix whose mass reaches top_p (the token that crosses top_p is kept)
    drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p  # [..., V]
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    p = torch.zeros_like(p).scatter_(-1, order, sorted_p)
    return p / p.sum(-1, keepdim=True)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim: logits [..., V] -> ids [...]. On CPU through the extension's vector scan (the same
    index as torch.argmax), several times faster than torch's over a vocab-wide row (docs/experiment_log.md,
    "Figures behind code choices"); paid once a greedy step and once per verified node."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16) and extension.available("fp32"):
        return cpu_linear.argmax(logits)
    return logits.float().argmax(-1)  # exact widening, same index; torch's CPU argmax over bf16 is the slower path


def sample(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: p [..., V] (need not sum to 1), u [...] uniforms in [0, 1) -> ids [...]."""
    cdf = p.cumsum(-1)  # [..., V]
    target = (u.to(cdf.dtype) * cdf[..., -1]).unsqueeze(-1)  # [..., 1]
    idx = torch.searchsorted(cdf.contiguous(), target.contiguous(), right=True).squeeze(-1)
    # u * total can round up to the total: fall back to the last token with mass
    last = (p > 0).long().cumsum(-1).argmax(-1)
    return torch.minimum(idx, last)

"""Training objectives over a draft's logits and the target's distribution, shared by every family that trains
on the target's soft distribution.

Why more than one: a small draft that minimises KL(p || q) need not maximise what serving pays for, the
acceptance of its tokens. Under speculative sampling a drafted token is accepted with probability
alpha = sum_v min(p_v, q_v) = 1 - TV(p, q), and the LK losses (arXiv 2602.23881) train on alpha itself:

- `kl`: soft cross-entropy against p (KL up to p's entropy, the same gradient); what every family trained with.
- `lk_alpha`: -log(alpha). Its gradient is TV's scaled by 1/alpha, so it still learns from a cold start; for a
  one-hot p it is the cross-entropy.
- `lk_hybrid`: lambda * KL + (1 - lambda) * (1 - alpha) with lambda = kl_scale * exp(-eta * alpha) taken per
  position without gradient (speculators' `lk_hybrid`): KL while the draft is far from the target, acceptance
  once it is close.
- `tv`: 1 - alpha.

alpha here is taken over the rows the family predicts (a draft vocabulary: the teacher renormalised over it, as
the families' teacher heads give it). Families weight the per-depth losses as they always did (EAGLE3:
step_decay ** i), so a loss is a drop-in that leaves the draft's files and serving unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from drafthead.layers import EXP_FLOOR, soft_cross_entropy

LOSSES = ("kl", "lk_alpha", "lk_hybrid", "tv")
ALPHA_FLOOR = 1e-5  # -log(alpha) is clamped here: a row the draft misses entirely adds 11.5, not infinity


@dataclass(frozen=True)
class Objective:
    """`train.loss` and its two knobs, passed to a family's training forward as `objective`."""

    name: str = "kl"
    eta: float = 3.0  # lk_hybrid: how fast lambda falls as alpha grows (the reference's 3)
    kl_scale: float = 1.0  # lk_hybrid: lambda at alpha = 0, in (0, 1] so that 1 - lambda >= 0

    def __post_init__(self) -> None:
        if self.name not in LOSSES:
            raise ValueError(f"loss {self.name!r} (choose from {', '.join(LOSSES)})")
        if not 0 < self.kl_scale <= 1:
            raise ValueError(f"lk_kl_scale {self.kl_scale} (must be in (0, 1])")
        if self.eta < 0:
            raise ValueError(f"lk_eta {self.eta} (must be >= 0)")


class _CrossEntropyAlpha(torch.autograd.Function):
    """Per-row soft cross-entropy and alpha = sum min(p, q) in one walk over the [M, N] rows, with a hand-written
    backward: d ce / dz = q - p; d alpha / dz_j = q_j * (1[q_j < p_j] - S), S = sum_{v: q_v < p_v} q_v."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lf = logits.float()  # [M, N] a copy unless logits are fp32 already
        m = lf.amax(-1, keepdim=True)  # [M, 1]
        dot = torch.linalg.vecdot(lf, probs)  # [M]  <p, logits>
        e = (lf - m) if lf.data_ptr() == logits.data_ptr() else lf.sub_(m)  # never overwrite the caller's logits
        e = e.clamp_min_(EXP_FLOOR).exp_()  # [M, N]
        s = e.sum(-1, keepdim=True)  # [M, 1]
        ce = (m + s.log()).squeeze(-1) - dot  # [M]  logsumexp - <p, logits>
        q = e.div_(s)  # [M, N]  the draft's distribution
        alpha = torch.minimum(q, probs).sum(-1)  # [M]
        ctx.save_for_backward(q, probs)
        ctx.in_dtype = logits.dtype
        return ce, alpha

    @staticmethod
    def backward(ctx, g_ce: torch.Tensor, g_alpha: torch.Tensor) -> tuple[torch.Tensor, None]:
        q, probs = ctx.saved_tensors
        below = q < probs  # [M, N]
        s = (q * below).sum(-1, keepdim=True)  # [M, 1]
        g = (q - probs).mul_(g_ce[:, None])  # [M, N]
        g += q * (below.to(q.dtype) - s) * g_alpha[:, None]
        return g.to(ctx.in_dtype), None


def cross_entropy_alpha(logits: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(soft cross-entropy [M], alpha [M]) of draft logits [M, N] against teacher probabilities [M, N]."""
    if logits.shape != probs.shape:
        raise ValueError(f"cross_entropy_alpha: logits {tuple(logits.shape)} vs probs {tuple(probs.shape)}")
    return _CrossEntropyAlpha.apply(logits, probs.float())


def draft_loss(logits: torch.Tensor, probs: torch.Tensor, objective: Objective | None, need_alpha: bool
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-row loss [M] under `objective` (None = kl) and alpha [M] when `need_alpha` or the loss needs it.

    The kl path without alpha is the soft cross-entropy every family trained with, unchanged to the bit."""
    name = "kl" if objective is None else objective.name
    if name == "kl" and not need_alpha:
        return soft_cross_entropy(logits, probs), None
    ce, alpha = cross_entropy_alpha(logits, probs)
    if name == "kl":
        return ce, alpha.detach()
    if name == "lk_alpha":
        return -alpha.clamp_min(ALPHA_FLOOR).log(), alpha.detach()
    if name == "tv":
        return 1 - alpha, alpha.detach()
    # lk_hybrid: KL = CE - H(p); the entropy has no gradient, it only makes the value the paper's
    entropy = -torch.special.xlogy(probs, probs).sum(-1)  # [M]
    lam = objective.kl_scale * torch.exp(-objective.eta * alpha.detach())  # [M]
    return lam * (ce - entropy) + (1 - lam) * (1 - alpha), alpha.detach()


def with_alpha(out: dict, alphas: list[torch.Tensor]) -> dict:
    """A training forward's result with "alpha" [K] (the per-depth sums `draft_loss` gave out of training) added
    when there are any: what the held-out eval reads as `eval/alpha_<k>`."""
    if alphas:
        out["alpha"] = torch.stack(alphas).float()
    return out

"""The training objectives (drafthead/losses.py) against hand-computed values and an autograd reference."""
from __future__ import annotations

import math

import pytest
import torch

from drafthead.layers import soft_cross_entropy
from drafthead.losses import LOSSES, Objective, cross_entropy_alpha, draft_loss


def _rows(seed: int = 0, m: int = 6, n: int = 9) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(m, n, generator=g) * 2
    probs = torch.softmax(torch.randn(m, n, generator=g) * 2, -1)
    return logits, probs


def test_cross_entropy_and_alpha_match_autograd_through_softmax():
    logits, probs = _rows()
    w_ce, w_a = torch.randn(6), torch.randn(6)
    z1 = logits.clone().requires_grad_()
    ce, alpha = cross_entropy_alpha(z1, probs)
    (ce @ w_ce + alpha @ w_a).backward()
    z2 = logits.clone().requires_grad_()
    ref_ce = -(probs * torch.log_softmax(z2, -1)).sum(-1)
    ref_alpha = torch.minimum(torch.softmax(z2, -1), probs).sum(-1)
    (ref_ce @ w_ce + ref_alpha @ w_a).backward()
    torch.testing.assert_close(ce, ref_ce, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(alpha, ref_alpha, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(z1.grad, z2.grad, rtol=1e-4, atol=1e-6)
    assert bool(((alpha > 0) & (alpha <= 1)).all())


def test_lk_alpha_is_cross_entropy_for_a_one_hot_target():
    logits, _ = _rows(1)
    onehot = torch.nn.functional.one_hot(torch.tensor([0, 3, 8, 2, 5, 1]), 9).float()
    z1, z2 = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    lk, alpha = draft_loss(z1, onehot, Objective("lk_alpha"), need_alpha=False)
    ce = soft_cross_entropy(z2, onehot)
    torch.testing.assert_close(lk, ce, rtol=1e-5, atol=1e-6)
    lk.sum().backward()
    ce.sum().backward()
    torch.testing.assert_close(z1.grad, z2.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(alpha, torch.softmax(logits, -1)[onehot.bool()])


def test_lk_hybrid_on_a_three_token_example():
    """p = (0.5, 0.3, 0.2), q = (0.2, 0.5, 0.3): alpha = 0.2 + 0.3 + 0.2 = 0.7; KL(p||q) = 0.5 ln 2.5 +
    0.3 ln 0.6 + 0.2 ln(2/3) = 0.223805; lambda = exp(-3 * 0.7) = 0.122456; loss = lambda KL + (1 - lambda) 0.3."""
    p = torch.tensor([[0.5, 0.3, 0.2]])
    logits = torch.tensor([[0.2, 0.5, 0.3]]).log()
    loss, alpha = draft_loss(logits, p, Objective("lk_hybrid"), need_alpha=True)
    kl = 0.5 * math.log(2.5) + 0.3 * math.log(0.6) + 0.2 * math.log(2 / 3)
    lam = math.exp(-2.1)
    assert abs(kl - 0.223805) < 1e-6 and abs(lam - 0.122456) < 1e-6
    assert alpha.item() == pytest.approx(0.7, abs=1e-6)
    assert loss.item() == pytest.approx(lam * kl + (1 - lam) * 0.3, abs=1e-6)
    assert loss.item() == pytest.approx(0.290670, abs=1e-5)
    half, _ = draft_loss(logits, p, Objective("lk_hybrid", eta=0.0, kl_scale=0.5), need_alpha=False)
    assert half.item() == pytest.approx(0.5 * kl + 0.5 * 0.3, abs=1e-6)  # eta 0: a fixed lambda


def test_tv_and_kl_values():
    logits, probs = _rows(2)
    tv, alpha = draft_loss(logits, probs, Objective("tv"), need_alpha=False)
    torch.testing.assert_close(tv, 1 - alpha)
    kl, none = draft_loss(logits, probs, None, need_alpha=False)
    assert none is None and torch.equal(kl, soft_cross_entropy(logits, probs))  # the default path, to the bit
    kl2, alpha2 = draft_loss(logits, probs, Objective("kl"), need_alpha=True)
    torch.testing.assert_close(kl2, kl)
    torch.testing.assert_close(alpha2, alpha)


def test_each_loss_pulls_the_draft_towards_the_target():
    """A few gradient steps on free logits raise alpha under every loss."""
    _, probs = _rows(3)
    for name in LOSSES:
        z = torch.zeros_like(probs, requires_grad=True)
        opt = torch.optim.SGD([z], lr=2.0)
        first = None
        for _ in range(30):
            loss, alpha = draft_loss(z, probs, Objective(name), need_alpha=True)
            first = alpha.mean().item() if first is None else first
            opt.zero_grad()
            loss.mean().backward()
            opt.step()
        assert alpha.mean().item() > first + 0.1, name


@pytest.mark.parametrize("kw,msg", [({"name": "ce"}, "choose from kl, lk_alpha"),
                                    ({"name": "lk_hybrid", "kl_scale": 0.0}, "lk_kl_scale"),
                                    ({"name": "lk_hybrid", "eta": -1.0}, "lk_eta")])
def test_bad_objectives_are_named(kw, msg):
    with pytest.raises(ValueError, match=msg):
        Objective(**kw)

"""drafthead/layers.py: the fused soft cross-entropy and the floored softmax against plain PyTorch."""
import pytest
import torch

from drafthead.layers import EXP_FLOOR, soft_cross_entropy, softmax_floored


def reference(logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    return -(probs * logits.float().log_softmax(-1)).sum(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_soft_cross_entropy_value_and_gradient_match_autograd(dtype):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(37, 300, generator=g) * 8).to(dtype).requires_grad_()
    probs = (torch.randn(37, 300, generator=g) * 5).softmax(-1)
    w = torch.rand(37, generator=g)
    keep = logits.detach().clone()
    ce = soft_cross_entropy(logits, probs)
    assert ce.shape == (37,) and ce.dtype == torch.float32
    (got,) = torch.autograd.grad((ce * w).sum(), logits)
    assert torch.equal(logits.detach(), keep)  # the caller's logits are not overwritten (fp32 case)
    ref_logits = logits.detach().clone().requires_grad_()
    ref = reference(ref_logits, probs)
    (want,) = torch.autograd.grad((ref * w).sum(), ref_logits)
    torch.testing.assert_close(ce, ref, rtol=1e-5, atol=1e-5)
    assert got.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_soft_cross_entropy_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match=r"logits \(2, 5\) vs probs \(2, 4\)"):
        soft_cross_entropy(torch.zeros(2, 5), torch.zeros(2, 4))


def test_floored_softmax_has_no_denormals_and_equals_softmax():
    x = torch.randn(16, 4000) * 60  # rows spanning thousands of nats: a plain softmax underflows
    plain = x.softmax(-1)
    tiny = torch.finfo(torch.float32).tiny  # smallest normal
    assert ((plain > 0) & (plain < tiny)).any()  # the plain one has denormals here
    got = softmax_floored(x)
    assert not ((got > 0) & (got < tiny)).any() and (got > 0).all()
    torch.testing.assert_close(got, plain, rtol=1e-5, atol=1e-20)
    torch.testing.assert_close(got.sum(-1), torch.ones(16))
    assert got.min() >= torch.tensor(EXP_FLOOR).exp() / 4000 * 0.99


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cached_attention_matches_expanded_sdpa_and_keeps_gradients(dtype):
    """A draft step's attention (the CPU kernel where it is built, else SDPA with GQA) equals SDPA over K/V
    expanded to every query head, with a mask broadcast over the batch; with autograd it stays differentiable."""
    import torch.nn.functional as F

    from drafthead.layers import cached_attention

    g = torch.Generator().manual_seed(0)
    B, h, kvh, T, S, D = 2, 6, 2, 3, 21, 16
    q = torch.randn(B, h, T, D, generator=g).to(dtype)
    k, v = (torch.randn(B, kvh, S, D, generator=g).to(dtype) for _ in range(2))
    mask = torch.ones(T, S, dtype=torch.bool).tril(S - T)[None, None]  # [1, 1, T, S]
    want = F.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(h // kvh, 1),
                                          v.double().repeat_interleave(h // kvh, 1), attn_mask=mask)
    got = cached_attention(q, k, v, mask)
    assert got.dtype == dtype and got.shape == (B, h, T, D)
    assert (got.double() - want).abs().max() < (1e-5 if dtype == torch.float32 else 2e-2)
    qg = q.float().requires_grad_()
    cached_attention(qg, k.float(), v.float(), mask).sum().backward()
    assert qg.grad is not None and qg.grad.abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inference_norm_and_rope_match_the_training_math(dtype):
    """Outside autograd on CPU, RMSNorm and RoPE take one extension call each (a draft step): RoPE gives the bits
    of the training formula; RMSNorm gives them in bf16 and agrees within fp32 rounding in fp32 (its sum of
    squares runs in another order)."""
    from drafthead.kernels import extension
    from drafthead.layers import RMSNorm, apply_rope, rope_cos_sin

    if not extension.available("fp32"):
        pytest.skip(f"fp32 CPU kernel unavailable: {extension.unavailable_reason('fp32')}")
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(96, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96, generator=g))
    x = (torch.randn(5, 3, 96, generator=g) * 3).to(dtype)
    q = torch.randn(2, 3, 4, 16, generator=g).to(dtype).transpose(1, 2)  # [B, h, T, D], a view as in a draft step
    cos, sin = rope_cos_sin(torch.randint(0, 500, (2, 3), generator=g), 16, 10000.0)
    want_norm, want_rope = norm(x), apply_rope(q, cos, sin)  # autograd on: the torch formulas
    assert torch.is_grad_enabled() and want_norm.requires_grad
    with torch.inference_mode():
        got_norm, got_rope = norm(x), apply_rope(q, cos, sin)
    assert torch.equal(got_rope, want_rope) and got_rope.shape == (2, 4, 3, 16)
    if dtype == torch.bfloat16:
        assert torch.equal(got_norm, want_norm)
    else:
        torch.testing.assert_close(got_norm, want_norm, rtol=2e-6, atol=1e-6)


def test_rope_tables_hold_the_formula():
    """rope_cos_sin reads rows of a cached table (grown past its first 1024 positions here): the formula's bits."""
    from drafthead.layers import rope_cos_sin

    pos = torch.tensor([[0, 1, 7, 1023], [1024, 5000, 3, 2]])
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    emb = torch.cat([pos.float()[..., None] * inv_freq] * 2, dim=-1)  # [B, T, D]
    for p in (pos[:1], pos):  # the second call grows the table
        cos, sin = rope_cos_sin(p, 64, 10000.0)
        assert cos.shape == sin.shape == (p.shape[0], 1, 4, 64) and cos.dtype == torch.float32
        assert torch.equal(cos, emb[: p.shape[0]].cos()[:, None]) and torch.equal(sin, emb[: p.shape[0]].sin()[:, None])


def test_rope_tables_keep_a_bounded_number_of_geometries() -> None:
    from drafthead import layers

    pos = torch.arange(6)[None]
    for hd in range(8, 8 + 2 * (layers.ROPE_TABLES_KEPT + 4), 2):
        cos, sin = layers.rope_cos_sin(pos, hd, 10000.0)
        want_cos, want_sin = layers._rope_rows(pos.float(), hd, 10000.0)
        assert torch.equal(cos[:, 0], want_cos) and torch.equal(sin[:, 0], want_sin)
    assert len(layers._ROPE_TABLES) <= layers.ROPE_TABLES_KEPT
    assert (8 + 2 * (layers.ROPE_TABLES_KEPT + 3), 10000.0) in layers._ROPE_TABLES  # the newest is kept

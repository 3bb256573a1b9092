"""The bf16 CPU decode kernel (`drafthead.kernels.cpu_linear`): agrees with an fp32 reference, gives a row the
same bits at any row count and position, and the runtime falls back to oneDNN when it is unavailable."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from drafthead.kernels import cpu_linear

needs_kernel = pytest.mark.skipif(not cpu_linear.available(),
                                  reason=f"bf16 CPU kernel unavailable: {cpu_linear.unavailable_reason()}")


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().t()  # [M, N]
    return y + b.double() if b is not None else y


@needs_kernel
@pytest.mark.parametrize("N,K", [(1536, 576), (576, 1536), (192, 576), (37, 64), (100, 2), (1, 130), (49152, 576)])
def test_matches_reference_within_one_rounding(N: int, K: int) -> None:
    g = torch.Generator().manual_seed(N + K)
    w = torch.randn(N, K, generator=g).to(torch.bfloat16)
    b = torch.randn(N, generator=g).to(torch.bfloat16)
    x = torch.randn(13, K, generator=g).to(torch.bfloat16)
    packed = cpu_linear.pack(w)
    for bias in (None, b):
        y = cpu_linear.linear(x, packed, N, bias)  # [13, N]
        assert y.dtype == torch.bfloat16 and y.shape == (13, N)
        ref = reference(x, w, bias)
        # fp32 accumulation over K, one bf16 rounding: within one bf16 ulp of the exact value (+ fp32 slack)
        tol = ref.abs() * 2.0 ** -8 + x.double().abs() @ w.double().abs().t() * 2.0 ** -20 + 1e-30
        assert ((y.double() - ref).abs() <= tol).all(), (N, K, bias is None)


@needs_kernel
def test_rows_have_the_same_bits_at_any_row_count_and_position() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(100, 576, generator=g).to(torch.bfloat16)  # 100 outputs: 6 full blocks of 16 + a tail
    b = torch.randn(100, generator=g).to(torch.bfloat16)
    x = torch.randn(70, 576, generator=g).to(torch.bfloat16)
    packed = cpu_linear.pack(w)
    alone = torch.cat([cpu_linear.linear(x[i: i + 1], packed, 100, b) for i in range(70)])
    for M in (2, 3, 4, 5, 7, 8, 33, 70):
        for start in (0, 70 - M):
            assert torch.equal(cpu_linear.linear(x[start: start + M], packed, 100, b), alone[start: start + M]), M
    three_d = cpu_linear.linear(x[:12].view(3, 4, 576), packed, 100, b)  # [B, T, K] in, [B, T, N] out
    assert torch.equal(three_d.view(12, 100), alone[:12])


@needs_kernel
def test_bad_inputs_are_named_errors() -> None:
    with pytest.raises(ValueError, match="K even"):
        cpu_linear.pack(torch.zeros(4, 7, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bf16"):
        cpu_linear.pack(torch.zeros(4, 8))
    packed = cpu_linear.pack(torch.zeros(4, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="x must be bf16"):
        cpu_linear.linear(torch.zeros(2, 8), packed, 4)
    with pytest.raises(RuntimeError, match="K = 6"):
        cpu_linear.linear(torch.zeros(2, 6, dtype=torch.bfloat16), packed, 4)
    with pytest.raises(RuntimeError, match="N = 40"):
        cpu_linear.linear(torch.zeros(2, 8, dtype=torch.bfloat16), packed, 40)


@needs_kernel
def test_with_packed_linears_copies_bf16_linears_only() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 48), nn.SiLU(), nn.Linear(48, 20, bias=False)).to(torch.bfloat16)
    fast = cpu_linear.with_packed_linears(net)
    assert fast is not net and type(net[0]) is nn.Linear  # the original is untouched
    assert isinstance(fast[0], cpu_linear.PackedLinear) and isinstance(fast[2], cpu_linear.PackedLinear)
    assert fast[0].weight.dtype == torch.bfloat16  # code reading .weight still works
    x = torch.randn(5, 64).to(torch.bfloat16)
    with torch.no_grad():
        want, got = net(x).float(), fast(x).float()
    assert (got - want).abs().max() <= 0.02 * want.abs().max()
    assert torch.equal(fast(x[2:3]), fast(x)[2:3])  # row-invariant like the kernel
    fp32 = nn.Linear(8, 8)
    assert cpu_linear.with_packed_linears(fp32) is fp32  # nothing to replace: the module itself


def test_stale_build_lock_is_removed_and_a_fresh_one_waited_for(tmp_path):
    """A process killed while loading the extension leaves torch's build lock, which made every later
    process wait forever in silence: an old lock is removed with a warning, a young one waited for."""
    import os
    import threading
    import time
    import warnings

    from drafthead.kernels.cpu_linear import clear_stale_lock

    lock = tmp_path / "lock"
    assert clear_stale_lock(lock) is False  # none there
    lock.touch()
    old = time.time() - 3600
    os.utime(lock, (old, old))
    with pytest.warns(UserWarning, match="removed a stale kernel build lock"):
        assert clear_stale_lock(lock) is True
    assert not lock.exists()
    lock.touch()  # a live builder: it finishes (removes its lock) while we wait
    threading.Timer(0.3, lock.unlink).start()
    with pytest.warns(UserWarning, match="waiting up to"):
        assert clear_stale_lock(lock, stale_s=30) is False
    lock.touch()  # a young lock that never goes away: waited for, then removed once it is stale_s old
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        assert clear_stale_lock(lock, stale_s=1.0) is True
    said = [str(w.message) for w in got]
    assert any("waiting up to" in m for m in said) and any("removed a stale kernel build lock" in m for m in said)
    assert not lock.exists()

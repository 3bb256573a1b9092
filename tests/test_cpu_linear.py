"""The CPU decode kernels (`drafthead.kernels.cpu_linear`): bf16 (AVX512-BF16) and fp32 (AVX2/FMA; fp32, bf16
or int8 weights) agree with an fp64 reference, give a row the same bits at any row count and position, and the
runtime falls back to oneDNN when they are unavailable."""
from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

from drafthead.kernels import cpu_linear, extension, hugepages, packing

needs_kernel = pytest.mark.skipif(not extension.available(),
                                  reason=f"bf16 CPU kernel unavailable: {extension.unavailable_reason()}")
needs_fp32_kernel = pytest.mark.skipif(not extension.available("fp32"),
                                       reason=f"fp32 CPU kernel unavailable: {extension.unavailable_reason('fp32')}")


@pytest.mark.parametrize("kind", ["fp32", "bf16"])
def test_kernels_build_where_a_compiler_and_the_cpu_allow(kind: str) -> None:
    """A kernel that fails to compile falls back to oneDNN with a warning and its tests skip, which would keep CI
    green on a broken kernel; where a compiler and ninja exist, a build failure is a failure here."""
    import shutil

    from torch.utils.cpp_extension import is_ninja_available

    why = extension.unavailable_reason(kind)
    if why is None:
        assert extension.available(kind)
        return
    if not why.startswith("building the extension failed"):
        pytest.skip(why)  # not for this CPU, or turned off
    if not (shutil.which("c++") or shutil.which("g++")) or not is_ninja_available():
        pytest.skip(f"no C++ compiler or ninja here: {why}")
    pytest.fail(f"the {kind} kernel does not build: {why}")


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
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("N", [100, 300])  # 7 blocks of 16 (a partial work item, partial last block); 19 (2 + 3)
def test_rows_have_the_same_bits_at_any_row_count_and_position(N: int, threads: int) -> None:
    """Every row count 1..70 takes one of the tile paths (one tile of <= 6 rows, two tiles sharing K chunks at 7-12
    rows, tiles one after another beyond), on 1-3 threads (groups split 1 : 1 or unevenly: N = 300 is 5 groups),
    and a row gets the bits it gets alone."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(N, 576, generator=g).to(torch.bfloat16)
    b = torch.randn(N, generator=g).to(torch.bfloat16)
    x = torch.randn(70, 576, generator=g).to(torch.bfloat16)
    packed = cpu_linear.pack(w)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        alone = torch.cat([cpu_linear.linear(x[i: i + 1], packed, N, b) for i in range(70)])
        torch.set_num_threads(threads)
        _same_bits_at_every_row_count(x, packed, N, b, alone)
    finally:
        torch.set_num_threads(before)


def _same_bits_at_every_row_count(x, packed, N, b, alone) -> None:
    for M in range(1, 71):
        for start in sorted({0, 70 - M, (70 - M) // 2}):
            assert torch.equal(cpu_linear.linear(x[start: start + M], packed, N, b), alone[start: start + M]), M
            # a streamed weight (a target's, prefetched non-temporally) gives the same bits
            assert torch.equal(cpu_linear.linear(x[start: start + M], packed, N, b, stream=True),
                               alone[start: start + M]), M
    three_d = cpu_linear.linear(x[:12].view(3, 4, x.shape[1]), packed, N, b)  # [B, T, K] in, [B, T, N] out
    assert torch.equal(three_d.view(12, N), alone[:12])


def _has_amx() -> bool:
    from drafthead import hardware
    return {"amx_bf16", "amx_tile"} <= hardware.cpu_flags()


@needs_kernel
def test_amx_path_is_refused_cleanly_without_amx() -> None:
    """Where the CPU has no AMX, asking for the AMX tiles is a named error and the AVX512-BF16 tiles keep running
    (same bits as before the request); where it has AMX, they turn on and off."""
    was = extension.amx()
    extension.amx(False)
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(64, 96, generator=g).bfloat16(), torch.randn(5, 96, generator=g).bfloat16()
    packed = cpu_linear.pack(w)
    before = cpu_linear.linear(x, packed, 64)
    if not _has_amx():
        with pytest.raises(RuntimeError, match="AMX tiles: this CPU .* lacks amx_bf16, amx_tile"):
            extension.amx(True)
        assert extension.amx() is False and torch.equal(cpu_linear.linear(x, packed, 64), before)
        assert "AMX" not in cpu_linear.tile_path("bf16", 8)
        return
    try:
        assert extension.amx(True) is True and cpu_linear.tile_path("bf16", 8).startswith("bf16 AMX")
        extension.amx(False)
        assert extension.amx() is False and torch.equal(cpu_linear.linear(x, packed, 64), before)
    finally:
        extension.amx(was)


@needs_kernel
@pytest.mark.skipif(not _has_amx(), reason="no AMX on this CPU (amx_bf16, amx_tile): the AMX tiles cannot run here")
@pytest.mark.parametrize("N,K", [(100, 576), (300, 576), (1536, 576), (576, 1536), (64, 96)])
def test_amx_rows_have_the_same_bits_at_1_to_70_rows_and_match_the_reference(N: int, K: int) -> None:
    """With the AMX tiles on: within one bf16 rounding of the fp64 product, and a row's bits equal at every row count
    1..70 and position (16-row A tiles, partial groups). A K that is not a multiple of 32 stays on the AVX512-BF16
    tiles, with their bits."""
    g = torch.Generator().manual_seed(N + K)
    w = torch.randn(N, K, generator=g).to(torch.bfloat16)
    b = torch.randn(N, generator=g).to(torch.bfloat16)
    x = torch.randn(70, K, generator=g).to(torch.bfloat16)
    packed = cpu_linear.pack(w)
    odd = torch.randn(N, 34, generator=g).to(torch.bfloat16)  # K = 34: not a multiple of 32
    odd_x = torch.randn(9, 34, generator=g).to(torch.bfloat16)
    was = extension.amx()
    extension.amx(False)
    odd_before = cpu_linear.linear(odd_x, cpu_linear.pack(odd), N, b)
    extension.amx(True)
    try:
        alone = torch.cat([cpu_linear.linear(x[i: i + 1], packed, N, b) for i in range(70)])
        ref = reference(x, w, b)
        tol = ref.abs() * 2.0 ** -8 + x.double().abs() @ w.double().abs().t() * 2.0 ** -20 + 1e-30
        assert ((alone.double() - ref).abs() <= tol).all()
        _same_bits_at_every_row_count(x, packed, N, b, alone)
        assert torch.equal(cpu_linear.linear(odd_x, cpu_linear.pack(odd), N, b), odd_before)
    finally:
        extension.amx(was)


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
    fast = packing.with_packed_linears(net)
    assert fast is not net and type(net[0]) is nn.Linear  # the original is untouched
    assert isinstance(fast[0], packing.PackedLinear) and isinstance(fast[2], packing.PackedLinear)
    assert fast[0].weight.dtype == torch.bfloat16  # code reading .weight still works
    x = torch.randn(5, 64).to(torch.bfloat16)
    with torch.no_grad():
        want, got = net(x).float(), fast(x).float()
    assert (got - want).abs().max() <= 0.02 * want.abs().max()
    assert torch.equal(fast(x[2:3]), fast(x)[2:3])  # row-invariant like the kernel
    f16 = nn.Linear(8, 8).half()
    assert packing.with_packed_linears(f16) is f16  # no kernel for fp16: the module itself


def test_builds_of_a_torch_that_is_gone_are_removed(tmp_path):
    """Each build folder records its torch; a build whose torch no longer exists (a deleted venv) is removed when
    another build is used, and builds of live installations, or with no record, stay."""
    from drafthead.kernels.extension import prune_orphan_builds

    live, gone, alive, unknown = (tmp_path / n for n in ("live", "gone", "alive", "unknown"))
    for folder, torch_at in ((gone, tmp_path / "deleted-venv" / "torch"), (alive, tmp_path)):
        folder.mkdir()
        (folder / "torch_dir").write_text(str(torch_at))
        (folder / "ext.so").write_bytes(b"x")
    unknown.mkdir()
    live.mkdir()
    assert prune_orphan_builds(live, tmp_path) == [gone]
    assert (live / "torch_dir").read_text() == str(tmp_path)
    assert not gone.exists() and alive.is_dir() and unknown.is_dir()


def test_stale_build_lock_is_removed_and_a_fresh_one_waited_for(tmp_path):
    """A process killed while loading the extension leaves torch's build lock, which made every later
    process wait forever in silence: an old lock is removed with a warning, a young one waited for."""
    import os
    import threading
    import time
    import warnings

    from drafthead.kernels.extension import clear_stale_lock

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


@contextlib.contextmanager
def switched(switch: Callable[[bool | None], bool], on: bool, missing: str) -> Iterator[None]:
    """A CPU-chosen code path of the extension on (skipping with `missing` where the CPU lacks it) or off, for
    the block; as it was after."""
    if on and not switch(None):
        pytest.skip(missing)
    before = switch(None)
    try:
        assert switch(on) == on
        yield
    finally:
        switch(before)


def avx512_tiles(on: bool) -> contextlib.AbstractContextManager:
    """fp32-kernel projections of 2+ rows on their AVX-512 tiles (on) or their 8-lane tiles."""
    return switched(extension.avx512_tiles, on, "the CPU has no AVX-512: fp32 projections run their 8-lane "
                    "tiles only")


@needs_fp32_kernel
def test_avx2_dispatch_turns_the_extensions_avx512_code_off() -> None:
    """ATEN_CPU_CAPABILITY=avx2 on a newer CPU stands for the AVX2 class (drafthead.hardware): the fp32 extension
    then runs its AVX2 code only, or figures measured that way would borrow AVX-512."""
    import subprocess
    import sys

    code = ("from drafthead.kernels import extension as c; from drafthead import hardware as h; "
            "print(h.cpu_class(), c.avx512_tiles(), c.avx512_bf16_ops())")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["AVX2", "False", "False"], out.stdout + out.stderr


@needs_fp32_kernel
@pytest.mark.parametrize("avx512", [False, True], ids=["tiles8", "tiles16"])
@pytest.mark.parametrize("weights", cpu_linear.WEIGHTS)
@pytest.mark.parametrize("N,K", [(1536, 576), (576, 1536), (192, 576), (37, 64), (100, 3), (1, 130), (49152, 576)])
def test_fp32_kernel_matches_fp64_reference(weights: str, N: int, K: int, avx512: bool) -> None:
    """fp32 accumulation over K of the weight `compress` stands for: within fp32 rounding of the fp64 product."""
    g = torch.Generator().manual_seed(N + K)
    w, b, x = torch.randn(N, K, generator=g), torch.randn(N, generator=g), torch.randn(13, K, generator=g)
    stored, scale, effective = cpu_linear.compress(w, weights)
    packed = cpu_linear.pack_fp32(stored)
    for bias in (None, b):
        with avx512_tiles(avx512):
            y = cpu_linear.linear_fp32(x, packed, N, scale, bias)  # [13, N]
        assert y.dtype == torch.float32 and y.shape == (13, N)
        ref = reference(x, effective, bias)
        tol = (x.double().abs() @ effective.double().abs().t() + (bias.double().abs() if bias is not None else 0)
               ) * K * 2.0 ** -23 + 1e-30
        assert ((y.double() - ref).abs() <= tol).all(), (weights, N, K, bias is None)


def test_compress_gives_the_weight_the_kernel_computes_with() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 64, generator=g)
    w[3] = 0  # an all-zero row: scale floored, no division by zero
    same, none, eff = cpu_linear.compress(w, "fp32")
    assert none is None and torch.equal(same, w) and torch.equal(eff, w)
    bits, none, eff = cpu_linear.compress(w, "bf16")
    assert none is None and bits.dtype == torch.int16 and torch.equal(eff, w.to(torch.bfloat16).float())
    q, scale, eff = cpu_linear.compress(w, "int8")
    assert q.dtype == torch.int8 and scale.shape == (40,) and int(q.abs().max()) == 127
    assert torch.equal(eff, q.float() * scale[:, None]) and torch.equal(eff[3], torch.zeros(64))
    assert ((eff - w).abs() <= scale[:, None] / 2 + 1e-7).all()  # round to the nearest level
    with pytest.raises(ValueError, match="weights='int4'"):
        cpu_linear.compress(w, "int4")


@needs_fp32_kernel
@pytest.mark.parametrize("avx512", [False, True], ids=["tiles8", "tiles16"])
@pytest.mark.parametrize("weights", cpu_linear.WEIGHTS)
def test_fp32_kernel_rows_have_the_same_bits_at_1_to_70_rows(weights: str, avx512: bool) -> None:
    """A row alone (the 1-row path) and inside 2..70 rows (8-lane or AVX-512 tiles) gives the same bits; so do the
    two tile kinds, since the CPU and not the row count chooses between them."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(100, 576, generator=g)  # 100 outputs: 2 full work items of 48 + a tail block of 4
    b = torch.randn(100, generator=g)
    x = torch.randn(70, 576, generator=g)
    stored, scale, _ = cpu_linear.compress(w, weights)
    packed = cpu_linear.pack_fp32(stored)
    alone = torch.cat([cpu_linear.linear_fp32(x[i: i + 1], packed, 100, scale, b) for i in range(70)])
    with avx512_tiles(avx512):
        for M in range(1, 71):
            for start in sorted({0, 70 - M, (70 - M) // 2}):
                got = cpu_linear.linear_fp32(x[start: start + M], packed, 100, scale, b)
                assert torch.equal(got, alone[start: start + M]), (weights, M, start)


@needs_fp32_kernel
@pytest.mark.parametrize("weights", cpu_linear.WEIGHTS)
def test_fp32_stream_settings_never_change_bits(weights: str) -> None:
    """How the kernel streams (how far a lone row prefetches; multi-row tiles over the whole K or in chunks, chunks
    that divide K or not, larger than K) is picked by the probe on the machine: every setting gives the same bits
    at every row count, so losslessness never depends on the machine's choice."""
    g = torch.Generator().manual_seed(2)
    w, b, x = torch.randn(100, 576, generator=g), torch.randn(100, generator=g), torch.randn(37, 576, generator=g)
    stored, scale, _ = cpu_linear.compress(w, weights)
    packed = cpu_linear.pack_fp32(stored)
    before = extension.fp32_stream()
    try:
        with avx512_tiles(False):
            want = {M: cpu_linear.linear_fp32(x[:M], packed, 100, scale, b) for M in (1, 2, 3, 4, 5, 8, 16, 37)}
            for ahead, kc in itertools.product((1, 16, 128), (0, 1, 64, 200, 576, 1024)):
                assert extension.fp32_stream(ahead=ahead, kc=kc) == {"ahead": ahead, "kc": kc}
                for M, y in want.items():
                    assert torch.equal(cpu_linear.linear_fp32(x[:M], packed, 100, scale, b), y), (ahead, kc, M)
        with pytest.raises(ValueError, match=r"fp32 stream ahead=0, kc=\d+: ahead is 1..1024 k"):
            extension.fp32_stream(ahead=0)
        with pytest.raises(ValueError, match=r"kc >= 0"):
            extension.fp32_stream(kc=-1)
    finally:
        extension.fp32_stream(**before)


@needs_fp32_kernel
def test_fp32_kernel_bad_inputs_are_named_errors() -> None:
    with pytest.raises(ValueError, match="int16 \\(bf16 bits\\) or int8"):
        cpu_linear.pack_fp32(torch.zeros(4, 8, dtype=torch.float64))
    packed = cpu_linear.pack_fp32(torch.zeros(4, 8))
    with pytest.raises(ValueError, match="x must be float32"):
        cpu_linear.linear_fp32(torch.zeros(2, 8, dtype=torch.bfloat16), packed, 4)
    with pytest.raises(RuntimeError, match="K = 6"):
        cpu_linear.linear_fp32(torch.zeros(2, 6), packed, 4)
    with pytest.raises(RuntimeError, match="N = 40"):
        cpu_linear.linear_fp32(torch.zeros(2, 8), packed, 40)
    q = cpu_linear.pack_fp32(torch.zeros(4, 8, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="int8 weights need a per-output scale"):
        cpu_linear.linear_fp32(torch.zeros(2, 8), q, 4)


@needs_fp32_kernel
def test_with_packed_linears_packs_fp32_linears_too() -> None:
    torch.manual_seed(0)
    # 64 features between the layers: torch's vectorized SiLU handles 2 x 16 fp32 lanes a loop and the rest
    # with scalar code that rounds differently, so only widths that are a multiple of 32 are row-invariant
    # outside the kernel (real hidden sizes are)
    net = nn.Sequential(nn.Linear(64, 64), nn.SiLU(), nn.Linear(64, 20, bias=False))
    fast = packing.with_packed_linears(net)
    assert fast is not net and isinstance(fast[0], packing.PackedLinear) and fast[0].kind == "fp32"
    x = torch.randn(5, 64)
    with torch.no_grad():
        want, got = net(x), fast(x)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(fast(x[2:3]), fast(x)[2:3])
    assert packing.packed_bytes(fast) == (8 * 8 * 64 + 3 * 8 * 64) * 4  # 64 -> 8 blocks, 20 -> 3 blocks of 8


def test_packed_linear_and_kind_bad_inputs_are_named_errors() -> None:
    with pytest.raises(ValueError, match="unknown CPU kernel kind 'fp16'; kinds: bf16, fp32"):
        extension.available("fp16")
    with pytest.raises(ValueError, match="no CPU decode kernel for torch.float16 layers"):
        packing.PackedLinear(nn.Linear(8, 8).half())


@needs_kernel
def test_compressed_weights_on_a_bf16_layer_are_a_named_error() -> None:
    with pytest.raises(ValueError, match="weights='int8' needs fp32 layers \\(this one is bf16\\)"):
        packing.PackedLinear(nn.Linear(8, 8).to(torch.bfloat16), "int8")


def avx512_bf16_ops(on: bool) -> contextlib.AbstractContextManager:
    """bf16 attention and elementwise ops on their AVX512-BF16 code (on) or their AVX2 code."""
    return switched(extension.avx512_bf16_ops, on, "the CPU has no AVX512-BF16: bf16 attention and elementwise "
                    "ops run their AVX2 code only")


def attention_reference(q, k, v, mask, scale):
    return torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask,
                                                            scale=scale, enable_gqa=True)


@needs_fp32_kernel
@pytest.mark.parametrize("dtype,avx512", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)],
                         ids=["fp32", "bf16-avx2", "bf16-avx512"])
@pytest.mark.parametrize("H,KVH,D", [(9, 3, 64), (4, 4, 128), (8, 2, 8), (2, 1, 24), (2, 1, 40)])
def test_fp32_attention_matches_fp64_and_ignores_row_count_and_capacity(H: int, KVH: int, D: int,
                                                                         dtype: torch.dtype, avx512: bool) -> None:
    """Causal and tree masks, requests at different lengths, k/v as views of a runtime-style cache, fp32 or bf16
    inputs (bf16 by FMAs of widened values, or by `vdpbf16ps` where the CPU has it): within fp32 rounding of fp64
    SDPA of the same values; a query alone, inside a block and against a larger cache (more masked keys) gives the
    same bits."""
    with avx512_bf16_ops(avx512):
        check_attention(H, KVH, D, dtype)


def check_attention(H: int, KVH: int, D: int, dtype: torch.dtype, T: int = 7, S: int = 48,
                    lens: tuple[int, int] = (11, 30)) -> None:
    from drafthead.runtime.model import attention_mask

    g = torch.Generator().manual_seed(H + D)
    B = 2
    tree = torch.eye(T, dtype=torch.bool)[None].repeat(B, 1, 1)
    tree[:, 1:, 0] = True  # every node's parent is node 0, and some nodes' is the node before
    tree[:, 3::2] |= torch.eye(T, dtype=torch.bool).roll(-1, 1)[3::2]
    cache = torch.randn(B, 3 * 2 * KVH, S + 16, D, generator=g).to(dtype)  # three layers' k/v, 16 spare slots
    k, v = cache[:, 2 * KVH: 3 * KVH], cache[:, 3 * KVH: 4 * KVH]  # layer 1's views, [B, kvh, S+16, D]
    q = torch.randn(B, H, T, D, generator=g).to(dtype)
    lens_t = torch.tensor(lens)
    for tree_mask in (None, tree):
        mask = attention_mask(lens_t, T, S, tree_mask)  # [B, 1, T, S]
        o = cpu_linear.attention_fp32(q, k[:, :, :S], v[:, :, :S], mask, D ** -0.5)
        ref = attention_reference(q, k[:, :, :S], v[:, :, :S], mask, D ** -0.5)
        assert o.dtype == torch.float32 and (o.double() - ref).abs().max() < 1e-5
        wide = attention_mask(lens_t, T, S + 16, tree_mask)
        assert torch.equal(cpu_linear.attention_fp32(q, k, v, wide, D ** -0.5), o)  # capacity does not matter
        for t in range(T):
            one = cpu_linear.attention_fp32(q[:, :, t: t + 1], k[:, :, :S], v[:, :, :S], mask[:, :, t: t + 1],
                                            D ** -0.5)
            assert torch.equal(one, o[:, :, t: t + 1]), t
            # decoded alone: the token's visible keys side by side from slot 0 (a tree node's ancestors written
            # after the prefix, as plain decoding writes them), under a causal mask
            for b in range(B):
                seen = mask[b, 0, t].nonzero().flatten()
                n = seen.numel()
                kb, vb = k[b: b + 1, :, seen], v[b: b + 1, :, seen]
                alone = cpu_linear.attention_fp32(q[b: b + 1, :, t: t + 1], kb, vb,
                                                  torch.ones(1, 1, 1, n, dtype=torch.bool), D ** -0.5)
                assert torch.equal(alone, o[b: b + 1, :, t: t + 1]), (t, b)


@needs_fp32_kernel
@pytest.mark.skipif(not _has_amx(), reason="no AMX on this CPU (amx_bf16, amx_tile): the AMX tiles cannot run here")
@pytest.mark.parametrize("H,KVH,D", [(9, 3, 64), (4, 4, 128), (32, 2, 64), (2, 1, 96), (8, 2, 40)])
def test_amx_attention_matches_fp64_and_keeps_a_querys_bits(H: int, KVH: int, D: int) -> None:
    """bf16 attention on AMX tiles (on with the AMX projections): requests whose shared prefix spans several blocks of
    16 keys, tokens over several tiles and their own keys past the shared blocks, causal and tree masks; within fp32
    rounding of fp64 and the same bits alone, in a block, decoded alone and against a larger cache. It rounds
    unlike the vdpbf16ps code (a sign that it ran); head_dim 40 stays on that code."""
    was = extension.amx()
    try:
        extension.amx(False)
        with avx512_bf16_ops(True):
            before = cpu_linear.attention_fp32(*_attention_case(H, KVH, D))
            extension.amx(True)
            check_attention(H, KVH, D, torch.bfloat16, T=37, S=160, lens=(100, 41))
            after = cpu_linear.attention_fp32(*_attention_case(H, KVH, D))
        assert torch.equal(before, after) is (D % 32 != 0)
    finally:
        extension.amx(was)


def _attention_case(H: int, KVH: int, D: int) -> tuple:
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, n, 20, D, generator=g).bfloat16() for n in (H, KVH, KVH))
    return q, k, v, torch.ones(1, 1, 20, 20, dtype=torch.bool).tril(), D ** -0.5


@needs_fp32_kernel
def test_fp32_attention_bad_inputs_are_named_errors() -> None:
    q, k, m = torch.randn(1, 2, 1, 12), torch.randn(1, 2, 5, 12), torch.ones(1, 1, 1, 5, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="head_dim must be a multiple of 8"):
        cpu_linear.attention_fp32(q, k, k, m, 1.0)
    q, k = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 5, 8)
    with pytest.raises(RuntimeError, match="all be float32 or all bfloat16"):
        cpu_linear.attention_fp32(q.double(), k, k, m, 1.0)
    with pytest.raises(RuntimeError, match="all be float32 or all bfloat16"):
        cpu_linear.attention_fp32(q.bfloat16(), k, k, m, 1.0)
    with pytest.raises(RuntimeError, match="bool"):
        cpu_linear.attention_fp32(q, k, k, m.float(), 1.0)


@pytest.mark.parametrize("kind,weights", [("bf16", "fp32"), ("fp32", "fp32"), ("fp32", "bf16"), ("fp32", "int8")])
def test_concat_gives_each_part_its_own_bits(kind: str, weights: str) -> None:
    """q/k/v (and gate/up) run as one joined weight in the runtime: every output must keep the bits its own
    projection gives, at 1 and at 11 rows, with and without biases."""
    if not extension.available(kind):
        pytest.skip(f"{kind} CPU kernel unavailable: {extension.unavailable_reason(kind)}")
    dtype = torch.bfloat16 if kind == "bf16" else torch.float32
    torch.manual_seed(0)
    # SmolLM2's q/k/v, and parts whose ends split the kernels' groups of blocks (5 and 10 blocks: neither a
    # multiple of the bf16 kernel's 4 nor of the fp32 kernel's 3)
    for bias, sizes in ((False, (576, 192, 192)), (True, (576, 192, 192)), (False, (80, 48, 16)), (True, (80, 48))):
        lins = [nn.Linear(576, n, bias=bias).to(dtype) for n in sizes]
        parts = [packing.PackedLinear(lin, weights) for lin in lins]
        joined = packing.concat(parts)
        assert joined.out_features == sum(sizes)
        assert packing.packed_bytes(joined) == sum(map(packing.packed_bytes, parts))
        for rows in (1, 11):
            x = torch.randn(rows, 576).to(dtype)
            want = torch.cat([p(x) for p in parts], dim=-1)  # [rows, sum(sizes)]
            assert torch.equal(joined(x), want), (bias, sizes, rows)


@needs_fp32_kernel
def test_concat_refuses_parts_it_cannot_join() -> None:
    a = packing.PackedLinear(nn.Linear(64, 16, bias=False))
    with pytest.raises(ValueError, match="whole packed blocks"):  # 20 outputs: a padded block in the middle
        packing.concat([packing.PackedLinear(nn.Linear(64, 20, bias=False)), a])
    with pytest.raises(ValueError, match="bias presence"):
        packing.concat([packing.PackedLinear(nn.Linear(64, 16)), a])
    with pytest.raises(ValueError, match="storage"):
        packing.concat([packing.PackedLinear(nn.Linear(64, 16, bias=False), "int8"), a])


@needs_fp32_kernel
@pytest.mark.parametrize("dtype,avx512", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)],
                         ids=["fp32", "bf16-avx2", "bf16-avx512"])
def test_small_ops_match_torch_and_ignore_row_count(dtype: torch.dtype, avx512: bool) -> None:
    """The one-call RMSNorm, RoPE and SiLU-and-multiply of generated tokens against the torch ops the runtime runs
    for prompts: bf16 bit for bit (the roundings sit where torch's ops round; each op by its AVX2 code and by its
    AVX512-BF16 code), RoPE in fp32 too, the rest within fp32 rounding (another summation order; a polynomial exp).
    A row's bits do not depend on the rows beside it. Widths off the vector width (577, 24, 1541) take the tails."""
    with avx512_bf16_ops(avx512):
        check_small_ops(dtype)


def check_small_ops(dtype: torch.dtype) -> None:
    from drafthead.layers import apply_rope
    from drafthead.runtime.model import rms_norm

    g = torch.Generator().manual_seed(0)
    exact = dtype == torch.bfloat16
    for H in (576, 577):
        norm = nn.Module()
        norm.weight, norm.variance_epsilon = nn.Parameter(torch.randn(H, generator=g).to(dtype)), 1e-5
        x = (torch.randn(13, H, generator=g) * 3).to(dtype)
        want, got = rms_norm(norm, x), cpu_linear.rms_norm(x, norm.weight, 1e-5)
        assert torch.equal(got, want) if exact else torch.allclose(got, want, rtol=1e-5, atol=1e-6), H
        assert torch.equal(cpu_linear.rms_norm(x[4:5], norm.weight, 1e-5), got[4:5])
    for D in (64, 24):
        x = torch.randn(2, 5, 12 * D, generator=g).to(dtype).view(2, 5, 12, D)  # a view, as of the joined q/k/v
        cos, sin = torch.randn(2, 5, D, generator=g).to(dtype), torch.randn(2, 5, D, generator=g).to(dtype)
        got = cpu_linear.rope(x, cos, sin)  # [2, 5, 12, D]
        assert torch.equal(got, apply_rope(x.transpose(1, 2), cos[:, None], sin[:, None]).transpose(1, 2)), D
        assert torch.equal(cpu_linear.rope(x[1:, 2:3], cos[1:, 2:3], sin[1:, 2:3]), got[1:, 2:3])
        assert torch.equal(cpu_linear.rope(x, cos[:, None], sin[:, None]), got)  # the runtime's [B, 1, T, D]
    for I in (1536, 1541):
        gu = (torch.randn(3, 4, 2 * I, generator=g) * 4).to(dtype)
        want = torch.nn.functional.silu(gu[..., :I]) * gu[..., I:]
        got = cpu_linear.silu_mul(gu)  # [3, 4, I]
        assert torch.equal(got, want) if exact else torch.allclose(got, want, rtol=1e-6, atol=1e-30), I
        assert torch.equal(cpu_linear.silu_mul(gu[2, 1:2]), got[2, 1:2])


@needs_fp32_kernel
def test_small_ops_bad_inputs_are_named_errors() -> None:
    with pytest.raises(RuntimeError, match="must both be float32 or both bfloat16"):
        cpu_linear.rms_norm(torch.randn(2, 8), torch.ones(8).bfloat16(), 1e-5)
    with pytest.raises(RuntimeError, match="weight must be"):
        cpu_linear.rms_norm(torch.randn(2, 8), torch.ones(9), 1e-5)
    with pytest.raises(RuntimeError, match=r"cos and sin must be \[B, T, D\] or \[B, 1, T, D\]"):
        cpu_linear.rope(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 4), torch.randn(1, 2, 4))
    with pytest.raises(RuntimeError, match="all be float32 or all bfloat16"):
        cpu_linear.rope(torch.randn(1, 2, 3, 8).double(), torch.randn(1, 2, 8), torch.randn(1, 2, 8))
    with pytest.raises(RuntimeError, match=r"\[gate \| up\]"):
        cpu_linear.silu_mul(torch.randn(2, 7))
    with pytest.raises(RuntimeError, match="contiguous rows and D even"):
        cpu_linear.rope(torch.randn(1, 2, 3, 7), torch.randn(1, 2, 7), torch.randn(1, 2, 7))
    with pytest.raises(RuntimeError, match="input must be float32 or bfloat16"):
        cpu_linear.silu_mul(torch.randn(2, 8).double())


@needs_fp32_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_gives_torch_argmax_index(dtype: torch.dtype) -> None:
    """The first largest value's index, as torch.argmax: ties, NaN (counts as the largest), all -inf, +inf, rows
    whose length is not a multiple of the vector width, batched leading dims."""
    g = torch.Generator().manual_seed(0)
    for N in (1, 7, 8, 9, 100, 49152):
        x = torch.randn(6, N, generator=g).to(dtype)
        x[1] = x[1].round().clamp(max=1)  # many ties at the maximum
        x[2, N // 2] = float("nan")
        x[2, N - 1] = float("nan")
        x[3] = float("-inf")
        x[4, N - 1] = float("inf")
        x[5] = 0.0
        assert torch.equal(cpu_linear.argmax(x), x.argmax(-1)), N
    x = torch.randn(2, 3, 1000, generator=g).to(dtype)
    assert torch.equal(cpu_linear.argmax(x), x.argmax(-1))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        cpu_linear.argmax(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="non-empty last dim"):
        cpu_linear.argmax(torch.zeros(3, 0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_project_joins_packed_draft_projections_with_their_own_bits(dtype: torch.dtype) -> None:
    """`layers.project` runs packed projections (a draft step) as one joined kernel call, made once and kept: each
    output equals its own projection's, bit for bit; plain nn.Linear layers (training) are called one by one."""
    from drafthead.layers import project

    kind = cpu_linear.kind_for(dtype)
    if not extension.available(kind):
        pytest.skip(f"{kind} CPU kernel unavailable: {extension.unavailable_reason(kind)}")
    torch.manual_seed(0)
    lins = [nn.Linear(64, n, bias=False).to(dtype) for n in (96, 32, 32)]
    packed = [packing.PackedLinear(lin) for lin in lins]
    x = torch.randn(3, 64).to(dtype)
    with torch.no_grad():
        got = project(x, *packed)
        assert packing.joined(*packed) is packing.joined(*packed) is not None  # made once
        assert all(torch.equal(g, p(x)) for g, p in zip(got, packed))
        assert all(torch.equal(g, lin(x)) for g, lin in zip(project(x, *lins), lins))
    assert packing.joined(*lins) is None
    odd = packing.PackedLinear(nn.Linear(64, 20, bias=False).to(dtype))  # not whole blocks: no join
    assert packing.joined(packed[0], odd) is None
    assert all(torch.equal(g, p(x)) for g, p in zip(project(x, packed[0], odd), (packed[0], odd)))


def test_huge_pages_copies_are_exact_aligned_on_huge_pages_and_outlive_their_arena() -> None:
    """`HugePages.put`: the same values, 64-byte aligned, one after another in a chunk that starts on a 2 MB boundary,
    backed by huge pages (what the decode step streams), and alive after the arena itself is gone."""
    why = hugepages.huge_pages()
    if why is not None:
        pytest.skip(f"huge pages off here: {why}")
    pages = hugepages.HugePages(chunk=4 << 20)
    g = torch.Generator().manual_seed(0)
    small, big = torch.randn(100, 37, generator=g).bfloat16(), torch.randn(1 << 20, 3, generator=g)  # 7.4 KB, 12 MB
    a, b, c = pages.put(small), pages.put(small.t()), pages.put(big)
    assert torch.equal(a, small) and torch.equal(b, small.t()) and torch.equal(c, big)
    assert a.data_ptr() % (2 << 20) == 0 and b.data_ptr() == a.data_ptr() + 7424  # 7400 bytes, rounded up to 64
    assert c.data_ptr() % (2 << 20) == 0 and c.data_ptr() != a.data_ptr() + 2 * 7424  # too big: a chunk of its own
    assert hugepages.huge_page_bytes(c) >= 10 << 20, "Linux gave the 12 MB copy no huge pages"
    del pages
    assert torch.equal(a, small) and torch.equal(c, big)


def test_huge_pages_off_keeps_tensors_as_they_are(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DRAFTHEAD_HUGE_PAGES", "0")
    t = torch.randn(64, 64)
    assert hugepages.huge_pages() == "DRAFTHEAD_HUGE_PAGES=0" and hugepages.HugePages().put(t) is t

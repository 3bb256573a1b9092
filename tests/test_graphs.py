"""The static-cache path a GPU replays as CUDA graphs (`runtime/graphs.py`), run eagerly on CPU: padded buckets,
static buffers and the sync-free forward give the eager forward's bits and the same greedy tokens in every mode."""
from __future__ import annotations

import pytest
import torch

from drafthead.runtime import SpecConfig, SpeculativeGenerator, TargetModel, graphs
from test_runtime import SETTINGS, OracleDrafter, random_drafter, random_prompts, tiny_target


def test_buckets_and_when_graphs_are_on(monkeypatch: pytest.MonkeyPatch) -> None:
    assert [graphs.bucket(t) for t in (1, 2, 3, 5, 9, 17, 33, 64, 65)] == [1, 2, 4, 8, 16, 32, 64, 64, None]
    assert not graphs.enabled(torch.device("cpu"))
    monkeypatch.setenv("DRAFTHEAD_CUDA_GRAPHS", "0")
    assert not graphs.enabled(torch.device("cuda"))
    monkeypatch.delenv("DRAFTHEAD_CUDA_GRAPHS")
    assert graphs.enabled(torch.device("cuda"))
    assert TargetModel(tiny_target("llama").model).static is None  # CPU: every forward eager


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_static_path_gives_the_eager_forwards_bits(dtype: torch.dtype) -> None:
    """A chain block and a tree block of T new tokens padded to their bucket: the real tokens' logits and aux features
    equal the eager forward's (bit for bit through the fp32 decode kernel, to fp64 rounding through torch), the cache
    holds the same K/V for them, and the eager path takes over past the last bucket or the cache's capacity."""
    target = tiny_target("qwen3", dtype=dtype, seed=4)
    tm = TargetModel(target.model, aux_layer_ids=[0, 1, 1])
    static = graphs.StaticForward(tm, graphs=False)
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, 128, (2, 9), generator=g)
    for T in (1, 3, 5, 8):
        new = torch.randint(3, 128, (2, T), generator=g)
        parents = torch.arange(-1, T - 1).clamp(min=0)  # a tree: node i under node i-1, node 2 under the root too
        parents[min(2, T - 1)] = 0
        tree = torch.zeros(2, T, T, dtype=torch.bool)
        depth = torch.zeros(2, T, dtype=torch.long)
        for i in range(T):
            j = i
            while True:
                tree[:, i, j] = True
                if j == 0:
                    break
                j = int(parents[j])
                depth[:, i] += 1
        for tree_mask, dep in ((None, None), (tree, depth)):
            out = {}
            for name in ("eager", "static"):
                tm.static = static if name == "static" else None
                cache = tm.new_cache(2, 32)
                lens = torch.zeros(2, dtype=torch.long)
                tm.forward(cache, prefix, lens, prefill=True)
                lens = lens + 9
                logits, aux = tm.forward(cache, new, lens, tree_mask=tree_mask, depth=dep, capture=True)
                out[name] = (logits, aux, cache[:, :, : 9 + T].clone())
            tm.static = None
            for a, b in zip(out["eager"], out["static"]):
                assert a.shape == b.shape, (T, tree_mask is not None)
                if dtype == torch.float32:  # the decode kernel: a row's bits do not depend on the padding
                    assert torch.equal(a, b), (T, tree_mask is not None)
                else:  # fp64 through torch's matmuls, whose sums may split by row count: equal to rounding
                    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    cache, lens = tm.new_cache(2, 12), torch.full((2,), 9)
    assert static.usable(cache, torch.zeros(2, 2, dtype=torch.long), lens)  # 9 + 2 <= 12
    assert not static.usable(cache, torch.zeros(2, 3, dtype=torch.long), lens)  # padded to 4: 9 + 4 > 12
    assert not static.usable(tm.new_cache(2, 128), torch.zeros(2, 65, dtype=torch.long), lens)  # past the last bucket
    with pytest.raises(ValueError, match="static forward of 65 tokens: the last bucket is 64"):
        static.run(tm.new_cache(2, 128), torch.zeros(2, 65, dtype=torch.long), lens, None, None, False)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_is_lossless_on_the_static_path(arch: str) -> None:
    """Every runtime setting (chains, trees, adaptive, n-gram, batches) gives the eager AR tokens with the target's
    decode and verify forwards on the static path."""
    target = tiny_target(arch, dtype=torch.float32, seed=4, head_scale=4.0)
    prompts = random_prompts(4, 128, seed=17)
    want = [r.tokens for r in SpeculativeGenerator(target, random_drafter(target)).generate(
        prompts, 24, SpecConfig(mode="ar"))]
    for drafter in (random_drafter(target), OracleDrafter(target, one_hot=True)):
        gen = SpeculativeGenerator(target, drafter)
        gen.model.static = graphs.StaticForward(gen.model, graphs=False)
        for spec in SETTINGS:
            assert [r.tokens for r in gen.generate(prompts, 24, spec)] == want, spec

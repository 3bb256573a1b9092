"""MoE targets (Qwen3-MoE, Mixtral) in the runtime: HF's sparse blocks run as they are inside our decoder loop,
so the forward equals HF's, greedy speculative decoding equals plain greedy in every mode at batch 1 and 3,
and what the runtime cannot run is a named error that says which measurement still works."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from drafthead.runtime import SpecConfig, SpeculativeGenerator, TargetModel
from drafthead.kernels import verify as ops  # Triton on CUDA, the eager reference elsewhere
from drafthead.target import Target, freeze
from test_dflash import make_drafter
from test_runtime import EOS, OracleDrafter, random_drafter, random_prompts, reference_greedy

COMMON = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1,
              tie_word_embeddings=False, num_experts_per_tok=2)


def tiny_moe(arch: str, seed: int = 0, dtype=torch.float64) -> Target:
    if arch == "qwen3_moe":  # layer 1 dense (mlp_only_layers), layers 0 and 2 sparse: both kinds in one target
        cfg = Qwen3MoeConfig(**COMMON, moe_intermediate_size=16, num_experts=4, decoder_sparse_step=1,
                             mlp_only_layers=[1], head_dim=8, norm_topk_prob=True)
        cls = Qwen3MoeForCausalLM
    else:
        cfg = MixtralConfig(**COMMON, num_local_experts=4, sliding_window=None)
        cls = MixtralForCausalLM
    cfg._experts_implementation = "eager"  # HF's default grouped_mm has no float64 kernel; eager is the same math
    torch.manual_seed(seed)
    model = cls(cfg).eval().to(dtype)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # sharper next-token distributions than the near-uniform random init
    return freeze(Target(model, None, f"tiny-{arch}"))


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def moe(request) -> Target:
    return tiny_moe(request.param)


def test_moe_forward_matches_hf(moe: Target) -> None:
    m = moe.model
    tm = TargetModel(m, aux_layer_ids=[1, 0])
    assert tm.moe == ([True, False, True] if m.config.model_type == "qwen3_moe" else [True, True, True])
    seq = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = m(seq, output_hidden_states=True)
    cache, lens = tm.new_cache(2, 32), torch.zeros(2, dtype=torch.long)
    logits, aux = tm.forward(cache, seq[:, :8], lens, capture=True, prefill=True)
    torch.testing.assert_close(logits, ref.logits[:, :8], atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(aux, torch.cat([ref.hidden_states[1], ref.hidden_states[0]], -1)[:, :8])
    lens += 8
    logits, _ = tm.forward(cache, seq[:, 8:12], lens)  # a verify block of 4 on the cache
    torch.testing.assert_close(logits, ref.logits[:, 8:12], atol=1e-10, rtol=1e-10)
    tokens, parents = torch.tensor([[5, 7, 9], [21, 23, 25]]), torch.tensor([[-1, 0, 0], [-1, 0, 1]])
    mask, depth = ops.build_tree_mask(parents, torch.tensor([3, 3]))
    logits, _ = tm.forward(cache, tokens, lens, tree_mask=mask, depth=depth)  # a tree: each node on its own path
    with torch.no_grad():
        want = m(torch.cat([seq[:, :8], torch.tensor([[5, 7], [21, 23]])], 1)).logits[:, -1]
    torch.testing.assert_close(logits[:, 1], want, atol=1e-10, rtol=1e-10)
    # what one token reads: attention, the dense layer, the router and 2 of the 4 experts of each sparse layer
    experts = sum(p.numel() for layer in m.model.layers if hasattr(layer.mlp, "experts")
                  for p in layer.mlp.experts.parameters())
    assert tm.streamed_bytes() < sum(p.numel() * 8 for p in m.parameters()) - experts * 8 // 2 + 1


SETTINGS = [SpecConfig(mode="ar"), SpecConfig(mode="chain", num_speculative_tokens=3),
            SpecConfig(mode="tree", num_speculative_tokens=3, tree_nodes=6, topk=2),
            SpecConfig(mode="ngram", num_speculative_tokens=3),
            SpecConfig(mode="chain", num_speculative_tokens=2, ngram=True, adaptive=True)]


@pytest.mark.parametrize("batch", [1, 3])
def test_moe_greedy_speculative_equals_plain_greedy(moe: Target, batch: int) -> None:
    prompts = random_prompts(3, 128, seed=batch)
    want = [reference_greedy(moe, p, 16) for p in prompts]
    for drafter in (random_drafter(moe), OracleDrafter(moe, one_hot=True)):
        gen = SpeculativeGenerator(moe, drafter)
        for spec in SETTINGS:
            s = SpecConfig(**{**spec.__dict__, "batch_size": batch})
            assert [r.tokens for r in gen.generate(prompts, 16, s)] == want, (type(drafter).__name__, s)
    block = SpeculativeGenerator(moe, make_drafter(moe, block_size=4, ids=(0, 1)).double())
    for k in (1, 3):
        got = block.generate(prompts, 16, SpecConfig(mode="block", num_speculative_tokens=k, batch_size=batch))
        assert [r.tokens for r in got] == want, k


def test_moe_on_cpu_says_it_leaves_the_decode_kernels() -> None:
    target = tiny_moe("qwen3_moe", dtype=torch.float32)
    from drafthead.runtime import model as runtime_model

    runtime_model._say_moe_slow_path.cache_clear()
    with pytest.warns(UserWarning, match="qwen3_moe target on CPU: the decode kernels cover dense layers only"):
        tm = TargetModel(target.model)
    assert tm.kernel is None and not tm.decode_ops
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TargetModel(target.model)  # once a process


class NotAnExpertBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(32, 4)

    def forward(self, x):
        return x


def test_moe_bad_blocks_and_unsupported_targets_are_named_errors() -> None:
    target = tiny_moe("qwen3_moe")
    layer = target.model.model.layers[2]
    keep, layer.mlp = layer.mlp, NotAnExpertBlock()
    try:
        with pytest.raises(ValueError, match=r"target layer 2: NotAnExpertBlock is neither a dense gate/up/down MLP "
                                             r"nor an MoE block with `gate` \(router\) and `experts` "
                                             r"\(children: router\)"):
            TargetModel(target.model)
    finally:
        layer.mlp = keep
    c = target.model.config
    c.model_type = "deepseek_v3"
    try:
        with pytest.raises(ValueError,
                           match="'deepseek_v3' is not supported by the runtime .*still train.*SGLang or vLLM"):
            TargetModel(target.model)
    finally:
        c.model_type = "qwen3_moe"
    mix = tiny_moe("mixtral")
    mix.model.config.sliding_window = 64  # shorter than the 256 positions: windowed attention the runtime lacks
    with pytest.raises(ValueError, match="sliding-window attention"):
        TargetModel(mix.model)

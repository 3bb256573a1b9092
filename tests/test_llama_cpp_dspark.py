"""llama.cpp runs our GGUF DSpark drafts (`--spec-type draft-dspark`) with the SmolLM2 target (slow: builds
llama.cpp once, ~15 min on 2 cores; then a few minutes).

As tests/test_llama_cpp_dflash.py: the target alone continues a few chat prompts, DSpark drafts (anchor-first
blocks: B drafts a forward) are trained in-process on those continuations, exported with `to=gguf` and run in
`llama-speculative-simple`. Checked: llama.cpp takes the file as a DSpark draft; the text equals the target
alone; acceptance is near complete for the overfit draft; and per draft position, the acceptance llama.cpp
reports for a half-trained draft is within 0.1 of our runtime's on the same prompts (both chain the drafts
greedily through the Markov head).
"""
from __future__ import annotations

import pytest
import torch

from drafthead.dspark import DsparkDrafter, DsparkOptions, build
from drafthead.export.llama_cpp import default_threads, llama_cpp_bin

from tests.llama_cpp_data import (assert_lossless, continuations, our_block_acceptance_by_position,
                                  overfit_block_drafts, run_block_drafts)

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France? Answer in two sentences.",
    "Write a short poem about the sea.",
    "Give three tips for staying healthy.",
]
N_PREDICT = 48
BLOCK = 4
N_DRAFT = BLOCK  # anchor-first: every slot of [root, MASK x 3] drafts
MASK = 16  # <empty_output>, as recipes/dspark_smollm2.yaml
STEPS = {"trained": 150, "half": 30}
THREADS = default_threads()


@pytest.fixture(scope="module")
def bins():
    return llama_cpp_bin(build=True)


@pytest.fixture(scope="module")
def world(tmp_path_factory, bins):
    torch.manual_seed(0)
    torch.set_num_threads(2)
    data = continuations(bins, PROMPTS, N_PREDICT, BLOCK + 2, THREADS)
    opts = DsparkOptions(num_layers=1, block_size=BLOCK, mask_token_id=MASK, target_layer_ids=[1, 14, 27],
                         markov_rank=32, num_anchors=16)  # 16 blocks a sequence: steps stay cheap
    cfg = build(data.target.config, opts, None, None)
    drafters, files = overfit_block_drafts(DsparkDrafter, cfg, data, STEPS, tmp_path_factory.mktemp("llama_cpp_dspark"))
    return dict(data=data, drafters=drafters, files=files)


def run_all(world, bins, name: str, verbose: bool = False) -> tuple[float, list[float], list[str]]:
    rate, by_pos, texts, log = run_block_drafts(bins, world["data"], world["files"][name], N_PREDICT, N_DRAFT, THREADS,
                                                "draft-dspark", verbose)
    if verbose:
        assert "markov" in log.lower() or "dspark" in log.lower(), log[-3000:]
    return rate, by_pos, texts


def test_llama_cpp_runs_dspark_draft_losslessly(world, bins):
    rate, _, texts = run_all(world, bins, "trained", verbose=True)
    assert_lossless(texts, world["data"], "trained")
    print(f"llama.cpp draft-dspark acceptance (overfit draft): {rate:.3f}")
    assert rate > 0.8, rate


def test_llama_cpp_dspark_acceptance_by_position_matches_our_runtime(world, bins):
    """A half-trained draft: llama.cpp's share of rounds accepting draft position i is within 0.1 of our
    runtime's (block mode, B drafts, greedy Markov chain in both)."""
    rate, lc_pos, _ = run_all(world, bins, "half", verbose=True)
    assert len(lc_pos) == N_DRAFT, lc_pos
    our_pos = our_block_acceptance_by_position(world["data"], world["drafters"]["half"], N_PREDICT, N_DRAFT)
    print(f"acceptance by position: llama.cpp {[round(x, 3) for x in lc_pos]} (all {rate:.3f}), "
          f"ours {[round(x, 3) for x in our_pos]}")
    assert 0.05 < our_pos[0] < 0.95, our_pos
    for a, b in zip(lc_pos, our_pos, strict=True):
        assert abs(a - b) <= 0.1, (lc_pos, our_pos)

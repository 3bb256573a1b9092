"""llama.cpp runs our GGUF DFlash drafts (`--spec-type draft-dflash`) with the SmolLM2 target (slow: builds
llama.cpp once, ~15 min on 2 cores; then a few minutes).

Flow: the SmolLM2 target alone (llama-completion, greedy) continues a few chat prompts; DFlash drafts are
trained in-process on those continuations (features from the same target, overfitting them is the point),
exported with `to=gguf` and run in `llama-speculative-simple`. Checked: llama.cpp loads the file as a dflash
draft with our layer ids (+1: it names layer inputs); the text equals the target alone; acceptance is near
complete for the overfit draft and near zero for an untrained one; and per draft position, the acceptance
llama.cpp reports for a half-trained draft is within 0.1 of our runtime's on the same prompts.
"""
from __future__ import annotations

import pytest
import torch

from drafthead.dflash import DflashDrafter, DflashOptions, build
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
BLOCK = 4  # llama.cpp runs [root, MASK x n_max]: n_max = BLOCK - 1 drafts the block the draft was trained on
N_DRAFT = BLOCK - 1
MASK = 16  # <empty_output>, as recipes/dflash_smollm2.yaml
STEPS = {"trained": 260, "half": 12}  # trained: overfit (its loss is below 0.01 from ~250 steps on)
THREADS = default_threads()


@pytest.fixture(scope="module")
def bins():
    return llama_cpp_bin(build=True)


@pytest.fixture(scope="module")
def world(tmp_path_factory, bins):
    torch.manual_seed(0)
    torch.set_num_threads(2)
    data = continuations(bins, PROMPTS, N_PREDICT, BLOCK + 2, THREADS)
    opts = DflashOptions(num_layers=1, block_size=BLOCK, mask_token_id=MASK, target_layer_ids=[1, 14, 27],
                         num_anchors=16)  # 16 blocks a sequence: dense 512 made the steps ~5x slower
    cfg = build(data.target.config, opts, None, None)
    drafters, files = overfit_block_drafts(DflashDrafter, cfg, data, STEPS, tmp_path_factory.mktemp("llama_cpp_dflash"),
                                           untrained=True)
    return dict(data=data, drafters=drafters, files=files)


def run_all(world, bins, name: str, verbose: bool = False) -> tuple[float, list[float], list[str]]:
    """(acceptance, acceptance by draft position averaged over prompts, texts) of one draft in llama.cpp."""
    rate, by_pos, texts, log = run_block_drafts(bins, world["data"], world["files"][name], N_PREDICT, N_DRAFT, THREADS,
                                                "draft-dflash", verbose)
    if verbose:
        assert "DFlash extract_layers = [2, 15, 28]" in log, log[-3000:]
        assert f"block_size={BLOCK}, mask_token_id={MASK}" in log, log[-3000:]
    return rate, by_pos, texts


def test_llama_cpp_runs_dflash_draft_losslessly(world, bins):
    rates = {}
    for name in ("trained", "random"):
        rates[name], _, texts = run_all(world, bins, name, verbose=name == "trained")
        assert_lossless(texts, world["data"], name)
    print(f"llama.cpp draft-dflash acceptance: {rates}")
    assert rates["trained"] > 0.8, rates
    assert rates["random"] < 0.1, rates


def test_llama_cpp_acceptance_by_position_matches_our_runtime(world, bins):
    """A half-trained draft (acceptance well inside (0, 1)): llama.cpp's share of rounds accepting draft
    position i is within 0.1 of our runtime's (block mode, 3 drafts verified, the same prompts)."""
    rate, lc_pos, _ = run_all(world, bins, "half", verbose=True)
    assert len(lc_pos) == N_DRAFT, lc_pos
    our_pos = our_block_acceptance_by_position(world["data"], world["drafters"]["half"], N_PREDICT, N_DRAFT)
    print(f"acceptance by position: llama.cpp {[round(x, 3) for x in lc_pos]} (all {rate:.3f}), "
          f"ours {[round(x, 3) for x in our_pos]}")
    assert 0.05 < our_pos[0] < 0.95, our_pos  # a draft that is neither always right nor always wrong (measured: 0.10)
    for a, b in zip(lc_pos, our_pos, strict=True):
        assert abs(a - b) <= 0.1, (lc_pos, our_pos)

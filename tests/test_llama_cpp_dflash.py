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

import time

import pytest
import torch

from drafthead.dflash import DflashDrafter, DflashOptions, build
from drafthead.export import export
from drafthead.export.llama_cpp import default_threads, llama_cpp_bin, run_speculative
from drafthead.registry import save_draft
from drafthead.runtime import SpecConfig, SpeculativeGenerator

from tests.llama_cpp_data import continuations
from drafthead.target import capture, lm_head_weight

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
STEPS = {"trained": 400, "half": 12}
THREADS = default_threads()
POLL = 0


@pytest.fixture(scope="module")
def bins():
    return llama_cpp_bin(build=True)


@pytest.fixture(scope="module")
def world(tmp_path_factory, bins):
    torch.manual_seed(0)
    torch.set_num_threads(2)
    t0 = time.perf_counter()
    root = tmp_path_factory.mktemp("llama_cpp_dflash")
    data = continuations(bins, PROMPTS, N_PREDICT, BLOCK + 2, THREADS)
    target, input_ids, loss_mask = data.target, data.input_ids, data.loss_mask
    opts = DflashOptions(num_layers=1, block_size=BLOCK, mask_token_id=MASK, target_layer_ids=[1, 14, 27],
                         num_anchors=16)  # 16 blocks a sequence: dense 512 made the 400 steps ~5x slower
    cfg = build(target.config, opts, None, None)
    aux, _ = capture(target.model, input_ids, data.attn, [i + 1 for i in cfg.target_layer_ids])  # [B, T, 3H]
    argmax, teacher = data.argmax, data.teacher

    def new_drafter(seed: int) -> DflashDrafter:
        torch.manual_seed(seed)
        d = DflashDrafter(cfg)
        with torch.no_grad():
            d.embed_tokens.weight.copy_(target.model.get_input_embeddings().weight)
            d.target_lm_head.weight.copy_(lm_head_weight(target.model))
            d.norm.weight.copy_(target.model.model.norm.weight)
        return d

    drafters = {"random": new_drafter(1).eval()}
    for name, steps in STEPS.items():
        d = new_drafter(1)
        opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=1e-3)  # 3e-3 stalls (loss ~3.7)
        for _ in range(steps):
            out = d(input_ids, aux, teacher, argmax, loss_mask)
            opt.zero_grad()
            out["loss"].backward()
            opt.step()
        drafters[name] = d.eval()
        print(f"[{time.perf_counter() - t0:.0f}s] {name}: {steps} steps, loss {out['loss'].item():.3f}, block accept "
              f"{1 + float(out['accept_len'] / out['blocks']):.2f}")
    files = {}
    for name, d in drafters.items():
        files[name] = export(save_draft(d, root / name, target.info()), "gguf", root / f"{name}.gguf")
    return dict(target=target, target_gguf=data.target_gguf, prompts=data.prompts, alone=data.alone,
                longer=data.longer, drafters=drafters, files=files)


def run_all(world, bins, name: str, verbose: bool = False) -> tuple[float, list[float], list[str]]:
    """(acceptance, acceptance by draft position averaged over prompts, texts) of one draft in llama.cpp."""
    drafted = accepted = 0
    by_pos, texts = [], []
    for i, prompt in enumerate(world["prompts"]):
        r = run_speculative(bins, world["target_gguf"], world["files"][name], prompt, N_PREDICT, N_DRAFT, THREADS,
                            verbose=verbose, poll=POLL, spec_type="draft-dflash")
        if i == 0 and verbose:
            assert "DFlash extract_layers = [2, 15, 28]" in r.log, r.log[-3000:]
            assert f"block_size={BLOCK}, mask_token_id={MASK}" in r.log, r.log[-3000:]
        assert r.n_drafted > 0
        texts.append(r.text.strip())
        drafted, accepted = drafted + r.n_drafted, accepted + r.n_accept
        if r.accept_by_pos is not None:
            by_pos.append(r.accept_by_pos + [0.0] * (N_DRAFT - len(r.accept_by_pos)))
    mean = [sum(c) / len(c) for c in zip(*by_pos)] if by_pos else []
    return accepted / drafted, mean, texts


def test_llama_cpp_runs_dflash_draft_losslessly(world, bins):
    rates = {}
    for name in ("trained", "random"):
        rates[name], _, texts = run_all(world, bins, name, verbose=name == "trained")
        for got, alone, longer in zip(texts, world["alone"], world["longer"], strict=True):
            # greedy speculative decoding does not change the text (llama.cpp may emit a few tokens more)
            assert got.startswith(alone.text.strip()) and longer.text.strip().startswith(got), (name, got)
    print(f"llama.cpp draft-dflash acceptance: {rates}")
    assert rates["trained"] > 0.8, rates
    assert rates["random"] < 0.1, rates


def test_llama_cpp_acceptance_by_position_matches_our_runtime(world, bins):
    """A half-trained draft (acceptance well inside (0, 1)): llama.cpp's share of rounds accepting draft
    position i is within 0.1 of our runtime's (block mode, 3 drafts verified, the same prompts)."""
    rate, lc_pos, _ = run_all(world, bins, "half", verbose=True)
    assert len(lc_pos) == N_DRAFT, lc_pos
    target, tok = world["target"], world["target"].tokenizer
    gen = SpeculativeGenerator(target, world["drafters"]["half"])
    prompts = [tok(p, add_special_tokens=False).input_ids for p in world["prompts"]]
    res = gen.generate(prompts, N_PREDICT, SpecConfig(mode="block", num_draft_tokens=N_DRAFT))
    ours = []
    for r in res:
        rounds = r.accept_lens
        ours.append([sum(a > i for a in rounds) / len(rounds) for i in range(N_DRAFT)])
    our_pos = [sum(c) / len(c) for c in zip(*ours)]
    print(f"acceptance by position: llama.cpp {[round(x, 3) for x in lc_pos]} (all {rate:.3f}), "
          f"ours {[round(x, 3) for x in our_pos]}")
    assert 0.05 < our_pos[0] < 0.95, our_pos  # a draft that is neither always right nor always wrong (measured: 0.10)
    for a, b in zip(lc_pos, our_pos, strict=True):
        assert abs(a - b) <= 0.1, (lc_pos, our_pos)

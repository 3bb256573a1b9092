"""llama.cpp runs our GGUF EAGLE3 drafts (slow: builds llama.cpp once, ~15 min on 2 cores; then ~3 min).

Flow: the SmolLM2 target alone (llama-completion, greedy) continues a few chat prompts; a draft is
trained in-process to reproduce those continuations (features captured from the same target with
`drafthead.target.capture`; overfitting these prompts is the point), exported to GGUF, and run with
`llama-speculative-simple --spec-type draft-eagle3`. Checked: llama.cpp loads it, the text equals the
target alone, its acceptance beats an untrained draft exported the same way and agrees with a PyTorch
replay of the same chain drafting; and llama.cpp's own convert_hf_to_gguf.py, run on our SGLang export,
writes the same file as our GGUF export (tensors bit for bit, eagle3.target_layers included).
"""
from __future__ import annotations

import time

import pytest
import torch

from drafthead.assets import asset_path
from drafthead.eagle3 import Eagle3Config, Eagle3Drafter
from drafthead.export import export
from drafthead.export import llama_cpp as lc
from drafthead.export.common import GGUF_FINGERPRINT_KEY
from drafthead.export.llama_cpp import default_threads, llama_cpp_bin, run_speculative
from drafthead.registry import save_draft
from drafthead.target import load_target
from drafthead.vocab import build_vocab_mapping
from tests.overfit import batch, overfit_eagle3

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France? Answer in two sentences.",
    "Write a short poem about the sea.",
    "Give three tips for staying healthy.",
]
N_PREDICT = 48
N_DRAFT = 3
DRAFT_VOCAB = 2048
TRAIN_STEPS = 40
TTT_STEPS = 3
THREADS = default_threads()
POLL = 0  # worker threads sleep instead of spinning: no collapse on shared cores


@pytest.fixture(scope="module")
def bins():
    return llama_cpp_bin(build=True)


@pytest.fixture(scope="module")
def world(tmp_path_factory, bins):
    """Target, prompts, llama.cpp's target-alone continuations, a trained and a random draft (as GGUF)."""
    torch.manual_seed(0)
    torch.set_num_threads(2)
    t0 = time.perf_counter()
    root = tmp_path_factory.mktemp("llama_cpp")
    target_gguf = asset_path("smollm2-135m-instruct")
    target = load_target("smollm2-135m-instruct", dtype="float32")  # replayed against llama.cpp's fp32 compute
    tok = target.tokenizer
    prompts = [lc.chat_prompt(tok, p) for p in PROMPTS]
    alone = [lc.run_target(bins, target_gguf, p, N_PREDICT, THREADS, poll=POLL) for p in prompts]
    # a few tokens more for training: llama-speculative-simple may overshoot -n by up to n_draft tokens
    longer = [lc.run_target(bins, target_gguf, p, N_PREDICT + N_DRAFT + 2, THREADS, poll=POLL) for p in prompts]
    print(f"\n[{time.perf_counter() - t0:.0f}s] target loaded, llama.cpp target-alone runs done")

    # training data: prompt + llama.cpp's own greedy continuation, loss on the continuation
    seqs = [tok(p + c.text, add_special_tokens=False).input_ids for p, c in zip(prompts, longer, strict=True)]
    data = batch(seqs, [len(tok(p, add_special_tokens=False).input_ids) for p in prompts])
    # a draft MLP twice the target's, as eagle3_smollm2 trains it: llama.cpp must read the draft's own n_ff
    fit = overfit_eagle3(target, data, DRAFT_VOCAB, TRAIN_STEPS, TTT_STEPS,
                         intermediate_size=2 * target.config.intermediate_size)
    trained, random_draft = fit.trained, fit.random
    print(f"[{time.perf_counter() - t0:.0f}s] trained {TRAIN_STEPS} steps")

    files = {}
    for name, d in (("trained", trained), ("random", random_draft)):
        ddir = save_draft(d, root / name, target.info())
        files[name] = export(ddir, "gguf", root / f"{name}.gguf")
    files["trained_q8"] = export(root / "trained", "gguf", root / "trained_q8.gguf", outtype="q8_0")
    print(f"[{time.perf_counter() - t0:.0f}s] exported")
    return dict(target=target, target_gguf=target_gguf, prompts=prompts, alone=alone, longer=longer, trained=trained,
                files=files, train_acc=fit.train_acc, input_ids=data.input_ids, attn=data.attn, aux=fit.aux)


def test_llama_cpp_runs_trained_draft(world, bins):
    """Same text as the target alone; acceptance of the trained draft well above the random one."""
    rates, texts = {}, {}
    for name in ("trained", "trained_q8", "random"):
        drafted = accepted = 0
        texts[name] = []
        for i, (prompt, alone, longer) in enumerate(zip(world["prompts"], world["alone"], world["longer"],
                                                        strict=True)):
            r = run_speculative(bins, world["target_gguf"], world["files"][name], prompt, N_PREDICT, N_DRAFT,
                                THREADS, verbose=i == 0, poll=POLL)
            if i == 0:  # llama.cpp loaded our file as an eagle3 draft with our layer ids
                assert "arch                  = eagle3" in r.log, r.log[-3000:]
                assert "EAGLE3 extract_layers = [2, 15, 27]" in r.log and "draft_vocab_size = 2048" in r.log
            assert r.n_drafted > 0
            # greedy speculative decoding must not change the text (llama.cpp may emit a few tokens more)
            got = r.text.strip()
            assert got.startswith(alone.text.strip()) and longer.text.strip().startswith(got), (name, got, alone.text)
            texts[name].append(got)
            drafted += r.n_drafted
            accepted += r.n_accept
        rates[name] = accepted / max(drafted, 1)
    print(f"llama.cpp acceptance {rates}, train acc per TTT step {world['train_acc']}")
    for a, b in zip(texts["trained"], texts["random"], strict=True):  # lossless whatever the draft proposes
        assert a.startswith(b) or b.startswith(a), (a, b)
    assert rates["trained"] > 0.6, rates
    assert rates["trained"] > rates["random"] + 0.3, rates
    assert rates["trained_q8"] > rates["random"] + 0.3, rates


def replay_acceptance(drafter: Eagle3Drafter, ids: torch.Tensor, aux: torch.Tensor, start: int, k: int
                      ) -> tuple[int, int]:
    """PyTorch replay of llama.cpp's greedy EAGLE3 chain over a fixed greedy sequence (target text known).

    A round that starts with the last committed token at index c feeds (x[t+1], f_t) for t < c, drafts k
    tokens greedily, accepts the matching prefix, then the target adds one token. Returns (drafted, accepted).
    """
    L = ids.numel()
    drafted = accepted = 0
    c = start
    with torch.no_grad():
        hidden = drafter.fuse(aux[None])  # [1, L, H]
        while c < L - 1:
            pos = torch.arange(c)[None]
            logits, out, kv = drafter.decode(ids[1: c + 1][None], hidden[:, :c], pos)
            tokens = []
            h = out[:, -1:]
            tok = drafter.draft_to_target(logits[0, -1].argmax())
            for j in range(k):
                tokens.append(int(tok))
                if j + 1 == k:
                    break
                logits, h, kv = drafter.decode(tok.view(1, 1), h, torch.tensor([[c + j]]), kv=kv)
                tok = drafter.draft_to_target(logits[0, -1].argmax())
            m = min(k, L - 1 - c)  # drafts that have a known token to be checked against
            n = 0
            while n < m and tokens[n] == int(ids[c + 1 + n]):
                n += 1
            drafted += m
            accepted += n
            c += n + 1
    return drafted, accepted


def test_llama_cpp_acceptance_matches_pytorch_replay(world, bins):
    """llama.cpp's acceptance agrees with a PyTorch replay of the same chain drafting, which feeds the
    draft (x[t+1], input of layers 2/15/27 at t) exactly as drafthead's trainer and runtime do."""
    tok = world["target"].tokenizer
    lc_d = lc_a = py_d = py_a = 0
    for b, prompt in enumerate(world["prompts"]):
        n_prompt = len(tok(prompt, add_special_tokens=False).input_ids)
        L = int(world["attn"][b].sum())
        # llama.cpp's first round drafts from the last prompt token (index n_prompt - 1)
        d, a = replay_acceptance(world["trained"], world["input_ids"][b, :L], world["aux"][b, :L], n_prompt - 1,
                                 N_DRAFT)
        py_d, py_a = py_d + d, py_a + a
        r = run_speculative(bins, world["target_gguf"], world["files"]["trained"], prompt, N_PREDICT, N_DRAFT,
                            THREADS, poll=POLL)
        lc_d, lc_a = lc_d + r.n_drafted, lc_a + r.n_accept
    rate, py_rate = lc_a / max(lc_d, 1), py_a / max(py_d, 1)
    print(f"acceptance: llama.cpp {rate:.3f} ({lc_a}/{lc_d}), pytorch replay {py_rate:.3f} ({py_a}/{py_d})")
    # the replay uses HF fp32 features; llama.cpp runs the Q4_1 target with 8-bit activations
    assert abs(rate - py_rate) < 0.1, (rate, py_rate)


def test_gguf_equals_llama_cpp_converter(world, tmp_path):
    """llama.cpp's own convert_hf_to_gguf.py, run on our `to=sglang` export, writes the same tensors
    (q/k permutation, orientation, absolute d2t) and the same eagle3 keys as our `to=gguf` export.
    Non-default aux ids check that the converter reads our top-level `eagle_aux_hidden_state_layer_ids`."""
    import os
    import subprocess
    import sys

    import gguf
    import numpy as np

    from drafthead.export.gguf_meta import read_gguf_metadata
    from drafthead.export.llama_cpp import llama_cpp_source

    target = world["target"]
    tdir = tmp_path / "target_hf"  # what --target-model-dir reads: config.json and the tokenizer
    target.config.save_pretrained(tdir)
    target.tokenizer.save_pretrained(tdir)
    torch.manual_seed(1)
    cfg = Eagle3Config.from_target(target.config, draft_vocab_size=1024, aux_layer_ids=[3, 12, 25],
                                   intermediate_size=2 * target.config.intermediate_size)
    d = Eagle3Drafter(cfg)
    d2t, t2d = build_vocab_mapping(torch.randint(0, 50, (cfg.vocab_size,)), cfg.draft_vocab_size)
    d.d2t.copy_(d2t)
    d.t2d.copy_(t2d)
    ddir = save_draft(d, tmp_path / "draft", target.info())
    ours = export(ddir, "gguf", tmp_path / "ours.gguf")
    sg = export(ddir, "sglang", tmp_path / "sglang", outtype="f32")  # the converter keeps f32 as our f32 GGUF
    stub = tmp_path / "stub"  # the converter imports sentencepiece before it looks for tokenizer.model
    stub.mkdir()
    (stub / "sentencepiece.py").write_text("class SentencePieceProcessor:\n    pass\n")
    src = llama_cpp_source()
    conv = tmp_path / "conv.gguf"
    res = subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(sg), "--target-model-dir",
                          str(tdir), "--outtype", "f32", "--outfile", str(conv)], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": f"{src / 'gguf-py'}:{stub}"}, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]

    a, b = read_gguf_metadata(ours), read_gguf_metadata(conv)
    assert a["eagle3.target_layers"] == b["eagle3.target_layers"] == (9, 5, [3, 12, 25])
    assert (a["eagle3.feed_forward_length"][2] == b["eagle3.feed_forward_length"][2]
            == 2 * target.config.intermediate_size)
    for k in sorted(set(a) | set(b)):
        if k.startswith("general.") or k in ("eagle3.norm_before_fc", "tokenizer.ggml.add_space_prefix",
                                              GGUF_FINGERPRINT_KEY):
            continue  # names/labels; norm_before_fc is false either way; add_space_prefix is false in both;
            # the target's fingerprint is ours alone (llama.cpp ignores the key)
        assert a.get(k) == b.get(k), k
    ta = {t.name: t for t in gguf.GGUFReader(str(ours)).tensors}
    tb = {t.name: t for t in gguf.GGUFReader(str(conv)).tensors}
    assert sorted(ta) == sorted(tb)
    for n, t in ta.items():
        assert t.tensor_type == tb[n].tensor_type and list(t.shape) == list(tb[n].shape), n
        assert np.array_equal(np.asarray(t.data), np.asarray(tb[n].data)), n

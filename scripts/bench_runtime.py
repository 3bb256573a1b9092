"""Decode speed of the runtime's target forward vs HF `generate`, and the verify-cost curve.

    python scripts/bench_runtime.py                      # SmolLM2-135M (built-in asset), fp32, CPU
    python scripts/bench_runtime.py --threads 1 --new 64 --reps 3
    python scripts/bench_runtime.py --dtype bfloat16             # bf16 target (AMX on recent Xeons)

Prints (1) greedy tokens/s of HF `model.generate`, of our "ar" loop and of prompt lookup ("ngram", no
trained drafter) on the same prompt and number of new tokens, in interleaved repetitions so that load on a
shared machine hits all alike, and (2) the time of one target forward over T = 1..64 new tokens on top of
a cached prefix: the cost of verifying T draft nodes, which a speculative round pays instead of T
autoregressive steps. On a shared CPU use --threads 1 (idle OpenMP threads spin against other jobs).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from drafthead import hardware
from drafthead.runtime import SpecConfig, SpeculativeGenerator, TargetModel
from drafthead.target import load_target

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def bench_generate(target, gen: SpeculativeGenerator, prompt: list[int], new: int, reps: int) -> dict:
    ids = torch.tensor([prompt])
    hf, ours, ngram = [], [], []
    for _ in range(reps):
        t = time.perf_counter()
        with torch.no_grad():
            target.model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        hf.append(new / (time.perf_counter() - t))
        t = time.perf_counter()
        (r,) = gen.generate([prompt], new, SpecConfig(mode="ar"))
        ours.append(len(r.tokens) / (time.perf_counter() - t))
        t = time.perf_counter()
        (n,) = gen.generate([prompt], new, SpecConfig(mode="ngram", num_speculative_tokens=4))
        ngram.append(len(n.tokens) / (time.perf_counter() - t))
    return {"hf_generate_tok_s": statistics.median(hf), "ar_loop_tok_s": statistics.median(ours),
            "ngram_tok_s": statistics.median(ngram), "ngram_tau": len(n.tokens) / max(n.num_rounds, 1),
            "hf_all": hf, "ar_all": ours, "ar_tokens": len(r.tokens)}


@torch.inference_mode()
def bench_verify(tm: TargetModel, prefix: int, sizes: list[int], reps: int) -> dict:
    cache = tm.new_cache(1, prefix + max(sizes) + 1)
    lens = torch.zeros(1, dtype=torch.long)
    tm.forward(cache, torch.randint(0, tm.vocab_size, (1, prefix)), lens, prefill=True)  # fill the prefix once
    lens += prefix
    out = {}
    for T in sizes:
        ids = torch.randint(0, tm.vocab_size, (1, T))
        times = []
        for _ in range(reps + 1):  # first call warms up
            t = time.perf_counter()
            tm.forward(cache, ids, lens, capture=True)  # writes at prefix.., lens unchanged: a rejected round
            times.append(time.perf_counter() - t)
        out[T] = statistics.median(times[1:]) * 1000
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prefix", type=int, default=256, help="cached tokens before the verify block")
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                    help="target dtype (auto: bf16 where native, fp32 elsewhere)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(args.target, dtype=args.dtype)
    tok = target.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                     tokenize=True)
    prompt = list(prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt)
    gen = SpeculativeGenerator(target)
    res = {"threads": torch.get_num_threads(), "prompt_tokens": len(prompt),
           "dtype": str(next(target.model.parameters()).dtype), **hardware.describe()}
    res.update(bench_generate(target, gen, prompt, args.new, args.reps))
    tm = TargetModel(target.model, aux_layer_ids=[2, target.num_layers // 2, target.num_layers - 3])
    res["verify_ms"] = bench_verify(tm, args.prefix, [1, 2, 4, 8, 16, 32, 64], args.reps)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

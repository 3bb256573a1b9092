"""The runtime settings a trained draft is served with: the draft length whose expected speedup is highest, from the
held-out eval's acceptance and the runtime's cost of a round on this machine. Recorded in final/config.json as
"serving"; `drafthead eval` and `bench` use it unless told otherwise (docs/eval.md).

Expected speedup at k drafts a round = tau(k) / cost(k): tau(k) = 1 + sum_{i<k} prod_{j<=i} acc_j (the held-out
simulated acceptance, the trainer's `eval/sim_accept_len` cut at k), cost(k) = the time of a round drafting k and
verifying k + 1 over the time of one autoregressive step, both measured with our runtime on a held-out prompt (the
acceptance of that decode does not enter: a round's cost does not depend on what it accepts). Only the depths the
held-out eval scored (k <= the trained depth) are candidates. Tree shapes are not chosen: a tree's acceptance is not
simulated from acc_k, so eval's tree defaults apply.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch

NEW_TOKENS = 24  # tokens a timing decode generates: enough rounds for a median, seconds on a CPU
REPEATS = 3  # timings per setting (the median is kept)


def simulated_tau(acc: list[float], k: int) -> float:
    """1 + sum_{i<k} prod_{j<=i} acc_j: the accepted length a chain of k drafts reaches on the held-out data."""
    tau, prod = 1.0, 1.0
    for a in acc[:k]:
        prod *= a
        tau += prod
    return tau


def held_out_acc(last_eval: dict[str, float]) -> list[float]:
    acc, i = [], 0
    while f"eval/acc_{i}" in last_eval:
        acc.append(float(last_eval[f"eval/acc_{i}"]))
        i += 1
    return acc


def round_costs(target: Any, final: Path, prompt: list[int], ks: list[int]) -> tuple[str, dict[int, float], str]:
    """(mode, {k: a round's time / one AR step's}, where) of the saved draft at `final` on `target`, with our
    runtime; `where` is the CPU class or the GPU's name."""
    from drafthead import hardware
    from drafthead.registry import load_draft
    from drafthead.runtime import SpecConfig, SpeculativeGenerator
    from drafthead.target import lm_head_weight

    weight = target.model.get_input_embeddings().weight
    drafter = load_draft(final, embed_weight=weight, device=weight.device, head_weight=lm_head_weight(target.model),
                         target=target.model).to(weight.dtype)
    mode = next(iter(drafter.draft_modes))
    gen = SpeculativeGenerator(target, drafter, device=weight.device)

    def timed(spec: Any, new_tokens: int) -> tuple[float, int]:
        """Median seconds of a decode and its verify rounds after the prefill."""
        times, rounds = [], 0
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            (r,) = gen.generate([prompt], new_tokens, spec)
            times.append(time.perf_counter() - t0)
            rounds = r.num_rounds
        return statistics.median(times), rounds

    def per_round(spec: Any) -> float:  # the prompt's forward (a decode of one token) taken out
        t, rounds = timed(spec, NEW_TOKENS)
        return max(t - prefill, 1e-9) / max(rounds, 1)

    timed(SpecConfig(mode="ar"), NEW_TOKENS)  # warm-up: packed weights, kernels
    prefill = timed(SpecConfig(mode="ar"), 1)[0]
    ar = per_round(SpecConfig(mode="ar"))
    where = hardware.cpu_class() if weight.device.type == "cpu" else torch.cuda.get_device_name(weight.device)
    return mode, {k: per_round(SpecConfig(mode=mode, num_speculative_tokens=k)) / ar for k in ks}, where


def choose(last_eval: dict[str, float], target: Any, final: Path, prompt: list[int]) -> dict:
    """The "serving" record: the chosen draft length, and the held-out tau and measured cost of each candidate."""
    acc = held_out_acc(last_eval)
    if not acc:
        return {"why": "no held-out eval ran (data.heldout_fraction = 0): eval's defaults apply"}
    ks = list(range(1, len(acc) + 1))
    mode, cost, where = round_costs(target, final, prompt, ks)
    speedup = {k: simulated_tau(acc, k) / cost[k] for k in ks}
    best = max(ks, key=lambda k: (speedup[k], -k))
    return {"mode": mode, "num_speculative_tokens": best, "expected_speedup": round(speedup[best], 3),
            "by_length": {str(k): {"tau": round(simulated_tau(acc, k), 3), "cost": round(cost[k], 3)} for k in ks},
            "measured_on": where,
            "why": "held-out tau(k) / measured round cost(k), k up to the trained depth (trainer/serving.py)"}

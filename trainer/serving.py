"""The runtime settings a trained draft is served with: the draft length whose expected speedup is highest, from the
held-out eval's acceptance and the runtime's cost of a round on this machine. Recorded in final/config.json as
"serving"; `drafthead eval` and `bench` use it unless told otherwise (docs/eval.md).

Expected speedup at k drafts a round = tau(k) / cost(k): tau(k) = 1 + sum_{i<k} prod_{j<=i} acc_j (the held-out
simulated acceptance, the trainer's `eval/sim_accept_len` cut at k), cost(k) = the time of a round drafting k and
verifying k + 1 over the time of one autoregressive step, both measured with our runtime on a held-out prompt (the
acceptance of that decode does not enter: a round's cost does not depend on what it accepts). Only the depths the
held-out eval scored (k <= the trained depth) are candidates.

A family that drafts trees too (EAGLE3, MTP) then has its tree shapes tried against that chain: a tree's acceptance
is not simulated from acc_k, so each shape (TREE_SHAPES, at the trained depth) and the chosen chain decode the same
held-out prompts, taking turns with our AR loop, and the tree is recorded only when its measured tokens/s beats the
chain's.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch

from drafthead.trainer.step import simulated_tau

NEW_TOKENS = 24  # tokens a timing decode generates: enough rounds for a median, seconds on a CPU
REPEATS = 3  # timings per setting (the median is kept)
# the tree shapes a tree-drafting family tries against its chain: name -> (topk, tree_nodes)
TREE_SHAPES = {f"tree {topk}x{nodes}": (topk, nodes) for topk, nodes in ((2, 4), (4, 8))}
TREE_TOKENS = 32  # tokens each held-out prompt decodes in the tree trial


def held_out_prompts(batches: list[dict[str, torch.Tensor]], n: int = 4, most: int = 256) -> list[list[int]]:
    """Up to n held-out prompts: each held-out conversation up to its first trained (assistant) token, at most
    `most` tokens: what a user's request looks like to the draft."""
    out: list[list[int]] = []
    for batch in batches:
        for ids, mask in zip(batch["input_ids"], batch["loss_mask"]):
            on = mask.nonzero()
            end = int(on[0]) if len(on) else int(mask.numel())
            if end > 0:
                out.append(ids[: min(end, most)].tolist())
            if len(out) == n:
                return out
    return out


def held_out_acc(last_eval: dict[str, float]) -> list[float]:
    acc, i = [], 0
    while f"eval/acc_{i}" in last_eval:
        acc.append(float(last_eval[f"eval/acc_{i}"]))
        i += 1
    return acc


def runtime_for(target: Any, final: Path) -> tuple[Any, Any, str]:
    """(the saved draft at `final` loaded on `target`, our runtime over both, where it runs: the CPU class or the
    GPU's name)."""
    from drafthead import hardware
    from drafthead.registry import load_draft
    from drafthead.runtime import SpeculativeGenerator
    from drafthead.target import lm_head_weight

    weight = target.model.get_input_embeddings().weight
    drafter = load_draft(final, embed_weight=weight, device=weight.device, head_weight=lm_head_weight(target.model),
                         target=target.model).to(weight.dtype)
    where = hardware.cpu_class() if weight.device.type == "cpu" else torch.cuda.get_device_name(weight.device)
    return drafter, SpeculativeGenerator(target, drafter, device=weight.device), where


def round_costs(gen: Any, mode: str, prompt: list[int], ks: list[int]) -> dict[int, float]:
    """{k: a round's time at k drafts / one AR step's} with our runtime `gen`, on `prompt`."""
    from drafthead.runtime import SpecConfig

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
    return {k: per_round(SpecConfig(mode=mode, num_speculative_tokens=k)) / ar for k in ks}


def tree_trial(gen: Any, prompts: list[list[int]], k: int, depth: int) -> dict[str, float]:
    """Tokens/s over our AR loop's of the chain at k and of each tree shape at `depth`, on the same prompts, every
    setting decoding each prompt in turn (so a drift of the machine falls on all of them alike)."""
    from drafthead.runtime import SpecConfig

    specs = {"ar": SpecConfig(mode="ar"), "chain": SpecConfig(mode="chain", num_speculative_tokens=k)}
    specs.update({name: SpecConfig(mode="tree", num_speculative_tokens=depth, topk=topk, tree_nodes=nodes)
                  for name, (topk, nodes) in TREE_SHAPES.items()})
    tokens = dict.fromkeys(specs, 0)
    seconds = dict.fromkeys(specs, 0.0)
    for prompt in prompts:
        for name, spec in specs.items():
            t0 = time.perf_counter()
            (r,) = gen.generate([prompt], TREE_TOKENS, spec)
            seconds[name] += time.perf_counter() - t0
            tokens[name] += len(r.tokens)
    rate = {n: tokens[n] / max(seconds[n], 1e-9) for n in specs}
    return {n: rate[n] / rate["ar"] for n in specs if n != "ar"}


def choose(last_eval: dict[str, float], target: Any, final: Path, prompts: list[list[int]]) -> dict:
    """The "serving" record: the chosen draft length (and tree shape, where a tree measured faster), with the
    held-out tau and measured cost of each length and the tree trial's speedups."""
    acc = held_out_acc(last_eval)
    if not acc:
        return {"why": "no held-out eval ran (data.heldout_fraction = 0): eval's defaults apply"}
    ks = list(range(1, len(acc) + 1))
    drafter, gen, where = runtime_for(target, final)
    mode = next(iter(drafter.draft_modes))
    cost = round_costs(gen, mode, prompts[0], ks)
    speedup = {k: simulated_tau(acc, k) / cost[k] for k in ks}
    best = max(ks, key=lambda k: (speedup[k], -k))
    rec: dict[str, Any] = {
        "mode": mode, "num_speculative_tokens": best, "chain_length": best, "expected_speedup": round(speedup[best], 3),
        "by_length": {str(k): {"tau": round(simulated_tau(acc, k), 3), "cost": round(cost[k], 3)} for k in ks},
        "measured_on": where,
        "why": "held-out tau(k) / measured round cost(k), k up to the trained depth (trainer/serving.py)"}
    if mode == "chain" and "tree" in drafter.draft_modes:
        trial = tree_trial(gen, prompts, best, len(acc))
        rec["tree_trial"] = {n: round(v, 3) for n, v in trial.items()}
        tree = max(TREE_SHAPES, key=lambda n: trial[n])
        if trial[tree] > trial["chain"]:
            topk, nodes = TREE_SHAPES[tree]
            rec.update(mode="tree", num_speculative_tokens=len(acc), topk=topk, tree_nodes=nodes,
                       why=rec["why"] + "; a tree measured faster than that chain on held-out prompts")
    return rec

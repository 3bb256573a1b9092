"""A wall-clock budget for a run: measure this machine for a few seconds, then choose how many
conversations to capture and how many passes to make over them so that the whole run ends in time.

Why: machines of one kind differ several-fold in speed (an AVX2-only CPU captures at ~190 tokens/s in
fp32, an AVX512-BF16 one at ~800 in bf16), so a recipe that fixes data and passes is an hour on one and
three on another. The plan follows what the experiment log measured (docs/experiment_log.md): a step on
the 2nd or 3rd pass over captured data teaches as much as a step on fresh data, and the 4th pass about half
as much (the held-out curve flattens there), while capturing a token costs ~2.5x training on it. So the
planner weighs passes 1-3 fully and the 4th by half, and among plans within 2% of the best it takes the one
with the most fresh data.

This module is the pure planner: rates in, plan out, no model and no torch, unit-tested on made-up rates.
The probe that measures the rates and ties a plan to a run directory is trainer/probe.py.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

PLAN_FILE = "plan.json"
SAFETY = 0.95  # plan to this share of the budget: rates drift a few % over a run (batch shapes, heap)
PASS_WEIGHT = (1.0, 1.0, 1.0, 0.5)  # value of a step on pass 1..4 relative to a step on fresh data


@dataclass
class Rates:
    """What the probe measured on this machine (tokens are real tokens, padding excluded)."""
    capture_tok_s: float  # target forward with the layer hooks and the stored argmax
    train_tok_s: float  # draft step on captured features: teacher head, forward, backward, optimizer
    eval_tok_s: float  # draft forward on held-out features, no grad
    tokens_per_sample: float  # mean tokens of a usable training conversation (after max_length)
    usable_frac: float  # usable samples per conversation read
    prep_s_per_conv: float  # reading + tokenizing one conversation
    save_s: float  # one checkpoint (weights + optimizer state)
    available: int | None = None  # training conversations the source holds (after the held-out ones)
    cpu_class: str = ""
    dtype: str = ""
    # target-written answers (data.regenerate): new tokens/s of the engine that writes them (None: not measured,
    # regeneration off), new tokens an answer is expected to take, and the share of conversations answered
    # (first prompts longer than data.regenerate.max_prompt_tokens keep their answers)
    regen_tok_s: float | None = None
    answer_tokens: float = 0.0
    answerable_frac: float = 1.0


@dataclass
class Plan:
    conversations: int  # data.max_samples
    passes: float  # train.epochs
    steps: int  # optimizer steps
    tokens: int  # captured training tokens (estimate)
    est_s: dict[str, float]  # setup, prepare, capture, train, eval, save, total
    budget_s: float
    chosen: list[str]  # the keys the plan chose (the others were given)
    rates: Rates
    fits: bool = True
    refit: dict | None = None  # after capture: passes re-fitted to the measured time and the real data
    step_refits: list[dict] = field(default_factory=list)  # in the loop: steps re-fitted to the loop's own rate


    def line(self) -> str:
        r = self.rates
        chose = f"chose {', '.join(self.chosen)}" if self.chosen else "all given"
        regen = (f", target answers {self.est_s.get('regenerate', 0) / 60:.1f} min at {r.regen_tok_s:.0f} tok/s"
                 if r.regen_tok_s else "")
        return (f"plan: {self.conversations} conversations ({self.tokens / 1000:.0f}k tokens), "
                f"{self.passes:g} passes, {self.steps} steps, est. {self.est_s['total'] / 60:.1f} min of "
                f"{self.budget_s / 60:g} on this machine ({r.cpu_class}, {r.dtype}): capture "
                f"{r.capture_tok_s:.0f} tok/s, train {r.train_tok_s:.0f} tok/s{regen} [{chose}]")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        return cls(**{**d, "rates": Rates(**d["rates"])})


@dataclass
class Shape:
    """The recipe keys the time model needs (from RunConfig; plain numbers so tests can build one)."""
    batch_size: int
    grad_accum: int
    eval_every: int
    save_every: int
    eval_samples: int  # held-out conversations evaluated
    max_passes: float = 4.0
    conversations: int | None = None  # data.max_samples if given
    passes: float | None = None  # train.epochs if given
    max_steps: int | None = None  # train.max_steps if given
    chosen: list[str] = field(default_factory=list)
    regen_fraction: float = 0.0  # share of training conversations the target answers (0: regeneration off)
    regen_heldout: int = 0  # held-out conversations the target answers too


def _count_every(steps: int, every: int) -> int:
    """Evaluations / checkpoints a run of `steps` makes: every `every` steps and at the end."""
    if not every:
        return 1
    return steps // every + (1 if steps % every else 0)


def steps_for(conversations: int, passes: float, r: Rates, s: Shape) -> int:
    samples = conversations * r.usable_frac
    return max(1, math.ceil(passes * samples / s.batch_size / s.grad_accum))


def _training_s(steps: int, train_tokens: float, r: Rates, s: Shape) -> dict[str, float]:
    """Seconds of the loop: `steps` steps over `train_tokens` tokens, its evaluations and checkpoints."""
    heldout_tokens = s.eval_samples * r.tokens_per_sample
    return {"train": train_tokens / r.train_tok_s,
            "eval": _count_every(steps, s.eval_every) * heldout_tokens / r.eval_tok_s,
            "save": (_count_every(steps, s.save_every) + 1) * r.save_s}  # + the final draft


def estimate(conversations: int, passes: float, r: Rates, s: Shape, setup_s: float,
             steps: int | None = None) -> dict[str, float]:
    """Seconds per phase of a run with this data and passes (or fixed `steps`), after `setup_s` spent."""
    steps = steps if steps is not None else steps_for(conversations, passes, r, s)
    tokens = conversations * r.usable_frac * r.tokens_per_sample
    step_tokens = s.batch_size * s.grad_accum * r.tokens_per_sample
    heldout_tokens = s.eval_samples * r.tokens_per_sample
    parts = {
        "setup": setup_s,
        "prepare": conversations * r.prep_s_per_conv,
        "regenerate": regen_s(conversations, r, s),
        "capture": tokens / r.capture_tok_s + heldout_tokens / r.capture_tok_s,  # + held-out features, once
        **_training_s(steps, steps * step_tokens, r, s),
    }
    parts["total"] = sum(parts.values())
    return parts


def regen_s(conversations: int, r: Rates, s: Shape) -> float:
    """Seconds the target spends writing answers: the answerable share of the chosen training conversations
    (and the held-out ones, when those are answered too) times the new tokens an answer takes."""
    if not r.regen_tok_s or not (s.regen_fraction or s.regen_heldout):
        return 0.0
    answered = (conversations * s.regen_fraction + s.regen_heldout) * r.answerable_frac
    return answered * r.answer_tokens / r.regen_tok_s


def _largest(fits: Callable[[int], bool]) -> int:
    """Largest n >= 0 with fits(n), for a `fits` that turns false once and stays false (0 if none fits)."""
    lo, hi = 0, 1
    while fits(hi) and hi < 10**8:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def pass_value(passes: float) -> float:
    """Fresh-data-equivalent passes (PASS_WEIGHT per pass, nothing past the 4th)."""
    v, p = 0.0, passes
    for w in PASS_WEIGHT:
        v += w * min(max(p, 0.0), 1.0)
        p -= 1.0
    return v


class BudgetError(ValueError):
    pass


def make_plan(budget_s: float, setup_s: float, r: Rates, s: Shape) -> Plan:
    """The plan for `budget_s` seconds, `setup_s` of which are spent already. Given keys win; the plan
    fills the others. Raises BudgetError naming the minimum when not even one step and one eval fit."""
    avail = budget_s * SAFETY
    cap = r.available if r.available is not None else 10**8

    def fits(passes: float) -> Callable[[int], bool]:
        return lambda n: n <= cap and estimate(n, passes, r, s, setup_s)["total"] <= avail

    minimum = estimate(max(1, math.ceil(s.batch_size * s.grad_accum / max(r.usable_frac, 1e-6))), 1.0, r, s,
                       setup_s, steps=1)["total"]
    if minimum > budget_s:
        raise BudgetError(
            f"budget.minutes={budget_s / 60:g} is too small on this machine ({r.cpu_class}, {r.dtype}): setup, "
            f"one step, the held-out features and one evaluation alone take ~{minimum / 60:.1f} min; set "
            f"budget.minutes >= {math.ceil(minimum / 60 / SAFETY)} or budget.minutes=null")
    chosen = []
    if s.max_steps is not None:  # steps fixed: data up to one pass of them
        conv = s.conversations
        if conv is None:
            one_pass = math.ceil(s.max_steps * s.batch_size * s.grad_accum / max(r.usable_frac, 1e-6))
            fit = _largest(lambda n: n <= cap and estimate(n, 1.0, r, s, setup_s, steps=s.max_steps)["total"] <= avail)
            conv, chosen = max(1, min(one_pass, fit)), ["data.max_samples"]
        steps = s.max_steps
        passes = steps * s.batch_size * s.grad_accum / max(conv * r.usable_frac, 1e-6)
        est = estimate(conv, passes, r, s, setup_s, steps=steps)
    elif s.conversations is not None and s.passes is not None:
        conv, passes = s.conversations, s.passes
        est = estimate(conv, passes, r, s, setup_s)
    elif s.conversations is not None:  # data given: as many passes as fit, up to max_passes
        conv, chosen = s.conversations, ["train.epochs"]
        passes = _most_passes(conv, r, s, setup_s, avail)
        est = estimate(conv, passes, r, s, setup_s)
    elif s.passes is not None:  # passes given: as much data as fits
        passes, chosen = s.passes, ["data.max_samples"]
        conv = max(1, _largest(fits(passes)))
        est = estimate(conv, passes, r, s, setup_s)
    else:  # both: the most fresh-data-equivalent passes, ties to more fresh data
        chosen = ["data.max_samples", "train.epochs"]
        cands = []
        for p in range(1, int(s.max_passes) + 1):
            c = _largest(fits(float(p)))
            if c >= 1:
                cands.append((pass_value(p) * c, p, c))
        if not cands:
            conv, passes = 1, 1.0
        else:
            best = max(v for v, _, _ in cands)
            _, p, conv = min((c for c in cands if c[0] >= 0.98 * best), key=lambda c: c[1])
            passes = float(p)
        est = estimate(conv, passes, r, s, setup_s)
    steps = s.max_steps if s.max_steps is not None else steps_for(conv, passes, r, s)
    return Plan(conversations=int(conv), passes=round(float(passes), 3), steps=int(steps),
                tokens=int(conv * r.usable_frac * r.tokens_per_sample), est_s={k: round(v, 1) for k, v in est.items()},
                budget_s=budget_s, chosen=chosen, rates=r, fits=est["total"] <= budget_s * 1.1)


def _most_tenths(fits: Callable[[float], bool], most: float) -> float:
    """Most passes, in tenths from 0.1 up to `most`, for which `fits` holds (0.1 when none does)."""
    best, p = 0.1, 0.1
    while p <= most + 1e-9:
        if fits(p):
            best = p
        p = round(p + 0.1, 1)
    return best


def _most_passes(conv: int, r: Rates, s: Shape, setup_s: float, avail_s: float) -> float:
    return _most_tenths(lambda p: estimate(conv, p, r, s, setup_s)["total"] <= avail_s, s.max_passes)


def refit_passes(plan: Plan, s: Shape, elapsed_s: float, samples: int, tokens: int) -> tuple[float, dict]:
    """Passes that fit what is left of the budget, now that the data (`samples`, `tokens`) and the time
    spent (`elapsed_s`, capture included) are known: tenths of a pass, at least 0.1, at most max_passes."""
    r, avail = plan.rates, plan.budget_s * SAFETY
    per_step = s.batch_size * s.grad_accum

    def rest(p: float) -> float:
        return sum(_training_s(max(1, math.ceil(p * samples / per_step)), p * tokens, r, s).values())

    best = _most_tenths(lambda p: elapsed_s + rest(p) <= avail, s.max_passes)
    steps = max(1, math.ceil(best * samples / per_step))
    return best, {"passes_planned": plan.passes, "passes": best, "steps": steps, "elapsed_s": round(elapsed_s, 1),
                  "samples": samples, "tokens": tokens, "est_total_s": round(elapsed_s + rest(best), 1)}


STEP_REFIT_AT = (0.05, 0.5)  # shares of the planned steps after which the loop re-fits its step count


def refit_steps(step: int, elapsed_s: float, budget_s: float, s_per_step: float, eval_s: float, save_s: float,
                eval_every: int, save_every: int, most: int) -> int:
    """Total steps that end by `budget_s` * SAFETY, `step` done after `elapsed_s`: each further step costs
    its measured seconds plus its share of the evaluations and checkpoints, and the final draft one save.
    Between step + 1 and `most` (the passes cap)."""
    per = s_per_step + (eval_s / eval_every if eval_every else 0.0) + (save_s / save_every if save_every else 0.0)
    left = budget_s * SAFETY - elapsed_s - eval_s - 2 * save_s  # the last eval, checkpoint and final draft
    return int(min(max(step + 1, step + math.floor(max(left, 0.0) / max(per, 1e-9))), max(most, step + 1)))


def load_plan(run_dir: Path) -> Plan | None:
    p = Path(run_dir) / PLAN_FILE
    return Plan.from_dict(json.loads(p.read_text())) if p.is_file() else None


def plan_matches(plan: Plan, budget_s: float, s: Shape) -> bool:
    """A stored plan is reused when the budget and the given keys are what they were."""
    given = {"data.max_samples": s.conversations, "train.epochs": s.passes, "train.max_steps": s.max_steps}
    kept = all(given[k] is None for k in plan.chosen)
    return plan.budget_s == budget_s and kept and (
        s.conversations in (None, plan.conversations)) and (s.passes in (None, plan.passes))


def shape_of(cfg: Any) -> Shape:
    eval_samples = min(cfg.train.eval_samples or cfg.data.num_holdout, cfg.data.num_holdout)
    rg = cfg.data.regenerate
    return Shape(batch_size=cfg.train.batch_size, grad_accum=cfg.train.grad_accum, eval_every=cfg.train.eval_every,
                 save_every=cfg.train.save_every, eval_samples=eval_samples, max_passes=cfg.budget.max_passes,
                 conversations=cfg.data.max_samples, passes=cfg.train.epochs, max_steps=cfg.train.max_steps,
                 regen_fraction=rg.fraction if rg.enabled else 0.0,
                 regen_heldout=cfg.data.num_holdout if rg.enabled and rg.heldout else 0)


def budget_record(plan: Plan | None, phases: dict[str, float], steps: int, tokens: int) -> dict:
    """Planned vs actual, for metrics.jsonl and final/config.json."""
    out = {"actual_s": {k: round(v, 1) for k, v in phases.items()}, "actual_steps": steps,
           "actual_train_tokens": tokens}
    if plan is not None:
        out["plan"] = plan.to_dict()
        out["actual_over_budget"] = round(phases.get("total", 0.0) / plan.budget_s, 3)
    return out

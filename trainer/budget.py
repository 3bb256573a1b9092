"""A wall-clock budget for a run: measure this machine for a few seconds, then choose how many
conversations to capture and how many passes to make over them so that the whole run ends in time.

Why: machines of one kind differ several-fold in speed (an AVX2-only CPU captures at ~190 tokens/s in
fp32, an AVX512-BF16 one at ~800 in bf16), so a recipe that fixes data and passes is an hour on one and
three on another. The plan follows what the experiment log measured (docs/experiment_log.md): a step on
the 2nd or 3rd pass over captured data teaches as much as a step on fresh data, and the 4th pass about half
as much (the held-out curve flattens there), while capturing a token costs ~2.5x training on it. So the
planner weighs passes 1-3 fully and the 4th by half, and among plans within 2% of the best it takes the one
with the most fresh data.

`make_plan` is pure (rates in, plan out) and tested; `measure_rates` is the probe; `plan_run` ties them
to a run directory so a resumed run reuses its first plan (a re-measured plan would ask for another capture).
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

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
        return (f"plan: {self.conversations} conversations ({self.tokens / 1000:.0f}k tokens), "
                f"{self.passes:g} passes, {self.steps} steps, est. {self.est_s['total'] / 60:.1f} min of "
                f"{self.budget_s / 60:g} on this machine ({r.cpu_class}, {r.dtype}): capture "
                f"{r.capture_tok_s:.0f} tok/s, train {r.train_tok_s:.0f} tok/s [{chose}]")

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
        "capture": tokens / r.capture_tok_s + heldout_tokens / r.capture_tok_s,  # + held-out features, once
        **_training_s(steps, steps * step_tokens, r, s),
    }
    parts["total"] = sum(parts.values())
    return parts


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


# ------------------------------------------------------------------------------------------------
# the probe: a few seconds of real work on this machine


def measure_rates(samples: list[dict], batch_size: int, batches: int, features: Callable[[list[dict]], dict],
                  step: Callable[[dict], Any], eval_forward: Callable[[dict], Any], save: Callable[[], Any]
                  ) -> dict[str, float]:
    """Time capture, a training step and an eval forward on `batches` batches of real samples, and one
    checkpoint save. Batches are length-grouped like the trainer's and spread over the length range, since
    short and long conversations cost differently per token. Training gets two warm-up steps: the first
    two allocate the optimizer state and the autocast caches (one warm-up under-read the rate by ~30%)."""
    pool = sorted(samples, key=lambda s: len(s["input_ids"]))
    groups = [pool[i: i + batch_size] for i in range(0, len(pool), batch_size)]
    n = batches + 2
    if len(groups) < n:
        raise BudgetError(f"the budget probe needs at least {n * batch_size} training samples, got {len(samples)}")
    pick = [groups[round(i * (len(groups) - 1) / (n - 1))] for i in range(n)]
    ntok = [sum(len(s["input_ids"]) for s in g) for g in pick]

    def rate(fn: Callable[[Any], Any], items: list, warm: int) -> tuple[float, list]:
        out = [fn(x) for x in items[:warm]]
        t = time.perf_counter()
        out += [fn(x) for x in items[warm:]]
        return sum(ntok[warm:]) / (time.perf_counter() - t), out

    capture, feats = rate(features, pick, 1)
    train, _ = rate(step, feats, 2)
    ev, _ = rate(eval_forward, feats, 1)
    t = time.perf_counter()
    save()
    return {"capture_tok_s": capture, "train_tok_s": train, "eval_tok_s": ev, "save_s": time.perf_counter() - t}


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


def refit_after_capture(plan: Plan | None, cfg: Any, d: Any, run_dir: Path, elapsed_s: float, samples: int,
                        tokens: int, log: Callable = print) -> Plan | None:
    """Re-fit the passes the plan chose (once; a resumed run keeps the result): the probe's estimates of the
    data size and the capture rate are off by some percent, and the passes are where that is absorbed."""
    from drafthead.io import atomic_write_json
    from trainer import engine as L

    if plan is None or plan.refit is not None or "train.epochs" not in plan.chosen:
        return plan
    if d.main:
        passes, info = refit_passes(plan, shape_of(cfg), elapsed_s, samples, tokens)
        plan.passes, plan.steps, plan.refit = passes, info["steps"], info
        atomic_write_json(run_dir / PLAN_FILE, plan.to_dict())
    L.barrier(d)
    plan = load_plan(run_dir)
    assert plan is not None and plan.refit is not None
    cfg.train.epochs = plan.passes
    log(f"plan after capture: {plan.passes:g} passes, {plan.steps} steps over {samples} samples ({tokens / 1000:.0f}k "
        f"tokens), {plan.refit['elapsed_s'] / 60:.1f} min spent, est. {plan.refit['est_total_s'] / 60:.1f} min in all")
    return plan


STEP_REFIT_AT = (0.05, 0.5)  # shares of the planned steps after which the loop re-fits its step count


def refit_steps(step: int, elapsed_s: float, budget_s: float, s_per_step: float, eval_s: float, save_s: float,
                eval_every: int, save_every: int, most: int) -> int:
    """Total steps that end by `budget_s` * SAFETY, `step` done after `elapsed_s`: each further step costs
    its measured seconds plus its share of the evaluations and checkpoints, and the final draft one save.
    Between step + 1 and `most` (the passes cap)."""
    per = s_per_step + (eval_s / eval_every if eval_every else 0.0) + (save_s / save_every if save_every else 0.0)
    left = budget_s * SAFETY - elapsed_s - eval_s - 2 * save_s  # the last eval, checkpoint and final draft
    return int(min(max(step + 1, step + math.floor(max(left, 0.0) / max(per, 1e-9))), max(most, step + 1)))


class StepClock:
    """Re-fits the step count from the loop's own rate at STEP_REFIT_AT of the plan, with the schedule
    rebuilt on the new total. Why: the probe's few steps read the train rate high (dflash_smollm2:
    591 tokens/s probed, ~440 over the run, which ended 10% over budget), and only the loop sees the
    rate of a whole run: all lengths, a warm heap, evals and checkpoints. Refits are stored in plan.json,
    so a resumed run keeps the total; only a run that started at step 0 measures (its clock is the run's)."""

    def __init__(self, plan: Plan | None, cfg: Any, total_steps: int, step: int, most: int) -> None:
        self.plan, self.most = plan, most
        self.total = plan.step_refits[-1]["steps"] if plan is not None and plan.step_refits else total_steps
        self.active = plan is not None and step == 0 and "train.epochs" in plan.chosen
        self.planned = total_steps
        self.eval_every, self.save_every = cfg.train.eval_every, cfg.train.save_every
        self.eval_samples = shape_of(cfg).eval_samples
        self.t0 = time.perf_counter()
        self.side = {"eval": [0.0, 0], "save": [0.0, 0]}  # seconds and count of evals / checkpoints

    def spent(self, kind: str, seconds: float) -> None:
        self.side[kind][0] += seconds
        self.side[kind][1] += 1

    def due(self, step: int) -> bool:
        done = len(self.plan.step_refits) if self.plan is not None else 0
        return self.active and done < len(STEP_REFIT_AT) and step >= max(2, STEP_REFIT_AT[done] * self.planned)

    def refit(self, step: int, elapsed_s: float, d: Any, run_dir: Path, log: Callable = print) -> int:
        """The new total (the same on every rank: rank 0 decides and stores it, the others read it)."""
        from drafthead.io import atomic_write_json
        from trainer import engine as L

        assert self.plan is not None
        if d.main:
            r = self.plan.rates
            loop_s = time.perf_counter() - self.t0 - self.side["eval"][0] - self.side["save"][0]
            est_eval = self.eval_samples * r.tokens_per_sample / r.eval_tok_s
            eval_s = self.side["eval"][0] / self.side["eval"][1] if self.side["eval"][1] else est_eval
            save_s = self.side["save"][0] / self.side["save"][1] if self.side["save"][1] else r.save_s
            total = refit_steps(step, elapsed_s, self.plan.budget_s, loop_s / step, eval_s, save_s, self.eval_every,
                                self.save_every, self.most)
            self.plan.step_refits.append({"at_step": step, "steps": total, "s_per_step": round(loop_s / step, 4),
                                          "eval_s": round(eval_s, 2), "save_s": round(save_s, 2),
                                          "elapsed_s": round(elapsed_s, 1)})
            atomic_write_json(run_dir / PLAN_FILE, self.plan.to_dict())
        L.barrier(d)
        self.plan = load_plan(run_dir)
        assert self.plan is not None
        last = self.plan.step_refits[-1]
        if last["steps"] != self.total:
            log(f"\nbudget: {last['s_per_step']:.2f} s a step measured over {step} steps; {last['steps']} steps "
                f"(was {self.total}) end the run in budget")
        self.total = last["steps"]
        return self.total


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
    return Shape(batch_size=cfg.train.batch_size, grad_accum=cfg.train.grad_accum, eval_every=cfg.train.eval_every,
                 save_every=cfg.train.save_every, eval_samples=eval_samples, max_passes=cfg.budget.max_passes,
                 conversations=cfg.data.max_samples, passes=cfg.train.epochs, max_steps=cfg.train.max_steps)


def probe(cfg: Any, target: Any, device: torch.device) -> Rates:
    """Measure this machine on the recipe's own data, target and drafter (a throwaway copy)."""
    import tempfile

    from drafthead.hardware import cpu_class, resolve_dtype_name
    from trainer import data as D
    from trainer import engine as L
    from trainer.prepare import build_draft, feature_dtype

    dc, n = cfg.data, cfg.budget.probe_samples
    every, _ = D.load_conversations(dc.dataset, None)  # a few seconds for ShareGPT; the plan is capped by it
    convs = every[:n]
    t = time.perf_counter()  # the file's one-time cost is setup; tokenizing grows with the conversations
    samples, _ = D.tokenize_conversations(target.tokenizer, convs, max_length=dc.max_length, overlong=dc.overlong,
                                          chat_template=dc.chat_template, enable_thinking=dc.enable_thinking)
    prep_s = (time.perf_counter() - t) / max(len(convs), 1)
    rng = L.rng_state()  # the throwaway drafter draws random numbers the real run must draw again
    try:
        ds = build_draft(cfg, target, samples, device, log=lambda *a: None)
        engine = L.TorchEngine(ds.drafter, cfg, 1000, L.Dist(device=device))
        layer_ids, fdt = ds.drafter.capture_layer_ids(), feature_dtype(cfg.capture.dtype)
        with tempfile.TemporaryDirectory() as tmp:
            got = measure_rates(
                samples, cfg.train.batch_size, cfg.budget.probe_batches,
                features=lambda g: L.make_batch(g, target, layer_ids, fdt, False, device, ds.d2t is not None),
                step=lambda fb: (L.forward_backward(engine, fb, ds.head, cfg.train.dtype, device), engine.step()),
                eval_forward=lambda fb: L.evaluate(ds.drafter, [fb], ds.head, L.Dist(device=device)),
                save=lambda: engine.save(Path(tmp)))
    finally:
        L.set_rng_state(rng)
    return Rates(**got, tokens_per_sample=sum(len(s["input_ids"]) for s in samples) / len(samples),
                 usable_frac=len(samples) / len(convs), prep_s_per_conv=prep_s,
                 available=max(len(every) - dc.num_holdout, 0), cpu_class=cpu_class(),
                 dtype=resolve_dtype_name(cfg.target.dtype, device, quiet=True))


def plan_run(cfg: Any, target: Any, d: Any, run_dir: Path, t_start: float, log: Callable = print) -> Plan | None:
    """With `budget.minutes` set: measure, plan, fill the null keys of `cfg` in place, say the plan. A
    resumed run (plan.json in run_dir, same budget and given keys) keeps its first plan."""
    from drafthead.io import atomic_write_json
    from trainer import engine as L

    if not cfg.budget.minutes:
        return None
    budget_s, s = cfg.budget.minutes * 60.0, shape_of(cfg)
    plan = load_plan(run_dir)
    if plan is not None and plan_matches(plan, budget_s, s):
        log(f"resuming with the plan in {run_dir / PLAN_FILE}")
    else:
        if d.main:
            log(f"budget: {cfg.budget.minutes:g} min; measuring this machine ...")
            rates = probe(cfg, target, d.device)
            plan = make_plan(budget_s, time.perf_counter() - t_start, rates, s)
            atomic_write_json(run_dir / PLAN_FILE, plan.to_dict())
        L.barrier(d)
        plan = load_plan(run_dir)
        assert plan is not None
    if "data.max_samples" in plan.chosen:
        cfg.data.max_samples = plan.conversations
    if "train.epochs" in plan.chosen:
        cfg.train.epochs = plan.passes
    log(plan.line())
    if not plan.fits:
        log(f"warning: the given keys ("
            f"{', '.join(k for k in ('data.max_samples', 'train.epochs', 'train.max_steps') if k not in plan.chosen)}) "
            f"make a run of ~{plan.est_s['total'] / 60:.0f} min, over budget.minutes={cfg.budget.minutes:g}")
    return plan


def budget_record(plan: Plan | None, phases: dict[str, float], steps: int, tokens: int) -> dict:
    """Planned vs actual, for metrics.jsonl and final/config.json."""
    out = {"actual_s": {k: round(v, 1) for k, v in phases.items()}, "actual_steps": steps,
           "actual_train_tokens": tokens}
    if plan is not None:
        out["plan"] = plan.to_dict()
        out["actual_over_budget"] = round(phases.get("total", 0.0) / plan.budget_s, 3)
    return out


# ---------------------------------------------------------------------------------------------
# memory per rank (printed at start; `train.dry_run=true` prints it from the configs alone, no weights)
GIB = 2 ** 30
OPTIMIZER_BYTES = 16  # a trainable parameter: fp32 weight + fp32 grad + AdamW's two fp32 moments


def memory_per_rank(target_params: int, target_dtype_bytes: int, tp: int, draft_trainable: int,
                    draft_frozen_bytes: int) -> dict[str, float]:
    """GiB a rank holds before activations: its 1/tp of the target (every weight is split by the tp plan),
    the draft replicated with fp32 grads and AdamW states, and the draft's frozen copies of target rows."""
    target = target_params * target_dtype_bytes / tp / GIB
    draft = (draft_trainable * OPTIMIZER_BYTES + draft_frozen_bytes) / GIB
    return {"target_gib": round(target, 2), "target_whole_gib": round(target * tp, 2),
            "draft_gib": round(draft, 2), "total_gib": round(target + draft, 2)}


def draft_params(drafter: torch.nn.Module) -> tuple[int, int]:
    """(trainable parameters, bytes of the frozen ones) as the drafter holds them: its frozen copies of target
    rows stay in the drafter's own dtype (fp32 when built), whatever the target's is."""
    trainable = sum(p.numel() for p in drafter.parameters() if p.requires_grad)  # the families freeze their copies
    frozen = sum(p.numel() * p.element_size() for p in drafter.parameters() if not p.requires_grad)
    return trainable, frozen


def memory_line(target: Any, drafter: torch.nn.Module, d: Any) -> str:
    """One line for the log: what this rank holds before activations."""
    tparams = sum(p.numel() for p in target.model.parameters())
    tbytes = next(target.model.parameters()).element_size()
    trainable, frozen = draft_params(drafter)
    m = memory_per_rank(tparams, tbytes, d.tp, trainable, frozen)
    split = f"1/{d.tp} of {m['target_whole_gib']:.1f}" if d.tp > 1 else "whole"
    return (f"memory per rank before activations: {m['total_gib']:.1f} GiB = target {m['target_gib']:.1f} GiB "
            f"({split}) + draft {m['draft_gib']:.1f} GiB ({trainable / 1e6:.0f}M trainable with fp32 grads and "
            f"AdamW states)")


def dry_run(cfg: Any, log: Callable = print) -> dict[str, float]:
    """The memory per rank of a recipe from the target's config alone: target and drafter are built on the
    meta device, so a 70B target needs no weights and no GPU (`python train.py recipe=NAME train.dry_run=true`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from drafthead.hardware import resolve_dtype_name
    from drafthead.registry import family
    from drafthead.target import resolve_target

    path, _ = resolve_target(cfg.target.name_or_path, cfg.target.gguf_file)
    tcfg = AutoConfig.from_pretrained(path)
    dtype = getattr(torch, resolve_dtype_name(cfg.target.dtype, torch.device("cuda"), quiet=True))
    fam = family(cfg.drafter.family)
    options = getattr(cfg.drafter, fam.name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tcfg, dtype=dtype)
        vocab = options.draft_vocab_size if fam.reduced_vocab else None  # reduced-vocab families size it
        drafter = fam.model(fam.build(tcfg, options, cfg.capture.layer_ids, vocab and min(vocab, tcfg.vocab_size)))
    tparams = sum(p.numel() for p in model.parameters())
    trainable, frozen = draft_params(drafter)  # built in fp32 on the meta device, as train.py builds it
    tp = cfg.target.tensor_parallel
    m = memory_per_rank(tparams, dtype.itemsize, tp, trainable, frozen)
    log(f"dry run: {cfg.target.name_or_path}, {tparams / 1e9:.1f}B params in {str(dtype).removeprefix('torch.')}, "
        f"drafter {fam.name} {trainable / 1e6:.0f}M trainable; tensor_parallel={tp}: memory per rank before "
        f"activations {m['total_gib']:.1f} GiB = target {m['target_gib']:.1f} GiB "
        f"(1/{tp} of {m['target_whole_gib']:.1f}) + draft {m['draft_gib']:.1f} GiB")
    return {**m, "target_params": tparams, "draft_trainable": trainable, "tensor_parallel": tp}

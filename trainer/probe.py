"""The budget's measurements and its place in a run: the probe times a few seconds of real work on this machine
(capture, a training step, an eval forward, a save), `plan_run` turns the rates into a plan (trainer/budget.py)
and stores it in the run folder so a resumed run reuses its first plan (a re-measured plan would ask for another
capture), and the plan is re-fitted after capture and twice from the loop's own rate.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

from drafthead.io import atomic_write_json
from drafthead.trainer.budget import (PLAN_FILE, STEP_REFIT_AT, BudgetError, Plan, Rates, load_plan, make_plan,
                                      plan_matches, refit_passes, refit_steps, shape_of)
from drafthead.trainer import regenerate
from drafthead.trainer.checkpoint import rng_state, set_rng_state
from drafthead.trainer.dist import Dist, barrier
from drafthead.trainer.engines import TorchEngine
from drafthead.trainer.step import evaluate, forward_backward, make_batch, objective


def shared_plan(d: Dist, run_dir: Path, decide: Callable[[], Plan]) -> Plan:
    """Rank 0 decides and writes plan.json; after a barrier every rank reads that file, so all ranks act on
    the same bytes (a plan decided on each rank from its own clock would differ)."""
    if d.main:
        atomic_write_json(Path(run_dir) / PLAN_FILE, decide().to_dict())
    barrier(d)
    plan = load_plan(run_dir)
    assert plan is not None
    return plan


def measure_rates(samples: list[dict], batch_size: int, batches: int, features: Callable[[list[dict]], dict],
                  step: Callable[[dict], Any], eval_forward: Callable[[dict], Any], save: Callable[[], Any]
                  ) -> dict[str, float]:
    """Time capture, a training step and an eval forward on `batches` batches of real samples, and one
    checkpoint save. Batches are length-grouped like the trainer's and spread over the length range, since
    short and long conversations cost differently per token. Training runs two passes over the batches and
    takes their mean: a step on a batch shape the process has not run yet costs far more than one on a shape it
    has, and the loop meets its shapes new in its first pass and warm in the later ones. Timed on the first pass
    alone, the first probe in a process read training up to 45% under the loop (the plan then captured too little
    data and the run ended early); on the second alone, ~20% over."""
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

    def two_pass_rate(fn: Callable[[Any], Any], items: list) -> float:
        took = []
        for _ in range(2):
            t = time.perf_counter()
            for x in items:
                fn(x)
            took.append(time.perf_counter() - t)
        return sum(ntok) / statistics.mean(took)  # the first pass meets new shapes, the second warm ones

    capture, feats = rate(features, pick, 1)
    train = two_pass_rate(step, feats)
    ev, _ = rate(eval_forward, feats, 1)
    t = time.perf_counter()
    save()
    return {"capture_tok_s": capture, "train_tok_s": train, "eval_tok_s": ev, "save_s": time.perf_counter() - t}


def refit_after_capture(plan: Plan | None, cfg: Any, d: Any, run_dir: Path, elapsed_s: float, samples: int,
                        tokens: int, log: Callable = print) -> Plan | None:
    """Re-fit the passes the plan chose (once; a resumed run keeps the result): the probe's estimates of the
    data size and the capture rate are off by some percent, and the passes are where that is absorbed."""
    if plan is None or plan.refit is not None or "train.epochs" not in plan.chosen:
        return plan

    def decide() -> Plan:
        passes, info = refit_passes(plan, shape_of(cfg), elapsed_s, samples, tokens)
        plan.passes, plan.steps, plan.refit = passes, info["steps"], info
        return plan

    plan = shared_plan(d, run_dir, decide)
    assert plan.refit is not None
    cfg.train.epochs = plan.passes
    log(f"plan after capture: {plan.passes:g} passes, {plan.steps} steps over {samples} samples ({tokens / 1000:.0f}k "
        f"tokens), {plan.refit['elapsed_s'] / 60:.1f} min spent, est. {plan.refit['est_total_s'] / 60:.1f} min in all")
    return plan


class StepClock:
    """Re-fits the step count from the loop's own rate at STEP_REFIT_AT of the plan, with the schedule
    rebuilt on the new total. Why: the probe's few steps can read the train rate high (block drafters' steps vary
    with their anchors), and only the loop sees the rate of a
    whole run: all lengths, a warm heap, evals and checkpoints. Refits are stored in plan.json,
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
        assert self.plan is not None

        def decide() -> Plan:
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
            return self.plan

        self.plan = shared_plan(d, run_dir, decide)
        last = self.plan.step_refits[-1]
        if last["steps"] != self.total:
            log(f"\nbudget: {last['s_per_step']:.2f} s a step measured over {step} steps; {last['steps']} steps "
                f"(was {self.total}) end the run in budget")
        self.total = last["steps"]
        return self.total


def probe(cfg: Any, target: Any, device: torch.device) -> Rates:
    """Measure this machine on the recipe's own data, target and drafter (a throwaway copy)."""
    import tempfile

    from drafthead.hardware import cpu_class, resolve_dtype_name
    from drafthead.trainer.data import load_conversations, tokenize_conversations
    from drafthead.trainer.prepare import build_draft, feature_dtype, regenerate_options

    dc, n = cfg.data, cfg.budget.probe_samples
    every, _ = load_conversations(dc.dataset, None)  # a few seconds for ShareGPT; the plan is capped by it
    convs = every[:n]
    t = time.perf_counter()  # the file's one-time cost is setup; tokenizing grows with the conversations
    samples, _ = tokenize_conversations(target.tokenizer, convs, max_length=dc.max_length, overlong=dc.overlong,
                                          chat_template=dc.chat_template, enable_thinking=dc.enable_thinking)
    prep_s = (time.perf_counter() - t) / max(len(convs), 1)
    rng = rng_state()  # the throwaway drafter draws random numbers the real run must draw again
    try:
        ds = build_draft(cfg, target, samples, device, log=lambda *a: None)
        engine = TorchEngine(ds.drafter, cfg, 1000, Dist(device=device))
        layer_ids, fdt = ds.drafter.capture_layer_ids(), feature_dtype(cfg.capture.dtype)
        goal = objective(cfg.train)
        with tempfile.TemporaryDirectory() as tmp:
            got = measure_rates(
                samples, cfg.train.batch_size, cfg.budget.probe_batches,
                features=lambda g: make_batch(g, target, layer_ids, fdt, False, device, ds.d2t is not None),
                step=lambda fb: (forward_backward(engine, fb, ds.head, cfg.train.dtype, device, goal), engine.step()),
                eval_forward=lambda fb: evaluate(ds.drafter, [fb], ds.head, Dist(device=device), goal),
                save=lambda: engine.save(Path(tmp)))
    finally:
        set_rng_state(rng)
    if dc.regenerate.enabled:  # the target's answers cost time before the capture: measured, then planned
        got.update(regenerate.measure(target, convs, regenerate_options(cfg)))
    return Rates(**got, tokens_per_sample=sum(len(s["input_ids"]) for s in samples) / len(samples),
                 usable_frac=len(samples) / len(convs), prep_s_per_conv=prep_s,
                 available=max(len(every) - dc.num_holdout, 0), cpu_class=cpu_class(),
                 dtype=resolve_dtype_name(cfg.target.dtype, device, quiet=True))


def plan_run(cfg: Any, target: Any, d: Any, run_dir: Path, t_start: float, log: Callable = print) -> Plan | None:
    """With `budget.minutes` set: measure, plan, fill the null keys of `cfg` in place, say the plan. A
    resumed run (plan.json in run_dir, same budget and given keys) keeps its first plan."""
    if not cfg.budget.minutes:
        return None
    budget_s, s = cfg.budget.minutes * 60.0, shape_of(cfg)
    plan = load_plan(run_dir)
    if plan is not None and plan_matches(plan, budget_s, s):
        log(f"resuming with the plan in {run_dir / PLAN_FILE}")
    else:
        def decide() -> Plan:
            log(f"budget: {cfg.budget.minutes:g} min; measuring this machine ...")
            rates = probe(cfg, target, d.device)
            return make_plan(budget_s, time.perf_counter() - t_start, rates, s)

        plan = shared_plan(d, run_dir, decide)
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

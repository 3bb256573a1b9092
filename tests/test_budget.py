"""The time-budget planner (trainer/budget.py): plans from given rates fit, given keys win, a budget too
small is a clear error naming the minimum; and train.py with a budget on a tiny target (plan, re-fit after
capture, planned vs actual recorded, a rerun keeps its plan)."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from drafthead.trainer import budget
from drafthead.trainer.probe import measure_rates
from drafthead.trainer.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("train_script", ROOT / "train.py")
train = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train)

# rates as measured on the three CPU classes of our machines (docs/benchmarks.md)
CLASSES = {"AVX2 fp32": (190.0, 470.0), "AVX512-BF16": (773.0, 1672.0), "AMX": (2000.0, 2500.0)}


def rates(capture: float, train_: float, available: int | None = None) -> budget.Rates:
    return budget.Rates(capture_tok_s=capture, train_tok_s=train_, eval_tok_s=3 * train_, tokens_per_sample=470.0,
                   usable_frac=0.88, prep_s_per_conv=0.003, save_s=0.7, available=available, cpu_class="X",
                   dtype="d")


def shape(**kw) -> budget.Shape:
    return budget.Shape(**{"batch_size": 4, "grad_accum": 1, "eval_every": 100, "save_every": 100, "eval_samples": 64,
                      **kw})


@pytest.mark.parametrize("cls", list(CLASSES))
@pytest.mark.parametrize("minutes", [10, 60, 240])
def test_plan_fits_the_budget(cls, minutes):
    r = rates(*CLASSES[cls])
    p = budget.make_plan(minutes * 60.0, 45.0, r, shape())
    assert p.chosen == ["data.max_samples", "train.epochs"] and p.fits
    assert p.est_s["total"] == pytest.approx(sum(v for k, v in p.est_s.items() if k != "total"), abs=0.5)
    assert p.est_s["total"] <= minutes * 60 * budget.SAFETY
    assert 1 <= p.passes <= 4 and p.conversations >= 1
    # the largest data at its passes: one more conversation's worth of time would not fit... nearly
    more = budget.estimate(int(p.conversations * 1.02) + 1, p.passes, r, shape(), 45.0)["total"]
    assert more > minutes * 60 * budget.SAFETY
    assert p.steps == budget.steps_for(p.conversations, p.passes, r, shape())
    assert f"plan: {p.conversations} conversations" in p.line() and "passes" in p.line()


def test_slower_machines_get_less_data_not_more_time():
    plans = {c: budget.make_plan(3600.0, 45.0, rates(*v), shape()) for c, v in CLASSES.items()}
    assert plans["AVX2 fp32"].conversations < plans["AVX512-BF16"].conversations < plans["AMX"].conversations
    assert all(p.est_s["total"] <= 3600 for p in plans.values())


def test_passes_prefer_fresh_data_until_the_source_runs_out():
    """Passes 1-3 count fully and the 4th by half: with data to spare, 3 passes over more data win (ties go
    to more fresh data); when the source is the limit, the plan makes the 4th pass rather than idle."""
    r = rates(773.0, 1672.0)
    assert budget.make_plan(3600.0, 45.0, r, shape()).passes == 3
    capped = budget.make_plan(3600.0, 45.0, rates(773.0, 1672.0, available=300), shape())
    assert capped.conversations == 300 and capped.passes == 4
    assert budget.make_plan(3600.0, 45.0, r, shape(max_passes=2)).passes == 2
    assert [budget.pass_value(p) for p in (1, 2, 3, 4, 5)] == [1, 2, 3, 3.5, 3.5]


def test_given_keys_win():
    r = rates(773.0, 1672.0)
    data = budget.make_plan(3600.0, 45.0, r, shape(conversations=500))  # data given: passes fill the time, up to 4
    assert data.conversations == 500 and data.chosen == ["train.epochs"] and data.passes == 4
    data = budget.make_plan(3600.0, 45.0, r, shape(conversations=3000))
    assert data.conversations == 3000 and 1 <= data.passes < 4 and data.est_s["total"] <= 3600 * budget.SAFETY
    passes = budget.make_plan(3600.0, 45.0, r, shape(passes=1.0))  # passes given: data fills the time
    assert passes.passes == 1 and passes.chosen == ["data.max_samples"]
    assert passes.conversations > budget.make_plan(3600.0, 45.0, r, shape(passes=3.0)).conversations
    both = budget.make_plan(3600.0, 45.0, r, shape(conversations=20000, passes=4.0))  # nothing chosen, said to be over
    assert both.chosen == [] and (both.conversations, both.passes) == (20000, 4.0) and not both.fits
    steps = budget.make_plan(3600.0, 45.0, r, shape(max_steps=200))
    assert steps.steps == 200 and steps.chosen == ["data.max_samples"]
    assert steps.conversations == pytest.approx(200 * 4 / 0.88, abs=1)  # one pass of the fixed steps


def test_budget_too_small_names_the_minimum():
    r = rates(*CLASSES["AVX2 fp32"])
    with pytest.raises(budget.BudgetError, match=r"budget.minutes=1 is too small on this machine \(X, d\): setup, one "
                       r"step, the held-out features and one evaluation alone take ~[0-9.]+ min; set "
                       r"budget.minutes >= [0-9]+ or budget.minutes=null"):
        budget.make_plan(60.0, 30.0, r, shape())
    err = None
    try:
        budget.make_plan(60.0, 30.0, r, shape())
    except budget.BudgetError as e:
        err = str(e)
    minimum = int(err.split(">= ")[1].split()[0])
    budget.make_plan(minimum * 60.0, 30.0, r, shape())  # the minimum it names is enough


def test_refit_after_capture_absorbs_a_slow_capture():
    r, s = rates(773.0, 1672.0), shape()
    p = budget.make_plan(3600.0, 45.0, r, s)
    on_time = p.est_s["setup"] + p.est_s["prepare"] + p.est_s["capture"]
    samples = int(p.conversations * r.usable_frac)
    same, _ = budget.refit_passes(p, s, on_time, samples, p.tokens)
    assert same == pytest.approx(p.passes, abs=0.1)
    slow, info = budget.refit_passes(p, s, on_time + 600, samples, p.tokens)  # capture 10 min late
    assert slow < p.passes and info["est_total_s"] <= 3600 * budget.SAFETY and info["passes_planned"] == p.passes
    fast, _ = budget.refit_passes(p, s, on_time - 600, samples, p.tokens)
    assert p.passes < fast <= 4
    late, _ = budget.refit_passes(p, s, 3590.0, samples, p.tokens)  # nothing left: the least, a tenth
    assert late == 0.1


def test_refit_steps_fits_what_is_left_and_respects_its_bounds():
    kw = dict(eval_s=20.0, save_s=1.0, eval_every=100, save_every=100, most=10_000)
    n = budget.refit_steps(100, 600.0, 3600.0, 2.0, **kw)
    per = 2.0 + 20.0 / 100 + 1.0 / 100
    end = 600.0 + (n - 100) * per + 20.0 + 2 * 1.0
    assert end <= 3600 * budget.SAFETY < end + per  # the most steps that fit, not fewer
    assert budget.refit_steps(100, 600.0, 3600.0, 4.0, **kw) < n  # a slower loop: fewer steps
    assert budget.refit_steps(100, 600.0, 3600.0, 0.01, **kw) == 10_000  # capped by the passes
    assert budget.refit_steps(100, 3599.0, 3600.0, 2.0, **kw) == 101  # nothing left: one more step, the last


@pytest.mark.parametrize("truth", [0.65, 1.0, 1.4])  # the loop's real train rate / the probe's
def test_step_refits_end_a_run_in_budget_when_the_probe_misreads_the_rate(truth):
    """A run simulated with the probe's plan and a loop `truth` times as fast as probed: with the refits at
    STEP_REFIT_AT it ends within the budget and, when the probe read high, past 90% of it."""
    r, s = rates(773.0, 1672.0), shape()
    p = budget.make_plan(3600.0, 45.0, r, s)
    step_tok = s.batch_size * r.tokens_per_sample
    s_step = step_tok / (r.train_tok_s * truth)
    eval_s, save_s = s.eval_samples * r.tokens_per_sample / r.eval_tok_s, r.save_s
    t, step, total = p.est_s["setup"] + p.est_s["prepare"] + p.est_s["capture"], 0, p.steps
    most = int(p.steps / p.passes * 4)
    for at in budget.STEP_REFIT_AT:
        upto = max(2, math.ceil(at * p.steps))
        t += (upto - step) * s_step + ((upto // 100) - (step // 100)) * (eval_s + save_s)
        step = upto
        total = budget.refit_steps(step, t, 3600.0, s_step, eval_s, save_s, 100, 100, most)
    t += (total - step) * s_step + (budget._count_every(total, 100) - step // 100) * (eval_s + save_s) + save_s
    assert t <= 3600
    without = p.est_s["total"] + p.steps * s_step - p.est_s["train"]  # the plan as probed, at the true rate
    if truth < 1:
        assert without > 3600 and t > 0.9 * 3600


def test_set_total_steps_keeps_the_warmup_and_ends_the_cosine_at_the_new_total():
    import torch

    from drafthead.trainer.engines import make_schedule, set_total_steps
    from drafthead.trainer.config import load_config

    cfg = load_config(["train.warmup_ratio=0.1", "train.min_lr_ratio=0.1", "train.lr=1.0"])
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = make_schedule(opt, 100, cfg)
    for _ in range(20):
        opt.step(), sched.step()
    set_total_steps(sched, 50, cfg)
    lrs = []
    for _ in range(40):
        opt.step(), sched.step()
        lrs.append(sched.get_last_lr()[0])
    assert sched.lr_lambdas[0](5) == pytest.approx(0.6)  # warm-up of 10 steps (from the first total), not 5
    assert lrs[29] == pytest.approx(0.1) and lrs == sorted(lrs, reverse=True)  # step 50: the floor


def test_a_stored_plan_is_kept_only_for_the_same_budget_and_keys():
    r, s = rates(773.0, 1672.0), shape()
    p = budget.Plan.from_dict(json.loads(json.dumps(budget.make_plan(3600.0, 45.0, r, s).to_dict())))
    assert p.rates == r
    assert budget.plan_matches(p, 3600.0, s)
    assert not budget.plan_matches(p, 1800.0, s)
    assert not budget.plan_matches(p, 3600.0, shape(conversations=10))


def test_budget_keys_are_validated():
    cfg = load_config([])
    assert cfg.budget.minutes == 60 and cfg.data.max_samples is None and cfg.train.epochs is None
    assert cfg.target.dtype == "auto" and cfg.train.dtype == "auto"
    for bad, key in (("budget.minutes=0", "budget.minutes"), ("budget.max_passes=0.5", "budget.max_passes"),
                     ("train.epochs=0", "train.epochs"), ("target.dtype=fp16", "target.dtype"),
                     ("train.dtype=half", "train.dtype"), ("budget.probe_samples=4", "budget.probe_samples"),
                     ("budget.probe_batches=0", "budget.probe_batches")):
        with pytest.raises(ConfigError, match=f"bad value for '{key}'"):
            load_config([bad])
    assert load_config(["budget.minutes=null"]).budget.minutes is None


def test_probe_with_too_few_samples_is_a_clear_error():
    samples = [{"input_ids": [1] * 5, "loss_mask": [1] * 5}] * 7
    with pytest.raises(budget.BudgetError, match="the budget probe needs at least 10 training samples, got 7"):
        measure_rates(samples, batch_size=2, batches=3, features=dict, step=dict, eval_forward=dict,
                        save=dict)


def tiny_args(run: Path, target: Path, data: Path, **over) -> list[str]:
    kv = {"target.name_or_path": target, "target.dtype": "float32", "data.dataset": data, "data.num_holdout": 4,
          "data.max_length": 96, "drafter.eagle3.draft_vocab_size": 128, "capture.layer_ids": "[1,2,3]",
          "train.batch_size": 2, "train.dtype": "float32", "train.eval_every": 0, "train.save_every": 0,
          "budget.probe_samples": 16, "logging.wandb": "false", "logging.progress": "false", "output_dir": run,
          "train.choose_serving": "false", **over}
    return [f"{k}={v}" for k, v in kv.items()]


def test_train_with_a_budget_plans_refits_records_and_keeps_its_plan(tiny_llama_dir, tiny_sharegpt, tmp_path,
                                                                     capsys, monkeypatch):
    monkeypatch.setenv("DRAFTHEAD_CACHE", str(tmp_path / "cache"))
    run = tmp_path / "run"
    a = tiny_args(run, tiny_llama_dir, tiny_sharegpt, **{"budget.minutes": 1.5})
    train.main(a)
    out = capsys.readouterr().out
    assert "budget: 1.5 min; measuring this machine ..." in out
    plan = budget.load_plan(run)
    # the tiny source (40 conversations, 4 held out) is the limit: all of it, and the 4th pass
    assert plan.rates.available == 36 and plan.conversations == 36 and plan.chosen == ["data.max_samples",
                                                                                      "train.epochs"]
    assert plan.line() in out and "plan after capture:" in out and plan.refit is not None
    cfg = load_config([f"recipe={run / 'config.yaml'}"])  # the resolved recipe holds what the plan chose
    assert cfg.data.max_samples == 36 and cfg.train.epochs == plan.passes
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[0] == {"step": 0, "budget_plan": json.loads(json.dumps(rows[0]["budget_plan"]))}
    assert rows[0]["budget_plan"]["conversations"] == 36
    rec = rows[-1]["budget"]
    assert set(rec["actual_s"]) == {"setup", "prepare", "capture", "train", "total"}
    # the loop re-fitted its steps at 5% and 50% of the plan from its own rate, and ended where it said
    assert [r["at_step"] for r in plan.step_refits] == [max(2, math.ceil(f * plan.steps)) for f in budget.STEP_REFIT_AT]
    assert rec["actual_steps"] == plan.step_refits[-1]["steps"]
    assert 0 < rec["actual_over_budget"] < 1.1
    meta = json.loads((run / "final" / "config.json").read_text())
    assert meta["budget"]["plan"]["refit"]["passes"] == plan.passes and meta["budget"]["actual_steps"] > 0

    train.main(a)  # the same command again: the stored plan, no second probe
    out = capsys.readouterr().out
    assert f"resuming with the plan in {run / 'plan.json'}" in out and "measuring this machine" not in out
    assert budget.load_plan(run) == plan

    explicit = tmp_path / "explicit"  # explicit keys win over the plan
    train.main(tiny_args(explicit, tiny_llama_dir, tiny_sharegpt,
                         **{"budget.minutes": 1.5, "data.max_samples": 10, "train.epochs": 1}))
    p2 = budget.load_plan(explicit)
    assert p2.chosen == [] and p2.conversations == 10 and p2.passes == 1 and p2.refit is None


def test_train_with_a_budget_too_small_is_a_clear_error(tiny_llama_dir, tiny_sharegpt, tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTHEAD_CACHE", str(tmp_path / "cache"))
    with pytest.raises(budget.BudgetError, match=r"budget.minutes=0.001 is too small on this machine .* set "
                                            r"budget.minutes >= 1 or budget.minutes=null"):
        train.main(tiny_args(tmp_path / "run", tiny_llama_dir, tiny_sharegpt, **{"budget.minutes": 0.001}))
    assert not (tmp_path / "run" / "final").exists()


def test_regeneration_time_is_planned():
    """The target's answers cost answered x answer_tokens / regen_tok_s before the capture: by hand, and a plan
    that must pay them takes fewer conversations and still fits."""
    r = rates(*CLASSES["AVX512-BF16"])
    r.regen_tok_s, r.answer_tokens, r.answerable_frac = 300.0, 200.0, 0.9
    s = shape(regen_fraction=0.5, regen_heldout=64)
    assert budget.regen_s(1000, r, s) == pytest.approx((1000 * 0.5 + 64) * 0.9 * 200.0 / 300.0)
    assert budget.regen_s(1000, r, shape()) == 0.0  # regeneration off
    plain = budget.make_plan(3600.0, 45.0, r, shape())
    regen = budget.make_plan(3600.0, 45.0, r, s)
    assert regen.conversations < plain.conversations and regen.est_s["total"] <= 3600 * budget.SAFETY
    assert regen.est_s["regenerate"] > 0 and "target answers" in regen.line() and "300 tok/s" in regen.line()


def test_regeneration_probe_times_the_answering_engine(tiny_llama_dir, tiny_sharegpt, tmp_path, monkeypatch):
    """What the probe adds with data.regenerate.enabled: our runtime answering the recipe's prompts (tokens/s), the
    expected answer length (the data's first answers, capped at max_new_tokens) and the share of prompts that fit."""
    monkeypatch.setenv("DRAFTHEAD_CACHE", str(tmp_path / "cache"))
    from drafthead.target import load_target
    from drafthead.trainer import regenerate
    from drafthead.trainer.data import load_conversations
    from drafthead.trainer.prepare import regenerate_options

    cfg = load_config(tiny_args(tmp_path / "run", tiny_llama_dir, tiny_sharegpt,
                                **{"data.regenerate.enabled": True, "data.regenerate.max_new_tokens": 64,
                                   "data.regenerate.batch_size": 4}))
    convs, _ = load_conversations(cfg.data.dataset, 16)
    got = regenerate.measure(load_target(str(tiny_llama_dir), dtype="float32"), convs, regenerate_options(cfg))
    assert got["regen_tok_s"] > 0 and 0 < got["answer_tokens"] <= 64 and 0 < got["answerable_frac"] <= 1
    assert set(got) <= {f.name for f in dataclasses.fields(budget.Rates)}  # the probe passes them on as they are

"""The serving record a trained draft carries (trainer/serving.py): the held-out tau of each draft length over its
measured round cost, the best one chosen, and `drafthead eval` / `bench` running it unless told otherwise. The record
written by a real training run is checked in tests/test_train.py::test_run_dir_contents."""
from __future__ import annotations

import json

import pytest
import torch

from drafthead.eval.models import DEFAULTS, runtime_settings, served
from drafthead.trainer import serving


def test_simulated_tau_is_the_held_out_chain_by_hand():
    acc = [0.5, 0.4, 0.2]
    assert serving.simulated_tau(acc, 1) == pytest.approx(1.5)
    assert serving.simulated_tau(acc, 2) == pytest.approx(1.5 + 0.5 * 0.4)
    assert serving.simulated_tau(acc, 3) == pytest.approx(1.7 + 0.5 * 0.4 * 0.2)
    assert serving.held_out_acc({"eval/acc_0": 0.5, "eval/acc_1": 0.4, "eval/loss": 3.0}) == [0.5, 0.4]


def test_the_length_with_the_best_expected_speedup_is_chosen(monkeypatch, tmp_path):
    from types import SimpleNamespace

    # tau 1.5 / 1.7 / 1.74 over costs 1.1 / 1.2 / 1.5: k = 2 gives 1.417, the best
    chain_only = SimpleNamespace(draft_modes={"chain": None})
    monkeypatch.setattr(serving, "runtime_for", lambda *a: (chain_only, None, "X"))
    monkeypatch.setattr(serving, "round_costs", lambda *a: {1: 1.1, 2: 1.2, 3: 1.5})
    rec = serving.choose({"eval/acc_0": 0.5, "eval/acc_1": 0.4, "eval/acc_2": 0.2}, None, tmp_path, [[1, 2]])
    assert rec["num_speculative_tokens"] == 2 and rec["expected_speedup"] == pytest.approx(1.7 / 1.2, abs=1e-3)
    assert rec["by_length"]["3"] == {"tau": 1.74, "cost": 1.5} and rec["mode"] == "chain" and rec["measured_on"] == "X"
    # without a held-out eval nothing is chosen, and eval's default applies
    assert "num_speculative_tokens" not in serving.choose({}, None, tmp_path, [[1]])
    # a family that drafts trees too: a shape that measured faster than the chain is what gets served
    trees = SimpleNamespace(draft_modes={"chain": None, "tree": None})
    monkeypatch.setattr(serving, "runtime_for", lambda *a: (trees, None, "X"))
    monkeypatch.setattr(serving, "tree_trial", lambda *a: {"chain": 1.10, "tree 2x4": 1.05, "tree 4x8": 1.2})
    rec = serving.choose({"eval/acc_0": 0.5, "eval/acc_1": 0.4, "eval/acc_2": 0.2}, None, tmp_path, [[1, 2]])
    assert (rec["mode"], rec["num_speculative_tokens"], rec["topk"], rec["tree_nodes"]) == ("tree", 3, 4, 8)
    monkeypatch.setattr(serving, "tree_trial", lambda *a: {"chain": 1.3, "tree 2x4": 1.05, "tree 4x8": 1.2})
    rec = serving.choose({"eval/acc_0": 0.5, "eval/acc_1": 0.4, "eval/acc_2": 0.2}, None, tmp_path, [[1, 2]])
    assert rec["mode"] == "chain" and rec["num_speculative_tokens"] == 2 and rec["tree_trial"]["tree 4x8"] == 1.2


def test_eval_and_bench_run_the_recorded_settings_unless_told(tmp_path):
    draft = tmp_path / "final"
    draft.mkdir()
    meta = {"family": "eagle3", "draft": {}, "target": {}}
    (draft / "config.json").write_text(json.dumps(meta))
    none = dict.fromkeys(DEFAULTS)
    assert runtime_settings("chain", none, str(draft)) == (DEFAULTS, "the command and the defaults")
    assert runtime_settings("chain", none, None)[0] == DEFAULTS
    (draft / "config.json").write_text(json.dumps({**meta, "serving": {"mode": "chain", "num_speculative_tokens": 3,
                                                                       "chain_length": 3}}))
    assert runtime_settings("chain", none, str(draft)) == ({**DEFAULTS, "num_speculative_tokens": 3},
                                                             "the draft's serving record")
    one = runtime_settings("chain", {**none, "num_speculative_tokens": 1}, str(draft))[0]
    assert one["num_speculative_tokens"] == 1
    # a draft served as a tree: eval runs that shape; a chain asked for by name takes the recorded chain length
    tree = {"mode": "tree", "num_speculative_tokens": 3, "topk": 2, "tree_nodes": 4, "chain_length": 1}
    (draft / "config.json").write_text(json.dumps({**meta, "serving": tree}))
    assert runtime_settings("tree", none, str(draft))[0] == {"num_speculative_tokens": 3, "tree_nodes": 4, "topk": 2}
    assert runtime_settings("chain", none, str(draft))[0] == {**DEFAULTS, "num_speculative_tokens": 1}
    assert served(str(draft)) == tree


def test_a_failed_timing_costs_the_record_never_the_saved_draft(monkeypatch, tmp_path):
    """The draft is saved before the timing: an error there is recorded (and said), the run goes on."""
    from types import SimpleNamespace

    from drafthead.trainer import run

    final = tmp_path / "final"
    final.mkdir()
    (final / "config.json").write_text(json.dumps({"family": "eagle3", "draft": {}, "target": {}}))
    said = []
    job = SimpleNamespace(cfg=SimpleNamespace(train=SimpleNamespace(choose_serving=True)),
                          d=SimpleNamespace(world=1), log=said.append)
    target = SimpleNamespace(config=SimpleNamespace(model_type="llama"))

    def boom(*a):
        raise RuntimeError("no kernel here")

    monkeypatch.setattr(serving, "choose", boom)
    heldout = [{"input_ids": torch.tensor([[5, 6, 7, 8]]), "loss_mask": torch.tensor([[0, 0, 1, 1]])}]
    assert serving.held_out_prompts(heldout) == [[5, 6]]  # the conversation up to its first trained token
    run.record_serving(job, target, final, {"eval/acc_0": 0.5}, heldout)
    rec = json.loads((final / "config.json").read_text())["serving"]
    assert rec == {"why": "timing our runtime failed: RuntimeError: no kernel here"} and "not chosen" in said[0]
    job.d.world = 2  # several processes: not measured, and the record says so
    run.record_serving(job, target, final, {"eval/acc_0": 0.5}, heldout)
    assert "one-process runs only" in json.loads((final / "config.json").read_text())["serving"]["why"]

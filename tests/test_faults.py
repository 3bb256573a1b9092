"""Faults a person or a cluster causes, each with the behaviour it must get (docs/training.md "Failure
behaviour"): a second run on a busy run folder, SIGINT/SIGTERM during training and capture (checkpoint,
bit-identical resume), metrics without duplicates after a resume, a draft refusing another target, read-only
and full destinations, and every bad option refused before anything loads."""
from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_train import ROOT, args, assert_same_weights, metrics, train

from drafthead import cli
from drafthead.fingerprint import TargetMismatch, compute
from drafthead.io import WriteError
from drafthead.trainer import run as trainer_run
from drafthead.trainer.checkpoint import list_checkpoints
from drafthead.trainer.capture import capture_offline
from drafthead.trainer.config import ConfigError, load_config
from drafthead.trainer.interrupt import GracefulStop, Interrupted
from drafthead.trainer.runlock import LOCK_NAME, RunLockError, run_lock

STEPS = 6


@pytest.fixture(autouse=True)
def _tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTHEAD_CACHE", str(tmp_path / "cache"))


@pytest.fixture(autouse=True)
def _signal_dispositions():
    """Python's own dispositions for the signals these tests send, restored afterwards: a suite started as a
    background job (`cmd &`, `nohup`, many CI runners) inherits SIGINT ignored, and a test that asserts what the
    trainer gives back must not depend on what its parent chose."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    for s, h in saved.items():
        signal.signal(s, h)


@pytest.fixture(scope="module")
def full_run(tiny_llama_dir, tiny_sharegpt, tmp_path_factory) -> Path:
    """An uninterrupted 6-step run: what every interrupted-and-resumed run must end equal to."""
    run = tmp_path_factory.mktemp("faults_full") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DRAFTHEAD_CACHE", str(run.parent / "cache"))
        train.main(args(run, tiny_llama_dir, tiny_sharegpt))
    return run


@pytest.fixture(scope="module")
def other_llama_dir(tmp_path_factory, tiny_llama_dir) -> Path:
    """A Llama of exactly the tiny target's shape and tokenizer, other weights: what a fine-tune looks like."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("other_llama")
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    with torch.no_grad():
        model.model.layers[1].self_attn.q_proj.weight.mul_(1.01)  # one projection of one layer, as a LoRA merge
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_llama_dir).save_pretrained(out)
    return out


def train_rows(run: Path) -> list[dict]:
    """Metrics rows without the fields that differ between otherwise identical runs (wall time, rates)."""
    return [{k: v for k, v in r.items() if k not in ("wall_s", "tokens_per_s")} for r in metrics(run)]


def hold_lock_in_subprocess(folder: Path) -> subprocess.Popen:
    """Another process holding `folder`'s run lock until killed; returns once it holds it."""
    code = ("import sys, time\nfrom trainer.runlock import run_lock\nwith run_lock(sys.argv[1]):\n"
            "    print('held', flush=True)\n    time.sleep(600)\n")
    p = subprocess.Popen([sys.executable, "-c", code, str(folder)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


# ----------------------------------------------------------------------------- options, before anything loads

@pytest.mark.parametrize("key,value,says", [
    ("train.batch_size", "0", "'train.batch_size': 0 (must be >= 1)"),
    ("train.lr", "-1", "'train.lr': -1.0 (must be > 0)"),
    ("train.lr", "0", "'train.lr': 0.0 (must be > 0)"),
    ("train.max_steps", "0", "'train.max_steps': 0 (must be >= 1)"),
    ("train.grad_accum", "0", "'train.grad_accum'"),
    ("train.warmup_ratio", "1.5", "'train.warmup_ratio'"),
    ("train.keep_checkpoints", "0", "'train.keep_checkpoints'"),
    ("train.betas", "[0.9]", "'train.betas'"),
    ("train.deepspeed", "zero9", "'train.deepspeed': 'zero9' is neither a file nor a built-in config"),
    ("budget.minutes", "-5", "'budget.minutes'"),
    ("data.max_length", "4", "'data.max_length'"),
    ("data.regenerate.fraction", "0", "'data.regenerate.fraction'"),
    ("capture.shard_samples", "0", "'capture.shard_samples'"),
    ("capture.dtype", "int8", "'capture.dtype'"),
    ("drafter.eagle3.num_draft_tokens", "0", "'drafter.eagle3.num_draft_tokens'"),
    ("logging.log_every", "0", "'logging.log_every'"),
])
def test_bad_option_is_one_line_before_anything_loads(key, value, says, tmp_path, capsys, monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("the target was loaded before the options were checked")

    monkeypatch.setattr(trainer_run, "load_target", no_load)
    with pytest.raises(SystemExit) as e:
        train.main([f"{key}={value}", f"output_dir={tmp_path / 'run'}"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1
    assert not (tmp_path / "run").exists()  # nothing created either


def test_output_dir_naming_a_file_is_refused(tmp_path):
    f = tmp_path / "a_file"
    f.write_text("x")
    with pytest.raises(ConfigError, match=r"'output_dir': .*a_file exists and is not a directory"):
        load_config([f"output_dir={f}"])


# ----------------------------------------------------------------------------- the run folder's lock

def test_second_run_on_a_busy_folder_is_refused_naming_the_holder(tiny_llama_dir, tiny_sharegpt, tmp_path):
    run = tmp_path / "run"
    holder = hold_lock_in_subprocess(run)
    try:
        with pytest.raises(RunLockError, match=rf"{run} is in use by another run \(pid {holder.pid} on "):
            train.main(args(run, tiny_llama_dir, tiny_sharegpt))
        # from the command line: one line, exit 2, nothing written into the folder
        r = subprocess.run([sys.executable, "train.py", *args(run, tiny_llama_dir, tiny_sharegpt)], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 2, r.stderr
        assert r.stderr.strip().splitlines() == [line for line in r.stderr.strip().splitlines() if "error" in line]
        assert f"pid {holder.pid}" in r.stderr and "choose another output_dir" in r.stderr
        assert sorted(p.name for p in run.iterdir()) == [LOCK_NAME]
    finally:
        holder.kill()
        holder.wait()


def test_lock_of_a_killed_process_is_taken_over_with_a_warning(tmp_path):
    holder = hold_lock_in_subprocess(tmp_path / "run")
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    said = []
    with run_lock(tmp_path / "run", log=said.append):
        assert said and f"left by pid {holder.pid}" in said[0] and "that process is gone" in said[0]
        with pytest.raises(RunLockError):  # and it is held again now
            with run_lock(tmp_path / "run"):
                pass
    with run_lock(tmp_path / "run", log=said.append):  # released cleanly: no warning the next time
        assert len(said) == 1


def test_readers_are_not_blocked_by_a_running_run(full_run, tiny_llama_dir, tmp_path):
    from drafthead.export import export

    holder = hold_lock_in_subprocess(full_run)
    try:
        out = export(full_run / "final", "sglang", tmp_path / "sglang", target=str(tiny_llama_dir))
        assert (out / "config.json").is_file()
    finally:
        holder.kill()
        holder.wait()


# ----------------------------------------------------------------------------- SIGINT / SIGTERM

def signal_at_step(monkeypatch, step: int, sigs: tuple[int, ...]) -> None:
    """Send `sigs` to this process in the middle of optimizer step `step` (inside its forward/backward)."""
    real = trainer_run.forward_backward
    calls = {"n": 0}

    def fb(*a, **k):
        calls["n"] += 1
        if calls["n"] == step:
            for s in sigs:
                os.kill(os.getpid(), s)
        return real(*a, **k)

    monkeypatch.setattr(trainer_run, "forward_backward", fb)


def test_metrics_row_summed_across_a_stop_equals_the_uninterrupted_one(tiny_llama_dir, tiny_sharegpt, tmp_path,
                                                                        monkeypatch):
    """A row averages the steps since the last one: a stop between two rows must not shorten that window."""
    over = {"logging.log_every": 5, "train.save_every": 100}
    train.main(args(tmp_path / "ref", tiny_llama_dir, tiny_sharegpt, **over))
    signal_at_step(monkeypatch, 3, (signal.SIGTERM,))  # 3 losses: a sum that fp32 would round
    with pytest.raises(Interrupted):
        train.main(args(tmp_path / "run", tiny_llama_dir, tiny_sharegpt, **over))
    monkeypatch.undo()
    train.main(args(tmp_path / "run", tiny_llama_dir, tiny_sharegpt, **over))
    assert [r["step"] for r in train_rows(tmp_path / "run")] == [5, 6, 6]
    assert train_rows(tmp_path / "run") == train_rows(tmp_path / "ref")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_mid_step_saves_that_step_and_resumes_bit_identical(sig, full_run, tiny_llama_dir, tiny_sharegpt,
                                                                     tmp_path, monkeypatch):
    step = random.Random(int(sig)).randint(1, STEPS - 1)  # a step where no checkpoint was due
    run = tmp_path / "run"
    signal_at_step(monkeypatch, step, (sig,))
    with pytest.raises(Interrupted) as e:
        train.main(args(run, tiny_llama_dir, tiny_sharegpt, **{"train.save_every": 100}))
    assert all(r["step"] <= step for r in metrics(run))
    assert e.value.code == 128 + sig
    assert f"at step {step} of {STEPS}" in str(e.value) and f"checkpoints/step_{step}" in str(e.value)
    assert "resume with python train.py" in str(e.value)
    assert [p.name for p in (run / "checkpoints").iterdir()] == [f"step_{step}"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers given back
    monkeypatch.undo()

    train.main(args(run, tiny_llama_dir, tiny_sharegpt, **{"train.save_every": 100}))
    assert_same_weights(run / "final", full_run / "final")
    assert train_rows(run) == train_rows(full_run)


def test_second_sigint_stops_at_once_without_saving(tiny_llama_dir, tiny_sharegpt, tmp_path, monkeypatch):
    run = tmp_path / "run"
    signal_at_step(monkeypatch, 4, (signal.SIGINT, signal.SIGINT))
    with pytest.raises(Interrupted, match="a second time") as e:
        train.main(args(run, tiny_llama_dir, tiny_sharegpt))
    assert e.value.code == 130
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_3"]  # the one save_every wrote


def test_signal_before_training_stops_at_once(tiny_llama_dir, tiny_sharegpt, tmp_path, monkeypatch):
    """While the target loads there is nothing to checkpoint: the signal stops the run where it is."""
    real = trainer_run.load_target

    def load(*a, **k):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(*a, **k)

    monkeypatch.setattr(trainer_run, "load_target", load)
    with pytest.raises(Interrupted, match="^stopped by SIGTERM$") as e:
        train.main(args(tmp_path / "run", tiny_llama_dir, tiny_sharegpt))
    assert e.value.code == 143
    with run_lock(tmp_path / "run"):  # the lock went with it
        pass


@pytest.mark.parametrize("seen", [(None, None), (signal.SIGTERM, None), (None, signal.SIGINT),
                                  (signal.SIGINT, signal.SIGTERM)])
def test_ranks_agree_to_stop_at_the_same_step(seen, monkeypatch):
    """Schedulers signal the ranks at slightly different moments: every rank stops at the step where any rank
    saw a signal (the all-reduce is simulated here as the sum over two ranks)."""
    from drafthead.trainer import interrupt
    from drafthead.trainer.dist import Dist

    stops = [GracefulStop(), GracefulStop()]
    for st, sig in zip(stops, seen):
        st.requested = sig
    total = sum(torch.tensor([float(st.requested == s) for s in interrupt.SIGNALS]) for st in stops)
    monkeypatch.setattr(interrupt, "all_reduce_sum", lambda t, d: total.clone())
    got = [st.stop_now(Dist(rank=r, world=2)) for r, st in enumerate(stops)]
    if seen == (None, None):
        assert got == [None, None]
    else:
        assert None not in got
        assert all(g == s for g, s in zip(got, seen) if s is not None)  # a rank that saw one stops on its own


def test_signal_during_capture_lands_the_shard_in_flight(tiny_llama_dir, tmp_path, monkeypatch):
    from drafthead.target import load_target
    from drafthead.trainer import capture

    target = load_target(str(tiny_llama_dir), dtype="float32")
    samples = [{"id": f"s{i}", "input_ids": list(range(3, 3 + 5 + i % 7)), "loss_mask": [0, 0] + [1] * (3 + i % 7)}
               for i in range(10)]
    clean = capture_offline(target, samples, tmp_path / "clean", [1, 2], torch.bfloat16, 3, progress=False)
    real, calls = capture._capture_chunk, {"n": 0}

    def chunk(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*a, **k)

    monkeypatch.setattr(capture, "_capture_chunk", chunk)
    with GracefulStop() as stop, pytest.raises(Interrupted, match="2 of 4 shards") as e:
        capture_offline(target, samples, tmp_path / "cap", [1, 2], torch.bfloat16, 3, progress=False, stop=stop)
    assert e.value.code == 143
    assert sorted(p.name for p in (tmp_path / "cap").glob("shard_*")) == ["shard_00000.safetensors",
                                                                         "shard_00001.safetensors"]
    monkeypatch.undo()
    resumed = capture_offline(target, samples, tmp_path / "cap", [1, 2], torch.bfloat16, 3, progress=False)
    assert [s["sha256"] for s in resumed["shards"]] == [s["sha256"] for s in clean["shards"]]


def test_signal_during_a_long_shard_drops_it_and_stops_promptly(tiny_llama_dir, tmp_path, monkeypatch):
    """A shard that would outlast a scheduler's grace is dropped at the next target batch instead."""
    from drafthead.target import load_target
    from drafthead.trainer import capture

    target = load_target(str(tiny_llama_dir), dtype="float32")
    samples = [{"id": f"s{i}", "input_ids": list(range(3, 3 + 5 + i % 7)), "loss_mask": [0, 0] + [1] * (3 + i % 7)}
               for i in range(10)]
    kw = dict(batch_tokens=8, progress=False)  # one conversation a target batch
    clean = capture_offline(target, samples, tmp_path / "clean", [1, 2], torch.bfloat16, 3, **kw)
    real, calls = capture.features_for_batch, {"n": 0}

    def batch(*a, **k):
        calls["n"] += 1
        if calls["n"] == 4:  # the first batch of the second shard
            os.kill(os.getpid(), signal.SIGINT)
        return real(*a, **k)

    monkeypatch.setattr(capture, "features_for_batch", batch)
    monkeypatch.setattr(capture, "FINISH_SHARD_WITHIN_S", -1.0)  # any shard is too long to finish
    with GracefulStop() as stop, pytest.raises(Interrupted, match=r"was dropped; 1 of 4 shards") as e:
        capture_offline(target, samples, tmp_path / "cap", [1, 2], torch.bfloat16, 3, stop=stop, **kw)
    assert e.value.code == 130 and calls["n"] == 4  # the batch in flight ended it: none of the shard's others ran
    assert sorted(p.name for p in (tmp_path / "cap").iterdir()) == ["manifest.json", "shard_00000.safetensors"]
    monkeypatch.undo()
    resumed = capture_offline(target, samples, tmp_path / "cap", [1, 2], torch.bfloat16, 3, **kw)
    assert [s["sha256"] for s in resumed["shards"]] == [s["sha256"] for s in clean["shards"]]


SIGNAL_STEPS = 120  # the signal lands at step 15-40: the run is still well short of its end
SIGNAL_OVER = {"train.max_steps": SIGNAL_STEPS, "train.save_every": 10, "train.keep_checkpoints": 1}
SIGNAL_ENV = {"DRAFTHEAD_MALLOC_RETAIN": "0"}


@pytest.fixture(scope="module")
def never_stopped(tiny_llama_dir, tiny_sharegpt, tmp_path_factory) -> Path:
    """The signalled runs' reference: the same command, never stopped (one for both signals)."""
    ref = tmp_path_factory.mktemp("signals") / "ref"  # in a process of its own too: the suite's thread count
    r = subprocess.run([sys.executable, "train.py", *args(ref, tiny_llama_dir, tiny_sharegpt, **SIGNAL_OVER)],
                       cwd=ROOT, capture_output=True, text=True, env={**os.environ, **SIGNAL_ENV}, timeout=600)
    assert r.returncode == 0, r.stderr
    return ref


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_real_process_signalled_mid_training_resumes_bit_identical(sig, tiny_llama_dir, tiny_sharegpt, tmp_path,
                                                                   never_stopped):
    """`python train.py` as a scheduler sees it: SIGTERM gets a checkpoint at the step in flight and exit 143;
    SIGKILL loses the steps since the last checkpoint. Either way the same command ends equal to a run that
    was never stopped, with each step's metrics once."""
    steps, over, env, ref = SIGNAL_STEPS, SIGNAL_OVER, {**os.environ, **SIGNAL_ENV}, never_stopped
    run = tmp_path / "run"
    cmd = [sys.executable, "train.py", *args(run, tiny_llama_dir, tiny_sharegpt, **over)]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    at = random.Random(int(sig)).randint(15, 40)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and p.poll() is None:
        with contextlib.suppress(FileNotFoundError):
            if sum(1 for _ in open(run / "metrics.jsonl")) >= at:
                break
        time.sleep(0.005)
    p.send_signal(sig)
    _, err = p.communicate(timeout=300)
    assert p.returncode == (143 if sig == signal.SIGTERM else -signal.SIGKILL), err
    seen = len(train_rows(run))
    assert seen < steps, "the run ended before the signal: nothing was tested"
    if sig == signal.SIGTERM:
        assert "stopped by SIGTERM at step" in err and "Traceback" not in err
        assert list_checkpoints(run)[-1].name == f"step_{seen}"  # the step in flight, saved
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    assert_same_weights(run / "final", ref / "final")
    assert [r["step"] for r in train_rows(run)] == list(range(1, steps + 1)) + [steps]  # + the final eval
    assert train_rows(run) == train_rows(ref)


# ----------------------------------------------------------------------------- metrics after a resume

def test_resume_cuts_metrics_back_to_the_checkpoint(full_run, tiny_llama_dir, tiny_sharegpt, tmp_path):
    """kill -9 between step 4's metrics row and its checkpoint: step_3 is the newest, metrics run to 4."""
    import shutil

    run = tmp_path / "run"
    train.main(args(run, tiny_llama_dir, tiny_sharegpt, **{"train.stop_after_steps": 4}))
    shutil.rmtree(run / "checkpoints" / "step_4")
    assert [r["step"] for r in train_rows(run)] == [1, 2, 3, 4]
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "loss": 1.')  # and a row cut short by the kill
    train.main(args(run, tiny_llama_dir, tiny_sharegpt))
    assert train_rows(run) == train_rows(full_run)


def test_fresh_start_clears_metrics_of_a_run_without_checkpoint(full_run, tiny_llama_dir, tiny_sharegpt, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n{"step": 2, "loss": 8.0}\n')
    train.main(args(run, tiny_llama_dir, tiny_sharegpt))
    assert train_rows(run) == train_rows(full_run)


# ----------------------------------------------------------------------------- the target's fingerprint

def test_fingerprint_is_the_same_in_any_dtype_and_differs_for_a_fine_tune(tiny_llama_dir, other_llama_dir):
    from drafthead.target import load_target

    a32 = load_target(str(tiny_llama_dir), dtype="float32")
    a16 = load_target(str(tiny_llama_dir), dtype="bfloat16")
    b = load_target(str(other_llama_dir), dtype="float32")
    assert a32.fingerprint == a16.fingerprint == compute(a32.model, a32.tokenizer)
    assert b.fingerprint["weights"] != a32.fingerprint["weights"]
    assert b.fingerprint["config"] == a32.fingerprint["config"] and b.fingerprint["vocab"] == a32.fingerprint["vocab"]


def test_draft_records_the_fingerprint_and_refuses_another_target(full_run, tiny_llama_dir, other_llama_dir,
                                                                  tmp_path):
    from drafthead.export import export
    from drafthead.export.common import FINGERPRINT_KEY, ExportError
    from drafthead.registry import read_draft_config
    from drafthead.target import load_target
    from drafthead.eval import load_models

    fp = read_draft_config(full_run / "final")["target"]["fingerprint"]
    assert fp == load_target(str(tiny_llama_dir), dtype="float32").fingerprint

    # eval / bench load the draft through load_models
    _, drafter, note = load_models(str(full_run / "final"), None, None, "cpu", "float32")
    assert drafter is not None and note is None
    with pytest.raises(TargetMismatch, match=r"its weights differ \(trained on config:\w+ weights:\w+ .*this target "
                                             r"is .*allow_target_mismatch=true"):
        load_models(str(full_run / "final"), str(other_llama_dir), None, "cpu", "float32")
    _, drafter, note = load_models(str(full_run / "final"), str(other_llama_dir), None, "cpu", "float32",
                                   allow_target_mismatch=True)
    assert drafter is not None and "run anyway" in note

    # export: refused before anything is written; allowed on request; the export carries the fingerprint
    with pytest.raises(ExportError, match="trained on another target"):
        export(full_run / "final", "sglang", tmp_path / "x", target=str(other_llama_dir))
    assert not (tmp_path / "x").exists()
    out = export(full_run / "final", "sglang", tmp_path / "y", target=str(other_llama_dir),
                 allow_target_mismatch=True)
    assert json.loads((out / "config.json").read_text())[FINGERPRINT_KEY].startswith(f"config:{fp['config']}")
    assert cli.main(["export", f"draft={full_run / 'final'}", "to=sglang", f"out={tmp_path / 'z'}",
                     f"target={other_llama_dir}"]) == 2


def test_eval_cli_refuses_another_target_in_one_line(full_run, other_llama_dir, capsys):
    assert cli.main(["eval", f"draft={full_run / 'final'}", f"target={other_llama_dir}", "dtype=float32",
                     "dataset=mt_bench", "max_prompts=1", "max_new_tokens=4", "progress=false"]) == 2
    err = capsys.readouterr().err.strip().splitlines()  # transformers' loading bars come before it
    assert err[-1].startswith("drafthead eval: error: draft ") and "trained on another target" in err[-1]
    assert "Traceback" not in "\n".join(err)


def test_resume_refuses_a_checkpoint_of_another_target(tiny_llama_dir, other_llama_dir, tiny_sharegpt, tmp_path):
    run = tmp_path / "run"
    train.main(args(run, tiny_llama_dir, tiny_sharegpt, **{"train.stop_after_steps": 3}))
    with pytest.raises(TargetMismatch, match=r"checkpoint .*step_3 was trained on another target.*"
                                             r"target\.allow_mismatch=true"):
        train.main(args(run, other_llama_dir, tiny_sharegpt))
    train.main(args(run, other_llama_dir, tiny_sharegpt, **{"target.allow_mismatch": "true"}))
    assert (run / "final").is_dir()


# ----------------------------------------------------------------------------- read-only and full destinations

@contextlib.contextmanager
def small_mount(path: Path, size: str = "64k", read_only: bool = False):
    """A tmpfs of `size` at `path` (read-only if asked); skips where this process may not mount."""
    path.mkdir(parents=True, exist_ok=True)
    opts = f"size={size}" + (",ro" if read_only else "")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        if read_only and os.geteuid() != 0:  # a plain read-only folder holds for a user who is not root
            path.chmod(0o555)
            try:
                yield path
            finally:
                path.chmod(0o755)
            return
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}): needs root or CAP_SYS_ADMIN")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


@pytest.mark.parametrize("fmt,out", [("sglang", "sg"), ("speculators", "spec")])
@pytest.mark.parametrize("kind", ["read-only", "full"])
def test_export_to_a_read_only_or_full_destination_is_one_line(kind, fmt, out, full_run, tiny_llama_dir, tmp_path,
                                                               capsys):
    with small_mount(tmp_path / "mnt", "16k", read_only=kind == "read-only") as mnt:
        rc = cli.main(["export", f"draft={full_run / 'final'}", f"to={fmt}", f"out={mnt / out}",
                       f"target={tiny_llama_dir}"])
        err = capsys.readouterr().err.strip().splitlines()  # the target's loading bar may come first
        assert rc == 2 and "Traceback" not in "\n".join(err), err
        cause = "Read-only file system" if kind == "read-only" else "No space left on device"
        assert err[-1] == f"drafthead export: error: cannot write {mnt / out}: {cause}", err[-1]
        assert list(mnt.iterdir()) == []  # nothing half-written, no temp files


def test_gguf_export_to_a_full_disk_is_one_line(tmp_path):
    """The GGUF writer's own file (not an atomic_dir): the same one line, nothing left behind."""
    from drafthead.export.gguf import write_atomic

    def write(tmp: Path) -> None:
        tmp.write_bytes(b"\0" * (1 << 20))

    with small_mount(tmp_path / "mnt", "64k") as mnt:
        with pytest.raises(WriteError, match=rf"cannot write {mnt}/d.gguf: No space left on device"):
            write_atomic(mnt / "d.gguf", write)
        assert list(mnt.iterdir()) == []


def test_training_into_a_full_disk_is_one_line(tiny_llama_dir, tiny_sharegpt, tmp_path):
    with small_mount(tmp_path / "mnt", "24k") as mnt:
        r = subprocess.run([sys.executable, "train.py", *args(mnt / "run", tiny_llama_dir, tiny_sharegpt)],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert r.returncode == 2, r.stderr
        assert "Traceback" not in r.stderr and "No space left on device" in r.stderr.strip().splitlines()[-1]

"""train.py end to end on a tiny random target: resume equivalence, run-dir contents, offline == online,
bad inputs; torchrun DDP, DeepSpeed ZeRO-2 and the real SmolLM2 recipe as `slow` subprocess tests."""
from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from drafthead import hardware
from drafthead.registry import load_draft, read_draft_config
from drafthead.target import load_target
from drafthead.trainer.checkpoint import list_checkpoints
from drafthead.trainer.config import load_config
from drafthead.trainer.data import load_conversations, read_jsonl, split_holdout

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("train_script", ROOT / "train.py")
train = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train)


@pytest.fixture(autouse=True)
def _tmp_cache(request, tmp_path, monkeypatch):
    """Tiny runs keep their tokenize/datasets caches in tmp; the slow SmolLM2 run uses the real cache."""
    if request.node.get_closest_marker("slow") is None:
        monkeypatch.setenv("DRAFTHEAD_CACHE", str(tmp_path / "cache"))


def args(run_dir: Path, target_dir: Path, data: Path, **over) -> list[str]:
    """A tiny, fast run: 36 training conversations, 4 held out, TTT 3, 6 steps of 2 conversations. Everything
    the tests rely on is pinned here, whatever the default recipe says."""
    kv = {"target.name_or_path": target_dir, "target.dtype": "float32", "data.dataset": data,
          "data.max_samples": "null", "data.num_holdout": 4, "data.max_length": 96, "data.overlong": "truncate",
          "data.regenerate.enabled": "false", "drafter.eagle3.draft_vocab_size": 128,
          "drafter.eagle3.num_draft_tokens": 3, "drafter.eagle3.step_decay": 0.8,
          "capture.mode": "online", "capture.layer_ids": "[1,2,3]",
          "capture.dtype": "bfloat16", "train.epochs": 1, "train.batch_size": 2, "train.batch_tokens": "null",
          "train.grad_accum": 1, "train.max_steps": 6, "train.save_every": 3, "train.keep_checkpoints": 2,
          "train.eval_every": 0, "train.eval_samples": "null", "train.lr": 1e-3, "train.warmup_ratio": 0.02,
          "train.min_lr_ratio": 0.0, "train.dtype": "float32", "train.deepspeed": "null",
          "logging.wandb": "false", "logging.progress": "false", "logging.log_every": 1, "budget.minutes": "null",
          "train.choose_serving": "false", "output_dir": run_dir, **over}  # the serving timing: full_run's only
    if over.get("drafter.family", "eagle3") != "eagle3":  # another family's keys are an error (nothing reads them)
        kv = {k: v for k, v in kv.items() if not k.startswith("drafter.eagle3.")}
    return [f"{k}={v}" for k, v in kv.items()]


def without_wall(row: dict) -> dict:
    """A metrics row minus `wall_s`, the one field that differs between otherwise identical runs."""
    return {k: v for k, v in row.items() if k != "wall_s"}


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def assert_same_weights(a: Path, b: Path, atol: float = 0.0) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


SERVING = {"train.choose_serving": "true"}  # the one tiny run that times the runtime after its save


@pytest.fixture(scope="module")
def full_run(tiny_llama_dir, tiny_sharegpt, tmp_path_factory) -> Path:
    """6 steps in one go (module-scoped: test (a) compares against it, test (b) inspects it)."""
    run = tmp_path_factory.mktemp("full") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DRAFTHEAD_CACHE", str(run.parent / "cache"))
        assert train.main(args(run, tiny_llama_dir, tiny_sharegpt, **SERVING)) == run / "final"
    return run


# ----------------------------------------------------------------------------- (a) resume

def test_resume_gives_the_same_draft(full_run, tiny_llama_dir, tiny_sharegpt, tmp_path, capsys):
    run = tmp_path / "run"
    train.main(args(run, tiny_llama_dir, tiny_sharegpt, **{"train.stop_after_steps": 3}))
    assert "stopped at step 3 of 6" in capsys.readouterr().out
    assert not (run / "final").exists()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_3"]
    assert [r["step"] for r in metrics(run)] == [1, 2, 3]

    train.main(args(run, tiny_llama_dir, tiny_sharegpt, **{"train.resume": "auto"}))
    assert "resumed from" in capsys.readouterr().out
    assert_same_weights(run / "final", full_run / "final")
    assert_same_weights(run / "checkpoints" / "step_6", full_run / "checkpoints" / "step_6")
    rows, ref = metrics(run), metrics(full_run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6, 6]  # continues at 4; the last row is the eval
    for r, q in zip(rows[3:6], ref[3:6]):  # same losses, rates and accuracies after the restart
        assert {k: r[k] for k in ("step", "loss", "lr", "acc_0", "acc_2", "tokens_seen")} == \
            {k: q[k] for k in ("step", "loss", "lr", "acc_0", "acc_2", "tokens_seen")}
    assert without_wall(rows[-1]) == without_wall(ref[-1])  # final eval


# ----------------------------------------------------------------------------- (b) run dir

def test_run_dir_contents(full_run, tiny_llama_dir, tiny_sharegpt):
    # the resolved recipe, loadable again
    cfg = load_config([f"recipe={full_run / 'config.yaml'}"])
    assert cfg.train.max_steps == 6 and cfg.recipe == "eagle3_smollm2" and cfg.capture.layer_ids == [1, 2, 3]
    assert cfg == load_config(args(full_run, tiny_llama_dir, Path(cfg.data.dataset), **SERVING))
    assert cfg.target.name_or_path == str(tiny_llama_dir) and cfg.output_dir == str(full_run)

    rows = metrics(full_run)
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3, 4, 5, 6]
    for r in train_rows:
        assert {"step", "epoch", "loss", "lr", "acc_0", "acc_1", "acc_2", "tokens_per_s", "tokens_seen",
                "wall_s"} <= set(r)
        assert r["loss"] > 0 and r["tokens_per_s"] > 0 and all(0 <= r[f"acc_{i}"] <= 1 for i in range(3))
    assert "acc_3" not in train_rows[0]
    # the lr of each row is the one its step used: warmup (1 step) then cosine down to ~0 at the last step
    lrs = [r["lr"] for r in train_rows]
    assert lrs[0] == pytest.approx(1e-3) and lrs == sorted(lrs, reverse=True) and 0 < lrs[-1] < 1e-4
    assert train_rows[-1]["tokens_seen"] > train_rows[0]["tokens_seen"] > 0
    ev = rows[-1]
    assert ev["step"] == 6 and {"eval/acc_0", "eval/acc_2", "eval/loss", "eval/sim_accept_len"} <= set(ev)
    assert 1.0 <= ev["eval/sim_accept_len"] <= 4.0

    ckpts = sorted((full_run / "checkpoints").iterdir())
    assert [p.name for p in ckpts] == ["step_3", "step_6"]
    st = json.loads((ckpts[1] / "trainer_state.json").read_text())
    assert st["step"] == 6 and st["world"] == 1 and st["engine"] == "torch"
    assert {"model.safetensors", "optimizer.pt", "rng_rank0.pt", "config.yaml"} <= {p.name for p in ckpts[1].iterdir()}

    # final/ is a draft: loads with the target's embedding, weights = the last checkpoint's, target described
    target = load_target(str(tiny_llama_dir), dtype="float32")
    meta = read_draft_config(full_run / "final")
    assert meta["family"] == "eagle3" and meta["target"]["num_hidden_layers"] == 4
    assert meta["draft"]["aux_layer_ids"] == [1, 2, 3] and meta["draft"]["draft_vocab_size"] == 128
    assert meta["train"]["steps"] == 6 and "eval/acc_0" in meta["train"]
    # the serving record: the draft length with the best held-out tau over its measured round cost, k <= depth 3
    serving = meta["serving"]
    assert set(serving["by_length"]) == {"1", "2", "3"} and set(serving["tree_trial"]) == {"chain", "tree 2x4",
                                                                                            "tree 4x8"}
    best = max(serving["by_length"].items(), key=lambda kv: (kv[1]["tau"] / kv[1]["cost"], -int(kv[0])))
    assert serving["chain_length"] == int(best[0]) and all(
        v["cost"] > 0 and 1 <= v["tau"] <= 1 + int(k) for k, v in serving["by_length"].items())
    tree = max((n for n in serving["tree_trial"] if n != "chain"), key=serving["tree_trial"].get)
    if serving["tree_trial"][tree] > serving["tree_trial"]["chain"]:  # a tree measured faster: it is served
        assert serving["mode"] == "tree" and f"tree {serving['topk']}x{serving['tree_nodes']}" == tree
    else:
        assert serving["mode"] == "chain" and serving["num_speculative_tokens"] == int(best[0])
    draft = load_draft(full_run / "final", embed_weight=target.model.get_input_embeddings().weight)
    ck = weights(ckpts[1])
    assert "embed_tokens.weight" not in ck  # the target's tensors: neither checkpoints nor final/ store them
    for k, v in draft.state_dict().items():
        if k != "embed_tokens.weight":
            assert torch.equal(v, ck[k]), k
    assert torch.equal(draft.embed_tokens.weight, target.model.get_input_embeddings().weight)
    assert "embed_tokens.weight" not in weights(full_run / "final")
    ids = draft.d2t + torch.arange(128)
    assert draft.t2d.sum() == 128 and draft.t2d[ids].all()

    # held-out conversations: the 4 of the fixed-seed split, none of them trained on
    held = read_jsonl(full_run / "heldout.jsonl")
    train_convs, held_convs = split_holdout(load_conversations(str(tiny_sharegpt))[0], 4, cfg.data.split_seed)
    assert held == held_convs and not {c.id for c in held} & {c.id for c in train_convs}


# ----------------------------------------------------------------------------- (f) offline

def test_offline_training_equals_online(tiny_llama_dir, tiny_sharegpt, tmp_path):
    """One conversation per micro-batch and per capture forward: offline features are bit-identical to
    online ones, so the drafts are too."""
    small = {"train.batch_size": 1, "train.max_steps": 4, "train.save_every": 0}
    on, off = tmp_path / "online", tmp_path / "offline"
    train.main(args(on, tiny_llama_dir, tiny_sharegpt, **small))
    train.main(args(off, tiny_llama_dir, tiny_sharegpt, **small, **{"capture.mode": "offline",
                                                                    "capture.batch_tokens": 1,
                                                                    "capture.shard_samples": 10}))
    m = json.loads((off / "capture" / "manifest.json").read_text())
    assert m["complete"] and m["num_samples"] == 36 and len(m["shards"]) == 4 and m["layer_ids"] == [1, 2, 3]
    assert_same_weights(off / "final", on / "final")
    assert [r["loss"] for r in metrics(off)[:4]] == [r["loss"] for r in metrics(on)[:4]]


def test_drafthead_capture_then_train_reuses_the_shards(tiny_llama_dir, tiny_sharegpt, tmp_path, capsys):
    from drafthead.trainer.commands import capture as capture_main

    run, cap = tmp_path / "run", tmp_path / "cap"
    kw = {"capture.mode": "offline", "capture.dir": cap, "train.max_steps": 2, "train.save_every": 0}
    assert capture_main(args(run, tiny_llama_dir, tiny_sharegpt, **kw)) == 0
    out = capsys.readouterr().out
    assert "captured 36 samples" in out and f"capture.dir={cap}" in out
    stamps = {p.name: p.stat().st_mtime_ns for p in cap.glob("shard_*.safetensors")}
    train.main(args(run, tiny_llama_dir, tiny_sharegpt, **kw))
    assert (run / "final" / "model.safetensors").exists()
    assert {p.name: p.stat().st_mtime_ns for p in cap.glob("shard_*.safetensors")} == stamps  # not captured again


def test_offline_capture_with_other_layers_is_refused(tiny_llama_dir, tiny_sharegpt, tmp_path):
    run = tmp_path / "run"
    kw = {"capture.mode": "offline", "train.max_steps": 1, "train.save_every": 0}
    train.main(args(run, tiny_llama_dir, tiny_sharegpt, **kw))
    with pytest.raises(Exception, match=r"existing capture was made with layer_ids=\[1, 2, 3\].*\[0, 1, 2\]"):
        train.main(args(run, tiny_llama_dir, tiny_sharegpt, **kw, **{"capture.layer_ids": "[0,1,2]"}))


# ----------------------------------------------------------------------------- (g) bad inputs

def test_regenerate_heldout_answers_the_heldout_prompts(tiny_llama_dir, tiny_sharegpt, tmp_path):
    """data.regenerate.heldout: held-out answers (and so held-out accuracy) come from the target too."""
    run = tmp_path / "run"
    train.main(args(run, tiny_llama_dir, tiny_sharegpt, **{
        "data.regenerate.enabled": "true", "data.regenerate.heldout": "true", "data.regenerate.fraction": 0.25,
        "data.regenerate.max_new_tokens": 8, "data.regenerate.batch_size": 4, "train.max_steps": 1}))
    held = [json.loads(line) for line in (run / "heldout.jsonl").read_text().splitlines()]
    (regen_file,) = run.glob("regenerated-heldout-*.jsonl")
    regen = {r["id"]: r["messages"] for r in map(json.loads, regen_file.read_text().splitlines())}
    assert len(held) == 4 and {r["id"] for r in held} == set(regen)  # every held-out prompt, whatever `fraction`
    assert all(r["messages"] == regen[r["id"]] for r in held)


def test_all_rows_bad_is_a_clear_error(tiny_llama_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"conversations": [{"from": "bing", "value": "x"}]}\nnot json\n'
                   '{"conversations": [{"from": "human", "value": "no answer"}]}\n')
    with pytest.raises(ValueError, match=r"no usable conversations.*"
                                         r"skipped: 1 malformed json, 1 no assistant turn, 1 unknown role"):
        train.main(args(tmp_path / "run", tiny_llama_dir, bad))


def test_holdout_larger_than_data_is_a_clear_error(tiny_llama_dir, tiny_sharegpt, tmp_path):
    with pytest.raises(ValueError, match=r"40 usable conversations.*data\.num_holdout=50"):
        train.main(args(tmp_path / "run", tiny_llama_dir, tiny_sharegpt, **{"data.num_holdout": 50}))


def test_max_samples_counts_training_conversations(tiny_llama_dir, tiny_sharegpt, tmp_path):
    from drafthead.trainer.dist import Dist
    from drafthead.trainer.prepare import prepare_samples

    cfg = load_config(args(tmp_path / "run", tiny_llama_dir, tiny_sharegpt, **{"data.max_samples": 10}))
    prep = prepare_samples(cfg, load_target(str(tiny_llama_dir), dtype="float32"), Dist(), tmp_path / "run",
                           log=lambda *a: None)
    assert len(prep.train) == 10 and len(prep.heldout) == len(prep.heldout_convs) == 4
    assert not {s["id"] for s in prep.train} & {c.id for c in prep.heldout_convs}


def test_resume_true_without_checkpoint_is_a_clear_error(tiny_llama_dir, tiny_sharegpt, tmp_path):
    with pytest.raises(SystemExit, match=r"train\.resume=true but .*checkpoints has no checkpoint"):
        train.main(args(tmp_path / "run", tiny_llama_dir, tiny_sharegpt, **{"train.resume": "true"}))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_retain_freed_memory_keeps_big_frees_in_the_heap():
    """train.py's allocator setting, in a fresh process: afterwards a freed 64 MB tensor is reused
    without new page faults (the default glibc setting mmaps and faults it in again every time), and
    DRAFTHEAD_MALLOC_RETAIN=0 turns it off."""
    code = (
        "import resource, torch\n"
        # the trainer's own imports first: it calls this after them (trainer/run.py), and the heap's layout
        # they leave decides whether glibc can reuse a freed 64 MB block in place (after `import torch` alone
        # it could not here, and every use faulted again)
        "from drafthead.trainer.run import retain_freed_memory\n"
        "on = retain_freed_memory()\n"
        "torch.empty(16 << 20).fill_(1)\n"  # first use of 64 MB: faults either way
        "r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
        "for _ in range(10): torch.empty(16 << 20).fill_(1)\n"
        "print(on, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0)\n"
        "from drafthead.trainer.memory import trim_freed_memory\n"
        "def anon(): return int([l for l in open('/proc/self/status') if l.startswith('RssAnon')][0].split()[1])\n"
        "x = [torch.empty(4 << 20).fill_(1) for _ in range(32)]; before = anon(); del x[::2]\n"  # holes
        "print(trim_freed_memory(), before - anon())\n")
    root = Path(__file__).resolve().parent.parent
    for flag, want_on in (("1", True), ("0", False)):
        env = {**os.environ, "DRAFTHEAD_MALLOC_RETAIN": flag, "PYTHONPATH": str(root)}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=root,
                             check=True).stdout.split()
        on, faults, trimmed, freed_kb = out[0] == "True", int(out[1]), out[2] == "True", int(out[3])
        assert on is want_on and trimmed is want_on
        if want_on:
            assert faults < 3 * 16384, faults  # glibc may move the block once or twice
            assert freed_kb > 200_000, freed_kb  # 16 freed 16 MiB holes inside the heap go back to the OS
        else:
            assert faults > 9 * 16384, faults  # 16k pages of 4 KiB faulted in on every use


def test_heap_cap_trims_once_the_heap_outgrows_its_slack(monkeypatch):
    """The per-step check: the first call after a trim takes the base (the step's working set included);
    a trim only once the process grew the slack past it; nothing without retain_freed_memory."""
    from drafthead.trainer import memory

    rss = {"now": 5 << 30}
    trims = []
    monkeypatch.setattr(memory, "resident_bytes", lambda: rss["now"])
    monkeypatch.setattr(memory, "trim_freed_memory", lambda: trims.append(rss["now"]) or True)
    monkeypatch.setattr(memory, "_LIBC", object())
    cap = memory.HeapCap(slack_bytes=2 << 30)
    assert cap() is False and cap.base == 5 << 30  # base taken
    rss["now"] = (7 << 30) - 1
    assert cap() is False and not trims  # within the slack
    rss["now"] = 7 << 30
    assert cap() is True and trims == [7 << 30] and cap.base is None and cap.trims == 1
    rss["now"] = 4 << 30  # after the trim: the next call measures the new base
    assert cap() is False and cap.base == 4 << 30
    cap.trim()  # a trim at an evaluation or checkpoint: handed back, base measured again
    assert trims == [7 << 30, 4 << 30] and cap.base is None and cap.trims == 2
    monkeypatch.setattr(memory, "_LIBC", None)  # retain_freed_memory off (or not glibc): nothing to hand back
    rss["now"] = 100 << 30
    assert cap() is False and cap() is False and len(trims) == 2


def test_resident_bytes_reads_this_process():
    if not sys.platform.startswith("linux"):
        pytest.skip("/proc/self/statm is Linux only")
    from drafthead.trainer.memory import resident_bytes

    import mmap

    before = resident_bytes()
    m = mmap.mmap(-1, 64 << 20)  # 64 MiB from the kernel, not from a heap that may hold freed pages already
    for off in range(0, 64 << 20, 4096):
        m[off] = 1  # touch every page
    assert resident_bytes() - before > 48 << 20
    m.close()


def test_bad_config_exits_before_any_work(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        train.main([f"output_dir={tmp_path / 'run'}", "train.max_step=3"])
    assert e.value.code == 2 and "did you mean 'train.max_steps'" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- (c, d) torchrun

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(argv: list[str], cache: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DRAFTHEAD_CACHE": str(cache)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), str(ROOT / "train.py"), *argv]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return p


# 5 held out: 2 per rank are evaluated (every rank must run the same number of eval batches)
DIST = {"train.max_steps": 4, "train.save_every": 2, "data.num_holdout": 5}


@pytest.fixture(scope="module")
def ddp_run(tiny_llama_dir, tiny_sharegpt, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("ddp") / "run"
    p = torchrun(args(run, tiny_llama_dir, tiny_sharegpt, **DIST) + ["train.num_threads=1"], run.parent / "cache")
    assert "world size 2" in p.stdout and f"draft saved to {run / 'final'}" in p.stdout
    return run


@pytest.mark.slow
def test_ddp_two_processes(ddp_run, tiny_llama_dir):
    st = json.loads((ddp_run / "checkpoints" / "step_4" / "trainer_state.json").read_text())
    assert st["world"] == 2 and st["engine"] == "torch"
    assert (ddp_run / "checkpoints" / "step_4" / "rng_rank1.pt").exists()
    rows = [r for r in metrics(ddp_run) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[0]["tokens_seen"] > 0 and rows[0]["epoch"] == pytest.approx(1 / 9)  # 18 batches of <=2, 9 per rank
    assert 1.0 <= metrics(ddp_run)[-1]["eval/sim_accept_len"] <= 4.0
    target = load_target(str(tiny_llama_dir), dtype="float32")
    load_draft(ddp_run / "final", embed_weight=target.model.get_input_embeddings().weight)


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_deepspeed_two_processes(stage, ddp_run, tiny_llama_dir, tiny_sharegpt, tmp_path):
    """ZeRO-2/3 on CPU (DS_ACCELERATOR=cpu set by train.py) train the same draft as DDP. ZeRO-3 with every
    weight sharded (persistence threshold 0; by default it keeps small tensors whole): final/ must hold the
    gathered weights, not the empty local shards."""
    run = tmp_path / "run"
    ds = stage
    if stage == "zero3":
        cfg = json.loads((ROOT / "recipes" / "deepspeed" / "zero3.json").read_text())
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        ds = tmp_path / "zero3_shard_all.json"
        ds.write_text(json.dumps(cfg))
    p = torchrun(args(run, tiny_llama_dir, tiny_sharegpt, **DIST, **{"train.deepspeed": ds}) +
                 ["train.num_threads=1"], tmp_path / "cache", timeout=480)
    assert f"draft saved to {run / 'final'}" in p.stdout
    ck = run / "checkpoints" / "step_4"
    st = json.loads((ck / "trainer_state.json").read_text())
    assert st["engine"] == "deepspeed" and st["world"] == 2 and st["step"] == 4
    assert len(list((ck / "deepspeed").glob("*zero_pp_rank_*_optim_states.pt"))) == 2
    assert_same_weights(run / "final", ddp_run / "final", atol=1e-5)  # other reduction orders
    assert [r["loss"] for r in metrics(run) if "loss" in r] == \
        pytest.approx([r["loss"] for r in metrics(ddp_run) if "loss" in r], rel=1e-6)
    # held-out eval on both ranks
    assert without_wall(metrics(run)[-1]) == pytest.approx(without_wall(metrics(ddp_run)[-1]), rel=1e-5)


# ----------------------------------------------------------------------------- (e) real SmolLM2

def train_real_smollm2(tmp_path: Path, recipe: str, steps: int, plan: bool = False
                       ) -> tuple[Path, subprocess.CompletedProcess]:
    """`train.py recipe=RECIPE` on 16 real conversations for `steps` steps; asserts it finished and saved. The
    recipe's time budget measures the machine (about a minute on 2 cores), and the serving length is timed after
    the save, only where `plan` asks for them: one smoke covers both on the real target, the others their family's
    path."""
    run = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "train.py"), f"recipe={recipe}", "data.max_samples=16",
           f"train.max_steps={steps}", f"output_dir={run}", "logging.wandb=false", "logging.progress=false",
           "train.eval_samples=8",
           # the budget's probe at its smallest: one timed batch a phase on 64 conversations (the path, not the figure)
           *(["budget.probe_batches=1", "budget.probe_samples=64"] if plan else
             ["budget.minutes=null", "train.choose_serving=false"])]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1500,
                       env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    assert f"draft saved to {run / 'final'}" in p.stdout
    return run, p


@pytest.mark.slow
def test_real_smollm2_recipe_smoke(tmp_path):
    run, p = train_real_smollm2(tmp_path, "eagle3_smollm2", steps=4, plan=True)
    assert "target: smollm2-135m-instruct (30 layers, hidden 576, vocab 49152)" in p.stdout
    # dtype auto, said with its reason; the recipe's 60-minute budget measures the machine even when the
    # run's size is given, and then only estimates
    cls = hardware.cpu_class()
    assert f"target dtype: {'bfloat16' if hardware.native_bf16() else 'float32'} (CPU capability" in p.stdout
    assert "plan: 16 conversations" in p.stdout and f"on this machine ({cls}," in p.stdout
    assert "[all given]" in p.stdout and "plan after capture" not in p.stdout
    recipe = load_config(["recipe=eagle3_smollm2"])
    meta = read_draft_config(run / "final")
    assert meta["draft"]["aux_layer_ids"] == [2, 15, 27]  # the default [2, N//2, N-3] for 30 layers
    assert meta["draft"]["draft_vocab_size"] == recipe.drafter.eagle3.draft_vocab_size
    assert meta["draft"]["num_draft_tokens"] == recipe.drafter.eagle3.num_draft_tokens
    assert meta["train"]["steps"] == 4 and meta["train"]["recipe"] == "eagle3_smollm2"
    rows = [r for r in metrics(run) if "loss" in r]
    assert rows[-1]["step"] == 4 and all(r["loss"] > 0 for r in rows)
    assert len(read_jsonl(run / "heldout.jsonl")) == recipe.data.num_holdout
    serving = meta["serving"]  # timed on the real target: a length up to the trained depth, and the tree trial
    assert 1 <= serving["chain_length"] <= recipe.drafter.eagle3.num_draft_tokens
    assert serving["mode"] in ("chain", "tree")
    assert set(serving["tree_trial"]) == {"chain", "tree 2x4", "tree 4x8"} and "serving: mode=" in p.stdout


@pytest.mark.slow
def test_real_smollm2_mtp_recipe_smoke(tmp_path):
    """mtp_smollm2 end to end on the real target: the block starts from SmolLM2's last layer, the draft
    saves in our format and loads back for the runtime."""
    run, p = train_real_smollm2(tmp_path, "mtp_smollm2", steps=3)
    assert "init target (last decoder layer)" in p.stdout
    meta = read_draft_config(run / "final")
    assert meta["family"] == "mtp" and meta["train"]["steps"] == 3 and meta["train"]["recipe"] == "mtp_smollm2"
    rows = [r for r in metrics(run) if "loss" in r]
    assert rows[-1]["step"] == 3 and all(r["loss"] > 0 for r in rows)
    assert any("eval/acc_1" in r for r in metrics(run))  # K=2 depths evaluated on held-out data


DFLASH = {"drafter.family": "dflash", "drafter.dflash.mask_token_id": 3, "drafter.dflash.block_size": 4,
          "drafter.dflash.num_layers": 1, "drafter.dflash.target_layer_ids": "[0,2]", "capture.layer_ids": "null"}


def test_dflash_resume_gives_the_same_draft(tiny_llama_dir, tiny_sharegpt, tmp_path, capsys):
    """Anchors are drawn from the torch RNG each step; a resumed run restores it and ends bit-identical."""
    full, part = tmp_path / "full", tmp_path / "part"
    train.main(args(full, tiny_llama_dir, tiny_sharegpt, **DFLASH, **{"train.eval_every": 3, "train.eval_samples": 4}))
    train.main(args(part, tiny_llama_dir, tiny_sharegpt, **DFLASH, **{"train.stop_after_steps": 3,
                                                                     "train.eval_every": 3, "train.eval_samples": 4}))
    train.main(args(part, tiny_llama_dir, tiny_sharegpt, **DFLASH, **{"train.resume": "auto", "train.eval_every": 3,
                                                                     "train.eval_samples": 4}))
    assert "resumed from" in capsys.readouterr().out
    assert_same_weights(part / "final", full / "final")
    evals = [r for r in metrics(full) if "eval/block_accept_len" in r]
    assert [r["step"] for r in evals] == [3, 6] and all(1.0 <= r["eval/block_accept_len"] <= 4.0 for r in evals)
    assert without_wall(metrics(part)[-1]) == without_wall(metrics(full)[-1])
    meta = read_draft_config(full / "final")
    assert meta["family"] == "dflash" and meta["draft"]["target_layer_ids"] == [0, 2]


@pytest.mark.slow
def test_real_smollm2_dflash_recipe_smoke(tmp_path):
    """dflash_smollm2 end to end on the real target: the mask token is checked against the data, the draft
    saves without the target's head and loads back for the runtime."""
    run, p = train_real_smollm2(tmp_path, "dflash_smollm2", steps=3)
    assert "mask token 16" in p.stdout and "init the target's last 3 layer(s)" in p.stdout
    meta = read_draft_config(run / "final")
    assert meta["family"] == "dflash" and meta["draft"]["target_layer_ids"] == [1, 14, 27]
    assert "target_lm_head.weight" not in weights(run / "final")
    assert any("eval/block_accept_len" in r for r in metrics(run))


LORA = {"drafter.family": "lora", "drafter.lora.exit_layer": 1, "drafter.lora.rank": 4, "capture.layer_ids": "null"}


def test_lora_resume_gives_the_same_draft(tiny_llama_dir, tiny_sharegpt, tmp_path, capsys):
    """Checkpoints hold the adapters (the target's tensors the drafter shares are not written, even when tied);
    a resumed run ends bit-identical to an uninterrupted one."""
    full, part = tmp_path / "full", tmp_path / "part"
    train.main(args(full, tiny_llama_dir, tiny_sharegpt, **LORA))
    train.main(args(part, tiny_llama_dir, tiny_sharegpt, **LORA, **{"train.stop_after_steps": 3}))
    ckpt = list_checkpoints(part)[-1]
    assert all(".lora_" in k for k in weights(ckpt))
    train.main(args(part, tiny_llama_dir, tiny_sharegpt, **LORA, **{"train.resume": "auto"}))
    assert "resumed from" in capsys.readouterr().out
    assert_same_weights(part / "final", full / "final")
    assert read_draft_config(full / "final")["draft"]["exit_layer"] == 1


@pytest.mark.slow
def test_real_smollm2_lora_recipe_smoke(tmp_path):
    """lora_smollm2 end to end on the real target: the exit block is layer 2 with adapters, final/ holds the
    adapters alone, and the draft loads back on the target and drafts losslessly in our runtime."""
    from drafthead.registry import load_draft
    from drafthead.runtime import SpecConfig, SpeculativeGenerator
    from drafthead.target import load_target

    run, p = train_real_smollm2(tmp_path, "lora_smollm2", steps=3)
    assert "exit after layer 2 (target layers shared, adapters fresh)" in p.stdout
    meta = read_draft_config(run / "final")
    assert meta["family"] == "lora" and meta["draft"]["exit_layer"] == 2 and meta["draft"]["rank"] == 32
    names = weights(run / "final")
    assert names and all(".lora_A." in k or ".lora_B." in k for k in names)
    target = load_target("smollm2-135m-instruct", dtype="float32")
    draft = load_draft(run / "final", target=target.model)
    prompt = target.tokenizer("The capital of France is", add_special_tokens=False).input_ids
    gen = SpeculativeGenerator(target, draft)
    ar = gen.generate([prompt], 24, SpecConfig(mode="ar"))[0].tokens
    assert gen.generate([prompt], 24, SpecConfig(mode="chain", num_speculative_tokens=3))[0].tokens == ar

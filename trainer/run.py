"""Train a speculative-decoding draft head for a frozen target. `drafthead train key=value ...` and the
repository's `python train.py key=value ...` both call `main` here.

    drafthead train                                      # the embedded default: 1 CPU process, 60 min
    drafthead train data.max_samples=16 train.max_steps=4
    torchrun --nproc_per_node 8 -m drafthead.trainer.run recipe=NAME   # a GPU recipe (DeepSpeed ZeRO-2)
    torchrun --nproc_per_node 2 -m drafthead.trainer.run train.deepspeed=zero2   # CPU: DS_ACCELERATOR=cpu is set
    torchrun --nnodes 2 --node_rank R --master_addr HOST --nproc_per_node 8 -m drafthead.trainer.run recipe=NAME

(In a checkout, `train.py` in place of `-m drafthead.trainer.run` does the same.)

`train` reads top to bottom: frozen target -> time budget (measure, plan) -> data -> drafter and its vocab ->
features (online or offline; the plan's passes re-fitted) -> engine (DDP / DeepSpeed) -> resume -> loop ->
final draft. The loop and the pieces around it are the functions below it, in the order they run.
"""
from __future__ import annotations

import json
import math
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from drafthead import options
from drafthead.io import atomic_write_bytes
from drafthead.registry import family, save_draft
from drafthead.target import Target, TargetHead, load_target
from drafthead.trainer.budget import Plan, budget_record
from drafthead.trainer.capture import ShardedFeatures, capture_offline
from drafthead.trainer.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from drafthead.trainer.config import RunConfig, as_dict, help_text, parse_or_exit, to_yaml
from drafthead.trainer.data import write_jsonl
from drafthead.trainer.dist import Dist, all_reduce_data, barrier, init_distributed
from drafthead.trainer.engines import build_engine
from drafthead.trainer.interrupt import GracefulStop, Interrupted, signal_name
from drafthead.trainer.memory import HeapCap, dry_run, memory_line, retain_freed_memory, trim_freed_memory
from drafthead.trainer.metrics import Logger, Throughput
from drafthead.trainer.prepare import Prepared, build_draft, feature_dtype, prepare_samples
from drafthead.trainer.probe import StepClock, plan_run, refit_after_capture
from drafthead.trainer.runlock import run_lock_on_rank0
from drafthead.trainer.step import epoch_batches, evaluate, forward_backward, make_batch, objective


def main(argv: list[str], entry: str = "drafthead train") -> Path:
    """Run the training `argv` (key=value ...) asks for; returns the final draft's folder. `entry`: the command
    the user typed, for the line that says how to resume."""
    # --- config, distributed, the run folder's lock, signals --------------------------------------
    cfg = parse_or_exit(argv)  # every option checked here, before anything loads
    if cfg.train.dry_run:  # memory per rank from the configs alone: no weights, no ranks
        dry_run(cfg)
        return Path(cfg.output_dir)
    retain_freed_memory()  # big per-step tensors reuse the heap instead of fresh page faults
    d = init_distributed(cfg.target.tensor_parallel)
    log = print if d.main else (lambda *a, **k: None)
    run_dir = Path(cfg.output_dir)
    folders = [run_dir] + ([Path(cfg.capture.dir)] if cfg.capture.mode == "offline" and cfg.capture.dir else [])
    with run_lock_on_rank0(folders, d, log), GracefulStop() as stop:
        return train(Job(cfg, argv, entry, d, run_dir, stop, log))


def cli(argv: list[str] | None = None, entry: str = "drafthead train") -> int:
    """The process entry (`drafthead train`, `python train.py`): a stop or bad input becomes one line and an
    exit code, a finished run 0; `--help` lists every option."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        if options.wants_help(argv):
            print(help_text([a for a in argv if a not in options.HELP_FLAGS], entry))
            return 0
        main(argv, entry)
    except Interrupted as e:  # SIGINT / SIGTERM: what was saved and how to resume, exit 128 + signal
        print(f"{e}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:  # before the handlers were installed
        print("stopped by SIGINT", file=sys.stderr)
        return 130
    except (ValueError, OSError) as e:  # bad input (BudgetError, CaptureError too), a run folder in use
        # (RunLockError), a read-only or full disk (WriteError): one clear line
        if os.environ.get("DRAFTHEAD_TRACEBACK"):
            raise
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    return 0


@dataclass
class Job:
    """What every phase of a run reads: the resolved config, the ranks, the run folder and its log."""
    cfg: RunConfig
    argv: list[str]
    entry: str  # the command the user typed: "drafthead train" or "python train.py"
    d: Dist
    run_dir: Path
    stop: GracefulStop
    log: Callable[..., None]
    t_start: float = 0.0

    def elapsed(self) -> float:
        return time.perf_counter() - self.t_start


@dataclass
class Features:
    """The training items (token lists online, stored shards offline), their lengths, and the held-out
    batches (always captured now: they are few)."""
    items: Any
    lengths: list[int]
    offline: bool
    eval_batches: list[dict[str, torch.Tensor]]
    layer_ids: list[int]
    feat_dtype: torch.dtype
    store_argmax: bool

    def batch(self, indices: list[int], target: Target, device: torch.device) -> dict[str, torch.Tensor]:
        return make_batch([self.items[i] for i in indices], target, self.layer_ids, self.feat_dtype, self.offline,
                          device, self.store_argmax)


def train(job: Job) -> Path:
    cfg, d, run_dir, log = job.cfg, job.d, job.run_dir, job.log
    if cfg.train.num_threads:
        torch.set_num_threads(cfg.train.num_threads)
    torch.manual_seed(cfg.seed)
    barrier(d)
    job.t_start = time.perf_counter()
    phases: dict[str, float] = {}  # wall seconds per phase, planned vs actual in the final record

    # --- frozen target (loaded once per process) -------------------------------------------------
    target = load_target(cfg.target.name_or_path, cfg.target.gguf_file, cfg.target.dtype, d.device, d.tp_mesh)
    log(f"target: {cfg.target.name_or_path} ({target.num_layers} layers, hidden {target.hidden_size}, "
        f"vocab {target.config.vocab_size}) on {d.device}, world size {d.world}"
        + (f" ({d.dp} data-parallel x {d.tp} tensor-parallel)" if d.tp > 1 else ""))
    if d.tp > 1:
        target.fingerprint  # gathers the split weights: every rank together, now, not in a later rank-0 branch

    # --- time budget: measure this machine, then fill data.max_samples / train.epochs where null ----
    plan = plan_run(cfg, target, d, run_dir, job.t_start, log)
    if d.main:
        atomic_write_bytes(run_dir / "config.yaml", to_yaml(cfg).encode())  # the resolved recipe, plan applied
    phases["setup"] = job.elapsed()

    # --- data ------------------------------------------------------------------------------------
    prep = prepare_samples(cfg, target, d, run_dir, log)
    if d.main:
        write_jsonl(prep.heldout_convs, run_dir / "heldout.jsonl")

    # --- drafter (and its vocabulary, from the loss-masked training tokens) -----------------------
    fam = family(cfg.drafter.family)
    ds = build_draft(cfg, target, prep.train, d.device, log, heldout=prep.heldout)
    drafter, head = ds.drafter, ds.head
    n_params = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    log(f"drafter: {fam.name}, {n_params / 1e6:.1f}M trainable params, "
        f"{fam.describe(getattr(cfg.drafter, fam.name), drafter.config)}, init {ds.init}")
    log(memory_line(target, drafter, d))
    phases["prepare"] = job.elapsed() - sum(phases.values())

    # --- features: online (captured in the step) or offline (sharded safetensors) -----------------
    feats = features(job, target, prep, drafter.capture_layer_ids(),
                     fam.predicts_draft_vocab(getattr(cfg.drafter, fam.name)))
    phases["capture"] = job.elapsed() - sum(phases.values())
    plan = refit_after_capture(plan, cfg, d, run_dir, job.elapsed(), len(feats.lengths), sum(feats.lengths), log)
    if d.main and plan is not None and plan.refit is not None:  # config.yaml records the passes the run uses
        atomic_write_bytes(run_dir / "config.yaml", to_yaml(cfg).encode())

    # --- engine: plain / DDP / DeepSpeed ---------------------------------------------------------
    per_epoch = len(epoch_batches(feats.lengths, cfg.train.batch_size, cfg.seed, 0, d.dp, d.dp_rank,
                                  cfg.train.batch_tokens))
    epochs = cfg.train.epochs or 1.0
    total_steps = cfg.train.max_steps or max(1, math.ceil(epochs * per_epoch / cfg.train.grad_accum))
    engine = build_engine(drafter, cfg, total_steps, d)

    # --- resume (the checkpoint must come from this target; metrics cut back to its step) -----------
    state = resume(job, engine, target)
    logger = Logger(run_dir, cfg, d, as_dict(cfg), start_step=state["step"])
    if plan is not None and state["step"] == 0:
        logger.log({"step": 0, "budget_plan": plan.to_dict()})
    # the budget re-fits the step count from the loop's own rate (resumed: the stored re-fits)
    most = max(total_steps, math.ceil(cfg.budget.max_passes * per_epoch / cfg.train.grad_accum))
    clock = StepClock(plan, cfg, total_steps, state["step"], most)
    if clock.total != total_steps:
        total_steps = clock.total
        engine.set_total_steps(total_steps)

    # --- training loop ---------------------------------------------------------------------------
    step, total_steps, last_eval = loop(job, engine, target, head, feats, state, total_steps, logger, clock)
    phases["train"] = job.elapsed() - sum(phases.values())
    phases["total"] = job.elapsed()  # of this process (a resumed run counts from its restart)
    budget_rec = budget_record(plan, phases, step, sum(feats.lengths))
    if plan is not None and step >= total_steps:
        logger.log({"step": step, "budget": budget_rec})  # planned vs actual, beside the plan row at step 0
    logger.close()

    # --- final draft -----------------------------------------------------------------------------
    return finish(job, engine, target, plan, step, total_steps, state, last_eval, budget_rec,
                  feats.eval_batches or [])


def record_serving(job: Job, target: Target, final: Path, last_eval: dict, heldout: list[dict[str, torch.Tensor]]
                   ) -> None:
    """Add the "serving" record (trainer/serving.py) to final/config.json; a run where it cannot be measured here
    records why, and eval's defaults then apply."""
    from drafthead.runtime.model import SUPPORTED_MODEL_TYPES
    from drafthead.trainer import serving

    cfg, d = job.cfg, job.d
    prompts = serving.held_out_prompts(heldout)
    if not cfg.train.choose_serving:
        rec = {"why": "train.choose_serving=false"}
    elif d.world > 1:
        rec = {"why": "measured in one-process runs only (drafthead eval num_speculative_tokens=K compares lengths)"}
    elif target.config.model_type not in SUPPORTED_MODEL_TYPES or not prompts:
        rec = {"why": "our runtime does not run this target" if prompts else "no held-out prompt"}
    else:
        try:
            rec = serving.choose(last_eval, target, final, prompts)
        except Exception as e:  # the draft is saved already: a failed timing costs the record, never the run
            rec = {"why": f"timing our runtime failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"}
            job.log(f"warning: the serving length was not chosen ({rec['why']}); eval's default applies")
    meta = json.loads((final / "config.json").read_text())
    atomic_write_bytes(final / "config.json", (json.dumps({**meta, "serving": rec}, indent=2) + "\n").encode())
    if "num_speculative_tokens" in rec:
        by = ", ".join(f"k={k}: tau {v['tau']:.2f} / cost {v['cost']:.2f}" for k, v in rec["by_length"].items())
        trial = ", ".join(f"{n} {v:.2f}x" for n, v in rec.get("tree_trial", {}).items())
        shape = f" topk={rec['topk']} tree_nodes={rec['tree_nodes']}" if rec["mode"] == "tree" else ""
        job.log(f"serving: mode={rec['mode']} num_speculative_tokens={rec['num_speculative_tokens']}{shape} ({by}"
                f"{'; held-out prompts: ' + trial if trial else ''}; measured on {rec['measured_on']})")


def features(job: Job, target: Target, prep: Prepared, layer_ids: list[int], store_argmax: bool) -> Features:
    """Offline: capture the training conversations into shards once (resumable), then read them; online:
    the token lists, captured in each step. `store_argmax`: the teacher head then computes only the
    draft-vocab rows (reduced-vocab families)."""
    cfg, d = job.cfg, job.d
    feat_dtype = feature_dtype(cfg.capture.dtype)
    offline = cfg.capture.mode == "offline"
    if offline:
        cap_dir = Path(cfg.capture.dir or job.run_dir / "capture")
        if d.dp_rank == 0:  # the first tp group runs the (split) target; its rank 0 writes the shards
            capture_offline(target, prep.train, cap_dir, layer_ids, feat_dtype, cfg.capture.shard_samples,
                            cfg.capture.batch_tokens, progress=cfg.logging.progress and d.main, argmax=store_argmax,
                            after_shard=trim_freed_memory, stop=job.stop, d=d)
        barrier(d)
        trim_freed_memory()  # the capture's shard buffers are not needed again
        shards = ShardedFeatures(cap_dir)
        items, lengths = shards, shards.lengths
    else:
        items, lengths = prep.train, [len(s["input_ids"]) for s in prep.train]
    eval_items = prep.heldout[: cfg.train.eval_samples or len(prep.heldout)]
    # the same number on every rank: evaluate() all-reduces (and ZeRO-3 gathers weights in each forward)
    eval_items = eval_items[: len(eval_items) // d.dp * d.dp][d.dp_rank:: d.dp]
    bs = cfg.train.batch_size
    eval_batches = [make_batch(eval_items[i: i + bs], target, layer_ids, feat_dtype, False, d.device, store_argmax)
                    for i in range(0, len(eval_items), bs)]
    return Features(items, lengths, offline, eval_batches, layer_ids, feat_dtype, store_argmax)


def resume(job: Job, engine: Any, target: Target) -> dict:
    """The trainer's counters: fresh, or restored with the engine and the RNGs from the last checkpoint
    (`train.resume`: auto / true / false)."""
    cfg, run_dir = job.cfg, job.run_dir
    state = {"epoch": 0, "batch_in_epoch": 0, "tokens_seen": 0, "step": 0}
    ckpts = list_checkpoints(run_dir)
    mode = str(cfg.train.resume).lower()
    if mode == "true" and not ckpts:
        raise SystemExit(f"error: train.resume=true but {run_dir}/checkpoints has no checkpoint")
    if mode in ("auto", "true") and ckpts:
        state = load_checkpoint(ckpts[-1], engine, job.d, target.fingerprint, cfg.target.allow_mismatch, job.log)
        job.log(f"resumed from {ckpts[-1]} (step {state['step']}, epoch {state['epoch']}, "
                f"batch {state['batch_in_epoch']})")
    return state


class Window:
    """The metrics row being summed between two log rows, per draft depth. A checkpoint taken between two rows
    stores the part summed so far (over ranks), and a resumed run carries on from it."""

    def __init__(self, depths: int, saved: dict | None, d: Dist) -> None:
        self.correct, self.count = torch.zeros(depths), torch.zeros(depths)
        self.loss_sum, self.n_micro = 0.0, 0
        self.depths = depths
        if saved is not None and d.main:  # summed over ranks when saved: rank 0 carries it, the all-reduce adds 0s
            self.correct, self.count = torch.tensor(saved["correct"]), torch.tensor(saved["count"])
            self.loss_sum, self.n_micro = saved["loss_sum"], saved["n_micro"]

    def add(self, out: dict[str, torch.Tensor]) -> None:
        self.correct += out["correct"].detach().cpu()
        self.count += out["count"].detach().cpu()
        self.loss_sum += float(out["loss"].detach())
        self.n_micro += 1

    def take(self, d: Dist) -> tuple[list[float], float]:
        """Accuracy per depth and mean loss over every rank's micro-steps since the last row; starts a new row."""
        c, n = all_reduce_data(self.correct, d), all_reduce_data(self.count, d)
        acc = (c / n.clamp(min=1)).tolist()
        ls = all_reduce_data(torch.tensor([self.loss_sum, float(self.n_micro)], dtype=torch.float64), d)
        self.correct.zero_(), self.count.zero_()
        self.loss_sum, self.n_micro = 0.0, 0
        return acc, float(ls[0] / ls[1])

    def saved(self, d: Dist) -> dict:
        """The row so far, summed over ranks, for a checkpoint (fp64: loss_sum is a Python float)."""
        K = self.depths
        sums = [self.correct.double(), self.count.double(),
                torch.tensor([self.loss_sum, self.n_micro], dtype=torch.float64)]
        w = all_reduce_data(torch.cat(sums), d)
        return {"correct": w[:K].tolist(), "count": w[K: 2 * K].tolist(), "loss_sum": float(w[-2]),
                "n_micro": int(w[-1])}


def loop(job: Job, engine: Any, target: Target, head: TargetHead, feats: Features, state: dict, total_steps: int,
         logger: Logger, clock: StepClock) -> tuple[int, int, dict]:
    """Steps until `total_steps` (re-fitted by the budget's clock), `train.stop_after_steps` or a signal;
    logs, evaluates and checkpoints on their schedules. Returns (step, total_steps, the last held-out eval)."""
    from tqdm import tqdm

    cfg, d, log = job.cfg, job.d, job.log
    fam = family(cfg.drafter.family)
    goal = objective(cfg.train)  # `train.loss` for every step and held-out eval of the loop
    step = state.pop("step")
    bar = tqdm(total=total_steps, initial=step, desc="train", disable=not (d.main and cfg.logging.progress),
               dynamic_ncols=True)
    tput = Throughput()
    heap_cap = HeapCap()
    window = Window(engine.module.config.num_draft_tokens, state.pop("log_window", None), d)
    last_eval: dict = {}
    stop_after = cfg.train.stop_after_steps
    steps_this_process = 0
    done = step >= total_steps
    with job.stop.deferred("finishing the step in flight, then saving a checkpoint"):
        while not done:
            batches = epoch_batches(feats.lengths, cfg.train.batch_size, cfg.seed, state["epoch"], d.dp, d.dp_rank,
                                    cfg.train.batch_tokens)
            for bi in range(state["batch_in_epoch"], len(batches)):
                batch = feats.batch(batches[bi], target, d.device)
                engine.module.schedule(step, total_steps)  # a loss that moves with training (Domino's curriculum)
                out = forward_backward(engine, batch, head, cfg.train.dtype, d.device, goal)
                ntok = int(batch["attention_mask"].sum())
                tput.add(ntok)
                state["tokens_seen"] += ntok
                window.add(out)
                lr = engine.lr()  # the rate this optimizer step uses (the scheduler moves on inside step())
                if not engine.step():
                    continue
                step += 1
                steps_this_process += 1
                state.update(epoch=state["epoch"], batch_in_epoch=bi + 1)
                bar.update(1)
                heap_cap()
                if step % cfg.logging.log_every == 0 or step == total_steps:
                    acc, loss = window.take(d)
                    row = {"step": step, "epoch": state["epoch"] + (bi + 1) / len(batches),
                           "loss": loss, "lr": lr, **{f"acc_{i}": a for i, a in enumerate(acc)},
                           "tokens_per_s": tput.rate() * d.dp, "tokens_seen": state["tokens_seen"] * d.dp,
                           "wall_s": round(job.elapsed(), 1)}  # since this process started
                    logger.log(row)
                    bar.set_postfix(loss=f"{loss:.3f}", acc0=f"{acc[0]:.3f}", tok_s=f"{row['tokens_per_s']:.0f}")
                if clock.due(step):
                    total_steps = clock.refit(step, job.elapsed(), d, job.run_dir, log)
                    engine.set_total_steps(total_steps)
                    bar.total = total_steps
                    bar.refresh()
                t_side = time.perf_counter()
                if feats.eval_batches and ((cfg.train.eval_every and step % cfg.train.eval_every == 0)
                                           or step == total_steps):
                    last_eval = evaluate(engine.module, feats.eval_batches, head, d, goal)
                    logger.log({"step": step, **last_eval, "wall_s": round(job.elapsed(), 1)})
                    said = (fam.eval_summary(last_eval) if fam.eval_summary else
                            f"simulated accept len {last_eval['eval/sim_accept_len']:.2f}")
                    alpha = f", alpha_0 {last_eval['eval/alpha_0']:.3f}" if "eval/alpha_0" in last_eval else ""
                    log(f"\nstep {step}: held-out acc_0 {last_eval['eval/acc_0']:.3f}{alpha}, {said}")
                    heap_cap.trim()
                    clock.spent("eval", time.perf_counter() - t_side)
                t_side = time.perf_counter()
                signum = job.stop.stop_now(d)  # every rank agrees on the step it stops at
                if (cfg.train.save_every and step % cfg.train.save_every == 0) or step == total_steps or (
                        stop_after and steps_this_process >= stop_after) or signum is not None:
                    ckpt = save_checkpoint(job.run_dir, step, engine, {**state, "log_window": window.saved(d)}, d,
                                           cfg.train.keep_checkpoints, target.fingerprint)
                    heap_cap.trim()
                    clock.spent("save", time.perf_counter() - t_side)
                if signum is not None:
                    bar.close()
                    logger.close()
                    again = "the same torchrun command" if d.world > 1 else f"{job.entry} {shlex.join(job.argv)}"
                    raise Interrupted(signum, f"stopped by {signal_name(signum)} at step {step} of {total_steps}; "
                                      f"checkpoint {ckpt}; resume with {again}")
                if step >= total_steps or (stop_after and steps_this_process >= stop_after):
                    done = True
                    break
            else:
                state.update(epoch=state["epoch"] + 1, batch_in_epoch=0)
    bar.close()
    return step, total_steps, last_eval


def finish(job: Job, engine: Any, target: Target, plan: Plan | None, step: int, total_steps: int, state: dict,
           last_eval: dict, budget_rec: dict, heldout: list[dict[str, torch.Tensor]]) -> Path:
    """Save the final draft when the run reached its last step, with the settings to serve it with (else say how
    to resume)."""
    cfg, d = job.cfg, job.d
    final = job.run_dir / "final"
    if step >= total_steps:
        with engine.full_params():  # ZeRO-3: gather the shards (a collective: every rank enters)
            if d.main:
                save_draft(engine.module, final, target.info(),
                           extra={"train": {"steps": step, "tokens_seen": state["tokens_seen"] * d.dp,
                                            "recipe": cfg.recipe, "wall_s": round(job.elapsed(), 1), **last_eval},
                                  "budget": budget_rec})
                record_serving(job, target, final, last_eval, heldout)
        job.log(f"\ndraft saved to {final}\nnext: drafthead eval draft={final} dataset=mt_bench max_prompts=10")
    else:
        job.log(f"\nstopped at step {step} of {total_steps}; run the same command again to resume")
    barrier(d)
    return final


if __name__ == "__main__":  # torchrun -m drafthead.trainer.run key=value ...
    sys.exit(cli())

"""Train a speculative-decoding draft head for a frozen target.

    python train.py                                      # the embedded default: 1 CPU process, 60 min
    python train.py data.max_samples=16 train.max_steps=4
    torchrun --nproc_per_node 8 train.py recipe=NAME     # a GPU recipe from recipes/ (DeepSpeed ZeRO-2)
    torchrun --nproc_per_node 2 train.py train.deepspeed=zero2   # CPU: DS_ACCELERATOR=cpu is set for you
    torchrun --nnodes 2 --node_rank R --master_addr HOST --nproc_per_node 8 train.py recipe=NAME

Reads top to bottom: config -> distributed -> the run folder's lock and the signal handlers -> frozen
target -> time budget (measure, plan) -> data -> drafter and its vocab -> features (online or offline; the
plan's passes re-fitted) -> engine (DDP / DeepSpeed) -> resume -> loop -> final draft.
"""
from __future__ import annotations

import math
import os
import shlex
import sys
import time
from pathlib import Path

import torch

from drafthead.io import atomic_write_bytes
from drafthead.registry import family, save_draft
from drafthead.target import load_target
from trainer import engine as L
from trainer.budget import StepClock, budget_record, dry_run, memory_line, plan_run, refit_after_capture
from trainer.capture import ShardedFeatures, capture_offline
from trainer.config import RunConfig, as_dict, parse_or_exit, to_yaml
from trainer.data import write_jsonl
from trainer.dist import Dist, barrier, init_distributed
from trainer.interrupt import GracefulStop, Interrupted, signal_name
from trainer.prepare import build_draft, feature_dtype, prepare_samples
from trainer.runlock import run_lock_on_rank0


def main(argv: list[str]) -> Path:
    # --- config, distributed, the run folder's lock, signals --------------------------------------
    cfg = parse_or_exit(argv)  # every option checked here, before anything loads
    if cfg.train.dry_run:  # memory per rank from the configs alone: no weights, no ranks
        dry_run(cfg)
        return Path(cfg.output_dir)
    L.retain_freed_memory()  # big per-step tensors reuse the heap instead of fresh page faults
    d = init_distributed(cfg.target.tensor_parallel)
    log = print if d.main else (lambda *a, **k: None)
    run_dir = Path(cfg.output_dir)
    folders = [run_dir] + ([Path(cfg.capture.dir)] if cfg.capture.mode == "offline" and cfg.capture.dir else [])
    with run_lock_on_rank0(folders, d, log), GracefulStop() as stop:
        return train(cfg, argv, d, run_dir, stop, log)


def train(cfg: RunConfig, argv: list[str], d: Dist, run_dir: Path, stop: GracefulStop, log) -> Path:
    if cfg.train.num_threads:
        torch.set_num_threads(cfg.train.num_threads)
    torch.manual_seed(cfg.seed)
    barrier(d)
    t_start = time.perf_counter()
    phases: dict[str, float] = {}  # wall seconds per phase, planned vs actual in the final record

    # --- frozen target (loaded once per process) -------------------------------------------------
    target = load_target(cfg.target.name_or_path, cfg.target.gguf_file, cfg.target.dtype, d.device, d.tp_mesh)
    log(f"target: {cfg.target.name_or_path} ({target.num_layers} layers, hidden {target.hidden_size}, "
        f"vocab {target.config.vocab_size}) on {d.device}, world size {d.world}"
        + (f" ({d.dp} data-parallel x {d.tp} tensor-parallel)" if d.tp > 1 else ""))
    if d.tp > 1:
        target.fingerprint  # gathers the split weights: every rank together, now, not in a later rank-0 branch

    # --- time budget: measure this machine, then fill data.max_samples / train.epochs where null ----
    plan = plan_run(cfg, target, d, run_dir, t_start, log)
    if d.main:
        atomic_write_bytes(run_dir / "config.yaml", to_yaml(cfg).encode())  # the resolved recipe, plan applied
    phases["setup"] = time.perf_counter() - t_start

    # --- data ------------------------------------------------------------------------------------
    prep = prepare_samples(cfg, target, d, run_dir, log)
    if d.main:
        write_jsonl(prep.heldout_convs, run_dir / "heldout.jsonl")

    # --- drafter (and its vocabulary, from the loss-masked training tokens) -----------------------
    fam = family(cfg.drafter.family)
    ds = build_draft(cfg, target, prep.train, d.device, log)
    drafter, head = ds.drafter, ds.head
    layer_ids = drafter.capture_layer_ids()
    feat_dtype = feature_dtype(cfg.capture.dtype)
    n_params = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    K = drafter.config.num_draft_tokens  # draft depths each training forward reports
    log(f"drafter: {fam.name}, {n_params / 1e6:.1f}M trainable params, "
        f"{fam.describe(getattr(cfg.drafter, fam.name), drafter.config)}, init {ds.init}")
    log(memory_line(target, drafter, d))

    phases["prepare"] = time.perf_counter() - t_start - sum(phases.values())

    # --- features: online (captured in the step) or offline (sharded safetensors) -----------------
    offline = cfg.capture.mode == "offline"
    store_argmax = fam.reduced_vocab  # the teacher head then computes only the draft-vocab rows
    if offline:
        cap_dir = Path(cfg.capture.dir or run_dir / "capture")
        if d.dp_rank == 0:  # the first tp group runs the (split) target; its rank 0 writes the shards
            capture_offline(target, prep.train, cap_dir, layer_ids, feat_dtype, cfg.capture.shard_samples,
                            cfg.capture.batch_tokens, progress=cfg.logging.progress and d.main, argmax=store_argmax,
                            after_shard=L.trim_freed_memory, stop=stop, d=d)
        barrier(d)
        L.trim_freed_memory()  # the capture's shard buffers are not needed again
        feats = ShardedFeatures(cap_dir)
        items, lengths = feats, feats.lengths
    else:
        items, lengths = prep.train, [len(s["input_ids"]) for s in prep.train]
    eval_items = prep.heldout[: cfg.train.eval_samples or len(prep.heldout)]
    # the same number on every rank: evaluate() all-reduces (and ZeRO-3 gathers weights in each forward)
    eval_items = eval_items[: len(eval_items) // d.dp * d.dp][d.dp_rank:: d.dp]
    eval_batches = [L.make_batch(eval_items[i: i + cfg.train.batch_size], target, layer_ids, feat_dtype, False,
                                 d.device, store_argmax) for i in range(0, len(eval_items), cfg.train.batch_size)]

    phases["capture"] = time.perf_counter() - t_start - sum(phases.values())
    plan = refit_after_capture(plan, cfg, d, run_dir, time.perf_counter() - t_start, len(lengths), sum(lengths), log)

    # --- engine: plain / DDP / DeepSpeed ---------------------------------------------------------
    per_epoch = len(L.epoch_batches(lengths, cfg.train.batch_size, cfg.seed, 0, d.dp, d.dp_rank,
                                    cfg.train.batch_tokens))
    epochs = cfg.train.epochs or 1.0
    total_steps = cfg.train.max_steps or max(1, math.ceil(epochs * per_epoch / cfg.train.grad_accum))
    engine = L.build_engine(drafter, cfg, total_steps, d)

    # --- resume (the checkpoint must come from this target; metrics cut back to its step) -----------
    state = {"epoch": 0, "batch_in_epoch": 0, "tokens_seen": 0}
    step = 0
    ckpts = L.list_checkpoints(run_dir)
    resume = str(cfg.train.resume).lower()
    if resume == "true" and not ckpts:
        raise SystemExit(f"error: train.resume=true but {run_dir}/checkpoints has no checkpoint")
    if resume in ("auto", "true") and ckpts:
        state = L.load_checkpoint(ckpts[-1], engine, d, target.fingerprint, cfg.target.allow_mismatch, log)
        step = state["step"]
        log(f"resumed from {ckpts[-1]} (step {step}, epoch {state['epoch']}, batch {state['batch_in_epoch']})")
    logger = L.Logger(run_dir, cfg, d, as_dict(cfg), start_step=step)

    if plan is not None and step == 0:
        logger.log({"step": 0, "budget_plan": plan.to_dict()})
    # the budget re-fits the step count from the loop's own rate (resumed: the stored re-fits)
    most = max(total_steps, math.ceil(cfg.budget.max_passes * per_epoch / cfg.train.grad_accum))
    clock = StepClock(plan, cfg, total_steps, step, most)
    if clock.total != total_steps:
        total_steps = clock.total
        engine.set_total_steps(total_steps)

    # --- training loop ---------------------------------------------------------------------------
    from tqdm import tqdm

    bar = tqdm(total=total_steps, initial=step, desc="train", disable=not (d.main and cfg.logging.progress),
               dynamic_ncols=True)
    tput = L.Throughput()
    heap_cap = L.HeapCap()
    acc_c, acc_n, loss_sum, n_micro = torch.zeros(K), torch.zeros(K), 0.0, 0  # the metrics row being summed
    window = state.pop("log_window", None)  # a checkpoint between two rows holds the part summed so far
    if window is not None and d.main:  # summed over ranks when saved: rank 0 carries it, the all-reduce adds 0s
        acc_c, acc_n = torch.tensor(window["correct"]), torch.tensor(window["count"])
        loss_sum, n_micro = window["loss_sum"], window["n_micro"]
    last_eval: dict = {}
    stop_after = cfg.train.stop_after_steps
    steps_this_process = 0
    done = step >= total_steps
    with stop.deferred("finishing the step in flight, then saving a checkpoint"):
        while not done:
            batches = L.epoch_batches(lengths, cfg.train.batch_size, cfg.seed, state["epoch"], d.dp, d.dp_rank,
                                      cfg.train.batch_tokens)
            for bi in range(state["batch_in_epoch"], len(batches)):
                batch = L.make_batch([items[i] for i in batches[bi]], target, layer_ids, feat_dtype, offline,
                                     d.device, store_argmax)
                out = L.forward_backward(engine, batch, head, cfg.train.dtype, d.device)
                ntok = int(batch["attention_mask"].sum())
                tput.add(ntok)
                state["tokens_seen"] += ntok
                acc_c += out["correct"].detach().cpu()
                acc_n += out["count"].detach().cpu()
                loss_sum += float(out["loss"].detach())
                n_micro += 1
                lr = engine.lr()  # the rate this optimizer step uses (the scheduler moves on inside step())
                if not engine.step():
                    continue
                step += 1
                steps_this_process += 1
                state.update(epoch=state["epoch"], batch_in_epoch=bi + 1)
                bar.update(1)
                heap_cap()
                if step % cfg.logging.log_every == 0 or step == total_steps:
                    c, n = L.all_reduce_data(acc_c, d), L.all_reduce_data(acc_n, d)
                    acc = (c / n.clamp(min=1)).tolist()
                    ls = L.all_reduce_data(torch.tensor([loss_sum, float(n_micro)], dtype=torch.float64), d)
                    row = {"step": step, "epoch": state["epoch"] + (bi + 1) / len(batches),
                           "loss": float(ls[0] / ls[1]), "lr": lr, **{f"acc_{i}": a for i, a in enumerate(acc)},
                           "tokens_per_s": tput.rate() * d.dp, "tokens_seen": state["tokens_seen"] * d.dp,
                           "wall_s": round(time.perf_counter() - t_start, 1)}  # since this process started
                    logger.log(row)
                    bar.set_postfix(loss=f"{row['loss']:.3f}", acc0=f"{acc[0]:.3f}",
                                    tok_s=f"{row['tokens_per_s']:.0f}")
                    acc_c.zero_(), acc_n.zero_()
                    loss_sum, n_micro = 0.0, 0
                if clock.due(step):
                    total_steps = clock.refit(step, time.perf_counter() - t_start, d, run_dir, log)
                    engine.set_total_steps(total_steps)
                    bar.total = total_steps
                    bar.refresh()
                t_side = time.perf_counter()
                if eval_batches and ((cfg.train.eval_every and step % cfg.train.eval_every == 0)
                                     or step == total_steps):
                    last_eval = L.evaluate(engine.module, eval_batches, head, d)
                    logger.log({"step": step, **last_eval, "wall_s": round(time.perf_counter() - t_start, 1)})
                    block = last_eval.get("eval/block_accept_len")  # block drafters measure it per block
                    log(f"\nstep {step}: held-out acc_0 {last_eval['eval/acc_0']:.3f}, "
                        + (f"block accept len {block:.2f}" if block is not None else
                           f"simulated accept len {last_eval['eval/sim_accept_len']:.2f}"))
                    heap_cap.trim()
                    clock.spent("eval", time.perf_counter() - t_side)
                t_side = time.perf_counter()
                signum = stop.stop_now(d)  # every rank agrees on the step it stops at
                if (cfg.train.save_every and step % cfg.train.save_every == 0) or step == total_steps or (
                        stop_after and steps_this_process >= stop_after) or signum is not None:
                    sums = [acc_c.double(), acc_n.double(), torch.tensor([loss_sum, n_micro], dtype=torch.float64)]
                    w = L.all_reduce_data(torch.cat(sums), d)  # fp64: loss_sum is a Python float
                    window = {"correct": w[:K].tolist(), "count": w[K: 2 * K].tolist(), "loss_sum": float(w[-2]),
                              "n_micro": int(w[-1])}
                    ckpt = L.save_checkpoint(run_dir, step, engine, {**state, "log_window": window}, d,
                                             cfg.train.keep_checkpoints, target.fingerprint)
                    heap_cap.trim()
                    clock.spent("save", time.perf_counter() - t_side)
                if signum is not None:
                    bar.close()
                    logger.close()
                    again = "the same torchrun command" if d.world > 1 else f"python train.py {shlex.join(argv)}"
                    raise Interrupted(signum, f"stopped by {signal_name(signum)} at step {step} of {total_steps}; "
                                      f"checkpoint {ckpt}; resume with {again}")
                if step >= total_steps or (stop_after and steps_this_process >= stop_after):
                    done = True
                    break
            else:
                state.update(epoch=state["epoch"] + 1, batch_in_epoch=0)
    bar.close()
    phases["train"] = time.perf_counter() - t_start - sum(phases.values())
    phases["total"] = time.perf_counter() - t_start  # of this process (a resumed run counts from its restart)
    budget_rec = budget_record(plan, phases, step, sum(lengths))
    if plan is not None and step >= total_steps:
        logger.log({"step": step, "budget": budget_rec})  # planned vs actual, beside the plan row at step 0
    logger.close()

    # --- final draft -----------------------------------------------------------------------------
    final = run_dir / "final"
    if step >= total_steps:
        with engine.full_params():  # ZeRO-3: gather the shards (a collective: every rank enters)
            if d.main:
                save_draft(engine.module, final, target.info(),
                           extra={"train": {"steps": step, "tokens_seen": state["tokens_seen"] * d.dp,
                                            "recipe": cfg.recipe, "wall_s": round(time.perf_counter() - t_start, 1),
                                            **last_eval},
                                  "budget": budget_rec})
        log(f"\ndraft saved to {final}\nnext: drafthead eval draft={final} dataset=mt_bench max_prompts=10")
    else:
        log(f"\nstopped at step {step} of {total_steps}; run the same command again to resume")
    barrier(d)
    return final


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except Interrupted as e:  # SIGINT / SIGTERM: what was saved and how to resume, exit 128 + signal
        print(f"{e}", file=sys.stderr)
        sys.exit(e.code)
    except KeyboardInterrupt:  # before the handlers were installed
        print("stopped by SIGINT", file=sys.stderr)
        sys.exit(130)
    except (ValueError, OSError) as e:  # bad input (BudgetError, CaptureError too), a run folder in use
        # (RunLockError), a read-only or full disk (WriteError): one clear line
        if os.environ.get("DRAFTHEAD_TRACEBACK"):
            raise
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(2)

"""Training machinery around the drafter: batching, the micro-step, DDP/DeepSpeed engines, checkpoints,
held-out eval, logging (the distributed helpers are in trainer/dist.py).

Drafter files stay free of all of this; `train.py` strings these pieces together top to bottom.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn

from drafthead.fingerprint import compare
from drafthead.hardware import DTYPES, resolve_dtype
from drafthead.io import atomic_write_bytes, writing
from drafthead.layers import softmax_floored
from drafthead.registry import not_saved
from drafthead.target import Target, TargetHead
from trainer.capture import collate, collate_features, features_for_batch
from trainer.config import RunConfig, deepspeed_config_path
from trainer.dist import Dist, all_reduce_data, barrier


# ---------------------------------------------------------------------------------------------
# batching: deterministic, length-grouped, resumable
def epoch_batches(lengths: list[int], batch_size: int, seed: int, epoch: int, world: int, rank: int,
                  batch_tokens: int | None = None) -> list[list[int]]:
    """Batches of sample indices for this rank and epoch. Same seed -> same batches (resume relies on it).

    Samples are shuffled, grouped in windows of 64 batches, sorted by length inside a window (less
    padding), cut into batches (by count, or packed up to `batch_tokens` padded tokens), and the batches
    are shuffled again. Every rank gets the same number of batches.
    """
    g = random.Random(seed * 1000003 + epoch)
    idx = list(range(len(lengths)))
    g.shuffle(idx)
    window = max(batch_size, 1) * 64
    batches: list[list[int]] = []
    for w in range(0, len(idx), window):
        chunk = sorted(idx[w: w + window], key=lambda i: lengths[i])
        if batch_tokens:
            cur: list[int] = []
            for i in chunk:
                if cur and (len(cur) + 1) * max(lengths[i], max(lengths[j] for j in cur)) > batch_tokens:
                    batches.append(cur)
                    cur = []
                cur.append(i)
            if cur:
                batches.append(cur)
        else:
            batches += [chunk[s: s + batch_size] for s in range(0, len(chunk), batch_size)]
    g.shuffle(batches)
    per_rank = len(batches) // world
    if per_rank == 0:
        raise ValueError(f"not enough training data: {len(lengths)} samples make {len(batches)} batches for "
                         f"{world} ranks")
    return batches[rank * per_rank: (rank + 1) * per_rank]


# ---------------------------------------------------------------------------------------------
# one step's math around the drafter
def teacher_targets(head: TargetHead, last: torch.Tensor, loss_mask: torch.Tensor,
                    argmax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher distribution over the draft vocab [B, T, N] fp32 (the full vocab for a head without draft
    ids; softmax taken once here, not once per TTT step) and the full-vocab argmax [B, T] at positions j
    whose next token is supervised (loss_mask[j+1] == 1); elsewhere zeros / -1. `argmax` [B, T]: the one
    the capture stored, so the head only computes the N draft-vocab logits."""
    B, T, _ = last.shape
    need = torch.zeros(B, T, dtype=torch.bool, device=last.device)
    need[:, :-1] = loss_mask[:, 1:].bool()
    b, t = need.nonzero(as_tuple=True)
    stored = argmax is not None and not head.full  # a full-vocab head gets the argmax from its own logits
    logits, top = head(last[b, t], argmax=not stored)
    probs = torch.zeros(B, T, logits.shape[-1], dtype=torch.float32, device=last.device)
    probs[b, t] = softmax_floored(logits)  # no denormal tail: the loss reads these rows twice a TTT step
    if stored:
        return probs, torch.where(need, argmax.to(last.device), -1)
    tgt = torch.full((B, T), -1, dtype=torch.long, device=last.device)
    tgt[b, t] = top
    return probs, tgt


def make_batch(items: list[Any], target: Target, layer_ids: list[int], feat_dtype: torch.dtype, offline: bool,
               device: torch.device, argmax: bool = False) -> dict[str, torch.Tensor]:
    """Collate samples (online: token lists, capture now, with the target argmax when `argmax`; offline:
    stored features, with the argmax when the capture stored it)."""
    pad = target.tokenizer.pad_token_id if target.tokenizer is not None else 0
    if offline:
        batch = collate_features(items, pad)
    else:
        batch = features_for_batch(target, collate(items, pad), layer_ids, feat_dtype, argmax)
    return {k: v.to(device) for k, v in batch.items()}


def drafter_inputs(batch: dict[str, torch.Tensor], head: TargetHead) -> dict[str, torch.Tensor]:
    """The training forward's arguments (the same for every family; each reads the features it needs)."""
    teacher, tgt = teacher_targets(head, batch["last"], batch["loss_mask"], batch.get("argmax"))
    return {"input_ids": batch["input_ids"], "aux_hidden": batch["aux"], "last_hidden": batch["last"],
            "teacher_probs": teacher, "target_argmax": tgt, "loss_mask": batch["loss_mask"]}


def forward_backward(engine: Any, batch: dict[str, torch.Tensor], head: TargetHead, dtype: str,
                     device: torch.device) -> dict[str, torch.Tensor]:
    """One micro-step: teacher targets, drafter forward under the run's precision, backward."""
    with autocast(dtype, device, engine.kind):
        out = engine.forward(**drafter_inputs(batch, head))
    engine.backward(out["loss"])
    return out


def retain_freed_memory() -> bool:
    """Ask glibc to keep freed memory instead of handing it back to the OS after every step.

    Big activations (the [rows, draft vocab] fp32 loss tensors are ~48 MB) are otherwise mmap'd fresh
    and page-faulted in on each use: on the default recipe's CPU step that was ~25% of the time (2.13
    -> 1.63 s a step, measured). Linux/glibc only; `DRAFTHEAD_MALLOC_RETAIN=0` turns it off. Returns
    whether it took effect."""
    if os.environ.get("DRAFTHEAD_MALLOC_RETAIN", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return False
    M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4
    global _LIBC
    if libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1) and libc.mallopt(M_TOP_PAD, 64 << 20):
        _LIBC = libc
    return _LIBC is not None


_LIBC = None  # glibc, once retain_freed_memory took effect


def trim_freed_memory() -> bool:
    """Hand the retained free memory back to the OS now (glibc `malloc_trim`). Batches of varying shapes
    fragment a heap that never shrinks: a 53-minute default run without this peaked at 15.3 GB RSS. The
    trainer calls it after each evaluation and checkpoint, so the next step's page faults are paid once per
    hundred steps rather than every step. No-op unless `retain_freed_memory` took effect."""
    return _LIBC is not None and bool(_LIBC.malloc_trim(0))


def resident_bytes() -> int:
    """This process's resident memory now (Linux: /proc/self/statm; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


HEAP_SLACK_BYTES = 2 << 30  # retained free heap allowed above the live set before it is handed back


class HeapCap:
    """Hand the retained heap back once the process has grown HEAP_SLACK_BYTES past its size one step after
    the last trim (that size includes the step's own working set, which the heap is meant to keep). Why:
    with `retain_freed_memory`, batches of varying shapes fragment a heap that never shrinks; trimming only
    at evaluations (every 100 steps) let a 60-minute LoRA or DFlash run climb from ~5 to 11 GB resident
    within minutes, and two such runs on a 24 GB machine thrashed. A check is one read of
    /proc/self/statm per step; a trim costs the page faults of one step."""

    def __init__(self, slack_bytes: int = HEAP_SLACK_BYTES) -> None:
        self.slack = slack_bytes
        self.base: int | None = None  # measured at the first call after a trim
        self.trims = 0

    def __call__(self) -> bool:
        """Call once per step; trims if the heap grew past the slack and returns whether it did."""
        if _LIBC is None:
            return False
        rss = resident_bytes()
        if self.base is None:
            self.base = rss
            return False
        if rss - self.base < self.slack:
            return False
        self.trim()
        return True

    def trim(self) -> None:
        """Hand the freed heap back now (also at evaluations and checkpoints); the next call measures the
        new base."""
        trim_freed_memory()
        self.base = None
        self.trims += 1


def autocast(dtype: str, device: torch.device, engine_kind: str):
    """Mixed precision for the drafter forward: bf16 autocast where bf16 is native (`auto`: CUDA, AMX /
    AVX512-BF16 CPUs), fp32 elsewhere. Master weights stay fp32. DeepSpeed on GPU handles bf16 itself."""
    if dtype not in DTYPES:
        raise ValueError(f"train.dtype={dtype!r}: use auto, bfloat16 or float32")
    enabled = resolve_dtype(dtype, device, "train") == torch.bfloat16 and not (
        engine_kind == "deepspeed" and device.type == "cuda")
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


# ---------------------------------------------------------------------------------------------
# optimizer, schedule, wrapping
def lr_lambda(total_steps: int, warmup_ratio: float, min_ratio: float, warm: int | None = None):
    warm = warm if warm is not None else max(1, int(round(total_steps * warmup_ratio)))

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        prog = min(1.0, (step - warm) / max(1, total_steps - warm))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * prog))
    return f


def make_schedule(opt: torch.optim.Optimizer, total_steps: int, cfg: RunConfig) -> torch.optim.lr_scheduler.LambdaLR:
    warm = max(1, int(round(total_steps * cfg.train.warmup_ratio)))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(total_steps, cfg.train.warmup_ratio,
                                                             cfg.train.min_lr_ratio, warm))
    sched.warm_steps = warm  # kept when set_total_steps moves the end of the cosine
    return sched


def set_total_steps(sched: torch.optim.lr_scheduler.LambdaLR, total_steps: int, cfg: RunConfig) -> None:
    """The cosine now ends at `total_steps` (the budget's re-fit); the warm-up keeps the length it had
    from the first total, since it may be over already. The next scheduler step reads the new curve."""
    sched.lr_lambdas = [lr_lambda(total_steps, cfg.train.warmup_ratio, cfg.train.min_lr_ratio, sched.warm_steps)
                        for _ in sched.lr_lambdas]


class TorchEngine:
    """Plain or DDP training with AdamW, cosine schedule, clipping and gradient accumulation."""

    kind = "torch"

    def __init__(self, model: nn.Module, cfg: RunConfig, total_steps: int, d: Dist) -> None:
        self.module = model
        self.d = d
        self.cfg = cfg
        self.model = model
        if d.dp > 1:  # gradients averaged over the data-parallel ranks (a tp group's ranks hold the same batch)
            self.model = nn.parallel.DistributedDataParallel(
                model, device_ids=[d.device.index] if d.device.type == "cuda" else None, process_group=d.dp_group)
        params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=cfg.train.lr, betas=tuple(cfg.train.betas),
                                     weight_decay=cfg.train.weight_decay)
        self.sched = make_schedule(self.opt, total_steps, cfg)
        self.clip = cfg.train.grad_clip
        self.accum = cfg.train.grad_accum
        self.micro = 0

    def forward(self, **kw: torch.Tensor) -> dict[str, torch.Tensor]:
        # skip the DDP all-reduce on micro-steps that do not end an accumulation window
        if isinstance(self.model, nn.parallel.DistributedDataParallel):
            self.model.require_backward_grad_sync = (self.micro + 1) % self.accum == 0
        return self.model(**kw)

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.accum).backward()
        self.micro += 1

    def step(self) -> bool:
        """Returns True when an optimizer step happened."""
        if self.micro % self.accum:
            return False
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.clip)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return True

    def lr(self) -> float:
        return self.sched.get_last_lr()[0]

    def set_total_steps(self, total_steps: int) -> None:
        set_total_steps(self.sched, total_steps, self.cfg)

    def save(self, folder: Path) -> None:
        if self.d.main:
            # the target's own tensors a drafter holds (frozen, maybe tied to each other) are not checkpointed
            skip = not_saved(self.module)
            save_file({k: v.detach().cpu().contiguous() for k, v in self.module.state_dict().items() if k not in skip},
                      str(folder / "model.safetensors"))
            torch.save({"opt": self.opt.state_dict(), "sched": self.sched.state_dict(), "micro": self.micro},
                       folder / "optimizer.pt")

    def full_params(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def load(self, folder: Path) -> None:
        sd = load_file(str(folder / "model.safetensors"))
        missing, unexpected = self.module.load_state_dict({k: v.to(self.d.device) for k, v in sd.items()}, strict=False)
        missing = sorted(set(missing) - not_saved(self.module))
        if missing or unexpected:
            raise RuntimeError(f"checkpoint {folder}: missing {missing[:6]}, unexpected {unexpected[:6]}")
        st = torch.load(folder / "optimizer.pt", map_location=self.d.device, weights_only=False)
        self.opt.load_state_dict(st["opt"])
        self.sched.load_state_dict(st["sched"])
        self.micro = st["micro"]


class DeepSpeedEngine:
    """DeepSpeed ZeRO 1/2/3 with the same AdamW + schedule (client optimizer)."""

    kind = "deepspeed"

    def __init__(self, model: nn.Module, cfg: RunConfig, total_steps: int, d: Dist) -> None:
        if d.device.type == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from drafthead.optional import require

        deepspeed = require("deepspeed", f"train.deepspeed={cfg.train.deepspeed}")

        self.d = d
        self.cfg = cfg
        self.module = model
        ds = resolve_deepspeed_config(cfg.train.deepspeed)
        ds["train_micro_batch_size_per_gpu"] = cfg.train.batch_size
        ds["gradient_accumulation_steps"] = cfg.train.grad_accum
        ds["train_batch_size"] = cfg.train.batch_size * cfg.train.grad_accum * d.world
        ds["gradient_clipping"] = cfg.train.grad_clip
        ds["bf16"] = {"enabled": d.device.type == "cuda"}
        ds["zero_allow_untested_optimizer"] = True
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=cfg.train.lr, betas=tuple(cfg.train.betas),
                                weight_decay=cfg.train.weight_decay)
        sched = make_schedule(opt, total_steps, cfg)
        self.engine, self.opt, _, self.sched = deepspeed.initialize(
            model=model, model_parameters=params, optimizer=opt, lr_scheduler=sched, config=ds,
            dist_init_required=d.world > 1 and not dist.is_initialized())

    def forward(self, **kw: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.engine(**kw)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def step(self) -> bool:
        boundary = self.engine.is_gradient_accumulation_boundary()
        self.engine.step()
        return boundary

    def lr(self) -> float:
        return self.sched.get_last_lr()[0]

    def set_total_steps(self, total_steps: int) -> None:
        set_total_steps(self.sched, total_steps, self.cfg)

    def save(self, folder: Path) -> None:
        self.engine.save_checkpoint(str(folder), tag="deepspeed")

    def load(self, folder: Path) -> None:
        self.engine.load_checkpoint(str(folder), tag="deepspeed")

    def full_params(self) -> contextlib.AbstractContextManager:
        """All ranks enter: inside, `self.module` holds whole weights (ZeRO-3 shards them; 1/2 do not)."""
        import deepspeed

        if self.engine.zero_optimization_stage() < 3:
            return contextlib.nullcontext()
        return deepspeed.zero.GatheredParameters(list(self.module.parameters()), modifier_rank=None)


def resolve_deepspeed_config(name: str) -> dict:
    return json.loads(deepspeed_config_path(name).read_text())


def build_engine(model: nn.Module, cfg: RunConfig, total_steps: int, d: Dist) -> TorchEngine | DeepSpeedEngine:
    return (DeepSpeedEngine if cfg.train.deepspeed else TorchEngine)(model, cfg, total_steps, d)


# ---------------------------------------------------------------------------------------------
# checkpoints: atomic across ranks (shared temp name, rank 0 renames)
def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(st: dict) -> None:
    torch.set_rng_state(st["torch"])
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    if st.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def save_checkpoint(run_dir: Path, step: int, engine: Any, state: dict, d: Dist, keep: int,
                    target_fingerprint: dict | None = None) -> Path:
    """Write `checkpoints/step_N` atomically (a shared temp name, rank 0 renames). A full or read-only disk
    raises a WriteError naming it; the last complete checkpoint stands."""
    ckpts = run_dir / "checkpoints"
    final = ckpts / f"step_{step}"
    with writing(final):
        _write_checkpoint(run_dir, ckpts, final, step, engine, state, d, keep, target_fingerprint)
    return final


def _write_checkpoint(run_dir: Path, ckpts: Path, final: Path, step: int, engine: Any, state: dict, d: Dist,
                      keep: int, target_fingerprint: dict | None) -> None:
    tmp = ckpts / f".step_{step}.tmp"
    if d.main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(d)
    engine.save(tmp)
    torch.save(rng_state(), tmp / f"rng_rank{d.rank}.pt")
    barrier(d)
    if d.main:
        (tmp / "trainer_state.json").write_text(json.dumps({**state, "step": step, "world": d.world,
                                                            "tensor_parallel": d.tp, "engine": engine.kind,
                                                            "target_fingerprint": target_fingerprint}, indent=2))
        shutil.copy(run_dir / "config.yaml", tmp / "config.yaml")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    barrier(d)


def list_checkpoints(run_dir: Path) -> list[Path]:
    ckpts = run_dir / "checkpoints"
    if not ckpts.is_dir():
        return []
    found = [p for p in ckpts.glob("step_*") if p.is_dir() and (p / "trainer_state.json").exists()]
    return sorted(found, key=lambda p: int(p.name.split("_")[1]))


def load_checkpoint(folder: Path, engine: Any, d: Dist, target_fingerprint: dict | None = None,
                    allow_mismatch: bool = False, log=print) -> dict:
    """Restore `engine` and the RNGs from `folder`; a checkpoint written against another target is an error
    (TargetMismatch) unless `allow_mismatch`."""
    state = json.loads((folder / "trainer_state.json").read_text())
    if target_fingerprint is not None:
        note = compare(state.pop("target_fingerprint", None), target_fingerprint, allow_mismatch,
                       f"checkpoint {folder}", "target.allow_mismatch")
        if note:
            log(f"warning: {note}")
    was_tp = state.get("tensor_parallel", 1)
    if was_tp != d.tp:
        raise ValueError(f"checkpoint {folder} was written with target.tensor_parallel={was_tp}; resume with the "
                         f"same (now {d.tp}): the data order depends on the data-parallel size")
    if state["world"] != d.world:
        raise ValueError(f"checkpoint {folder} was written by {state['world']} ranks; resume with the same "
                         f"--nproc_per_node (now {d.world})")
    if state["engine"] != engine.kind:
        raise ValueError(f"checkpoint {folder} is a {state['engine']} checkpoint; this run uses {engine.kind}")
    engine.load(folder)
    rng = folder / f"rng_rank{d.rank}.pt"
    if rng.exists():
        set_rng_state(torch.load(rng, weights_only=False))
    return state


# ---------------------------------------------------------------------------------------------
# evaluation: TTT accuracies on held-out data, simulated acceptance length
@torch.no_grad()
def evaluate(model: nn.Module, batches: list[dict[str, torch.Tensor]], head: TargetHead, d: Dist
             ) -> dict[str, float]:
    was = model.training
    model.eval()
    correct = count = loss = None
    blocks = torch.zeros(2, dtype=torch.float64)  # accepted prefix, blocks (families that draft blocks)
    nb = 0
    for batch in batches:
        out = model(**drafter_inputs(batch, head))
        correct = out["correct"] if correct is None else correct + out["correct"]
        count = out["count"] if count is None else count + out["count"]
        loss = out["loss"].detach() if loss is None else loss + out["loss"].detach()
        if "accept_len" in out:
            blocks += torch.tensor([float(out["accept_len"]), float(out["blocks"])], dtype=torch.float64)
        nb += 1
    model.train(was)
    if correct is None:
        return {}
    correct, count = all_reduce_data(correct, d), all_reduce_data(count, d)
    acc = (correct / count.clamp(min=1)).tolist()
    sim, prod = 1.0, 1.0
    for a in acc:
        prod *= a
        sim += prod
    res = {f"eval/acc_{i}": a for i, a in enumerate(acc)}
    res["eval/loss"] = float(all_reduce_data(loss, d)) / (nb * d.dp)
    res["eval/sim_accept_len"] = sim  # 1 (bonus token) + sum_k prod_{i<=k} acc_i
    if blocks[1] > 0:  # measured per block: 1 (bonus) + the run of greedy-correct slots
        blocks = all_reduce_data(blocks, d)
        res["eval/block_accept_len"] = 1.0 + float(blocks[0] / blocks[1].clamp(min=1))
    return res


# ---------------------------------------------------------------------------------------------
# logging
class Logger:
    """metrics.jsonl always; wandb (offline unless a key is configured) when enabled; rank 0 only."""

    def __init__(self, run_dir: Path, cfg: RunConfig, d: Dist, config_dict: dict, start_step: int = 0) -> None:
        self.main = d.main
        self.path = run_dir / "metrics.jsonl"
        self.wandb = None
        if self.main:
            cut_metrics(self.path, start_step)
        if self.main and cfg.logging.wandb:
            try:
                from drafthead.optional import require

                wandb = require("wandb", "logging.wandb=true")
                if not os.environ.get("WANDB_API_KEY"):
                    os.environ.setdefault("WANDB_MODE", "offline")
                self.wandb = wandb.init(project=cfg.logging.project, dir=str(run_dir), config=config_dict,
                                        name=Path(cfg.output_dir).name, resume="allow")
            except Exception as e:  # wandb is optional: say so, keep metrics.jsonl
                print(f"wandb disabled (metrics go to {self.path} only): {e}")

    def log(self, row: dict) -> None:
        if not self.main:
            return
        with writing(self.path), open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()


def cut_metrics(path: Path, step: int) -> int:
    """Cut an append-only metrics file back to what a run starting at `step` (0: a fresh run; N: resumed from
    checkpoint step_N) keeps: rows up to that step, less the end-of-run budget record, which the run writes
    again. Rows logged after the checkpoint by the run that stopped would otherwise appear twice. A line cut
    short by a kill is dropped. Returns the number of rows removed."""
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            dropped += 1
            continue
        if step > 0 and row.get("step", 0) <= step and "budget" not in row:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        atomic_write_bytes(path, "".join(line + "\n" for line in kept).encode())
    return dropped


class Throughput:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.tokens = 0

    def add(self, n: int) -> None:
        self.tokens += n

    def rate(self) -> float:
        dt = time.perf_counter() - self.t0
        r = self.tokens / dt if dt > 0 else 0.0
        self.t0, self.tokens = time.perf_counter(), 0
        return r

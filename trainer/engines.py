"""What steps the optimizer: plain/DDP (`TorchEngine`) or DeepSpeed ZeRO (`DeepSpeedEngine`), with the same
AdamW and warm-up + cosine schedule. `train.py` only sees forward/backward/step/save/load.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn

from drafthead.registry import not_saved
from drafthead.trainer.config import RunConfig, deepspeed_config_path
from drafthead.trainer.dist import Dist


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

"""Distributed helpers (a leaf: every trainer module may import it)."""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def main(self) -> bool:
        return self.rank == 0


def init_distributed() -> Dist:
    """torchrun sets WORLD_SIZE/RANK; gloo on CPU, nccl on GPU. Plain `python train.py` = 1 process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{local}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        # long timeout: the other ranks wait in a barrier while rank 0 alone regenerates data or runs an
        # offline capture, which takes hours on real data (the NCCL default of 10 min would kill them)
        dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(hours=12))
    return Dist(rank, world, local, device)


def barrier(d: Dist) -> None:
    if d.world > 1:
        dist.barrier()


def all_reduce_sum(t: torch.Tensor, d: Dist) -> torch.Tensor:
    if d.world > 1:  # NCCL reduces only CUDA tensors: go through the rank's device
        dev = t.device
        t = t.to(d.device, copy=True)
        dist.all_reduce(t)
        t = t.to(dev)
    return t

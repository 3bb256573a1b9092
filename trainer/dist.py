"""Distributed helpers (a leaf: every trainer module may import it).

Ranks form a (dp, tp) grid: `target.tensor_parallel` = tp consecutive ranks share one frozen target, split by
transformers' tensor-parallel plan over a torch DeviceMesh; the draft is replicated inside a tp group and
trained data-parallel across the dp groups. tp = 1 is plain DDP over the whole world.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    tp: int = 1  # ranks sharing one target (tensor parallel)
    tp_mesh: Any = None  # the DeviceMesh of this rank's tp group (tp > 1)
    dp_group: Any = None  # the process group of this rank's data-parallel peers (same tp rank; tp > 1)

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def dp(self) -> int:
        """Data-parallel ranks: groups that see different batches."""
        return self.world // self.tp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp


def check_tensor_parallel(tp: int, world: int) -> None:
    if tp > world:
        raise ValueError(f"target.tensor_parallel={tp} needs {tp} ranks to split the target over, the world has "
                         f"{world} (torchrun --nproc_per_node {tp} or more)")
    if world % tp:
        raise ValueError(f"target.tensor_parallel={tp} does not divide the world size {world}: ranks form "
                         f"(data-parallel x {tp}) groups")


def init_distributed(tp: int = 1) -> Dist:
    """torchrun sets WORLD_SIZE/RANK; gloo on CPU, nccl on GPU. Plain `python train.py` = 1 process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    check_tensor_parallel(tp, world)
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{local}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        # long timeout: the other ranks wait in a barrier while rank 0 alone regenerates data or runs an
        # offline capture, which takes hours on real data (the NCCL default of 10 min would kill them)
        dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(hours=12))
    d = Dist(rank, world, local, device, tp)
    if tp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
        d.tp_mesh, d.dp_group = mesh["tp"], mesh.get_group("dp")
    return d


def barrier(d: Dist) -> None:
    if d.world > 1:
        dist.barrier()


def all_reduce_sum(t: torch.Tensor, d: Dist, group: Any = None) -> torch.Tensor:
    """Sum over every rank, or over `group` (a process group of this rank's)."""
    if (d.world if group is None else dist.get_world_size(group)) > 1:
        dev = t.device  # NCCL reduces only CUDA tensors: go through the rank's device
        t = t.to(d.device, copy=True)
        dist.all_reduce(t, group=group)
        t = t.to(dev)
    return t


def all_reduce_data(t: torch.Tensor, d: Dist) -> torch.Tensor:
    """Sum over the data-parallel ranks only: the ranks of a tp group hold the same batch, counted once."""
    return all_reduce_sum(t, d, d.dp_group if d.tp > 1 else None)


def tp_broadcast(obj: Any, d: Dist) -> Any:
    """The tp group leader's `obj` on every rank of its group (a no-op without tensor parallelism)."""
    if d.tp == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, group=d.tp_mesh.get_group(), group_src=0)
    return box[0]

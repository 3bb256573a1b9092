"""The target's decode and verify forwards on a static cache, replayed as CUDA graphs on a GPU.

Why: a forward of a few new tokens of an 8B target on a GPU is launch-bound (19.5 ms at T = 1 on an H200 for
Llama-3.1-8B geometry, where the weights stream in ~4 ms): hundreds of small kernels, each launched from Python.
A CUDA graph launches them all at once. A graph fixes shapes and addresses, so:
- T is padded up to a bucket (`BUCKETS`); the padded tokens sit after the real ones, write their K/V past them (the
  next round's mask ends at its lens, so nothing ever attends to them) and their outputs are dropped;
- the cache is the model's own buffer per (batch, capacity) (`cache()`, which `TargetModel.new_cache` returns while
  graphs are on) and the inputs are copied into buffers the graph reads;
- the forward runs without host syncs (`TargetModel.forward(static=True)`: K/V written by index, the capacity
  checked here before the replay).
A graph is captured on first use of each (cache, batch, bucket, tree or chain, capture) and replayed after.
Prompts, MoE targets (their routers sync), calls past the last bucket or the cache's capacity run eagerly.

On CPU the same static path runs eagerly (no graphs): `scripts/gpu_check.py --dry` and the tests check that it
gives the eager forward's logits and the same greedy tokens, so the path a GPU replays is tested without a GPU.
`DRAFTHEAD_CUDA_GRAPHS=0` turns it off on CUDA.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any

import torch

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
MAX_CACHES = 4  # static caches kept (one per batch and capacity); the oldest and its graphs go first
CACHE_STEP = 256  # capacities round up to a multiple: prompts of other lengths reuse a cache and its graphs


def enabled(device: torch.device) -> bool:
    """Graphs on by default on CUDA; DRAFTHEAD_CUDA_GRAPHS=0 turns them off."""
    return device.type == "cuda" and os.environ.get("DRAFTHEAD_CUDA_GRAPHS", "1") != "0"


def bucket(T: int) -> int | None:
    return next((b for b in BUCKETS if b >= T), None)


class StaticForward:
    """Decode and verify forwards of one `TargetModel` on padded buckets and static buffers; `graphs` replays
    them as CUDA graphs (CUDA only), else runs the same path eagerly (CPU checks)."""

    def __init__(self, tm: Any, graphs: bool) -> None:
        self.tm = tm
        self.graphs = bool(graphs and tm.device.type == "cuda")
        self._caches: OrderedDict[tuple[int, int], torch.Tensor] = OrderedDict()
        self._entries: dict[tuple, dict] = {}  # key -> graph, input and output buffers
        self._pool = torch.cuda.graph_pool_handle() if self.graphs else None
        self.captured = 0  # graphs captured so far (reports, tests)
        self.replayed = 0

    def cache(self, batch: int, capacity: int) -> torch.Tensor:
        """The static cache for (batch, capacity rounded up to CACHE_STEP), zeroed: a graph holds its address, so it
        is reused."""
        capacity = -(-capacity // CACHE_STEP) * CACHE_STEP
        key = (batch, capacity)
        c = self._caches.get(key)
        if c is None:
            while len(self._caches) >= MAX_CACHES:
                _, old = self._caches.popitem(last=False)
                self._entries = {k: v for k, v in self._entries.items() if k[0] != old.data_ptr()}
            c = self._caches[key] = torch.zeros(batch, self.tm.num_layers * 2 * self.tm.num_kv_heads, capacity,
                                                self.tm.head_dim, dtype=self.tm.dtype, device=self.tm.device)
        else:
            c.zero_()
            self._caches.move_to_end(key)
        return c

    def usable(self, cache: torch.Tensor, input_ids: torch.Tensor, lens: torch.Tensor) -> bool:
        """Whether this call can take the static path: a cache of ours, T within the last bucket, and room in the
        cache for the padded block (checked on the host, before any replay)."""
        b = bucket(input_ids.shape[1])
        if b is None or any(self.tm.moe) or (self.graphs and cache.data_ptr() not in
                                             {c.data_ptr() for c in self._caches.values()}):
            return False
        return int(lens.max()) + b <= cache.shape[2]

    def run(self, cache: torch.Tensor, input_ids: torch.Tensor, lens: torch.Tensor,
            tree_mask: torch.Tensor | None, depth: torch.Tensor | None, capture: bool
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`TargetModel.forward` of T new tokens (no prompt, all logits) through the bucket's static buffers."""
        B, T = input_ids.shape
        Tb = bucket(T)
        if Tb is None:
            raise ValueError(f"static forward of {T} tokens: the last bucket is {BUCKETS[-1]} (check `usable` first)")
        tree = tree_mask is not None
        key = (cache.data_ptr(), B, Tb, tree, capture)
        e = self._entries.get(key)
        if e is None:
            e = self._entries[key] = self._buffers(cache, B, Tb, tree, capture)
        ids, ln = e["ids"], e["lens"]
        ids.zero_()
        ids[:, :T] = input_ids  # [B, Tb]
        ln.copy_(lens)
        if tree:  # padded rows see themselves only; real rows never see them
            e["tree"].copy_(torch.eye(Tb, dtype=torch.bool, device=ids.device).expand(B, Tb, Tb))
            e["tree"][:, :T, :T] = tree_mask
            e["depth"].copy_(torch.arange(Tb, device=ids.device).expand(B, Tb))
            e["depth"][:, :T] = depth
        if self.graphs:
            if e["graph"] is None:
                self._capture(e, cache)
            e["graph"].replay()
            self.replayed += 1
            logits, aux = e["out"]
        else:
            logits, aux = self._forward(e, cache)
        return logits[:, :T].clone(), None if aux is None else aux[:, :T].clone()

    def _buffers(self, cache: torch.Tensor, B: int, Tb: int, tree: bool, capture: bool) -> dict:
        dev = cache.device
        e = {"ids": torch.zeros(B, Tb, dtype=torch.long, device=dev),
             "lens": torch.zeros(B, dtype=torch.long, device=dev),
             "tree": torch.zeros(B, Tb, Tb, dtype=torch.bool, device=dev) if tree else None,
             "depth": torch.zeros(B, Tb, dtype=torch.long, device=dev) if tree else None,
             "capture": capture, "graph": None, "out": None}
        return e

    def _forward(self, e: dict, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.tm.forward(cache, e["ids"], e["lens"], tree_mask=e["tree"], depth=e["depth"],
                               capture=e["capture"], static=True)

    def _capture(self, e: dict, cache: torch.Tensor) -> None:
        # warm-up on a side stream first (cuBLAS and cuDNN set up their workspaces outside the graph), on a copy of
        # the cache so the warm-up's K/V writes leave the real one as it is
        saved = cache.clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            self._forward(e, cache)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self._pool):
            e["out"] = self._forward(e, cache)
        cache.copy_(saved)
        e["graph"] = g
        self.captured += 1

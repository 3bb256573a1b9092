"""The seam between the runtime and a family's draft state, declared in one place.

Runtime -> draft state: the runtime calls `DraftState` (bind, select, extend) on every draft state, and a mode's
`propose` (the family's mode table, `DraftMode`) calls the one method its mode declares in `DraftMode.state`:
`ChainState.chain`, `TreeState.tree`, or a family's own protocol (DFlash's `BlockState.block`).
Draft state -> runtime: `bind` hands a draft state a `SessionView` (read-only: the batch's roots, lengths, target
KV cache and settings) and a `TargetLayers` (the target's layers a self-draft may run). A family file imports this
module, `runtime.draft` (the shared runners and mode entries) and `runtime.sampling`; never the session or the
target model behind these views, so renaming a runtime field cannot silently break a family.
tests/test_families.py checks every family's draft states against these protocols (`hooks`), and mypy checks the
runtime and the family files against them (tests/test_imports.py).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, TypeVar

import torch
from torch import nn


_Fn = TypeVar("_Fn", bound=Callable[..., Any])


def inference(fn: _Fn) -> _Fn:
    """`torch.inference_mode()` as a method decorator that keeps the method's signature for mypy (torch is read as
    Any there, so its own decorator would hide every draft state's method from the protocol checks)."""
    return torch.inference_mode()(fn)


@dataclass
class SpecConfig:
    mode: str = "chain"  # "ar" (no drafting: our own autoregressive loop) | "chain" | "tree" | "ngram" | "block"
    # drafts per round along one path (chain length, deepest tree path; block: the first this many of the block's
    # B-1 slots are verified); vLLM's name. A draft's trained depth is its config's `num_draft_tokens`
    num_speculative_tokens: int = 4
    tree_nodes: int = 8  # tree: draft nodes verified per round (excl. the root; EAGLE-2 dynamic tree)
    topk: int = 4  # tree: children expanded per node
    temperature: float = 0.0
    top_p: float = 1.0
    adaptive: bool = False  # adaptive draft length (chain: k in [1, max]; tree: depth)
    ngram: bool = False  # stack the n-gram / prompt-lookup drafter with the trained drafter (longer proposal wins)
    ngram_n: int = 3  # match length for prompt lookup
    seed: int = 0
    batch_size: int = 1  # requests verified together
    # chain: a request's drafts for the round end before the first token whose draft probability is below
    # this (llama.cpp's draft p_min; drafters that support it: the LoRA self-drafter); 0 = off
    draft_stop_prob: float = 0.0


@dataclass
class Proposal:
    tokens: torch.Tensor  # [B, N] target ids, node 0 = root
    parents: torch.Tensor  # [B, N] parent node (-1 for the root), parents[b, i] < i
    num_nodes: torch.Tensor  # [B] valid nodes (root included); the rest is padding
    depth: torch.Tensor  # [B] draft tokens along the deepest path (= num_drafted)
    draft_probs: torch.Tensor | None = None  # [B, N, V] distribution each node was sampled from (chains)
    is_chain: bool = True  # every row is a chain (parents[i] = i - 1)


class ChainDraft(NamedTuple):
    """What a drafter's `chain(k, ...)` proposes: k drafts a request, the distributions they were sampled from,
    and how many of them each request keeps (None: all k; a drafter with a confidence stop cuts some short)."""
    drafts: torch.Tensor  # [B, k] target ids
    q: torch.Tensor | None = None  # [B, k, V] when sampled
    lengths: torch.Tensor | None = None  # [B] drafts kept, <= k


class SessionView(Protocol):
    """What a draft state may read of the batch it drafts for; every tensor's row b is the same request, and the
    tensors are replaced (not resized in place) as requests leave the batch, so read them when drafting."""

    @property
    def spec(self) -> SpecConfig: ...

    @property
    def roots(self) -> torch.Tensor: ...  # [B] the last accepted token, not in the target cache yet

    @property
    def lens(self) -> torch.Tensor: ...  # [B] target tokens cached per request

    @property
    def cache(self) -> torch.Tensor: ...  # [B, L*2*kvh, S, D] the target's KV cache (TargetLayers.block's layout)


class TargetLayers(Protocol):
    """The target's layers as a self-draft runs them: the runtime's own block math, kernels and KV layout."""

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def num_kv_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...

    @property
    def lm_head(self) -> nn.Module: ...

    def layer(self, i: int) -> nn.Module: ...

    def embed(self, ids: torch.Tensor) -> torch.Tensor: ...  # [B, T] -> [B, T, H]

    def rotary(self, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def causal_mask(self, lens: torch.Tensor, T: int, S: int) -> torch.Tensor: ...  # [B, 1, T, S]

    def block(self, i: int, layer: nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              cache: torch.Tensor, positions: torch.Tensor, start: int | None, S: int, mask: torch.Tensor,
              prefill: bool = False) -> torch.Tensor: ...  # decoder layer `layer` with KV slot i of `cache`

    def norm(self, norm: nn.Module, h: torch.Tensor) -> torch.Tensor: ...

    def linear(self, proj: nn.Module, x: torch.Tensor) -> torch.Tensor: ...


class DraftState(Protocol):
    """What the runtime calls on every draft state (one per batch, from `Drafter.draft_state`)."""

    def bind(self, target: TargetLayers, session: SessionView) -> None:
        """Once, before the prompt's entries: a drafter that runs the target's own layers keeps these."""

    def select(self, rows: torch.Tensor) -> None:
        """Keep only these batch rows (finished requests leave the batch)."""

    def extend(self, tokens: torch.Tensor, feats: torch.Tensor, counts: torch.Tensor) -> None:
        """Append verified entries: tokens [B, T] = x_{t+1}, feats [B, T, F] = the target's f_t, counts [B] valid."""


class ChainState(DraftState, Protocol):
    def chain(self, k: int, temperature: float, top_p: float, gen: torch.Generator | None) -> ChainDraft:
        """k drafts per request, each conditioned on the ones before it, greedy or sampled."""


class TreeState(DraftState, Protocol):
    def tree(self, roots: torch.Tensor, topk: int, depth: int, budget: int,
             max_depth: torch.Tensor | None = None) -> Proposal:
        """An EAGLE-2 dynamic tree of at most `budget` nodes under each root."""


@dataclass(frozen=True)
class DraftMode:
    """One drafting mode as a family offers it. A drafter's `draft_modes` maps mode names to these (the first is
    its default) and the runtime dispatches through that table, so a new proposal shape is code in the family's
    file: its draft state's method (declared in a protocol, `state`), a `propose` that calls it, the mode entry."""
    propose: Callable[..., Proposal]  # (draft state, roots [B], lengths [B], spec, gen) -> Proposal
    max_nodes: Callable[[SpecConfig], int]  # nodes one round verifies besides the root (sizes the cache)
    ngram_cap: Callable[[SpecConfig], int]  # the longest n-gram chain stacked onto this mode's proposal
    state: type = DraftState  # the protocol a draft state drafting in this mode follows
    check: Callable[[SpecConfig, Any], str | None] = lambda spec, drafter: None  # a problem with spec for drafter


def hooks(protocol: type) -> tuple[str, ...]:
    """The names a protocol declares, its protocol bases' included: the list a contract test checks a class
    against (so the protocol is the one place the hooks are written)."""
    names: list[str] = []
    for cls in reversed(protocol.__mro__):
        if cls in (object, Protocol) or not getattr(cls, "_is_protocol", False):
            continue
        for name in [*getattr(cls, "__annotations__", {}), *vars(cls)]:
            if not name.startswith("_") and name not in names:
                names.append(name)
    return tuple(names)

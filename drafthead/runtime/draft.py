"""Proposals for one verify round: chain, EAGLE-2 dynamic tree, n-gram (prompt lookup), and the shared
drafting states families build theirs from.

Every proposal is a token tree (a chain is parents[i] = i - 1) whose node 0 is the root = the last
accepted token, which the target has not processed yet. The target verifies the whole tree in one
forward, so drafting only has to produce `Proposal` tensors.

Draft positions (the `decode` contract of a drafter run by `DraftRunner`): the draft's prefix entry at
position t is (token x_{t+1}, fuse(f_t)) and predicts x_{t+2}, where f_t is the target feature the family
reads (`drafter.features`: the captured aux layers, or the last hidden state). The draft prefix always
covers exactly the tokens the target has cached, so after a round it is extended with the accepted path
and its fresh target features; entries made while speculating are never kept. A drafter without a
reduced vocabulary reports its full vocabulary as the "draft vocabulary" (`draft_to_target` = identity).
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from drafthead.layers import take_rows
from drafthead.runtime.contract import (ChainDraft, ChainState, DraftMode, Proposal, SessionView, inference,
                                        SpecConfig, TargetLayers, TreeState)
from drafthead.runtime.model import attention_mask
from drafthead.runtime.sampling import greedy, probs, sample


def run_chain(first: "DraftRunner", step_runner: Callable[[int], "DraftRunner"], k: int, temperature: float,
              top_p: float, gen: torch.Generator | None) -> ChainDraft:
    """k draft tokens per request from `first`'s last prefix entry, greedy or sampled; draft j's entry is
    decoded by `step_runner(j)` (the runner itself for a one-module draft, module (j + 1) % M for a
    multi-module one) at position lens + j, after that runner's own entries of this round."""
    logits, h = first.logits, first.hidden  # [B, V], [B, H]
    B, dev = logits.shape[0], logits.device
    drafts, qs = [], []
    for j in range(k):
        if temperature > 0:
            q = probs(logits, temperature, top_p)  # [B, V]
            d = sample(q, torch.rand(B, generator=gen, device=dev))
            qs.append(first.full_probs(q))
        else:
            d = greedy(logits)  # [B]
        drafts.append(d)
        if j == k - 1:
            break
        r = step_runner(j)
        lg, out = r.decode(r.to_target(d)[:, None], h[:, None], (first.lens + j)[:, None])
        logits, h = lg[:, 0], out[:, 0]
    return ChainDraft(first.to_target(torch.stack(drafts, dim=1)), torch.stack(qs, dim=1) if qs else None)


NGRAM_STACK_FACTOR = 2  # a stacked n-gram chain may be this many times longer than the drafter's proposal


def tree_budget(spec: SpecConfig) -> int:
    """Nodes an EAGLE-2 tree keeps: the pool holds topk + (depth-1)*topk^2 candidates."""
    return min(spec.tree_nodes, spec.topk + (spec.num_speculative_tokens - 1) * spec.topk ** 2)


def propose_chain(state: ChainState, roots: torch.Tensor, lengths: torch.Tensor, spec: SpecConfig,
                  gen: torch.Generator | None) -> Proposal:
    got = state.chain(int(lengths.max()), spec.temperature, spec.top_p, gen)
    if got.lengths is not None:  # the drafter stopped some requests early (its confidence stop)
        lengths = torch.minimum(lengths, got.lengths)
    return chain_proposal(roots, got.drafts, lengths, got.q)


def propose_tree(state: TreeState, roots: torch.Tensor, lengths: torch.Tensor, spec: SpecConfig,
                 gen: torch.Generator | None) -> Proposal:
    return state.tree(roots, spec.topk, int(lengths.max()), tree_budget(spec), lengths if spec.adaptive else None)


CHAIN = DraftMode(propose_chain, lambda spec: spec.num_speculative_tokens,
                  lambda spec: NGRAM_STACK_FACTOR * spec.num_speculative_tokens, ChainState)
TREE = DraftMode(propose_tree, tree_budget, tree_budget, TreeState)  # the n-gram chain then costs what the tree would


def chain_proposal(roots: torch.Tensor, drafts: torch.Tensor, lengths: torch.Tensor,
                   draft_probs: torch.Tensor | None = None) -> Proposal:
    """roots [B], drafts [B, K] (the first lengths[b] count), draft_probs [B, K, V] | None -> chain Proposal."""
    B, K = drafts.shape
    tokens = torch.cat([roots[:, None], drafts], dim=1)  # [B, K+1]
    parents = torch.arange(-1, K, device=roots.device).expand(B, K + 1).contiguous()  # [B, K+1]
    if draft_probs is not None:
        draft_probs = torch.cat([torch.zeros_like(draft_probs[:, :1]), draft_probs], dim=1)  # the root has no q
    return Proposal(tokens, parents, lengths + 1, lengths.clone(), draft_probs, True)


def ngram_lookup(history: list[int], n: int, max_len: int) -> list[int]:
    """Prompt lookup: continue the most recent earlier occurrence of the last n (then n-1, .., 1) tokens.

    Returns up to max_len proposed tokens (possibly none).
    """
    L = len(history)
    if max_len <= 0 or L < 2:
        return []
    seq = np.asarray(history, dtype=np.int64)
    for m in range(min(n, L - 1), 0, -1):
        windows = np.lib.stride_tricks.sliding_window_view(seq[: L - 1], m)  # starts 0 .. L-1-m
        hits = np.flatnonzero((windows == seq[L - m:]).all(axis=1))  # all have a continuation token
        if hits.size:
            start = int(hits[-1]) + m
            return seq[start: start + max_len].tolist()
    return []


def merge_ngram(prop: Proposal, ngram: list[list[int]], use: list[bool]) -> Proposal:
    """Replace the rows with use[b] by their n-gram chain; the q of an n-gram token is one-hot."""
    if not any(use):
        return prop
    B, N = prop.tokens.shape
    N2 = max([N] + [len(g) + 1 for g, u in zip(ngram, use) if u])
    tokens = F.pad(prop.tokens, (0, N2 - N))
    parents = F.pad(prop.parents, (0, N2 - N))
    q = None if prop.draft_probs is None else F.pad(prop.draft_probs, (0, 0, 0, N2 - N))
    num_nodes, depth = prop.num_nodes.clone(), prop.depth.clone()
    chain = torch.arange(-1, N2 - 1, device=tokens.device)
    for b in range(B):
        if not use[b]:
            continue
        g = torch.tensor(ngram[b], dtype=torch.long, device=tokens.device)
        n = g.numel()
        tokens[b, 1:] = 0
        tokens[b, 1: 1 + n] = g
        parents[b] = chain
        num_nodes[b], depth[b] = n + 1, n
        if q is not None:
            q[b] = 0
            q[b, torch.arange(1, 1 + n), g] = 1.0
    return Proposal(tokens, parents, num_nodes, depth, q, prop.is_chain)


class DraftRunner:
    """Drafting state of a one-layer drafter for a batch: one KV cache holding the prefix entries and,
    right after them, this round's speculative entries. Chains and trees.

    Args:
        drafter: a module with `config` (num_key_value_heads, head_dim, draft_vocab_size, vocab_size),
            `fuse`, `decode` and `draft_to_target`.
        batch, capacity: rows and max entries (prefix and speculative) of the cache.
    """

    def __init__(self, drafter: nn.Module, batch: int, capacity: int, device: torch.device) -> None:
        c = drafter.config
        self.drafter = drafter
        dtype = next(drafter.parameters()).dtype
        self.kv_heads = c.num_key_value_heads
        # [B, 2 * kvh, S, D]: keys then values (the layout `decode` writes and the CPU one-call layer reads)
        self.cache = torch.zeros(batch, 2 * self.kv_heads, capacity, c.head_dim, dtype=dtype, device=device)
        self.lens = torch.zeros(batch, dtype=torch.long, device=device)  # prefix entries per request
        self.draft_vocab = drafter.draft_to_target(torch.arange(c.draft_vocab_size, device=device))  # [N]
        self.vocab_size = c.vocab_size
        self.num_spec = 0  # entries made while speculating this round, at slots lens .. lens + num_spec - 1
        # set by every extend (the runtime extends with the prompt before it drafts): empty until then
        self.logits = torch.zeros(batch, 0, device=device)  # [B, N] draft logits for the token after the root
        self.hidden = torch.zeros(batch, 0, device=device)  # [B, H] output hidden of the root's prefix entry

    def bind(self, target: TargetLayers, session: SessionView) -> None:
        """Nothing to keep: this drafter runs its own layers (the runtime calls this on every draft state)."""

    @property
    def k(self) -> torch.Tensor:
        return self.cache[:, : self.kv_heads]  # [B, kvh, S, D]

    @property
    def v(self) -> torch.Tensor:
        return self.cache[:, self.kv_heads:]  # [B, kvh, S, D]

    def select(self, rows: torch.Tensor) -> None:
        """Keep only these batch rows (finished requests leave the batch)."""
        self.cache, self.lens = self.cache[rows], self.lens[rows]
        self.logits, self.hidden = self.logits[rows], self.hidden[rows]

    def to_target(self, idx: torch.Tensor) -> torch.Tensor:
        return self.draft_vocab[idx]

    def full_probs(self, q: torch.Tensor) -> torch.Tensor:
        """Draft-vocab probabilities [..., N] -> target vocab [..., V] (zero outside the draft vocab)."""
        out = q.new_zeros(*q.shape[:-1], self.vocab_size)
        out[..., self.draft_vocab] = q
        return out

    def decode(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
               spec_mask: torch.Tensor | None = None, logits_at: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft forward on T new entries that see their prefix plus the spec entries in spec_mask.

        tokens [B, T] target ids, hidden [B, T, H], positions [B, T], spec_mask [B, T, E+T] bool over
        (existing spec entries, new entries), or None: every existing entry and, among the new ones, causally
        (a chain; one comparison builds that mask); logits_at [B] | None: the one new entry per request whose
        logits are wanted. The new entries are written after the existing spec entries.
        Returns (logits [B, T or 1, N], out hidden [B, T, H]).
        """
        T = tokens.shape[1]
        E, S = self.num_spec, self.cache.shape[2]
        if int(self.lens.max()) + E + T > S:
            raise ValueError(f"draft KV cache overflow: {int(self.lens.max())} prefix + {E + T} speculative "
                             f"entries > capacity {S}")
        slots = self.lens[:, None] + E + torch.arange(T, device=tokens.device)  # [B, T]
        if spec_mask is None:  # causal from the new entries' first slot: they see every earlier slot
            mask = attention_mask(self.lens + E, T, S, None)  # [B, 1, T, S]
        else:  # a block of the E spec entries and the T new ones after the prefix
            mask = attention_mask(self.lens, T, S, spec_mask)
        logits, out, _ = self.drafter.decode(tokens, hidden, positions, (self.cache, slots), mask, logits_at)
        self.num_spec = E + T
        return logits, out

    @inference
    def extend(self, tokens: torch.Tensor, feats: torch.Tensor, counts: torch.Tensor) -> None:
        """Append prefix entries: tokens [B, T] = x_{t+1}, feats [B, T, F] = target aux f_t, counts[b] valid.

        Drops this round's speculative entries and sets `logits` / `hidden` from each request's last entry.
        """
        T = tokens.shape[1]
        self.num_spec = 0  # the new entries overwrite them; padded entries land past the new length
        positions = self.lens[:, None] + torch.arange(T, device=tokens.device)  # [B, T] = their slots
        last = counts - 1
        logits, out = self.decode(tokens, self.drafter.fuse(feats), positions, None, last)  # causal
        self.num_spec = 0
        self.logits, self.hidden = logits[:, 0], take_rows(out, last)[:, 0]  # [B, N], [B, H]
        self.lens = self.lens + counts

    @inference
    def chain(self, k: int, temperature: float, top_p: float, gen: torch.Generator | None) -> ChainDraft:
        """k draft tokens per request, greedy or sampled; draft j's entry sits at position lens + j and sees
        the prefix and drafts 0..j."""
        return run_chain(self, lambda j: self, k, temperature, top_p, gen)

    @inference
    def tree(self, roots: torch.Tensor, topk: int, depth: int, budget: int,
             max_depth: torch.Tensor | None = None) -> Proposal:
        """EAGLE-2 dynamic tree: expand the `topk` best frontier nodes by cumulative log-prob for `depth`
        levels (topk children each), then keep the best `budget` nodes over all levels.

        max_depth [B] (adaptive) drops nodes deeper than max_depth[b] from the final selection.
        """
        B, dev, k = roots.shape[0], roots.device, topk
        score, tok = torch.log_softmax(self.logits.float(), dim=-1).topk(k, dim=-1)  # [B, k] depth-1 nodes
        pool_tok, pool_score = [tok], [score]
        pool_parent = [torch.full((B, k), -1, dtype=torch.long, device=dev)]
        pool_depth = [torch.ones(B, k, dtype=torch.long, device=dev)]
        front = torch.arange(k, device=dev).expand(B, k)  # [B, k] pool ids of the frontier
        front_tok, front_score = tok, score
        front_hidden = self.hidden[:, None].expand(B, k, self.hidden.shape[-1])  # [B, k, H] parent outputs
        front_parent = torch.full((B, k), -1, dtype=torch.long, device=dev)  # spec entry of the parent
        anc = torch.zeros(B, 0, 0, dtype=torch.bool, device=dev)  # [B, E, E] ancestor-or-self among spec entries
        for d in range(2, depth + 1):
            E = anc.shape[1]
            # a new entry sees its parent's entry with that entry's ancestors (none under the root), and itself
            par_rows = anc.gather(1, front_parent.clamp(min=0)[:, :, None].expand(B, k, E))  # [B, k, E]
            par_rows = par_rows & (front_parent >= 0)[:, :, None]
            new_rows = torch.cat([par_rows, torch.eye(k, dtype=torch.bool, device=dev).expand(B, k, k)], -1)
            anc = torch.cat([F.pad(anc, (0, k)), new_rows], dim=1)  # [B, E+k, E+k]
            pos = (self.lens + d - 2)[:, None].expand(B, k)  # entry of a depth-(d-1) node
            logits, out = self.decode(self.to_target(front_tok), front_hidden, pos, new_rows)
            child_score, child_tok = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)  # [B, k, k]
            cum = (front_score[:, :, None] + child_score).reshape(B, k * k)
            pool_tok.append(child_tok.reshape(B, k * k))
            pool_score.append(cum)
            pool_parent.append(front.repeat_interleave(k, dim=1))
            pool_depth.append(torch.full((B, k * k), d, dtype=torch.long, device=dev))
            n_before = sum(t.shape[1] for t in pool_tok[:-1])
            front_score, best = cum.topk(k, dim=-1)  # [B, k] next frontier among the new candidates
            front = n_before + best
            front_tok = pool_tok[-1].gather(1, best)
            front_hidden = out.gather(1, (best // k)[:, :, None].expand(-1, -1, out.shape[-1]))
            front_parent = E + best // k
        return select_nodes(roots, self.to_target(torch.cat(pool_tok, 1)), torch.cat(pool_score, 1),
                            torch.cat(pool_parent, 1), torch.cat(pool_depth, 1), budget, max_depth)


class _Module:
    """One module of a multi-module draft seen through the drafter API `DraftRunner` uses."""

    def __init__(self, drafter: nn.Module, module: int) -> None:
        self.drafter, self.module, self.config = drafter, module, drafter.config

    def parameters(self):
        return self.drafter.parameters()

    def draft_to_target(self, idx: torch.Tensor) -> torch.Tensor:
        return self.drafter.draft_to_target(idx)

    def fuse(self, feats: torch.Tensor) -> torch.Tensor:
        return self.drafter.fuse(feats)

    def decode(self, *args):
        return self.drafter.decode(*args, module=self.module)


class ModuleChainRunner:
    """Chains for a draft with sequential modules (module m drafts depth m, as in DeepSeek-V3's layout).

    Each module keeps its own prefix KV cache, built like module 0's from (x_{t+1}, h_t) pairs (what
    vLLM's single-module chain sees). Chain step j runs module j % M and attends to that module's
    prefix and its own entries of this round; tokens drafted by other modules reach it only through
    the hidden state. A one-module (recursive) draft uses `DraftRunner` as is.
    """

    def __init__(self, drafter: nn.Module, batch: int, capacity: int, device: torch.device) -> None:
        self.runners = [DraftRunner(_Module(drafter, m), batch, capacity, device)
                        for m in range(drafter.chain_modules)]

    def bind(self, target: TargetLayers, session: SessionView) -> None:
        """Nothing to keep: this drafter runs its own layers (the runtime calls this on every draft state)."""

    def select(self, rows: torch.Tensor) -> None:
        for r in self.runners:
            r.select(rows)

    def extend(self, tokens: torch.Tensor, feats: torch.Tensor, counts: torch.Tensor) -> None:
        for r in self.runners:
            r.extend(tokens, feats, counts)

    @inference
    def chain(self, k: int, temperature: float, top_p: float, gen: torch.Generator | None) -> ChainDraft:
        """k draft tokens per request (see `run_chain`): module 0's last prefix entry drafts the first, and
        draft j's entry goes to module (j + 1) % M, after that module's own entries."""
        return run_chain(self.runners[0], lambda j: self.runners[(j + 1) % len(self.runners)], k, temperature,
                         top_p, gen)


def select_nodes(roots: torch.Tensor, tok: torch.Tensor, score: torch.Tensor, parent: torch.Tensor,
                 depth: torch.Tensor, budget: int, max_depth: torch.Tensor | None) -> Proposal:
    """Keep the `budget` best pool nodes (cumulative log-prob) as a verify tree rooted at `roots`.

    tok/score/parent/depth [B, P] in pool order (= depth order; parent is a pool id or -1 for the root).
    A child never scores above its parent and the stable sort keeps pool order among ties, so the kept
    set holds every kept node's ancestors.
    """
    B, P = score.shape
    dev = score.device
    if max_depth is not None:
        score = score.masked_fill(depth > max_depth[:, None], float("-inf"))
    M = min(budget, P)
    order = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :M]  # [B, M]
    valid = score.gather(1, order) > float("-inf")
    keep = torch.sort(order.masked_fill(~valid, P), dim=1).values  # [B, M] pool ids in depth order, pad = P
    valid = keep < P
    new_id = torch.zeros(B, P + 1, dtype=torch.long, device=dev)  # pool id -> node id (slot P takes padding)
    new_id.scatter_(1, keep, torch.arange(1, M + 1, device=dev).expand(B, M).contiguous())
    keep = keep.clamp(max=P - 1)
    par = parent.gather(1, keep)  # [B, M]
    par = torch.where(par < 0, 0, new_id.gather(1, par.clamp(min=0))).masked_fill(~valid, 0)
    tokens = torch.cat([roots[:, None], tok.gather(1, keep)], dim=1)  # [B, M+1]
    parents = torch.cat([torch.full((B, 1), -1, dtype=torch.long, device=dev), par], dim=1)  # [B, M+1]
    kept_depth = depth.gather(1, keep).masked_fill(~valid, 0)
    return Proposal(tokens, parents, 1 + valid.sum(1), kept_depth.amax(1), None, False)


def _declared(r: DraftRunner, m: ModuleChainRunner) -> tuple[ChainState, TreeState, ChainState]:
    """Never called: mypy holds each shared runner to the protocols of the modes it drafts in."""
    return r, r, m

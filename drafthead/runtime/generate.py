"""Speculative generation: draft (chain / EAGLE-2 tree / block / n-gram) -> one target verify forward -> accept.

One round for a batch of requests (each at its own length):
  1. propose a token tree per request; node 0 is the root = last accepted token, not yet in the target cache
  2. one target forward over all nodes with the tree mask (positions = cache length + depth), capturing
     the features the drafter reads
  3. greedy match or lossless rejection sampling -> accept_len, path, next_token (the bonus)
  4. compact the target KV of the accepted path (tree) and advance the lengths; nothing is recomputed
  5. emit tokens (stop at EOS / budget), drop finished requests from the batch
  6. extend the draft prefix with (accepted token, target feature) pairs of the path
Mode "ar" is a plain loop over the same target forward (the baseline for speedups).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from drafthead import cores
from drafthead.kernels import packing
from drafthead.kernels import verify as ops  # Triton on CUDA, the eager reference elsewhere
from drafthead.runtime.contract import DraftMode, DraftState, Proposal, SpecConfig, inference
from drafthead.runtime.draft import chain_proposal, merge_ngram, ngram_lookup
from drafthead.runtime.model import TargetModel
from drafthead.runtime.sampling import greedy, probs, sample
from drafthead.target import Target

OWN_MODES = ("ar", "ngram")  # the modes the runtime runs without a drafter; the others are each drafter's table
EMA_ALPHA = 0.2  # weight of the newest round in the acceptance EMA (SGLang's adaptive default)
# KV slots kept past the longest request. Attention spans the whole cache (batch invariance, see
# runtime/model.py), so AR and speculative runs must size it alike: with verify blocks of at most this
# many nodes they do, and their greedy outputs are then bitwise equal in bf16.
CACHE_SLACK = 64


@dataclass
class GenerationResult:
    tokens: list[int]  # new tokens (EOS included if hit, nothing after it)
    num_rounds: int  # target verify forwards after prefill
    accept_lens: list[int]  # per round: accepted draft tokens (bonus excluded)
    num_drafted: list[int]  # per round: draft tokens proposed along the verified chain/tree depth
    time_s: float
    stopped_eos: bool


@dataclass
class _Request:
    index: int  # position in the caller's prompt list
    prompt: list[int]
    limit: int  # max new tokens (budget capped by the context)
    out: list[int] = field(default_factory=list)
    accept_lens: list[int] = field(default_factory=list)
    num_drafted: list[int] = field(default_factory=list)
    eos: bool = False
    time_s: float = 0.0

    @property
    def history(self) -> list[int]:
        return self.prompt + self.out

    def result(self) -> GenerationResult:
        return GenerationResult(self.out, len(self.accept_lens), self.accept_lens, self.num_drafted,
                                self.time_s, self.eos)


class SpeculativeGenerator:
    """Generate with a frozen target and an optional trained drafter of any registered family.

    Args:
        target: the frozen target (`drafthead.target.Target`; Llama / Qwen2 / Qwen3 architecture).
        drafter: a drafter trained for this target (`drafthead.family.Drafter`), or None (modes "ar"
            and "ngram" only). Modes "chain" / "tree" need the drafter to list them in `draft_modes`.
        device: where to run.
        weights: None, or "bf16" / "int8": an fp32 CPU target's decode kernel streams compressed weights
            (the target's weights are rounded in place to match; see `TargetModel`).
    Raises:
        ValueError: unsupported target, or a drafter that does not fit the target.
    """

    def __init__(self, target: Target, drafter: nn.Module | None = None, device: str | torch.device = "cpu",
                 weights: str | None = None) -> None:
        self.target = target
        self.device = torch.device(device)
        self.drafter = drafter.to(self.device).eval() if drafter is not None else None
        # bf16 drafts on CPU draft through the packed decode kernel (a copy; the drafter passed in is untouched)
        # (a drafter that runs through the target's own runtime layers gives its own `runtime_module`)
        self.draft_model: nn.Module | None = None
        if self.drafter is not None:
            own = self.drafter.runtime_module()
            self.draft_model = own if own is not None else packing.with_packed_linears(self.drafter)
        aux = check_drafter(drafter, target.config) if drafter is not None else []
        last = drafter is not None and drafter.features == "last"
        self.model = TargetModel(target.model.to(self.device), aux, capture_last=last, weights=weights)
        self.eos = eos_ids(target)

    # ---- public ---------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], max_new_tokens: int, spec: SpecConfig,
                 stream: Callable[[int, list[int]], None] | None = None) -> list[GenerationResult]:
        """Generate for each prompt (token ids); batches of `spec.batch_size` are verified together.

        stream(i, tokens) is called with the tokens request i gained in each round.
        Raises ValueError on bad input (empty or too long prompt, max_new_tokens <= 0, bad spec).
        """
        self.check(prompts, max_new_tokens, spec)
        gen = torch.Generator(device=self.device).manual_seed(spec.seed)
        ctx = self.model.max_positions
        results: list[GenerationResult] = []
        with cores.shared(self.device):
            for s in range(0, len(prompts), spec.batch_size):
                reqs = [_Request(s + i, list(p), min(max_new_tokens, ctx - len(p) + 1))
                        for i, p in enumerate(prompts[s: s + spec.batch_size])]
                self.run_batch(reqs, spec, gen, stream)
                results += [r.result() for r in reqs]
        return results

    def check(self, prompts: list[list[int]], max_new_tokens: int, spec: SpecConfig) -> None:
        if spec.mode not in OWN_MODES:
            if self.drafter is None:
                raise ValueError(f"spec mode {spec.mode!r} needs a drafter (or use mode 'ngram' / 'ar')")
            if spec.mode not in self.drafter.draft_modes:
                raise ValueError(f"unknown spec mode {spec.mode!r}: this {self.drafter.family} draft drafts "
                                 f"{', '.join(self.drafter.draft_modes)} only (without it: {', '.join(OWN_MODES)})")
            problem = self.drafter.draft_modes[spec.mode].check(spec, self.drafter)
            if problem:
                raise ValueError(problem)
        for name in ("num_speculative_tokens", "tree_nodes", "topk", "batch_size", "ngram_n"):
            if getattr(spec, name) < 1:
                raise ValueError(f"spec.{name} must be >= 1, got {getattr(spec, name)}")
        if spec.temperature < 0:
            raise ValueError(f"spec.temperature must be >= 0, got {spec.temperature}")
        if not 0 < spec.top_p <= 1:
            raise ValueError(f"spec.top_p must be in (0, 1], got {spec.top_p}")
        if max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be > 0, got {max_new_tokens}")
        if not prompts:
            raise ValueError("no prompts given")
        ctx, V = self.model.max_positions, self.model.vocab_size
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty")
            if len(p) > ctx:
                raise ValueError(f"prompt {i} has {len(p)} tokens, longer than the target context "
                                 f"(max_position_embeddings={ctx})")
            if min(p) < 0 or max(p) >= V:
                raise ValueError(f"prompt {i} has token ids outside the target vocab [0, {V})")

    # ---- one batch ------------------------------------------------------------------------------
    @inference
    def run_batch(self, reqs: list[_Request], spec: SpecConfig, gen: torch.Generator,
                  stream: Callable[[int, list[int]], None] | None) -> None:
        s = _Session(self, reqs, spec, gen, stream)
        s.prefill()
        while s.reqs:
            cores.tick()  # fewer threads while other processes hold cores (drafthead.cores)
            s.step()


class _Session:
    """Decoding state of one batch. Row b of every tensor is request self.reqs[b]; rows leave when done."""

    def __init__(self, g: SpeculativeGenerator, reqs: list[_Request], spec: SpecConfig, gen: torch.Generator,
                 stream: Callable[[int, list[int]], None] | None) -> None:
        self.g, self.spec, self.gen, self.stream = g, spec, gen, stream
        self.reqs = list(reqs)
        self.t0 = time.perf_counter()
        self.dev = g.device
        B = len(reqs)
        self.use_drafter = spec.mode not in OWN_MODES
        self.use_ngram = spec.mode == "ngram" or (self.use_drafter and spec.ngram)
        # the drafter's entry for this mode; longest proposal along one path, verify nodes per round, n-gram cap
        self.mode: DraftMode | None = None
        if self.use_drafter and g.drafter is not None:  # `check` refused a drafting mode without a drafter
            self.mode = g.drafter.draft_modes[spec.mode]
        if self.mode is not None:
            self.max_len, self.max_nodes = spec.num_speculative_tokens, self.mode.max_nodes(spec)
            self.ngram_cap = self.mode.ngram_cap(spec)
        else:
            self.max_len = self.max_nodes = 0
            self.ngram_cap = spec.num_speculative_tokens if spec.mode == "ngram" else 0
        self.max_nodes = max(self.max_nodes, self.ngram_cap if self.use_ngram else 0)
        longest = max(len(r.prompt) + r.limit for r in reqs)
        self.capacity = longest + max(self.max_nodes, CACHE_SLACK) + 2
        self.cache = g.model.new_cache(B, self.capacity)
        self.lens = torch.zeros(B, dtype=torch.long, device=self.dev)  # target tokens cached per request
        self.roots = torch.zeros(B, dtype=torch.long, device=self.dev)  # last accepted token, not yet cached
        self.draft: DraftState | None = None
        if self.use_drafter and g.draft_model is not None:  # one that runs the target's layers keeps these views
            self.draft = g.draft_model.draft_state(B, self.capacity, self.dev)
            self.draft.bind(g.model.layers_view(), _SessionView(self))
        # adaptive draft length per request: EMA of accept_len, k = round(ema) + 1
        self.ema = torch.full((B,), (self.max_len - 1) / 2, device=self.dev)

    # ---- helpers --------------------------------------------------------------------------------
    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """Next token from target logits [B, V]: argmax, or a draw from the tempered / top-p distribution."""
        if self.spec.temperature == 0:
            return greedy(logits)
        p = probs(logits, self.spec.temperature, self.spec.top_p)
        return sample(p, torch.rand(p.shape[0], generator=self.gen, device=self.dev))

    def emit(self, new: list[list[int]]) -> list[int]:
        """Append each row's new tokens (cut at EOS / budget), stream them; returns the rows still running."""
        keep = []
        for b, (r, toks) in enumerate(zip(self.reqs, new)):
            toks = toks[: r.limit - len(r.out)]
            for i, t in enumerate(toks):
                if t in self.g.eos:
                    toks, r.eos = toks[: i + 1], True
                    break
            r.out += toks
            if self.stream is not None and toks:
                self.stream(r.index, toks)
            if r.eos or len(r.out) >= r.limit:
                r.time_s = time.perf_counter() - self.t0
            else:
                keep.append(b)
        return keep

    def select(self, keep: list[int]) -> None:
        if len(keep) == len(self.reqs):
            return
        rows = torch.tensor(keep, dtype=torch.long, device=self.dev)
        self.reqs = [self.reqs[b] for b in keep]
        self.cache, self.lens = self.cache[rows], self.lens[rows]
        self.roots, self.ema = self.roots[rows], self.ema[rows]
        if self.draft is not None:
            self.draft.select(rows)

    def draft_lengths(self) -> torch.Tensor:
        """Per-request draft length (chain k / tree depth): fixed, or adaptive from the acceptance EMA."""
        B = len(self.reqs)
        if not self.spec.adaptive:
            return torch.full((B,), self.max_len, dtype=torch.long, device=self.dev)
        return (self.ema.round().long() + 1).clamp(1, self.max_len)

    # ---- prefill --------------------------------------------------------------------------------
    @inference
    def prefill(self) -> None:
        B = len(self.reqs)
        plen = torch.tensor([len(r.prompt) for r in self.reqs], device=self.dev)
        T = int(plen.max())
        ids = torch.zeros(B, T, dtype=torch.long, device=self.dev)
        for b, r in enumerate(self.reqs):
            ids[b, : len(r.prompt)] = torch.tensor(r.prompt, device=self.dev)
        logits, aux = self.g.model.forward(self.cache, ids, self.lens, logits_at=plen - 1, capture=self.use_drafter,
                                           prefill=True)
        first = self.pick(logits[:, 0])  # [B]
        self.lens = plen.clone()
        self.roots = first
        if self.draft is not None:
            # draft entry t pairs token x_{t+1} with f_t; x_L is the token just sampled
            nxt = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)  # [B, T]
            nxt[torch.arange(B, device=self.dev), plen - 1] = first
            self.draft.extend(nxt, aux, plen)
        keep = self.emit([[t] for t in first.tolist()])
        self.select(keep)

    # ---- one round ------------------------------------------------------------------------------
    @inference
    def step(self) -> None:
        if self.spec.mode == "ar":
            return self.step_ar()
        prop = self.propose()
        tree = None if prop.is_chain else ops.build_tree_mask(prop.parents, prop.num_nodes)
        logits, aux = self.g.model.forward(self.cache, prop.tokens, self.lens,
                                           tree_mask=None if tree is None else tree[0],
                                           depth=None if tree is None else tree[1], capture=self.use_drafter)
        accept_len, path, nxt = self.verify(prop, logits)
        # target KV: move the accepted path next to the prefix (a chain path is already contiguous)
        if not prop.is_chain:
            ops.kv_compact(self.cache, self.lens[:, None] + path.clamp(min=0), accept_len + 1, self.lens)
        B = len(self.reqs)
        rows = torch.arange(B, device=self.dev)
        ptoks = prop.tokens.gather(1, path.clamp(min=0))  # [B, N] tokens along the path (root first)
        new = []
        for b, r in enumerate(self.reqs):
            a = int(accept_len[b])
            new.append(ptoks[b, 1: a + 1].tolist() + [int(nxt[b])])
            r.accept_lens.append(a)
            r.num_drafted.append(int(prop.depth[b]))
        self.lens = self.lens + accept_len + 1
        self.roots = nxt
        if self.spec.adaptive:
            self.ema = (1 - EMA_ALPHA) * self.ema + EMA_ALPHA * accept_len.float()
        if self.draft is None:
            return self.select(self.emit(new))
        # draft entries for the accepted path: (token after node j, target feature of node j), j <= accept_len
        T = int(accept_len.max()) + 1
        nxt_tok = torch.cat([ptoks[:, 1:], ptoks[:, :1]], dim=1)[:, :T]  # [B, T]
        nxt_tok[rows, accept_len] = nxt
        feats = aux.gather(1, path[:, :T].clamp(min=0)[:, :, None].expand(-1, -1, aux.shape[-1]))  # [B, T, F]
        keep = self.emit(new)
        self.select(keep)
        if len(keep) == B:  # every request goes on (no row to drop)
            self.draft.extend(nxt_tok, feats, accept_len + 1)
        elif keep:
            rows = torch.tensor(keep, dtype=torch.long, device=self.dev)
            self.draft.extend(nxt_tok[rows], feats[rows], accept_len[rows] + 1)

    def step_ar(self) -> None:
        logits, _ = self.g.model.forward(self.cache, self.roots[:, None], self.lens)
        self.lens = self.lens + 1
        self.roots = self.pick(logits[:, -1])
        for r in self.reqs:
            r.accept_lens.append(0)
            r.num_drafted.append(0)
        self.select(self.emit([[t] for t in self.roots.tolist()]))

    def propose(self) -> Proposal:
        spec, B = self.spec, len(self.reqs)
        lengths = self.draft_lengths()  # [B] the longest path the drafter may propose per request
        grams = [ngram_lookup(r.history, spec.ngram_n, self.ngram_cap) for r in self.reqs] if self.use_ngram else []
        # the longer proposal wins below; when every request's n-gram chain is longer than anything the
        # drafter may propose, drafting this round would be thrown away, so it is skipped (same proposal)
        skip = spec.mode == "ngram" or (self.use_ngram and all(len(g) > n for g, n in zip(grams, lengths.tolist())))
        if skip:
            prop = chain_proposal(self.roots, torch.zeros(B, 0, dtype=torch.long, device=self.dev),
                                  torch.zeros(B, dtype=torch.long, device=self.dev))
            lengths = lengths * 0
        else:  # the drafter's own table: chain, tree, block, or whatever its family adds
            assert self.mode is not None and self.draft is not None, "only a drafting mode reaches here"
            prop = self.mode.propose(self.draft, self.roots, lengths, spec, self.gen)
        if self.use_ngram:
            use = [len(g) > int(n) for g, n in zip(grams, prop.depth)]
            prop = merge_ngram(prop, grams, use)
        return prop

    def verify(self, prop: Proposal, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Greedy match or rejection sampling over the proposal. logits [B, N, V] at every node.

        Returns accept_len [B], path [B, N] (node ids, -1 padded) and next_token [B].
        """
        spec = self.spec
        B, N = prop.tokens.shape
        # the chain ops assume every row has all N nodes; ragged rows (adaptive, n-gram) take the tree path
        uniform = prop.is_chain and bool((prop.num_nodes == N).all())
        if spec.temperature == 0:
            argmax = greedy(logits)  # [B, N] (as `pick`)
            if uniform:
                accept_len, nxt = ops.greedy_verify_chain(prop.tokens[:, 1:], argmax)
                return accept_len, chain_path(accept_len, N), nxt
            return ops.greedy_verify_tree(prop.tokens, prop.parents, prop.num_nodes, argmax)
        p = probs(logits, spec.temperature, spec.top_p)  # [B, N, V]
        u = torch.rand(B, N, generator=self.gen, device=self.dev)
        ub = torch.rand(B, generator=self.gen, device=self.dev)
        q = prop.draft_probs
        if uniform:
            accept_len, nxt = ops.rejection_sample_chain(prop.tokens[:, 1:], None if q is None else q[:, 1:],
                                                         p, u[:, 1:], ub)
            return accept_len, chain_path(accept_len, N), nxt
        return ops.rejection_sample_tree(prop.tokens, prop.parents, prop.num_nodes, p, q, u, ub)


class _SessionView:
    """A session as `contract.SessionView` (read-only) for the draft state it binds."""

    __slots__ = ("_s",)

    def __init__(self, session: _Session) -> None:
        self._s = session

    @property
    def spec(self) -> SpecConfig:
        return self._s.spec

    @property
    def roots(self) -> torch.Tensor:
        return self._s.roots

    @property
    def lens(self) -> torch.Tensor:
        return self._s.lens

    @property
    def cache(self) -> torch.Tensor:
        return self._s.cache


def chain_path(accept_len: torch.Tensor, N: int) -> torch.Tensor:
    """Accepted node ids of a chain: 0..accept_len, then -1. [B, N]"""
    idx = torch.arange(N, device=accept_len.device).expand(accept_len.shape[0], N)
    return torch.where(idx <= accept_len[:, None], idx, -1)


def check_drafter(drafter: nn.Module, tcfg) -> list[int]:
    """Raise ValueError when the drafter was not built for this target; returns the layers it captures."""
    problems = drafter.check_target(tcfg)
    if problems:
        raise ValueError("draft/target mismatch: " + "; ".join(problems))
    return drafter.capture_layer_ids()


def eos_ids(target: Target) -> set[int]:
    """All EOS ids the target stops on (tokenizer, generation config, model config)."""
    ids: set[int] = set()
    sources = [getattr(target.tokenizer, "eos_token_id", None) if target.tokenizer is not None else None,
               getattr(getattr(target.model, "generation_config", None), "eos_token_id", None),
               getattr(target.config, "eos_token_id", None)]
    for e in sources:
        if e is None:
            continue
        ids.update(e if isinstance(e, (list, tuple)) else [e])
    return {int(i) for i in ids}

"""DFlash block-diffusion drafter: a few Qwen3-style layers that propose a whole block in one forward.

Math only (no DDP/DeepSpeed/checkpointing). Parameter names are z-lab's `DFlashDraftModel` names
(`layers.{i}.self_attn.{q,k,v,o}_proj`, `q_norm`, `k_norm`, `mlp.*`, `norm`, `fc`, `hidden_norm`), so
`to=dflash` is a plain save. The draft owns no embedding and no head: `embed_tokens` and `target_lm_head`
are frozen copies of the target's, never saved (`registry.NOT_SAVED`) and taken back from the target on load.

Conventions (pinned by tests):
- `target_layer_ids` are z-lab's: the OUTPUT of these target decoder layers, i.e. HF
  `hidden_states[i + 1]`. drafthead captures layer inputs, so `capture_layer_ids()` = ids + 1. Exports
  convert: z-lab / SGLang (`dflash_config.target_layer_ids`) as stored, llama.cpp (`dflash.target_layers`,
  the input of a layer) ids + 1.
- Context: the target features of positions < p are fused once (`hidden_norm(fc(cat))`) and injected as
  extra keys/values in every layer. A block at position p is [x_p, MASK x (B-1)] at positions p..p+B-1;
  inside the block attention is bidirectional, and every block position sees the whole context.
  Slot k (1..B-1) predicts the token AT position p+k (the target's distribution at p+k-1).
- Training samples anchors p over loss-masked positions, one block each, blocks never overlap. A block
  query sees context keys strictly before its anchor (the anchor's own feature does not exist yet at
  inference) and all keys of its own block. Slot k's loss weight is exp(-(k-1)/gamma).
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any, NamedTuple, Protocol, Self

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from drafthead.family import Family, OwnLayers
from drafthead.layers import RMSNorm, SwiGLU, apply_rope, decoder_layer_shape, given, rope_cos_sin
from drafthead.losses import LOSSES, Objective, draft_loss
from drafthead.options import shared
from drafthead.runtime.contract import (ChainDraft, DraftMode, DraftState, Proposal, SessionView, SpecConfig,
                                        TargetLayers, inference)
from drafthead.runtime.draft import CHAIN, chain_proposal
from drafthead.vocab import draft_ids, target_to_draft


@dataclass
class DflashBackbone:
    """The block drafter's backbone options, DFlash's and DSpark's alike (both families' options extend it)."""

    num_layers: int = 1  # draft decoder layers (z-lab ships 5 for Qwen3-8B)
    mask_token_id: int | None = None  # a row of the target's embedding that never occurs in the data (required)
    target_layer_ids: list[int] | None = None  # outputs of these target layers (z-lab); null = z-lab's spacing
    intermediate_size: int | None = None  # null = the target's
    init: str = "target"  # target = the target's last layers and final norm; random = random layers, its final norm

    def check_backbone(self) -> None:
        if self.num_layers < 1:
            raise ValueError("num_layers: must be >= 1")
        if self.mask_token_id is None:
            raise ValueError("mask_token_id: required (a token id of the target's vocabulary that never occurs in "
                             "the training data; see docs/dflash.md)")
        if self.init not in INITS:
            raise ValueError(f"init: {self.init!r} (choose from {', '.join(INITS)})")


@dataclass
class DflashTraining:
    """The recipe's choices a block draft keeps in its config: DFlash's and DSpark's options and configs extend
    this, so each is declared once (`build` carries them over with `options.shared`)."""

    block_size: int = 8  # B: the last verified token + B-1 mask slots, drafted in one forward
    num_anchors: int = 512  # blocks per sequence and step, at most

    # dense: anchors may overlap (each block still sees only the context before its own anchor), as the reference
    # trains; false: no two blocks overlap (at most T / B of them), which starves the slots of supervision
    overlap_anchors: bool = True
    anchor_chunk: int = 64  # anchors per forward piece: bounds the training memory, the math is the same

    # how the block's slots weigh in the loss: decay = exp(-(k-1)/loss_decay_gamma), fixed; dpace = D-PACE (arXiv
    # 2605.18810): per block, each slot weighs the expected accepted length it leads to, from the draft's own
    # probabilities of the target's tokens (detached), as speculators and ModelOpt train DFlash
    loss_weighting: str = "decay"
    dpace_alpha: float = 0.5  # D-PACE floor on each slot probability, in (0, 1]; 1: weights that ignore the draft

    def check_training(self) -> None:
        if self.block_size < 2:
            raise ValueError(f"block_size: {self.block_size} (must be >= 2: the root and at least one mask slot)")
        if self.num_anchors < 1:
            raise ValueError(f"num_anchors: {self.num_anchors} (must be >= 1)")
        if self.anchor_chunk < 1:
            raise ValueError(f"anchor_chunk: {self.anchor_chunk} (must be >= 1)")
        if self.loss_weighting not in LOSS_WEIGHTINGS:
            raise ValueError(f"loss_weighting: {self.loss_weighting!r} (choose from {', '.join(LOSS_WEIGHTINGS)})")
        if not 0 < self.dpace_alpha <= 1:
            raise ValueError(f"dpace_alpha: {self.dpace_alpha} (must be in (0, 1])")


@dataclass
class OnBackbone:
    """The keys a block drafter that adds a head of its own to DFlash's backbone (DSpark, Domino) has beside it."""

    loss_decay_gamma: float = 4.0  # draft j weight exp(-j/gamma) under `decay` (speculators' DSpark default; 7 at B 16)
    warm_start: str | None = None  # a DFlash draft directory (e.g. runs/dflash_smollm2/final): backbone from it

    def check_on_backbone(self) -> None:
        if self.loss_decay_gamma <= 0:
            raise ValueError(f"loss_decay_gamma: {self.loss_decay_gamma} (must be > 0)")


@dataclass
class DraftVocab:
    """A block head over a draft vocabulary (DFlash, Domino): DSpark's options have no such key."""

    # the block's head scores the N most frequent loss-masked target tokens (d2t / t2d, as EAGLE3's draft vocabulary):
    # N rows of the target's head instead of all V in training and drafting; null = the whole vocabulary. Engines
    # read the backbone alone and score every row (what the exports say)
    draft_vocab_size: int | None = None

    def check_draft_vocab(self) -> None:
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise ValueError(f"draft_vocab_size: {self.draft_vocab_size} (must be >= 1, or null: the whole vocabulary)")


def has_draft_vocab(options: DraftVocab) -> bool:
    """`Family.reduced_vocab` of a block family with a `draft_vocab_size` key."""
    return options.draft_vocab_size is not None


@dataclass
class DflashLabels:
    """DFlash's training target, kept in its config (DSpark trains CE + TV instead)."""

    labels: str = "soft"  # soft = the target's distribution (distillation); hard = the data token


@dataclass
class DflashOptions(DraftVocab, DflashLabels, DflashTraining, DflashBackbone):
    """The recipe section `drafter.dflash.*`."""

    loss_decay_gamma: float | None = None  # slot k weight exp(-(k-1)/gamma); null: 7 for B >= 16, else 4

    def validate(self) -> None:
        self.check_backbone()
        self.check_training()
        self.check_draft_vocab()
        if self.loss_decay_gamma is not None and self.loss_decay_gamma <= 0:
            raise ValueError(f"loss_decay_gamma: {self.loss_decay_gamma} (must be > 0)")
        if self.labels not in LABELS:
            raise ValueError(f"labels: {self.labels!r} (choose from {', '.join(LABELS)})")


LABELS = ("soft", "hard")
LOSS_WEIGHTINGS = ("decay", "dpace")
INITS = ("target", "random")


def default_target_layer_ids(num_target_layers: int, num_layers: int) -> list[int]:
    """z-lab's spacing: the middle layer for a one-layer draft, else evenly from 1 to N-3."""
    if num_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_layers - 1)) for i in range(num_layers)]


@dataclass(kw_only=True)
class DflashConfig(DflashTraining, DflashLabels):
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's
    num_hidden_layers: int
    mask_token_id: int
    target_layer_ids: list[int] = field(default_factory=list)  # OUTPUTS of these target layers (z-lab)
    target_num_layers: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    loss_decay_gamma: float = 4.0
    draft_vocab_size: int | None = None  # the rows of the target's head the block scores (d2t / t2d); None = all

    @property
    def num_draft_tokens(self) -> int:
        """Draft tokens one forward proposes (the B-1 mask slots)."""
        return self.block_size - 1

    @classmethod
    def from_target(cls, tcfg: Any, **overrides: Any) -> Self:
        """Layers sized like the target's (z-lab does the same for its Qwen3 drafts)."""
        return cls(**decoder_layer_shape(tcfg), **given(overrides))

    def to_dict(self) -> dict:
        return asdict(self)


def mask_token_problem(mask_token_id: int, vocab_size: int) -> str | None:
    """The one range check of the mask token (recipe, runtime target, export): it must be a row of the target's
    embedding. That the data never holds it is `DflashDrafter.check_data`'s question."""
    if not 0 <= mask_token_id < vocab_size:
        return f"mask_token_id: {mask_token_id} is not a row of the target's embedding (vocab_size={vocab_size})"
    return None


def mask_token_in_data(family: str, mask_token_id: int, samples: list[dict]) -> list[str]:
    """The data check of a mask token (a drafter's `check_data`): the samples that hold it, as one problem."""
    hits = [s.get("id", i) for i, s in enumerate(samples) if mask_token_id in s["input_ids"]]
    if hits:
        return [f"drafter.{family}.mask_token_id={mask_token_id} occurs in {len(hits)} training sample(s) "
                f"(first: {hits[0]}): choose a token id the data never holds"]
    return []


class DflashAttention(nn.Module):
    """Qwen3 attention (q/k RMSNorm per head) over [context keys; block keys]."""

    def __init__(self, c: DflashConfig) -> None:
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def q(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.c.num_attention_heads, self.c.head_dim))
        return apply_rope(q.transpose(1, 2), cos, sin)  # [B, h, T, D]

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, _ = x.shape
        c = self.c
        k = self.k_norm(self.k_proj(x).view(B, T, c.num_key_value_heads, c.head_dim))
        v = self.v_proj(x).view(B, T, c.num_key_value_heads, c.head_dim)
        return apply_rope(k.transpose(1, 2), cos, sin), v.transpose(1, 2)  # [B, kvh, T, D] x2

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [B, h, Q, D], k/v [B, kvh, S, D], mask bool [B, 1, Q, S] -> o_proj output [B, Q, H]."""
        rep = self.c.num_attention_heads // self.c.num_key_value_heads
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask)  # [B, h, Q, D]
        return self.o_proj(o.transpose(1, 2).flatten(2))


class DflashLayer(nn.Module):
    def __init__(self, c: DflashConfig) -> None:
        super().__init__()
        self.self_attn = DflashAttention(c)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x [B, Q, H] block hidden; ctx_k/ctx_v [B, kvh, S, D] this layer's context keys/values (roped);
        mask [B, 1, Q, S+Q] over (context, block)."""
        attn = self.self_attn
        h = self.input_layernorm(x)
        q = attn.q(h, cos, sin)
        k, v = attn.kv(h, cos, sin)
        x = x + attn.attend(q, torch.cat([ctx_k, k], 2), torch.cat([ctx_v, v], 2), mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DflashDrafter(OwnLayers, nn.Module):
    family = "dflash"
    features = "aux"  # the context entries read the fused target features
    reads_target_head = True  # drafts through the target's own head (frozen, not saved)

    def __init__(self, c: DflashConfig) -> None:
        super().__init__()
        self.config = c
        N = c.draft_vocab_size or c.vocab_size
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)  # the target's, frozen, not saved
        self.target_lm_head = nn.Linear(c.hidden_size, N, bias=False)  # the target's (its d2t rows), frozen, not saved
        # a draft vocabulary: d2t [N] offsets (target id = draft id + d2t), t2d [V] membership; saved
        self.register_buffer("d2t", torch.zeros(N, dtype=torch.long) if c.draft_vocab_size else None)
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool) if c.draft_vocab_size else None)
        for p in (self.embed_tokens.weight, self.target_lm_head.weight):
            p.requires_grad_(False)
        self.fc = nn.Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(DflashLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    # ---- what the trainer / capture / runtime need to know ---------------------------------------
    def capture_layer_ids(self) -> list[int]:
        return [i + 1 for i in self.config.target_layer_ids]  # output of layer i = input of layer i+1

    def check_target(self, tcfg: Any) -> list[str]:
        c, problems = self.config, []
        if c.hidden_size != tcfg.hidden_size:
            problems.append(f"hidden size: draft has {c.hidden_size}, target has hidden_size={tcfg.hidden_size}")
        if c.vocab_size != tcfg.vocab_size:
            problems.append(f"vocab: draft expects vocab_size={c.vocab_size}, target has {tcfg.vocab_size}")
        n = tcfg.num_hidden_layers
        bad = [i for i in c.target_layer_ids if not 0 <= i < n - 1]
        if bad or not c.target_layer_ids:
            problems.append(f"target layer ids {list(c.target_layer_ids)} (outputs of these layers) out of range "
                            f"for a target with {n} decoder layers (0..{n - 2}: the last layer's output is not "
                            f"captured)")
        if (bad_mask := mask_token_problem(c.mask_token_id, tcfg.vocab_size)) is not None:
            problems.append(bad_mask)
        rows = self.head_rows()
        if rows is not None and int(rows.max()) >= tcfg.vocab_size:
            problems.append(f"vocab: d2t maps draft ids to target id {int(rows.max())} >= target vocab "
                            f"{tcfg.vocab_size}")
        return problems

    def head_rows(self) -> torch.Tensor | None:
        """The target ids of the head's rows (the draft vocabulary), None for all of them."""
        return None if self.d2t is None else draft_ids(self.d2t)

    def draft_to_target(self, idx: torch.Tensor) -> torch.Tensor:
        """Ids of the head's rows -> target ids."""
        return idx if self.d2t is None else idx + self.d2t[idx]

    def row_mapper(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """Target ids -> the head's rows, -1 outside the draft vocabulary; the [V] map is built once per call of
        this, so a training piece that maps two sets of ids builds it once."""
        if self.t2d is None:
            return lambda ids: ids
        rowmap = target_to_draft(self.t2d)  # [V]
        return lambda ids: rowmap[ids]

    def full_vocab(self, q: torch.Tensor) -> torch.Tensor:
        """Probabilities over the head's rows [.., N] -> over the target's vocabulary [.., V], zero outside."""
        if self.d2t is None:
            return q
        return q.new_zeros(*q.shape[:-1], self.config.vocab_size).index_copy_(-1, self.head_rows(), q)

    def check_data(self, samples: list[dict]) -> list[str]:
        """The mask token must never occur in the data (a block could not tell a mask slot from that token)."""
        return mask_token_in_data(self.family, self.config.mask_token_id, samples)

    @property
    def draft_modes(self) -> dict[str, DraftMode]:
        """One mode: a block forward proposes every slot (BLOCK, below with its runner)."""
        return {"block": BLOCK}

    def draft_state(self, batch: int, capacity: int, device: torch.device) -> "BlockState":  # mypy checks it
        return BlockRunner(self, batch, capacity, device)

    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """[.., M*H] captured target features -> [.., H] the context every layer reads."""
        x = aux_hidden if torch.is_autocast_enabled(aux_hidden.device.type) else aux_hidden.to(self.fc.weight.dtype)
        return self.hidden_norm(self.fc(x))

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta)  # [B, 1, T, D] x2

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (k, v) [B, kvh, T, D] of the fused context ctx [B, T, H] at positions [B, T]."""
        cos, sin = self.rope(positions)
        return [layer.self_attn.kv(ctx, cos, sin) for layer in self.layers]

    def block_hidden(self, block_ids: torch.Tensor, positions: torch.Tensor,
                     ctx_kv: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor) -> torch.Tensor:
        """Run the layers on block tokens [B, Q] at positions [B, Q] against per-layer context K/V;
        mask [B, 1, Q, S+Q]. Returns the normed output [B, Q, H] (what the target's head reads)."""
        x = self.embed_tokens(block_ids).to(self.fc.weight.dtype)  # [B, Q, H]
        cos, sin = self.rope(positions)
        for layer, (k, v) in zip(self.layers, ctx_kv):
            x = layer(x, k, v, cos, sin, mask)
        return self.norm(x)

    # ---- training --------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, aux_hidden: torch.Tensor, teacher_probs: torch.Tensor,
                target_argmax: torch.Tensor, loss_mask: torch.Tensor, last_hidden: torch.Tensor | None = None,
                objective: Objective | None = None) -> dict[str, Any]:
        """Decayed per-slot loss over sampled anchor blocks (`objective`: `train.loss`, None = kl).

        Args:
            input_ids: [B, T] target token ids (right-padded).
            aux_hidden: [B, T, M*H] target features (inputs of `capture_layer_ids()`).
            teacher_probs: [B, T, V] fp32 target distribution over the full vocab at position j
                (predicting x_{j+1}); rows j with loss_mask[j+1] are filled.
            target_argmax: [B, T] target argmax at j (-1 where unknown): what acceptance is scored on.
            loss_mask: [B, T] 1 on assistant tokens.
            last_hidden: not read.
        Returns `loss`, per slot `step_loss` / `correct` / `count` (and out of training `alpha`, the expected
        acceptance sum min(p, q)) ([B-1] each), and `ratios`: the accepted prefix per block (greedy against the
        target argmax) and P(slot k right | slots < k right).
        """
        c = self.config
        Bk, dev = c.block_size, input_ids.device
        B, T = input_ids.shape
        K = Bk - 1
        gen = None if self.training else torch.Generator().manual_seed(0)  # held-out blocks: the same every eval
        anchors, valid = sample_anchors(loss_mask, Bk, c.num_anchors, gen, c.overlap_anchors)  # [B, A] each
        A = anchors.shape[1]
        ctx_kv = self.context_kv(self.fuse(aux_hidden), torch.arange(T, device=dev).expand(B, T))  # once for all

        lab = anchors[:, :, None] + torch.arange(1, Bk, device=dev)  # [B, A, K] position each slot predicts
        inside = lab < T
        lab = lab.clamp(max=T - 1)
        ok = valid[:, :, None] & inside & loss_mask.gather(1, lab.flatten(1)).view_as(lab).bool()
        tgt = target_argmax.gather(1, (lab - 1).flatten(1)).view_as(lab)  # [B, A, K] target argmax at lab
        ok = ok & (tgt >= 0)
        weighted, weights = torch.zeros((), device=dev), torch.zeros((), device=dev)
        step_loss, count, correct, alphas = (torch.zeros(K, device=dev) for _ in range(4))
        slot_hit = torch.zeros(B, A, K, dtype=torch.bool, device=dev)
        # pieces of anchor_chunk anchors: blocks never see each other, so each piece is its own forward; in
        # training each piece is recomputed in the backward, so only one piece's activations and [M, V] logits
        # are alive at a time, whatever num_anchors is
        piece = self._piece_ce
        if torch.is_grad_enabled():
            piece = functools.partial(checkpoint, self._piece_ce, use_reentrant=False)
        for s in range(0, A, c.anchor_chunk):
            sl = slice(s, s + c.anchor_chunk)
            b_idx, a_idx, k_idx = ok[:, sl].nonzero(as_tuple=True)  # M supervised slots of this piece
            if b_idx.numel() == 0:
                continue
            rows = b_idx * T + lab[:, sl][b_idx, a_idx, k_idx] - 1  # teacher row: the target at position lab-1
            labels = tgt[:, sl][b_idx, a_idx, k_idx]  # [M] the target's tokens
            ce, alpha, top, logp = piece(input_ids, anchors[:, sl], valid[:, sl], b_idx, a_idx, k_idx, rows,
                                         teacher_probs, objective, labels, *[t for kv in ctx_kv for t in kv])
            w = slot_weights(c, k_idx, logp, b_idx, a_idx, (B, ok[:, sl].shape[1], K))  # [M]
            weighted, weights = weighted + (ce * w).sum(), weights + w.sum()
            hit = top == labels  # [M]
            step_loss.index_add_(0, k_idx, ce.detach().float())
            count.index_add_(0, k_idx, torch.ones_like(ce, dtype=torch.float32))
            correct.index_add_(0, k_idx, hit.float())
            if not self.training:
                alphas.index_add_(0, k_idx, alpha.float())
            slot_hit[b_idx, a_idx + s, k_idx] = hit
        loss = weighted / weights.clamp(min=1e-6)
        # greedy block acceptance: the run of correct slots from slot 1 (an unsupervised slot ends it)
        run = slot_hit.long().cumprod(-1)  # [B, A, K] 1 while every slot so far was right
        accepted = run.sum(-1)  # [B, A]
        # P(slot k right | slots < k right) over blocks whose slot k is supervised: independent guesses (a starved
        # block drafter) show as slot-1 accuracy ~ this ratio at every k; a drafter that conditions well, higher
        before = torch.cat([torch.ones_like(run[..., :1]), run[..., :-1]], -1).bool() & ok  # [B, A, K]
        blocks = valid.sum().float()
        return {"loss": loss, "step_loss": step_loss / count.clamp(min=1), "correct": correct, "count": count,
                "ratios": {"block_accept_len": ((accepted * valid).sum().float() + blocks, blocks),  # 1 + the run
                           "cond_acc": ((before & slot_hit).sum((0, 1)).float(), before.sum((0, 1)).float())},
                **({} if self.training else {"alpha": alphas})}

    def _piece_ce(self, input_ids: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor, b_idx: torch.Tensor,
                  a_idx: torch.Tensor, k_idx: torch.Tensor, rows: torch.Tensor, teacher_probs: torch.Tensor,
                  objective: Objective | None, labels: torch.Tensor, *ctx_flat: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The loss [M], alpha [M] (empty in training), the draft's argmax [M] and (D-PACE) its log-probability of
        `labels` [M] (empty otherwise) of the M supervised slots (b_idx, a_idx, k_idx) of one piece of anchors;
        rows: the teacher row of each slot in the flattened [B*T] positions."""
        c = self.config
        ctx_kv = list(zip(ctx_flat[::2], ctx_flat[1::2]))
        out = self.anchor_blocks(input_ids, None, anchors, valid, ctx_kv)[:, :, 1:]  # [B, a, K, H] mask slots
        logits = self.target_lm_head(out[b_idx, a_idx, k_idx])  # [M, N] (loss in fp32)
        N = logits.shape[-1]
        to_row = self.row_mapper()
        if c.labels == "soft":  # the teacher head computed the same N rows
            teach = teacher_probs.flatten(0, 1).index_select(0, rows)  # [M, N]
        else:  # a data token outside the draft vocabulary teaches nothing (a zero row)
            tok = to_row(input_ids.flatten().index_select(0, rows + 1))  # [M], -1 outside
            teach = F.one_hot(tok.clamp(min=0), N).float() * (tok >= 0)[:, None]
        loss, alpha = draft_loss(logits, teach, objective, not self.training)
        logp = logits.new_zeros(0)  # [M] D-PACE's log-probability of the target's token (-inf outside the vocabulary)
        if c.loss_weighting == "dpace":
            row = to_row(labels)
            logp = logits.detach().float().log_softmax(-1).gather(1, row.clamp(min=0)[:, None])[:, 0]
            logp = logp.masked_fill(row < 0, float("-inf"))
        top = self.draft_to_target(logits.detach().argmax(-1))  # [M] target ids
        return loss, logits.new_zeros(0) if alpha is None else alpha, top, logp

    def anchor_blocks(self, input_ids: torch.Tensor, aux_hidden: torch.Tensor | None, anchors: torch.Tensor,
                      valid: torch.Tensor, ctx_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
                      ) -> torch.Tensor:
        """Every anchor's block in one forward: the normed output [B, A, Bk, H] of blocks
        [x_a, MASK x (Bk-1)] at positions a..a+Bk-1, each seeing the context before a and its own block.
        ctx_kv: the per-layer context K/V of `aux_hidden` when the caller has them already."""
        c = self.config
        Bk, dev = c.block_size, input_ids.device
        B, T = input_ids.shape
        A = anchors.shape[1]
        pos = anchors[:, :, None] + torch.arange(Bk, device=dev)  # [B, A, Bk] block positions
        block_ids = torch.full((B, A, Bk), c.mask_token_id, dtype=torch.long, device=dev)
        block_ids[:, :, 0] = input_ids.gather(1, anchors)
        # a block query sees context keys strictly before its anchor and every key of its own block
        ctx_ok = torch.arange(T, device=dev)[None, None] < anchors[:, :, None]  # [B, A, T]
        ctx_ok = ctx_ok & valid[:, :, None]
        same = torch.eye(A, dtype=torch.bool, device=dev)  # [A, A]
        mask = torch.cat([ctx_ok.repeat_interleave(Bk, dim=1),  # [B, A*Bk, T]
                          same.repeat_interleave(Bk, 0).repeat_interleave(Bk, 1).expand(B, -1, -1)], dim=-1)
        if ctx_kv is None:
            ctx_kv = self.context_kv(self.fuse(aux_hidden), torch.arange(T, device=dev).expand(B, T))
        out = self.block_hidden(block_ids.flatten(1), pos.flatten(1), ctx_kv, mask[:, None])  # [B, A*Bk, H]
        return out.view(B, A, Bk, -1)


def slot_weights(c: DflashConfig, slot: torch.Tensor, logp: torch.Tensor, b_idx: torch.Tensor, a_idx: torch.Tensor,
                 shape: tuple[int, int, int]) -> torch.Tensor:
    """The loss weight [M] of each supervised slot (b_idx, a_idx, slot) of blocks shaped [B, A, K] (`loss_weighting`):
    the fixed decay exp(-slot/gamma) (slot 0 is the first drafted), or D-PACE's from the draft's log-probability
    `logp` [M] of the target's token there."""
    if c.loss_weighting == "decay":
        return torch.exp(-slot.float() / c.loss_decay_gamma)
    return dpace_weights(logp, b_idx, a_idx, slot, shape, c.dpace_alpha)


def dpace_weights(logp: torch.Tensor, b_idx: torch.Tensor, a_idx: torch.Tensor, slot: torch.Tensor,
                  shape: tuple[int, int, int], alpha: float) -> torch.Tensor:
    """D-PACE (arXiv 2605.18810, Eq. 7-8): with q_j = (1 - alpha) p_j + alpha (p_j: the draft's probability of the
    target's token at slot j, detached), C_j = prod_{i<=j} q_i and w_j = sum_{m>=j} C_m over a block's supervised
    slots. An unsupervised slot counts as 1 in the product and is left out of the sum. -> w [M]."""
    q = torch.ones(shape, dtype=torch.float32, device=logp.device)  # [B, A, K]
    held = torch.zeros(shape, dtype=torch.bool, device=logp.device)
    q[b_idx, a_idx, slot] = (1 - alpha) * logp.detach().float().exp() + alpha
    held[b_idx, a_idx, slot] = True
    c = q.cumprod(-1) * held  # [B, A, K]
    w = c.flip(-1).cumsum(-1).flip(-1)  # [B, A, K] sum over m >= j
    return w[b_idx, a_idx, slot]


class PieceLoss(NamedTuple):
    """A conditional block head's loss over one piece of anchors, per supervised draft [M]."""
    loss: torch.Tensor  # what the draft trains on (the loop weighs it by `slot_weights`)
    top: torch.Tensor  # the head's argmax (right when it is the target's token)
    logp: torch.Tensor  # log-probability of the target's token (detached; D-PACE reads it)
    ratios: dict[str, torch.Tensor]  # name -> per-draft values; the held-out eval reports their mean


def drafts_loss(drafter: nn.Module, piece_loss: Callable[..., PieceLoss], ratio_names: tuple[str, ...],
                input_ids: torch.Tensor, aux_hidden: torch.Tensor, target_argmax: torch.Tensor, loss_mask: torch.Tensor,
                *tensors: torch.Tensor) -> dict[str, Any]:
    """The training loop of a block head whose drafts read the drafts before them (DSpark's Markov head, Domino's
    GRU), teacher-forced: the block forward gives every slot, and `piece_loss(input_ids, anchors, valid, b_idx,
    a_idx, j_idx, pos, tgt, *tensors, *ctx_kv)` scores the supervised drafts of a piece of anchors. Draft j of a
    block at anchor p predicts the token at p+j+1 (which slot it reads is the head's business); the data's tokens
    stand in for the drafts before it. Returns the `Drafter.forward` dict: `loss`, per draft `step_loss` /
    `correct` / `count`, and `ratios`: the block accept length, P(draft j right | drafts before it right) and the
    pieces' own, `ratio_names` (every rank reports each, also from a batch with nothing supervised)."""
    c = drafter.config
    Bk, dev = c.block_size, input_ids.device
    B, T = input_ids.shape
    K = c.num_draft_tokens
    gen = None if drafter.training else torch.Generator().manual_seed(0)
    anchors, valid = sample_anchors(loss_mask, Bk, c.num_anchors, gen, c.overlap_anchors)  # [B, A] each
    A = anchors.shape[1]
    ctx_kv = drafter.context_kv(drafter.fuse(aux_hidden), torch.arange(T, device=dev).expand(B, T))

    lab = anchors[:, :, None] + torch.arange(1, K + 1, device=dev)  # [B, A, K] position draft j predicts
    inside = lab < T
    lab = lab.clamp(max=T - 1)
    ok = valid[:, :, None] & inside & loss_mask.gather(1, lab.flatten(1)).view_as(lab).bool()
    tgt = target_argmax.gather(1, (lab - 1).flatten(1)).view_as(lab)  # [B, A, K]
    ok = ok & (tgt >= 0)
    totals = torch.zeros(2, device=dev)  # weighted loss, weights
    step_loss, count, correct = (torch.zeros(K, device=dev) for _ in range(3))
    extra = {name: torch.zeros(2, device=dev) for name in ratio_names}  # sum, count
    slot_hit = torch.zeros(B, A, K, dtype=torch.bool, device=dev)
    piece = piece_loss
    if torch.is_grad_enabled():  # one piece's activations and [M, V] logits alive at a time (as DFlash)
        piece = functools.partial(checkpoint, piece_loss, use_reentrant=False)
    for s in range(0, A, c.anchor_chunk):
        sl = slice(s, s + c.anchor_chunk)
        b_idx, a_idx, j_idx = ok[:, sl].nonzero(as_tuple=True)  # M supervised drafts of this piece
        if b_idx.numel() == 0:
            continue
        pos = lab[:, sl][b_idx, a_idx, j_idx]  # [M] the predicted token's position
        got: PieceLoss = piece(input_ids, anchors[:, sl], valid[:, sl], b_idx, a_idx, j_idx, pos,
                               tgt[:, sl][b_idx, a_idx, j_idx], *tensors, *[t for kv in ctx_kv for t in kv])
        w = slot_weights(c, j_idx, got.logp, b_idx, a_idx, (B, ok[:, sl].shape[1], K))  # [M]
        totals = totals + torch.stack([(got.loss * w).sum(), w.sum()])
        hit = got.top == tgt[:, sl][b_idx, a_idx, j_idx]
        step_loss.index_add_(0, j_idx, got.loss.detach().float())
        count.index_add_(0, j_idx, torch.ones_like(w))
        correct.index_add_(0, j_idx, hit.float())
        for name, v in got.ratios.items():
            extra[name] = extra[name] + torch.stack([v.sum(), w.new_tensor(float(v.numel()))])
        slot_hit[b_idx, a_idx + s, j_idx] = hit
    run = slot_hit.long().cumprod(-1)  # [B, A, K]
    before = torch.cat([torch.ones_like(run[..., :1]), run[..., :-1]], -1).bool() & ok
    blocks = valid.sum().float()
    return {"loss": totals[0] / totals[1].clamp(min=1e-6), "step_loss": step_loss / count.clamp(min=1),
            "correct": correct, "count": count,
            "ratios": {"block_accept_len": ((run.sum(-1) * valid).sum().float() + blocks, blocks),
                       "cond_acc": ((before & slot_hit).sum((0, 1)).float(), before.sum((0, 1)).float()),
                       **{name: (v[0], v[1]) for name, v in extra.items()}}}


def warm_start_backbone(drafter: nn.Module, path: str, section: str) -> None:
    """Copy every tensor of the DFlash draft at `path` into a block drafter built on DFlash's backbone (same
    names, same shapes, or an error naming `drafter.<section>.warm_start`); the drafter's own heads stay."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    where = f"drafter.{section}.warm_start: {path}"
    folder = Path(path)
    if not (folder / "config.json").is_file() or not (folder / "model.safetensors").is_file():
        raise ValueError(f"{where} is not a draft directory (config.json + model.safetensors)")
    meta = json.loads((folder / "config.json").read_text())
    if meta.get("family") != "dflash":
        raise ValueError(f"{where} holds a {meta.get('family')!r} draft, not a DFlash one")
    cfg, state = meta.get("draft") or {}, load_file(str(folder / "model.safetensors"))
    mine = drafter.state_dict()
    bad = [k for k, v in state.items() if k not in mine or mine[k].shape != v.shape]
    bad += [k for k, v in state.items() if k not in bad and v.is_floating_point() and not bool(v.isfinite().all())]
    if bad:
        raise ValueError(f"{where} does not fit this draft's backbone (layers, sizes or target differ, or values "
                         f"are not finite): {bad[:4]}")
    c = drafter.config
    for key in ("block_size", "mask_token_id", "target_layer_ids"):
        if cfg.get(key) != getattr(c, key):
            raise ValueError(f"{where} has {key}={cfg.get(key)!r}, this draft {getattr(c, key)!r}")
    with torch.no_grad():
        for k, v in state.items():
            mine[k].copy_(v)


def sample_anchors(loss_mask: torch.Tensor, block_size: int, num_anchors: int,
                   gen: torch.Generator | None = None, overlap: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `num_anchors` block starts per row among positions t with loss_mask[t] and loss_mask[t+1] (the
    first slot has a supervised target). Returns (anchors [B, A] sorted, valid [B, A]).

    A random order of the candidates; `overlap`: the first num_anchors of it (distinct positions, blocks may
    overlap, as the reference trains); else greedy: a candidate is kept when no kept anchor lies within
    block_size of it."""
    B, T = loss_mask.shape
    m = loss_mask.bool().cpu()
    cand = torch.zeros(B, T, dtype=torch.bool)
    cand[:, :-1] = m[:, :-1] & m[:, 1:]
    picks: list[list[int]] = []
    for b in range(B):
        idx = cand[b].nonzero().flatten()
        order = idx[torch.randperm(idx.numel(), generator=gen)]
        if overlap:
            picks.append(sorted(order[:num_anchors].tolist()))
            continue
        taken = torch.zeros(T + 2 * block_size, dtype=torch.bool)  # anchor s marks index s + block_size
        keep: list[int] = []
        for t in order.tolist():
            if len(keep) >= num_anchors:
                break
            if not taken[t + 1: t + 2 * block_size].any():  # no kept anchor in [t-B+1, t+B-1]
                keep.append(t)
                taken[t + block_size] = True
        picks.append(sorted(keep))
    A = max(1, max(len(p) for p in picks))
    anchors = torch.zeros(B, A, dtype=torch.long)
    valid = torch.zeros(B, A, dtype=torch.bool)
    for b, p in enumerate(picks):
        anchors[b, : len(p)] = torch.tensor(p, dtype=torch.long)
        valid[b, : len(p)] = True
    return anchors.to(loss_mask.device), valid.to(loss_mask.device)


# ---- inference: block proposals over a static context cache ----------------------------------------
class BlockState(DraftState, Protocol):
    """What mode "block" calls: one draft forward proposes the first k slots of a block."""

    def block(self, roots: torch.Tensor, k: int, temperature: float, top_p: float, gen: torch.Generator | None
              ) -> ChainDraft: ...


class BlockRunner:
    """Drafting state for a batch: per-layer context K/V (one entry per verified target position) and the
    block proposal. Same interface as the chain runners (`extend`, `select`), plus `block`."""

    def __init__(self, drafter: DflashDrafter, batch: int, capacity: int, device: torch.device) -> None:
        c = drafter.config
        self.drafter = drafter
        dtype = next(drafter.parameters()).dtype
        shape = (batch, c.num_key_value_heads, capacity, c.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(c.num_hidden_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(c.num_hidden_layers)]
        self.lens = torch.zeros(batch, dtype=torch.long, device=device)  # context entries per request

    def bind(self, target: TargetLayers, session: SessionView) -> None:
        """Nothing to keep: this drafter runs its own layers (the runtime calls this on every draft state)."""

    def select(self, rows: torch.Tensor) -> None:
        self.k = [k[rows] for k in self.k]
        self.v = [v[rows] for v in self.v]
        self.lens = self.lens[rows]

    @inference
    def extend(self, tokens: torch.Tensor, feats: torch.Tensor, counts: torch.Tensor) -> None:
        """Append context entries: feats [B, T, M*H] = target features of the next T positions (counts[b]
        valid). `tokens` are not read: a context entry is the target's feature alone."""
        B, T = feats.shape[:2]
        slots = self.lens[:, None] + torch.arange(T, device=feats.device)  # [B, T]; padding lands past the end
        S = self.k[0].shape[2]
        if int((self.lens + counts).max()) > S:
            raise ValueError(f"draft context overflow: {int((self.lens + counts).max())} entries > capacity {S}")
        slots = slots.clamp(max=S - 1)
        fill = torch.arange(T, device=feats.device)[None] < counts[:, None]  # [B, T]
        b_i, t_i = fill.nonzero(as_tuple=True)  # padded entries are not written
        for (k, v), ck, cv in zip(self.drafter.context_kv(self.drafter.fuse(feats), slots), self.k, self.v):
            kk, vv = k.transpose(1, 2), v.transpose(1, 2)  # [B, T, kvh, D]
            ck[b_i, :, slots[b_i, t_i]] = kk[b_i, t_i].to(ck.dtype)
            cv[b_i, :, slots[b_i, t_i]] = vv[b_i, t_i].to(cv.dtype)
        self.lens = self.lens + counts

    @inference
    def block_out(self, roots: torch.Tensor) -> torch.Tensor:
        """One forward over [root, MASK x (B-1)] per request at positions lens..lens+B-1 -> the normed output of
        every block position [B, B, H]."""
        c = self.drafter.config
        B, Bk, dev = roots.shape[0], c.block_size, roots.device
        ids = torch.full((B, Bk), c.mask_token_id, dtype=torch.long, device=dev)
        ids[:, 0] = roots
        pos = self.lens[:, None] + torch.arange(Bk, device=dev)  # [B, Bk]
        S = int(self.lens.max())
        ctx = (torch.arange(S, device=dev)[None] < self.lens[:, None])[:, None].expand(B, Bk, S)
        mask = torch.cat([ctx, torch.ones(B, Bk, Bk, dtype=torch.bool, device=dev)], -1)[:, None]
        kv = [(k[:, :, :S], v[:, :, :S]) for k, v in zip(self.k, self.v)]
        return self.drafter.block_hidden(ids, pos, kv, mask)  # [B, Bk, H]

    @inference
    def block_logits(self, roots: torch.Tensor) -> torch.Tensor:
        """Slot logits [B, B-1, N] of one block forward over the head's rows (slot k predicts the token at lens+k;
        N = V without a draft vocabulary)."""
        return self.drafter.target_lm_head(self.block_out(roots)[:, 1:])  # [B, Bk-1, N]

    @inference
    def block(self, roots: torch.Tensor, k: int, temperature: float, top_p: float, gen: torch.Generator | None
              ) -> ChainDraft:
        """The first k (<= B-1) slots of one block forward. Greedy: argmax per slot; sampled: one draw per
        slot from its own distribution (slots are drafted independently, so q of slot j is the slot's
        distribution whatever was drawn before it, which is what rejection sampling needs).
        Returns drafts [B, k] target ids and q [B, k, V] | None."""
        from drafthead.runtime.sampling import probs, sample

        d = self.drafter
        logits = self.block_logits(roots)[:, :k]  # [B, k, N]
        if temperature == 0:
            return ChainDraft(d.draft_to_target(logits.argmax(-1)))
        q = probs(logits, temperature, top_p)  # [B, k, N]
        B = roots.shape[0]
        u = torch.rand(B, k, generator=gen, device=roots.device)
        drafts = torch.stack([sample(q[:, j], u[:, j]) for j in range(k)], dim=1)
        return ChainDraft(d.draft_to_target(drafts), d.full_vocab(q))  # q [B, k, V] zero outside the vocabulary


def propose_block(state: BlockState, roots: torch.Tensor, lengths: torch.Tensor, spec: SpecConfig,
                  gen: torch.Generator | None) -> Proposal:
    """Mode "block": one draft forward proposes every slot at once, verified as a chain."""
    got = state.block(roots, int(lengths.max()), spec.temperature, spec.top_p, gen)
    return chain_proposal(roots, got.drafts, lengths, got.q)


def check_block(spec: SpecConfig, drafter: DflashDrafter) -> str | None:
    if spec.num_speculative_tokens > drafter.config.num_draft_tokens:
        return (f"spec.num_speculative_tokens={spec.num_speculative_tokens}: a block of this draft has "
                f"{drafter.config.num_draft_tokens} draft slots")
    return None


# verified and sized as a chain of the block
BLOCK = replace(CHAIN, propose=propose_block, state=BlockState, check=check_block)


# ---- the family record ------------------------------------------------------------------------------
def build(tcfg: Any, options: DflashOptions, layer_ids: list[int] | None, draft_vocab_size: int | None
          ) -> DflashConfig:
    """`capture.layer_ids` (layer inputs, drafthead's capture convention) wins over the options' z-lab ids."""
    gamma = options.loss_decay_gamma or (7.0 if options.block_size >= 16 else 4.0)
    c = DflashConfig.from_target(tcfg, num_hidden_layers=options.num_layers, mask_token_id=options.mask_token_id,
                                 target_layer_ids=target_layer_ids(tcfg, options, layer_ids),
                                 intermediate_size=options.intermediate_size, loss_decay_gamma=gamma,
                                 draft_vocab_size=draft_vocab_size,
                                 **shared(options, DflashTraining), **shared(options, DflashLabels))
    check_built(c, tcfg, "dflash")
    return c


def build_with_head(config_cls: type[DflashConfig], head: type, tcfg: Any, options: Any, layer_ids: list[int] | None,
                    section: str, draft_vocab_size: int | None = None) -> Any:
    """The config of a block drafter that adds a head of its own to DFlash's backbone (DSpark, Domino): the
    backbone's fields from the options, then the head's (`head`, the dataclass its options and config both extend),
    checked against the target under `drafter.<section>`."""
    c = config_cls.from_target(
        tcfg, num_hidden_layers=options.num_layers, mask_token_id=options.mask_token_id,
        target_layer_ids=target_layer_ids(tcfg, options, layer_ids), intermediate_size=options.intermediate_size,
        loss_decay_gamma=options.loss_decay_gamma, draft_vocab_size=draft_vocab_size,
        **shared(options, DflashTraining), **shared(options, head))
    check_built(c, tcfg, section)
    return c


def init_with_warm_start(drafter: DflashDrafter, target: Any, options: Any, section: str, layout: str = "") -> str:
    """DFlash's init (the target's embedding, head rows and final norm; its last layers with `init: target`), then
    the backbone of the DFlash draft `options.warm_start` names, if any (`layout`: how its slots line up here)."""
    said = init(drafter, target, DflashOptions(init=options.init, mask_token_id=options.mask_token_id))
    if options.warm_start is None:
        return said
    warm_start_backbone(drafter, options.warm_start, section)
    return f"backbone from the DFlash draft {options.warm_start}{layout}"


def target_layer_ids(tcfg: Any, options: Any, layer_ids: list[int] | None) -> list[int]:
    """`capture.layer_ids` (layer inputs) as z-lab ids, else the options' ids, else z-lab's spacing (DFlash and
    DSpark options both carry `target_layer_ids` and `num_layers`)."""
    if layer_ids:
        return [i - 1 for i in layer_ids]
    return list(options.target_layer_ids or default_target_layer_ids(tcfg.num_hidden_layers, options.num_layers))


def check_built(c: DflashConfig, tcfg: Any, section: str) -> None:
    """The mask token and layer ids of a built block-drafter config against the target, named under the recipe
    section `drafter.<section>`."""
    n = tcfg.num_hidden_layers
    if (bad_mask := mask_token_problem(c.mask_token_id, tcfg.vocab_size)) is not None:
        raise ValueError(f"drafter.{section}.{bad_mask}")
    bad = [i for i in c.target_layer_ids if not 0 <= i < n - 1]
    if bad:
        raise ValueError(f"drafter.{section}.target_layer_ids: {bad} out of range (outputs of layers 0..{n - 2} of "
                         f"the target's {n})")


def init(drafter: DflashDrafter, target: Any, options: DflashOptions) -> str:
    """The target's embedding and head (frozen) always; with `init: target` also its last decoder layers
    (projections, MLP, norms; q/k norms start at one) and final norm."""
    from drafthead.split import whole_state
    from drafthead.target import decoder_layers, final_norm_weight, input_embedding_weight, lm_head_weight

    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(input_embedding_weight(target.model))
        head, rows = lm_head_weight(target.model), drafter.head_rows()  # d2t is set before init
        drafter.target_lm_head.weight.copy_(head if rows is None else head[rows])
        # the head is the target's: its final norm is the scale that head expects (SmolLM2's tied head gives
        # logits in the hundreds, a first loss of ~70, behind a unit norm)
        drafter.norm.weight.copy_(final_norm_weight(target.model))
        if options.init == "random":
            return "random layers, the target's final norm"
        src = list(decoder_layers(target.model))[-len(drafter.layers):]
        for mine, theirs in zip(drafter.layers, src):
            theirs_sd = whole_state(theirs)
            for name, p in mine.state_dict().items():
                if name in theirs_sd and theirs_sd[name].shape == p.shape:
                    p.copy_(theirs_sd[name])
    return f"the target's last {len(drafter.layers)} layer(s) and final norm"


def describe(options: DflashOptions, config: DflashConfig) -> str:
    vocab = f", draft vocab {config.draft_vocab_size}" if config.draft_vocab_size else ""
    return (f"{config.num_hidden_layers} layer(s), block {config.block_size}{vocab}, features of layers "
            f"{config.target_layer_ids} (outputs), mask token {config.mask_token_id}")


def eval_summary(res: dict[str, float]) -> str:
    """A block drafter's held-out health: the accept length measured per block, and how well slot 2 builds on
    slot 1 (independent slots: about slot 1's accuracy)."""
    words = (f"block accept len {res['eval/block_accept_len']:.2f}" if "eval/block_accept_len" in res
             else f"simulated accept len {res['eval/sim_accept_len']:.2f}")
    return words + (f", P(slot 2 | slot 1) {res['eval/cond_acc_1']:.3f}" if "eval/cond_acc_1" in res else "")


FAMILY = Family(
    name="dflash", options=DflashOptions, config=DflashConfig, model=DflashDrafter, build=build, init=init,
    losses=LOSSES, reduced_vocab=has_draft_vocab, describe=describe,
    eval_summary=eval_summary,
    exporters={"dflash": "drafthead.export.dflash:to_dflash", "speculators": "drafthead.export.dflash:to_speculators",
               "gguf": "drafthead.export.dflash:to_gguf"},
    readers={"dflash": "drafthead.export.dflash:read_back", "speculators": "drafthead.export.dflash:read_back",
             "gguf": "drafthead.export.dflash:read_back_gguf"},
    vllm={"dflash": "dflash", "speculators": "dflash"},  # vLLM's DFlashProposer; on CPU with enforce_eager
)

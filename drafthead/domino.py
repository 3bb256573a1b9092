"""Domino: DFlash's block, each draft's logits corrected by a GRU over the drafts before it (arXiv 2605.29707;
SpecForge, ModelOpt and AutoModel train it, SGLang serves it as a DFlash draft with `projector_type: domino`).

Math only. The backbone is DFlash's (`drafthead/dflash.py`: fused target features as context keys, a block
[x_p, MASK x (B-1)] at positions p..p+B-1, bidirectional inside the block, the target's own head); this file adds:
- Layout: anchor-first (the references' `shift_label: true`, the only one SGLang serves): draft j is slot j and
  predicts the token at p+j+1, so a block forward gives B-1 drafts as SGLang proposes them (slot B-1 is computed
  and not read).
- Correction head: a GRU (one layer, no bias) reads the target's embeddings of the block's tokens so far - the
  verified root, then each draft - and draft j's logits are U_j + W2 . SiLU(W1 . [z_j ; g_j]), where z_j is slot
  j's normed output, U_j the target's head on it, g_j the GRU state after the root and drafts 0..j-1. The first
  `pure_draft_prefix_len` drafts keep U_j. So the block is drafted left to right, each draft seeing the ones
  before it, for one small GRU step and one [E -> V] product a draft: no second pass of the backbone.
- Loss: the base-anchored curriculum (1 - lambda_t) CE(final) + lambda_t CE(base) to the target's token, with
  lambda_t = clip(lambda_0 (1 - t / (rho T)), 0, 1) over the optimizer steps t of the planned T (`schedule`),
  drafts weighed as DFlash weighs its slots (`loss_weighting`: the decay exp(-j/gamma), or D-PACE).
With a draft vocabulary (`draft_vocab_size`, as DFlash's) the head and W2 score its N rows, and drafts map back to
target ids before the GRU reads them. W2 starts at zero, so a fresh Domino computes its backbone's logits;
`warm_start` copies a DFlash draft's backbone (same tensor names; its slots read one position earlier here, as
DSpark's anchor-first layout).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from drafthead.dflash import (BlockRunner, DflashBackbone, DflashConfig, DflashDrafter, DflashTraining, DraftVocab,
                              OnBackbone, PieceLoss, build_with_head, drafts_loss, eval_summary, has_draft_vocab,
                              init_with_warm_start)
from drafthead.family import Family
from drafthead.losses import Objective
from drafthead.runtime.contract import ChainDraft, inference


@dataclass
class DominoHead:
    """Domino's correction head and curriculum, chosen in the recipe and kept in the config."""

    gru_hidden_dim: int = 1024  # G: the GRU's state (the references' Qwen3-8B recipe)
    emb_dim: int = 256  # E: the correction's bottleneck, W1 [H+G -> E], W2 [E -> V]
    pure_draft_prefix_len: int = 1  # drafts at the block's start that keep the backbone's logits (SGLang: 1)
    lambda_base_start: float = 1.0  # lambda_0: the base loss's share at step 0
    lambda_base_decay_ratio: float = 1.0  # rho: the share reaches 0 after this fraction of the planned steps

    # drafting: a corrected draft is chosen among the block's candidate pool, the top-K tokens of the backbone's
    # logits over the corrected slots (SGLang's --speculative-domino-candidate-pool-size, default 2048), so a draft
    # step reads K rows of W2, not V; 0 = the whole vocabulary (what training scores)
    candidate_pool_size: int = 2048

    def check_head(self, block_size: int) -> None:
        for name in ("gru_hidden_dim", "emb_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: {getattr(self, name)} (must be >= 1)")
        if not 0 <= self.pure_draft_prefix_len < block_size - 1:
            raise ValueError(f"pure_draft_prefix_len: {self.pure_draft_prefix_len} (must be in [0, block_size - 1 = "
                             f"{block_size - 1}): at least one draft of the block is corrected)")
        if not 0 <= self.lambda_base_start <= 1:
            raise ValueError(f"lambda_base_start: {self.lambda_base_start} (must be in [0, 1])")
        if self.lambda_base_decay_ratio <= 0:
            raise ValueError(f"lambda_base_decay_ratio: {self.lambda_base_decay_ratio} (must be > 0)")
        if self.candidate_pool_size < 0:
            raise ValueError(f"candidate_pool_size: {self.candidate_pool_size} (must be >= 0; 0: the whole vocabulary)")


@dataclass
class DominoOptions(OnBackbone, DraftVocab, DominoHead, DflashTraining, DflashBackbone):
    """The recipe section `drafter.domino.*`: the DFlash backbone's keys (`block_size`: the root and B-1 drafts a
    forward), then Domino's own. With `draft_vocab_size` the backbone's head and W2 both score the draft
    vocabulary's rows."""

    def validate(self) -> None:
        self.check_backbone()
        self.check_training()
        self.check_draft_vocab()
        self.check_on_backbone()
        self.check_head(self.block_size)


@dataclass(kw_only=True)
class DominoConfig(DflashConfig, DominoHead):
    """DFlash's config and Domino's head (`labels` is unused: the loss is CE to the target's token)."""


class DominoDrafter(DflashDrafter):
    family = "domino"
    config: DominoConfig

    def __init__(self, c: DominoConfig) -> None:
        super().__init__(c)
        self.prefix_gru = nn.GRU(c.hidden_size, c.gru_hidden_dim, bias=False, batch_first=True)
        self.embed_proj = nn.Sequential(nn.Linear(c.hidden_size + c.gru_hidden_dim, c.emb_dim, bias=False), nn.SiLU(),
                                        nn.Linear(c.emb_dim, self.target_lm_head.out_features, bias=False))
        # SGLang's tensor names; W2 scores the head's rows (V, or the draft vocabulary's N: the export widens it)
        nn.init.zeros_(self.embed_proj[2].weight)  # a fresh head adds nothing: the backbone's logits stand
        self.lambda_base = c.lambda_base_start  # the curriculum's share of the base loss now (`schedule`)

    def draft_state(self, batch: int, capacity: int, device: torch.device) -> "DominoRunner":  # mypy checks it
        return DominoRunner(self, batch, capacity, device)

    def schedule(self, step: int, total_steps: int) -> None:
        c = self.config
        span = c.lambda_base_decay_ratio * max(total_steps, 1)
        self.lambda_base = min(max(c.lambda_base_start * (1 - step / span), 0.0), 1.0)

    def read(self, ids: torch.Tensor) -> torch.Tensor:
        """The GRU from zeros over the target's embeddings of ids [N, L] -> its state after each token [N, L, G]."""
        x = self.embed_tokens(ids).to(self.prefix_gru.weight_hh_l0.dtype)  # [N, L, H]
        return self.prefix_gru(x)[0]

    def correction_in(self, z: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """SiLU(W1 . [z ; g]): z [.., H] slot outputs, g [.., G] GRU states -> [.., E], what W2 reads."""
        return self.embed_proj[1](self.embed_proj[0](torch.cat([z, g.to(z.dtype)], -1)))

    def correction(self, z: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """W2 . SiLU(W1 . [z ; g]) -> [.., N], added to the logits (N: the head's rows)."""
        return self.embed_proj[2](self.correction_in(z, g))

    # ---- training --------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, aux_hidden: torch.Tensor, teacher_probs: torch.Tensor,
                target_argmax: torch.Tensor, loss_mask: torch.Tensor, last_hidden: torch.Tensor | None = None,
                objective: Objective | None = None) -> dict[str, Any]:
        """The curriculum loss over sampled anchor blocks, the GRU reading the data's tokens (teacher-forced).

        Shapes as `DflashDrafter.forward`. Returns `dflash.drafts_loss`'s dict (accuracies are the corrected
        drafts'); its ratios add `base_acc` and `corrected_acc`: the backbone's and the corrected drafts' mean
        accuracy over the same drafts (what the correction buys)."""
        if objective is not None:  # FAMILY.losses is empty: the config refuses train.loss before this
            raise ValueError("domino trains its own loss only (train.loss must stay null)")
        return drafts_loss(self, self._piece_loss, ("base_acc", "corrected_acc"), input_ids, aux_hidden,
                           target_argmax, loss_mask)

    def _piece_loss(self, input_ids: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor, b_idx: torch.Tensor,
                    a_idx: torch.Tensor, j_idx: torch.Tensor, pos: torch.Tensor, tgt: torch.Tensor,
                    *ctx_flat: torch.Tensor) -> PieceLoss:
        """Per supervised draft [M]: the curriculum's loss, the corrected argmax, its log-probability of the target's
        token, and the base / corrected hits."""
        c = self.config
        T, K, dev = input_ids.shape[1], c.num_draft_tokens, input_ids.device
        ctx_kv = list(zip(ctx_flat[::2], ctx_flat[1::2]))
        z = self.anchor_blocks(input_ids, None, anchors, valid, ctx_kv)[b_idx, a_idx, j_idx]  # [M, H] slot j
        base = self.target_lm_head(z).float()  # [M, N]
        row = self.row_mapper()(tgt)  # [M] -1: the target's token is outside the draft vocabulary (teaches nothing)
        # the GRU reads each block's x_p .. x_{p+K-1}; draft j takes its state after x_{p+j}
        read = (anchors[:, :, None] + torch.arange(K, device=dev)).clamp(max=T - 1)  # [B, a, K]
        ids = input_ids.gather(1, read.flatten(1)).view_as(read)  # [B, a, K]
        g = self.read(ids.flatten(0, 1)).view(*ids.shape, -1)[b_idx, a_idx, j_idx]  # [M, G]
        corrected = (j_idx >= c.pure_draft_prefix_len)[:, None]  # [M, 1]
        final = base + self.correction(z, g).float() * corrected  # [M, N]
        ce_final = F.cross_entropy(final, row, ignore_index=-1, reduction="none")  # [M]
        ce_base = F.cross_entropy(base, row, ignore_index=-1, reduction="none")  # [M]
        lam = self.lambda_base
        top = self.draft_to_target(final.detach().argmax(-1))  # [M] target ids
        logp = (-ce_final.detach()).masked_fill(row < 0, float("-inf"))  # D-PACE reads it
        base_top = self.draft_to_target(base.detach().argmax(-1))
        return PieceLoss((1 - lam) * ce_final + lam * ce_base, top, logp,
                         {"base_acc": (base_top == tgt).float(), "corrected_acc": (top == tgt).float()})


# ---- inference: the block forward, then the drafts left to right ------------------------------------
class DominoRunner(BlockRunner):
    """DFlash's context cache and block forward; the drafts are read one at a time, the GRU stepping over the root
    and each draft before the one it corrects (`BlockState.block`, so DFlash's mode "block" drives it)."""

    drafter: DominoDrafter

    @inference
    def block(self, roots: torch.Tensor, k: int, temperature: float, top_p: float, gen: torch.Generator | None
              ) -> ChainDraft:
        """Up to k (<= B-1) drafts per request, target ids. Sampled drafts: q of draft j [B, V] is its distribution
        given the drafts before it, as a chain's (what lossless rejection sampling needs); a corrected draft's q is
        zero outside the candidate pool, every draft's outside the draft vocabulary. Scores, the pool and W2's rows
        are the head's rows (N) until a token is drawn."""
        from drafthead.runtime.sampling import probs, sample

        d = self.drafter
        c = d.config
        z = self.block_out(roots)[:, :k]  # [B, k, H] anchor-first: slot j drafts token j
        base = d.target_lm_head(z)  # [B, k, N] the head once over the block (one pass over its weights)
        B, V = roots.shape[0], base.shape[-1]
        s = c.pure_draft_prefix_len
        pool = None
        if 0 < c.candidate_pool_size < V and k > s:  # the block's candidates, their W2 rows gathered once
            pool = base[:, s:].amax(1).topk(c.candidate_pool_size, -1, sorted=False).indices  # [B, K]
            w2 = d.embed_proj[2].weight[pool]  # [B, K, E]
        gru = d.prefix_gru
        w_ih, w_hh = gru.weight_ih_l0, gru.weight_hh_l0  # one ATen GRU cell a token: a step is a token, not a sequence
        state = roots.new_zeros(B, c.gru_hidden_dim, dtype=w_hh.dtype)  # [B, G]
        unread = [roots]  # tokens the GRU has not read yet
        drafts, qs = [], []
        u = torch.rand(B, k, generator=gen, device=roots.device) if temperature > 0 else torch.zeros(0)
        for j in range(k):
            logits = base[:, j]  # [B, N]
            picked = None  # a greedy pick from the pool: no [B, V] row to build
            if j >= s:
                for tok in unread:
                    state = torch.gru_cell(d.embed_tokens(tok).to(w_ih.dtype), state, w_ih, w_hh)  # [B, G]
                unread = []
                if pool is None:
                    logits = logits + d.correction(z[:, j], state)
                else:  # W2 . SiLU(W1 [z ; g]) on the pool's rows only, every other token out of reach
                    e = d.correction_in(z[:, j], state)  # [B, E]
                    scores = logits.gather(1, pool) + torch.bmm(w2, e[:, :, None].to(w2.dtype))[..., 0]  # [B, K]
                    if temperature == 0:
                        picked = pool.gather(1, scores.argmax(-1, keepdim=True))[:, 0]  # [B] rows
                    else:
                        logits = torch.full_like(logits, float("-inf")).scatter(1, pool, scores)
            if picked is not None:
                row = picked
            elif temperature == 0:
                row = logits.argmax(-1)
            else:
                q = probs(logits, temperature, top_p)  # [B, N]
                row = sample(q, u[:, j])
                qs.append(d.full_vocab(q))  # [B, V]
            tok = d.draft_to_target(row)  # [B] what the GRU reads next and the target verifies
            drafts.append(tok)
            unread.append(tok)
        return ChainDraft(torch.stack(drafts, 1), torch.stack(qs, 1) if qs else None)


# ---- the family record ------------------------------------------------------------------------------
def build(tcfg: Any, options: DominoOptions, layer_ids: list[int] | None, draft_vocab_size: int | None
          ) -> DominoConfig:
    return build_with_head(DominoConfig, DominoHead, tcfg, options, layer_ids, "domino", draft_vocab_size)


def init(drafter: DominoDrafter, target: Any, options: DominoOptions) -> str:
    return init_with_warm_start(drafter, target, options, "domino", " (its slots read one position earlier here)")


def describe(options: DominoOptions, config: DominoConfig) -> str:
    pool = f"{config.candidate_pool_size} candidates" if config.candidate_pool_size else "the whole vocabulary"
    return (f"{config.num_hidden_layers} layer(s), block {config.block_size} ({config.num_draft_tokens} drafts), "
            f"GRU {config.gru_hidden_dim}, correction rank {config.emb_dim} from draft "
            f"{config.pure_draft_prefix_len}, base-loss share {config.lambda_base_start} to 0 over "
            f"{config.lambda_base_decay_ratio:g} of the steps, drafting among {pool}"
            f"{f', draft vocab {config.draft_vocab_size}' if config.draft_vocab_size else ''}, features of layers "
            f"{config.target_layer_ids} (outputs), mask token {config.mask_token_id}")


def domino_summary(res: dict[str, float]) -> str:
    """The block drafter's words, and what the correction buys over the backbone's own drafts."""
    words = eval_summary(res)
    if "eval/base_acc" in res:
        words += f", drafts right {res['eval/corrected_acc']:.3f} corrected vs {res['eval/base_acc']:.3f} base"
    return words


FAMILY = Family(
    name="domino", options=DominoOptions, config=DominoConfig, model=DominoDrafter, build=build, init=init,
    reduced_vocab=has_draft_vocab, describe=describe, eval_summary=domino_summary,
    exporters={"dflash": "drafthead.export.domino:to_dflash"},
    readers={"dflash": "drafthead.export.domino:read_back"},
)

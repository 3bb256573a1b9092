"""DSpark: a DFlash block drafter whose slots see each other through a low-rank Markov head, with a confidence
head that says how many of them to verify (DeepSpec; speculators 0.9.0 `models/dspark`, SpecForge 0.2.0
`algorithms/dspark`, llama.cpp `--spec-type draft-dspark`).

Math only. The backbone is DFlash's (`drafthead/dflash.py`: fused target features as context keys, a block
[x_p, MASK x (B-1)] at positions p..p+B-1, bidirectional inside the block, the target's own head); this file adds:
- Markov head: logits of a slot += W2 . W1[prev], W1 an embedding [V, r] of the token before the predicted one,
  W2 a Linear r -> V. Drafting goes left to right inside the block: the token drawn for a slot is the next slot's
  prev, so slot k no longer guesses blind of slot k-1 (DFlash's weakness: independent slots).
- Confidence head: sigmoid(proj([h; W1[prev]])) estimates the slot's acceptance probability; trained with BCE on
  the soft label 1 - TV(q, p) (the chance a sample from the draft q survives rejection against the target p).
  At decode time a request's drafts end before the first slot whose confidence is under `draft_stop_prob`
  (llama.cpp: `--spec-draft-p-min`).
- Loss per slot: ce_weight * CE(teacher argmax) + tv_weight * TV(q, p) + confidence_weight * BCE, weighted
  exp(-j/gamma) over drafts j = 0.. (the reference recipe: 0.1 CE + 0.9 TV).

Layouts (`sample_from_anchor`, speculators' field): true (the reference's "anchor-first" block) - slot k predicts the
token at p+k+1, so one forward gives B drafts; false - DFlash's layout, slot k >= 1 predicts the token at p+k, B-1
drafts. Either way draft j predicts the token at p+j+1 and its prev is the token at p+j (draft 0: the anchor).
W2 starts at zero, so a fresh DSpark computes its backbone's logits: `warm_start` from a DFlash draft (same tensor
names) starts exactly where that draft ended when the layouts agree (`sample_from_anchor: false`).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from drafthead.dflash import (BlockRunner, DflashBackbone, DflashConfig, DflashDrafter, DflashTraining, OnBackbone,
                              PieceLoss, build_with_head, drafts_loss, eval_summary, init_with_warm_start,
                              warm_start_backbone)
from drafthead.family import Family
from drafthead.losses import Objective
from drafthead.runtime.contract import ChainDraft, DraftMode, DraftState, Proposal, SpecConfig, inference
from drafthead.runtime.draft import CHAIN, chain_proposal


@dataclass
class DsparkTraining:
    """DSpark's heads and loss, chosen in the recipe and kept in the config (both extend this)."""

    markov_rank: int = 256  # r of W2 . W1[prev]
    confidence_head: bool = True  # a head that predicts whether each draft will be accepted (its own loss)
    sample_from_anchor: bool = True  # anchor-first block: B drafts a forward (false: DFlash's layout, B-1)
    ce_weight: float = 0.1  # weight of the cross-entropy to the target's token
    tv_weight: float = 0.9  # weight of the total-variation distance to the target's distribution
    confidence_weight: float = 1.0  # weight of the confidence head's loss

    def check_heads(self) -> None:
        if self.markov_rank < 1:
            raise ValueError(f"markov_rank: {self.markov_rank} (must be >= 1)")
        for name in ("ce_weight", "tv_weight", "confidence_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: {getattr(self, name)} (must be >= 0)")
        if self.ce_weight + self.tv_weight <= 0:
            raise ValueError("ce_weight + tv_weight: must be > 0 (the token loss)")


@dataclass
class DsparkOptions(OnBackbone, DsparkTraining, DflashTraining, DflashBackbone):
    """The recipe section `drafter.dspark.*`: the DFlash backbone's keys (`block_size`: the block drafted in one
    forward, see `sample_from_anchor`), then DSpark's own."""

    def validate(self) -> None:
        self.check_backbone()
        self.check_training()
        self.check_on_backbone()
        self.check_heads()


@dataclass(kw_only=True)
class DsparkConfig(DflashConfig, DsparkTraining):
    """DFlash's config and DSpark's heads and loss (`labels` is unused: the loss is CE + TV)."""

    @property
    def num_draft_tokens(self) -> int:
        return self.block_size if self.sample_from_anchor else self.block_size - 1

    @property
    def first_slot(self) -> int:
        """The block slot of draft 0 (the anchor's own slot when `sample_from_anchor`)."""
        return 0 if self.sample_from_anchor else 1


class MarkovHead(nn.Module):
    """W2 . W1[prev]: a low-rank bias on the logits from the token before the predicted one."""

    def __init__(self, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)  # [V, r]
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)  # [V, r]
        nn.init.normal_(self.markov_w1.weight, std=0.01)
        nn.init.zeros_(self.markov_w2.weight)  # a fresh head adds nothing: the backbone's logits stand


class ConfidenceHead(nn.Module):
    """sigmoid(proj([h; W1[prev]])): the slot's acceptance probability, as a logit."""

    def __init__(self, hidden_size: int, rank: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden_size + rank, 1)


class DsparkDrafter(DflashDrafter):
    family = "dspark"
    config: DsparkConfig

    def __init__(self, c: DsparkConfig) -> None:
        super().__init__(c)
        self.markov_head = MarkovHead(c.vocab_size, c.markov_rank)
        self.confidence_head = ConfidenceHead(c.hidden_size, c.markov_rank) if c.confidence_head else None

    @property
    def draft_modes(self) -> dict[str, DraftMode]:
        return {"block": DSPARK_BLOCK}

    def draft_state(self, batch: int, capacity: int, device: torch.device) -> "DsparkState":  # mypy checks it
        return DsparkRunner(self, batch, capacity, device)

    def slot_logits(self, h: torch.Tensor, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """h [.., H] normed slot outputs, prev [..] the token before each predicted one -> (logits [.., V],
        confidence logits [..] or None)."""
        return self.markov_step(self.target_lm_head(h), h, prev)

    def markov_step(self, base: torch.Tensor, h: torch.Tensor, prev: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The backbone's logits base [.., V] of slots h [.., H] -> (base + W2 . W1[prev], confidence logits [..]
        or None). Split from the head so decoding runs the head once for the whole block."""
        e = self.markov_head.markov_w1(prev).to(h.dtype)  # [.., r]
        logits = base + self.markov_head.markov_w2(e)  # [.., V]
        conf = None
        if self.confidence_head is not None:
            conf = self.confidence_head.proj(torch.cat([h, e], -1)).squeeze(-1)  # [..]
        return logits, conf

    # ---- training --------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, aux_hidden: torch.Tensor, teacher_probs: torch.Tensor,
                target_argmax: torch.Tensor, loss_mask: torch.Tensor, last_hidden: torch.Tensor | None = None,
                objective: Objective | None = None) -> dict[str, Any]:
        """The per-draft loss over sampled anchor blocks, with teacher-forced prev tokens (the data's).

        Shapes as `DflashDrafter.forward`; teacher_probs [B, T, V] is the target's full-vocab distribution.
        Returns `dflash.drafts_loss`'s dict; with a confidence head its ratios add `confidence_error`, the mean
        |sigmoid(confidence) - soft acceptance label| (how well the stop is calibrated).
        """
        if objective is not None:  # FAMILY.losses is empty: the config refuses train.loss before this
            raise ValueError("dspark trains its own loss only (train.loss must stay null)")
        names = ("confidence_error",) if self.confidence_head is not None else ()
        return drafts_loss(self, self._piece_loss, names, input_ids, aux_hidden, target_argmax, loss_mask,
                           teacher_probs)

    def _piece_loss(self, input_ids: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor, b_idx: torch.Tensor,
                    a_idx: torch.Tensor, j_idx: torch.Tensor, pos: torch.Tensor, tgt: torch.Tensor,
                    teacher_probs: torch.Tensor, *ctx_flat: torch.Tensor) -> PieceLoss:
        """Per supervised draft [M]: its loss (CE + TV + BCE, weighted by the options), its argmax, its
        log-probability of the target's token, and |confidence - label| (the ratio `confidence_error`, with a
        confidence head)."""
        c = self.config
        T = input_ids.shape[1]
        ctx_kv = list(zip(ctx_flat[::2], ctx_flat[1::2]))
        out = self.anchor_blocks(input_ids, None, anchors, valid, ctx_kv)[:, :, c.first_slot:]  # [B, a, K, H]
        prev = input_ids.flatten().index_select(0, b_idx * T + pos - 1)  # [M] the token before each predicted
        logits, conf = self.slot_logits(out[b_idx, a_idx, j_idx], prev)  # [M, V], [M]
        logits = logits.float()
        p = teacher_probs.flatten(0, 1).index_select(0, b_idx * T + pos - 1)  # [M, V] the target at pos-1
        q = logits.softmax(-1)
        tv = 0.5 * (q - p).abs().sum(-1)  # [M] total variation; 1 - tv = P(a sample of q is accepted)
        ce = F.cross_entropy(logits, tgt, reduction="none")  # [M]
        loss = c.ce_weight * ce + c.tv_weight * tv
        ratios = {}
        if conf is not None:
            label = (1 - tv).detach().clamp(0, 1)
            loss = loss + c.confidence_weight * F.binary_cross_entropy_with_logits(conf.float(), label,
                                                                                  reduction="none")
            ratios["confidence_error"] = (conf.detach().float().sigmoid() - label).abs()
        return PieceLoss(loss, logits.detach().argmax(-1), -ce.detach(), ratios)


# ---- inference: the block forward, then the slots left to right -------------------------------------
class DsparkState(DraftState, Protocol):
    """What DSpark's mode "block" calls: a block's drafts read left to right, cut at the confidence stop."""

    def block(self, roots: torch.Tensor, k: int, temperature: float, top_p: float, gen: torch.Generator | None,
              stop_prob: float = 0.0) -> ChainDraft: ...


class DsparkRunner(BlockRunner):
    """DFlash's context cache and block forward; the drafts are read one slot at a time, each slot's Markov term
    from the token drafted before it, and a request stops where its confidence falls under the threshold."""

    @inference
    def block(self, roots: torch.Tensor, k: int, temperature: float, top_p: float, gen: torch.Generator | None,
              stop_prob: float = 0.0) -> ChainDraft:
        """Up to k (<= num_draft_tokens) drafts per request. Sampled drafts: q of draft j is its distribution
        given the drafts before it, as a chain's (what lossless rejection sampling needs)."""
        from drafthead.runtime.sampling import probs, sample

        d: DsparkDrafter = self.drafter
        c = d.config
        out = self.block_out(roots)[:, c.first_slot: c.first_slot + k]  # [B, k, H]
        # the target head once over the block (one pass over its weights); only the Markov term waits for prev
        base = d.target_lm_head(out)  # [B, k, V]
        B = roots.shape[0]
        prev, drafts, qs = roots, [], []
        lengths = torch.full((B,), k, dtype=torch.long, device=roots.device)
        stopped = torch.zeros(B, dtype=torch.bool, device=roots.device)
        u = torch.rand(B, k, generator=gen, device=roots.device) if temperature > 0 else torch.zeros(0)
        for j in range(k):
            logits, conf = d.markov_step(base[:, j], out[:, j], prev)  # [B, V], [B] | None
            if stop_prob > 0 and conf is not None:
                low = ~stopped & (conf.float().sigmoid() < stop_prob)
                lengths = torch.where(low, torch.full_like(lengths, j), lengths)
                stopped = stopped | low
            if temperature == 0:
                prev = logits.argmax(-1)
            else:
                q = probs(logits, temperature, top_p)  # [B, V]
                prev = sample(q, u[:, j])
                qs.append(q)
            drafts.append(prev)
        return ChainDraft(torch.stack(drafts, 1), torch.stack(qs, 1) if qs else None, lengths)


def propose_dspark(state: DsparkState, roots: torch.Tensor, lengths: torch.Tensor, spec: SpecConfig,
                   gen: torch.Generator | None) -> Proposal:
    """Mode "block" of DSpark: one block forward, drafts left to right, verified as a chain."""
    got = state.block(roots, int(lengths.max()), spec.temperature, spec.top_p, gen, spec.draft_stop_prob)
    return chain_proposal(roots, got.drafts, torch.minimum(lengths, got.lengths), got.q)


def check_dspark(spec: SpecConfig, drafter: DsparkDrafter) -> str | None:
    if spec.num_speculative_tokens > drafter.config.num_draft_tokens:
        return (f"spec.num_speculative_tokens={spec.num_speculative_tokens}: a block of this draft has "
                f"{drafter.config.num_draft_tokens} drafts")
    if spec.draft_stop_prob > 0 and drafter.confidence_head is None:
        return "spec.draft_stop_prob > 0 stops on the confidence head, and this draft has none"
    return None


DSPARK_BLOCK = replace(CHAIN, propose=propose_dspark, state=DsparkState, check=check_dspark)


# ---- the family record ------------------------------------------------------------------------------
def build(tcfg: Any, options: DsparkOptions, layer_ids: list[int] | None, draft_vocab_size: int | None
          ) -> DsparkConfig:
    return build_with_head(DsparkConfig, DsparkTraining, tcfg, options, layer_ids, "dspark")


def init(drafter: DsparkDrafter, target: Any, options: DsparkOptions) -> str:
    return init_with_warm_start(drafter, target, options, "dspark", layout(drafter))


def warm_start(drafter: DsparkDrafter, path: str) -> str:
    """Every backbone tensor of the DFlash draft at `path` (same names, same shapes, or a named error)."""
    warm_start_backbone(drafter, path, "dspark")
    return f"backbone from the DFlash draft {path}{layout(drafter)}"


def layout(drafter: DsparkDrafter) -> str:
    """How a DFlash draft's slots line up in this DSpark's block."""
    if not drafter.config.sample_from_anchor:
        return ""
    return " (its slots read one position earlier here: sample_from_anchor)"


def describe(options: DsparkOptions, config: DsparkConfig) -> str:
    return (f"{config.num_hidden_layers} layer(s), block {config.block_size} ({config.num_draft_tokens} drafts), "
            f"Markov rank {config.markov_rank}, confidence head {'on' if config.confidence_head else 'off'}, "
            f"features of layers {config.target_layer_ids} (outputs), mask token {config.mask_token_id}")


FAMILY = Family(
    name="dspark", options=DsparkOptions, config=DsparkConfig, model=DsparkDrafter, build=build, init=init,
    reduced_vocab=False, describe=describe, eval_summary=eval_summary,
    exporters={"speculators": "drafthead.export.dspark:to_speculators", "gguf": "drafthead.export.dspark:to_gguf"},
    readers={"speculators": "drafthead.export.dspark:read_back", "gguf": "drafthead.export.dspark:read_back_gguf"},
    vllm={"speculators": "dspark"},
    vllm_refused={"speculators": "Model Runner V1 does not support: dspark speculative decoding"},  # GPU runner only
)

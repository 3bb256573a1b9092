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

import functools
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from drafthead.dflash import (BlockRunner, DflashBackbone, DflashConfig, DflashDrafter, DflashTraining, check_built,
                              eval_summary, sample_anchors, slot_weights, target_layer_ids)
from drafthead.family import Family
from drafthead.losses import Objective
from drafthead.options import shared
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
class DsparkOptions(DsparkTraining, DflashTraining, DflashBackbone):
    """The recipe section `drafter.dspark.*`: the DFlash backbone's keys (`block_size`: the block drafted in one
    forward, see `sample_from_anchor`), then DSpark's own."""

    loss_decay_gamma: float = 4.0  # draft j weight exp(-j/gamma) (speculators' dspark default)
    warm_start: str | None = None  # a DFlash draft directory (e.g. runs/dflash_smollm2/final): backbone from it

    def validate(self) -> None:
        self.check_backbone()
        self.check_training()
        if self.loss_decay_gamma <= 0:
            raise ValueError(f"loss_decay_gamma: {self.loss_decay_gamma} (must be > 0)")
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
        Returns `loss`, per draft `step_loss` / `correct` / `count`, `accept_len` / `blocks` (the greedy run of
        right drafts per block), `cond_correct` / `cond_count`, and `conf_error` / `conf_count` (the summed
        |sigmoid(confidence) - soft acceptance label|: how well the stop is calibrated).
        """
        if objective is not None:  # FAMILY.losses is empty: the config refuses train.loss before this
            raise ValueError("dspark trains its own loss only (train.loss must stay null)")
        c = self.config
        Bk, dev = c.block_size, input_ids.device
        B, T = input_ids.shape
        K = c.num_draft_tokens
        gen = None if self.training else torch.Generator().manual_seed(0)
        anchors, valid = sample_anchors(loss_mask, Bk, c.num_anchors, gen, c.overlap_anchors)  # [B, A] each
        A = anchors.shape[1]
        ctx_kv = self.context_kv(self.fuse(aux_hidden), torch.arange(T, device=dev).expand(B, T))

        lab = anchors[:, :, None] + torch.arange(1, K + 1, device=dev)  # [B, A, K] position draft j predicts
        inside = lab < T
        lab = lab.clamp(max=T - 1)
        ok = valid[:, :, None] & inside & loss_mask.gather(1, lab.flatten(1)).view_as(lab).bool()
        tgt = target_argmax.gather(1, (lab - 1).flatten(1)).view_as(lab)  # [B, A, K]
        ok = ok & (tgt >= 0)
        totals = torch.zeros(2, device=dev)  # weighted loss, weights
        step_loss, count, correct = (torch.zeros(K, device=dev) for _ in range(3))
        conf_stats = torch.zeros(2, device=dev)
        slot_hit = torch.zeros(B, A, K, dtype=torch.bool, device=dev)
        piece = self._piece_loss
        if torch.is_grad_enabled():  # one piece's activations and [M, V] logits alive at a time (as DFlash)
            piece = functools.partial(checkpoint, self._piece_loss, use_reentrant=False)
        for s in range(0, A, c.anchor_chunk):
            sl = slice(s, s + c.anchor_chunk)
            b_idx, a_idx, j_idx = ok[:, sl].nonzero(as_tuple=True)  # M supervised drafts of this piece
            if b_idx.numel() == 0:
                continue
            pos = lab[:, sl][b_idx, a_idx, j_idx]  # [M] the predicted token's position
            loss_m, top, conf_err, logp = piece(input_ids, anchors[:, sl], valid[:, sl], b_idx, a_idx, j_idx, pos,
                                                tgt[:, sl][b_idx, a_idx, j_idx], teacher_probs,
                                                *[t for kv in ctx_kv for t in kv])  # [M] each
            w = slot_weights(c, j_idx, logp, b_idx, a_idx, (B, ok[:, sl].shape[1], K))  # [M]
            totals = totals + torch.stack([(loss_m * w).sum(), w.sum()])
            hit = top == tgt[:, sl][b_idx, a_idx, j_idx]
            step_loss.index_add_(0, j_idx, loss_m.detach().float())
            count.index_add_(0, j_idx, torch.ones_like(w))
            correct.index_add_(0, j_idx, hit.float())
            if conf_err is not None:
                conf_stats = conf_stats + torch.stack([conf_err.sum(), w.new_tensor(float(conf_err.numel()))])
            slot_hit[b_idx, a_idx + s, j_idx] = hit
        run = slot_hit.long().cumprod(-1)  # [B, A, K]
        before = torch.cat([torch.ones_like(run[..., :1]), run[..., :-1]], -1).bool() & ok
        blocks = valid.sum().float()
        return {"loss": totals[0] / totals[1].clamp(min=1e-6), "step_loss": step_loss / count.clamp(min=1),
                "correct": correct, "count": count,
                "ratios": {"block_accept_len": ((run.sum(-1) * valid).sum().float() + blocks, blocks),
                           "cond_acc": ((before & slot_hit).sum((0, 1)).float(), before.sum((0, 1)).float()),
                           "confidence_error": (conf_stats[0], conf_stats[1])}}

    def _piece_loss(self, input_ids: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor, b_idx: torch.Tensor,
                    a_idx: torch.Tensor, j_idx: torch.Tensor, pos: torch.Tensor, tgt: torch.Tensor,
                    teacher_probs: torch.Tensor, *ctx_flat: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Per supervised draft [M]: its loss (CE + TV + BCE, weighted by the options), its argmax,
        |confidence - label| (None without a confidence head) and its log-probability of the target's token
        (detached; D-PACE's weights read it)."""
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
        err = None
        if conf is not None:
            label = (1 - tv).detach().clamp(0, 1)
            loss = loss + c.confidence_weight * F.binary_cross_entropy_with_logits(conf.float(), label,
                                                                                  reduction="none")
            err = (conf.detach().float().sigmoid() - label).abs()
        return loss, logits.detach().argmax(-1), err, -ce.detach()


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
    c = DsparkConfig.from_target(
        tcfg, num_hidden_layers=options.num_layers, mask_token_id=options.mask_token_id,
        target_layer_ids=target_layer_ids(tcfg, options, layer_ids), intermediate_size=options.intermediate_size,
        loss_decay_gamma=options.loss_decay_gamma, **shared(options, DflashTraining), **shared(options, DsparkTraining))
    check_built(c, tcfg, "dspark")
    return c


def init(drafter: DsparkDrafter, target: Any, options: DsparkOptions) -> str:
    """DFlash's init (the target's embedding, head and final norm; its last layers with `init: target`), then
    the backbone of a DFlash draft when `warm_start` names one."""
    from drafthead.dflash import init as dflash_init

    said = dflash_init(drafter, target, _dflash_options(options))
    if options.warm_start is None:
        return said
    return warm_start(drafter, options.warm_start)


def _dflash_options(options: DsparkOptions) -> Any:
    """The DFlash options DFlash's init reads (only `init`)."""
    from drafthead.dflash import DflashOptions

    return DflashOptions(init=options.init, mask_token_id=options.mask_token_id)


def warm_start(drafter: DsparkDrafter, path: str) -> str:
    """Copy every backbone tensor of the DFlash draft at `path` (same names, same shapes, or a named error)."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    folder = Path(path)
    if not (folder / "config.json").is_file() or not (folder / "model.safetensors").is_file():
        raise ValueError(f"drafter.dspark.warm_start: {path} is not a draft directory (config.json + "
                         f"model.safetensors)")
    meta = json.loads((folder / "config.json").read_text())
    if meta.get("family") != "dflash":
        raise ValueError(f"drafter.dspark.warm_start: {path} holds a {meta.get('family')!r} draft, not a DFlash one")
    cfg, state = meta.get("draft") or {}, load_file(str(folder / "model.safetensors"))
    mine = drafter.state_dict()
    bad = [k for k, v in state.items() if k not in mine or mine[k].shape != v.shape]
    bad += [k for k, v in state.items() if k not in bad and v.is_floating_point() and not bool(v.isfinite().all())]
    if bad:
        raise ValueError(f"drafter.dspark.warm_start: {path} does not fit this draft's backbone (layers, sizes or "
                         f"target differ, or values are not finite): {bad[:4]}")
    c = drafter.config
    for key in ("block_size", "mask_token_id", "target_layer_ids"):
        if cfg.get(key) != getattr(c, key):
            raise ValueError(f"drafter.dspark.warm_start: {path} has {key}={cfg.get(key)!r}, this draft "
                             f"{getattr(c, key)!r}")
    with torch.no_grad():
        for k, v in state.items():
            mine[k].copy_(v)
    shift = "" if not c.sample_from_anchor else " (its slots read one position earlier here: sample_from_anchor)"
    return f"backbone from the DFlash draft {path}{shift}"


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

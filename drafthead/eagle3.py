"""EAGLE3 draft head: 3-layer feature fusion + one decoder layer + reduced-vocab head.

Math only (no DDP/DeepSpeed/checkpointing). Parameter names follow the SGLang/SpecForge layout
(`fc`, `midlayer.*`, `norm`, `lm_head`, buffers `d2t`/`t2d`) so that export is a rename at most.

Conventions (pinned by tests):
- `aux_layer_ids` = ids of decoder layers whose *input* is captured, i.e. HF `hidden_states[i]`
  (= output of layer i-1). That is what SGLang/vLLM/llama.cpp mean by
  `eagle_aux_hidden_state_layer_ids`; their default is `[2, N//2, N-3]`.
- Training position t sees token x_{t+1} and the target feature f_t and is trained towards the target
  distribution at t+1 (which predicts x_{t+2}). Step i of the training-time test (TTT) shifts the
  tokens and targets by i and replaces f_t by the draft's own output hidden state of step i-1.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Self

import torch
import torch.nn.functional as F
from torch import nn

from drafthead.family import Family, OwnLayers
from drafthead.layers import (RMSNorm, SwiGLU, apply_rope, cached_attention, decoder_layer_shape, given, kv_cache,
                              one_call_layer, project, rope_cos_sin, shift, take_rows,
                              ttt_attention)
from drafthead.losses import LOSSES, Objective, draft_loss, with_alpha
from drafthead.options import shared
from drafthead.runtime.draft import CHAIN, TREE, DraftRunner
from drafthead.vocab import target_to_draft


@dataclass
class Eagle3Training:
    """The recipe's choices an EAGLE3 draft keeps in its config: the options and the config both extend this, so
    each is declared once (`build` carries them over with `options.shared`)."""

    num_draft_tokens: int = 7  # training-time-test steps (draft depths trained)
    step_decay: float = 0.8  # loss weight of step i: step_decay ** i
    hard_label_weight: float = 0.0  # mix lambda of a one-hot on the target argmax into the soft target
    feature_loss_weight: float = 0.0  # > 0 adds EAGLE-1's regression of the draft hidden onto the target's

    # EAGLE 3.1 (arXiv 2605.09992), the field names speculators, vLLM and SGLang read. fc_norm: an RMSNorm on
    # each captured layer's state (weights `fc_norm.{i}`) before `fc`
    fc_norm: bool = False
    norm_output: bool = False  # the draft hidden is normed once: the next TTT step and the head read norm(hidden)


@dataclass
class Eagle3Options(Eagle3Training):
    """The recipe section `drafter.eagle3.*`."""

    draft_vocab_size: int = 32000  # the most frequent loss-masked target tokens (d2t / t2d)
    intermediate_size: int | None = None  # null = the target's
    init: str = "auto"  # auto = random (the embedding is always the target's)
    init_head_from_target: bool = False  # start lm_head/norm from the target's (rows of the draft vocab)

    def validate(self) -> None:
        if self.num_draft_tokens < 1:
            raise ValueError("num_draft_tokens: must be >= 1")
        if self.draft_vocab_size < 1:
            raise ValueError("draft_vocab_size: must be >= 1")
        if not 0 <= self.hard_label_weight <= 1:
            raise ValueError(f"hard_label_weight: {self.hard_label_weight} (must be in [0, 1])")
        if self.feature_loss_weight < 0:
            raise ValueError(f"feature_loss_weight: {self.feature_loss_weight} (must be >= 0)")
        if self.init not in INITS:
            raise ValueError(f"init: {self.init!r} (choose from {', '.join(INITS)})")
        for name in ("fc_norm", "norm_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: {getattr(self, name)!r} (must be true or false)")


INITS = ("auto", "random")


@dataclass(kw_only=True)
class Eagle3Config(Eagle3Training):
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # target vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: list[int] = field(default_factory=list)  # inputs of these decoder layers
    target_num_layers: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    norm_before_residual: bool = False  # residual = fc output (SpecForge/SGLang), not its norm

    @staticmethod
    def default_aux_layer_ids(num_layers: int) -> list[int]:
        """SGLang/vLLM/llama.cpp default: inputs of layers 2, N//2, N-3."""
        return [2, num_layers // 2, num_layers - 3]

    @classmethod
    def from_target(cls, tcfg: Any, draft_vocab_size: int, aux_layer_ids: list[int] | None = None,
                    **overrides: Any) -> Self:
        """Size the draft like one decoder layer of the target (the EAGLE3 recipe)."""
        n = tcfg.num_hidden_layers
        kw = dict(decoder_layer_shape(tcfg), draft_vocab_size=min(draft_vocab_size, tcfg.vocab_size),
                  target_hidden_size=tcfg.hidden_size,
                  aux_layer_ids=list(aux_layer_ids) if aux_layer_ids else cls.default_aux_layer_ids(n))
        kw.update(given(overrides))
        return cls(**kw)

    def to_dict(self) -> dict:
        return asdict(self)


class Eagle3Attention(nn.Module):
    """Attention whose q/k/v read the 2H concat [norm(embed); norm(hidden)]."""

    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)

    def qkv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, T, _ = x.shape
        c = self.c
        q, k, v = project(x, self.q_proj, self.k_proj, self.v_proj)
        q = q.view(B, T, c.num_attention_heads, c.head_dim).transpose(1, 2)  # [B, h, T, D]
        k = k.view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)  # [B, kvh, T, D]
        v = v.view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)  # [B, kvh, T, D]
        cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def expand_kv(self, t: torch.Tensor) -> torch.Tensor:
        rep = self.c.num_attention_heads // self.c.num_key_value_heads
        return t.repeat_interleave(rep, dim=1) if rep > 1 else t


class Eagle3Layer(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.c = c
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Eagle3Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)

    def pre(self, emb: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (attention input [B, T, 2H], residual [B, T, H])."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.c.norm_before_residual else hidden
        return torch.cat([self.input_layernorm(emb), normed], dim=-1), residual

    def post(self, attn_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        h = self.self_attn.o_proj(attn_out) + residual  # [B, T, H]
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Drafter(OwnLayers, nn.Module):
    family = "eagle3"
    features = "aux"  # a prefix entry reads the fused aux features of the target
    draft_modes = {"chain": CHAIN, "tree": TREE}

    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)  # copied from target, frozen
        self.embed_tokens.weight.requires_grad_(False)
        # one norm per captured layer: the layers' scales differ by orders of magnitude in deep targets
        self.fc_norm = nn.ModuleList(RMSNorm(c.target_hidden_size, c.rms_norm_eps) for _ in c.aux_layer_ids) \
            if c.fc_norm else None
        self.fc = nn.Linear(len(c.aux_layer_ids) * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))

    # ---- what the trainer/capture need to know -------------------------------------------------
    def capture_layer_ids(self) -> list[int]:
        return list(self.config.aux_layer_ids)

    def check_target(self, tcfg: Any) -> list[str]:
        """Mismatches with a target's HF config, as messages (none: the draft fits)."""
        c, problems = self.config, []
        if c.target_hidden_size != tcfg.hidden_size:
            problems.append(f"hidden size: draft expects target_hidden_size={c.target_hidden_size}, "
                            f"target has hidden_size={tcfg.hidden_size}")
        if c.vocab_size != tcfg.vocab_size:
            problems.append(f"vocab: draft expects vocab_size={c.vocab_size}, target has {tcfg.vocab_size}")
        n = tcfg.num_hidden_layers
        bad = [i for i in c.aux_layer_ids if not 0 <= i < n]
        if bad or not c.aux_layer_ids:
            problems.append(f"aux layer ids {list(c.aux_layer_ids)} out of range for a target with {n} decoder "
                            f"layers")
        if not problems:
            top = int(self.draft_to_target(torch.arange(c.draft_vocab_size, device=self.d2t.device)).max())
            if top >= tcfg.vocab_size:
                problems.append(f"vocab: d2t maps draft ids to target id {top} >= target vocab {tcfg.vocab_size}")
        return problems

    def draft_state(self, batch: int, capacity: int, device: torch.device) -> DraftRunner:
        return DraftRunner(self, batch, capacity, device)

    @torch.no_grad()
    def init_from_target(self, embed: torch.Tensor, lm_head: torch.Tensor | None = None,
                         final_norm: torch.Tensor | None = None) -> None:
        """Copy the target's embedding (frozen) and, optionally, its lm_head rows of the draft vocabulary
        and its final norm (`drafter.eagle3.init_head_from_target`; on the default recipe it learned slower
        than a random head, see docs/experiment_log.md, row B)."""
        self.embed_tokens.weight.copy_(embed)
        if lm_head is not None:
            self.lm_head.weight.copy_(lm_head[self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)])
        if final_norm is not None:
            self.norm.weight.copy_(final_norm)

    def draft_to_target(self, idx: torch.Tensor) -> torch.Tensor:
        return idx + self.d2t[idx]

    # ---- training: unrolled training-time test -------------------------------------------------
    def forward(self, input_ids: torch.Tensor, aux_hidden: torch.Tensor, teacher_probs: torch.Tensor,
                target_argmax: torch.Tensor, loss_mask: torch.Tensor, last_hidden: torch.Tensor | None = None,
                num_draft_tokens: int | None = None, objective: Objective | None = None) -> dict[str, Any]:
        """TTT loss.

        Args:
            input_ids: [B, T] target token ids (right-padded).
            aux_hidden: [B, T, 3*Ht] captured target features.
            teacher_probs: [B, T, N] fp32 target distribution restricted to (and renormalised over) the
                draft vocab at position j (predicting x_{j+1}); only rows j with loss_mask[j+1] are read.
            target_argmax: [B, T] full-vocab target argmax at position j (-1 where unknown).
            loss_mask: [B, T] 1 on assistant tokens.
            last_hidden: [B, T, H] the target's last hidden state after its final norm (what its lm_head
                reads); needed when `feature_loss_weight` > 0: step i at row t then also regresses
                norm(draft hidden) onto row t+1+i (smooth L1), a dense signal per token as in EAGLE-1.
            objective: `train.loss` (drafthead/losses.py); None = kl.
        Returns dict with `loss` (scalar), and per step `correct`, `count`, `step_loss` ([K] each); out of
        training also `alpha` [K], the expected acceptance sum min(p, q) summed per step.
        """
        c = self.config
        K = num_draft_tokens or c.num_draft_tokens
        B, T = input_ids.shape
        layer = self.midlayer
        attn = layer.self_attn
        hidden = self.fuse(aux_hidden)  # [B, T, H]
        causal = torch.ones(T, T, dtype=torch.bool, device=input_ids.device).tril()
        keys: list[torch.Tensor] = []
        vals: list[torch.Tensor] = []
        total = hidden.new_zeros(())
        step_loss, correct, count, alphas = [], [], [], []
        for i in range(K):
            mask_i = shift(loss_mask, 2 + i).bool()  # [B, T]  x_{t+2+i} is an assistant token
            pos = torch.arange(T, device=input_ids.device).expand(B, T) + i  # [B, T]
            x, residual = layer.pre(*self.step_inputs(i, input_ids, hidden))
            q, k, v = attn.qkv(x, pos)  # [B, h, T, D], [B, kvh, T, D] x2
            keys.append(attn.expand_kv(k))
            vals.append(attn.expand_kv(v))
            # scores vs step-0 keys (causal) and the diagonal of every later step's keys
            o = ttt_attention(q, keys[0], vals[0], keys[1:], vals[1:], causal)  # [B, h, T, D]
            o = o.transpose(1, 2).reshape(B, T, -1)  # [B, T, h*D]
            hidden = self.step_output(layer.post(o, residual))  # [B, T, H]

            b_idx, t_idx = mask_i.nonzero(as_tuple=True)  # M rows with a target to match
            normed = self.head_input(hidden[b_idx, t_idx])  # [M, H]
            logits = self.lm_head(normed)  # [M, N] (bf16 under autocast; the loss runs in fp32)
            teach = teacher_probs.flatten(0, 1).index_select(0, b_idx * T + t_idx + 1 + i)  # [M, N] rows (b, t+1+i)
            tgt = target_argmax[b_idx, t_idx + 1 + i]  # [M]
            in_vocab = self.t2d[tgt.clamp(min=0)] & (tgt >= 0)  # target argmax representable by the draft
            if c.hard_label_weight > 0:  # sharpen towards the argmax that acceptance is scored on
                teach = teach.mul_(1 - c.hard_label_weight)  # a fresh gathered copy: in place is safe
                rows = in_vocab.nonzero(as_tuple=True)[0]
                teach[rows, target_to_draft(self.t2d)[tgt[rows]]] += c.hard_label_weight
            ce, alpha = draft_loss(logits, teach, objective, not self.training)  # [M] each (alpha: eval only)
            n = max(int(b_idx.numel()), 1)
            li = (ce * in_vocab).sum() / n
            if c.feature_loss_weight > 0:
                if last_hidden is None:
                    raise ValueError("feature_loss_weight > 0 needs last_hidden (the target's last hidden state)")
                want = last_hidden[b_idx, t_idx + 1 + i].float()  # [M, H]
                li = li + c.feature_loss_weight * F.smooth_l1_loss(normed.float(), want, reduction="sum") / (
                    n * want.shape[-1])
            total = total + (c.step_decay ** i) * li
            step_loss.append(li.detach())
            pred = self.draft_to_target(logits.detach().max(-1).indices)  # first maximum, as argmax
            correct.append((pred == tgt).sum())
            count.append(torch.tensor(b_idx.numel(), device=input_ids.device))
            if alpha is not None:
                alphas.append(alpha.sum())
        return with_alpha({"loss": total, "step_loss": torch.stack(step_loss), "correct": torch.stack(correct).float(),
                           "count": torch.stack(count).float()}, alphas)

    def step_inputs(self, i: int, input_ids: torch.Tensor, hidden: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """TTT step i's inputs at row t: the embedding of x_{t+1+i} [B, T, H] beside `hidden` [B, T, H] (step 0: the
        fused target feature f_t; later steps: the previous step's output, as a chain drafts)."""
        return self.embed_tokens(shift(input_ids, 1 + i)).to(hidden.dtype), hidden

    # ---- inference: one pass of the decoder layer with a KV cache ------------------------------
    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """[.., 3*Ht] target features -> [.., H] draft hidden input. Under autocast the features go in as
        they are (bf16 captures are not widened to fp32 only for autocast to narrow them again)."""
        x = aux_hidden if torch.is_autocast_enabled(aux_hidden.device.type) else aux_hidden.to(self.fc.weight.dtype)
        if self.fc_norm is not None:
            x = torch.cat([norm(part) for norm, part in zip(self.fc_norm, x.chunk(len(self.fc_norm), -1))], -1)
        return self.fc(x)  # [.., H]

    def step_output(self, h: torch.Tensor) -> torch.Tensor:
        """The layer output -> the hidden state the next draft step reads (EAGLE 3.1 `norm_output`: normed)."""
        return self.norm(h) if self.config.norm_output else h

    def head_input(self, h: torch.Tensor) -> torch.Tensor:
        """A step's hidden state -> what lm_head reads: norm(h), applied once (already so with `norm_output`)."""
        return h if self.config.norm_output else self.norm(h)

    def decode(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
               kv: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
               attn_mask: torch.Tensor | None = None,
               logits_at: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run the draft layer on T new positions.

        Args:
            input_ids: [B, T] tokens x_{t+1} paired with `hidden` (fused target feature or the draft's
                previous output hidden state) at the same position.
            hidden: [B, T, H]; positions: [B, T] rope positions.
            kv: (cache [B, 2*kvh, S, D], slots [B, T]): the new keys / values are written at their slots and the
                queries attend over the cache under attn_mask [B, 1, T, S]; or a cache an earlier call returned
                (the new entries are appended), or None (the new entries alone); see `layers.kv_cache`.
            logits_at: [B] the one new position per request whose logits are wanted; None = all.
        Returns (draft-vocab logits [B, T or 1, N], output hidden [B, T, H], the cache).
        """
        layer = self.midlayer
        attn = layer.self_attn
        c = self.config
        B, T = input_ids.shape
        x, residual = layer.pre(self.embed_tokens(input_ids).to(hidden.dtype), hidden)  # [B, T, 2H], [B, T, H]
        step = None if torch.is_grad_enabled() or not isinstance(kv, tuple) else one_call_layer(
            self, c.num_attention_heads, c.num_key_value_heads, c.head_dim, layer.post_attention_layernorm,
            attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, layer.mlp)
        if step is not None and isinstance(kv, tuple) and attn_mask is not None and x.dtype == kv[0].dtype == \
                layer.post_attention_layernorm.weight.dtype:
            # a packed CPU draft step: the layer in one call, the bits of the op-by-op path below
            cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta)  # [B, 1, T, D] fp32
            cache, slots = kv
            out = step.forward_input(x, residual, cos, sin, cache, slots, attn_mask.expand(B, 1, T, cache.shape[2]))
        else:
            q, k, v = attn.qkv(x, positions)  # [B, h, T, D], [B, kvh, T, D] x2
            cache, attn_mask = kv_cache(kv, k, v, attn_mask)
            kvh = c.num_key_value_heads
            o = cached_attention(q, cache[:, :kvh], cache[:, kvh:], attn_mask)  # [B, h, T, D]
            out = layer.post(o.transpose(1, 2).reshape(B, T, -1), residual)  # [B, T, H]
        out = self.step_output(out)  # [B, T, H]
        return self.lm_head(self.head_input(take_rows(out, logits_at))), out, cache


# ---- the family record: what the trainer, runtime and exporters ask of EAGLE3 -----------------------
def build(tcfg: Any, options: Eagle3Options, layer_ids: list[int] | None, draft_vocab_size: int | None
          ) -> Eagle3Config:
    return Eagle3Config.from_target(tcfg, draft_vocab_size or options.draft_vocab_size, layer_ids,
                                    intermediate_size=options.intermediate_size, **shared(options, Eagle3Training))


def init(drafter: Eagle3Drafter, target: Any, options: Eagle3Options) -> str:
    """The target's embedding and, with `init_head_from_target`, its head rows and final norm (d2t is set)."""
    from drafthead.target import final_norm_weight, input_embedding_weight, lm_head_weight

    head = options.init_head_from_target
    drafter.init_from_target(input_embedding_weight(target.model),
                             lm_head_weight(target.model) if head else None,
                             final_norm_weight(target.model) if head else None)
    return "head from target" if head else "random"


def describe(options: Eagle3Options, config: Eagle3Config) -> str:
    norms = [name for name in ("fc_norm", "norm_output") if getattr(config, name)]
    return (f"aux layers {config.aux_layer_ids}, TTT {config.num_draft_tokens} steps"
            + (f", EAGLE 3.1 {' + '.join(norms)}" if norms else ""))


FAMILY = Family(
    name="eagle3", options=Eagle3Options, config=Eagle3Config, model=Eagle3Drafter, build=build, init=init,
    losses=LOSSES, reduced_vocab=True, describe=describe,
    exporters={"sglang": "drafthead.export.eagle3:to_sglang", "speculators": "drafthead.export.eagle3:to_speculators",
               "gguf": "drafthead.export.eagle3:to_gguf"},
    readers={"sglang": "drafthead.export.eagle3:read_back", "speculators": "drafthead.export.eagle3:read_back",
             "gguf": "drafthead.export.eagle3_gguf:read_back"},
    renamed_keys={"ttt_steps": "num_draft_tokens"},
    vllm={"sglang": "eagle3", "speculators": "eagle3"},
)

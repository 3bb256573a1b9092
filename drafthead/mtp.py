"""DeepSeek-style MTP (multi-token prediction) draft head trained on a frozen target.

Math only (no DDP/DeepSpeed/checkpointing). Module k (DeepSeek-V3 report, section 2.2):

    x = eh_proj([enorm(embed(x_{t+1+k})); hnorm(h^{k-1}_t)])       # 2H -> H, no bias
    out = decoder_block(x)                                          # one pre-norm attention + SwiGLU layer
    logits = shared_head.head(shared_head.norm(out))                # full target vocabulary

h^{-1}_t is the target's last hidden state at t (the output of its final norm, as captured by
`drafthead.target.capture`); depth k is trained towards the target distribution at t+1+k, which
predicts x_{t+2+k}. The hidden passed on to depth k+1 is `shared_head.norm(out)` (as Qwen3-Next/3.5 and
transformers' `MtpLayer` do; `chain_normed=False` passes `out` as DeepSeek's vLLM code does).

Weight names follow the DeepSeek/GLM checkpoint layout under `layers.{k}.*` (`enorm`, `hnorm`,
`eh_proj`, `input_layernorm`, `self_attn.{q,k,v,o}_proj`, `post_attention_layernorm`,
`mlp.{gate,up,down}_proj`, `shared_head.{norm,head}`), so exporting to the target's
`model.layers.{N+k}.*` is a prefix rename. The token embedding is a frozen copy of the target's and is
not saved (like EAGLE3). The shared head starts as a copy of the target's final norm and lm_head and
stays frozen unless `train_head`.

`recursive=True` stores one module and applies it K times (FastMTP; what vLLM does for N > 1 steps);
`recursive=False` stores K modules, module k for depth k (DeepSeek-V3).

Attention while training (`attention`):
- "causal" (DeepSeek/FastMTP): depth k attends causally over depth k's own entries.
- "chain": depth k attends to the module's entries built from depth-0 inputs (x_{t'+1}, h_t'), t' <= t,
  plus its own entries of depths 1..k at the same t: exactly what the KV-cached runtime chain sees
  (the EAGLE3 training-time-test pattern), so training accuracy predicts chained acceptance.
Rope position of depth k at t is t + k in both, as in the runtime chain.

Flags for targets whose blocks are not plain Llama (so weights copy exactly): `attention_bias` (q/k/v,
Qwen2/GLM), `qk_norm` (Qwen3/3.5), `attn_output_gate` (Qwen3.5/Qwen3-Next: q_proj also yields a
sigmoid gate per head), `norm_unit_offset` (RMSNorm scales by 1 + w, zero-centred weights: Qwen3.5),
`partial_rotary_factor` (rope on the first fraction of each head: Qwen3.5 0.25, GLM 0.5).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from drafthead.family import Family, OwnLayers
from drafthead.layers import (RMSNorm, SwiGLU, apply_rope, cached_attention, decoder_layer_shape, given, kv_cache,
                              rope_cos_sin, shift, take_rows, ttt_attention)
from drafthead.losses import LOSSES, Objective, draft_loss, with_alpha
from drafthead.mtp_native import QWEN_NEXT_TYPES, native_mtp_layers, read_native, to_ours
from drafthead.options import shared
from drafthead.runtime.contract import DraftMode, DraftState
from drafthead.runtime.draft import CHAIN, TREE, DraftRunner, ModuleChainRunner

FASTMTP_STEP_WEIGHTS = [0.51, 0.31, 0.18]  # TencentBAC/FastMTP mtp_loss_step_weights for K = 3
ATTENTION_MODES = ("causal", "chain")


def decay_weights(k: int, beta: float = 0.8) -> list[float]:
    """beta^i normalised to sum 1 (speculators/SpecForge use beta 0.6, EAGLE3 TTT 0.8 unnormalised)."""
    w = [beta ** i for i in range(k)]
    return [x / sum(w) for x in w]


@dataclass
class MtpTraining:
    """The recipe's choices an MTP draft keeps in its config: the options and the config both extend this, so each
    is declared, defaulted and checked once."""

    num_draft_tokens: int = 1  # depths K trained (predicting x_{t+2} .. x_{t+1+K})
    recursive: bool = True  # one module applied K times (FastMTP, vLLM) vs K modules (DeepSeek-V3)
    step_weights: list[float] | None = None  # loss weight per depth; null = 0.8^k normalised
    train_head: bool = False  # also train the shared norm + lm_head copy (else frozen = the target's)
    attention: str = "causal"  # causal within each depth (DeepSeek) | chain (what the runtime chain sees)

    def check(self) -> None:
        if self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens: {self.num_draft_tokens} (must be >= 1)")
        if self.step_weights is not None:
            if len(self.step_weights) != self.num_draft_tokens:
                raise ValueError(f"step_weights: {len(self.step_weights)} weights for num_draft_tokens="
                                 f"{self.num_draft_tokens} depths (one per depth)")
            if any(w < 0 for w in self.step_weights) or sum(self.step_weights) <= 0:
                raise ValueError(f"step_weights: {self.step_weights} (each >= 0, with a positive sum)")
        if self.attention not in ATTENTION_MODES:
            raise ValueError(f"attention: {self.attention!r} (choose from {', '.join(ATTENTION_MODES)})")


@dataclass
class MtpOptions(MtpTraining):
    """The recipe section `drafter.mtp.*`."""

    intermediate_size: int | None = None  # null = the target's
    init: str = "auto"  # auto (native MTP weights if present, else target) | native | target | random

    def validate(self) -> None:
        self.check()
        if self.init not in INITS:
            raise ValueError(f"init: {self.init!r} (choose from {', '.join(INITS)})")


INITS = ("auto", "native", "target", "random")


@dataclass(kw_only=True)
class MtpConfig(MtpTraining):
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # target vocabulary (MTP predicts over all of it)
    target_num_layers: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    partial_rotary_factor: float = 1.0
    attention_bias: bool = False
    qk_norm: bool = False
    attn_output_gate: bool = False
    norm_unit_offset: bool = False
    chain_normed: bool = True  # next depth reads shared_head.norm(out) (True) or out (False)
    native_layers: int = 0  # MTP layers the target checkpoint declares (for export), 0 = none

    def __post_init__(self) -> None:
        try:
            self.check()
        except ValueError as e:
            raise ValueError(f"MTP {e}") from None
        weights = decay_weights(self.num_draft_tokens) if self.step_weights is None else self.step_weights
        self.step_weights = [float(w) for w in weights]

    @property
    def draft_vocab_size(self) -> int:
        """MTP has no reduced vocabulary (the runtime reads this name)."""
        return self.vocab_size

    @property
    def stored_modules(self) -> int:
        return 1 if self.recursive else self.num_draft_tokens

    @classmethod
    def from_target(cls, hf_config: Any, **overrides: Any) -> "MtpConfig":
        """Size the MTP block like one decoder layer of the target; None overrides are ignored."""
        t = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        act = getattr(t, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"MTP block uses a SwiGLU MLP; the target's hidden_act is {act!r}")
        rope = getattr(t, "rope_parameters", None) or {}
        partial = rope.get("partial_rotary_factor", getattr(t, "partial_rotary_factor", 1.0)) or 1.0
        mt = getattr(t, "model_type", "")
        qwen_next = mt in QWEN_NEXT_TYPES
        kw = dict(
            decoder_layer_shape(t),
            partial_rotary_factor=float(partial),
            attention_bias=bool(getattr(t, "attention_bias", False)) or mt == "qwen2",
            qk_norm=mt.startswith("qwen3") or bool(getattr(t, "use_qk_norm", False)),
            attn_output_gate=qwen_next,
            norm_unit_offset=qwen_next,
            native_layers=native_mtp_layers(t),
        )
        kw.update(given(overrides))
        return cls(**kw)

    def to_dict(self) -> dict:
        return asdict(self)


class MtpRMSNorm(RMSNorm):
    """RMSNorm scaling by (1 + w) with zero-initialised w (Qwen3.5 / Qwen3-Next), statistics and scale in fp32."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__(dim, eps)
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


def _norm(c: MtpConfig, dim: int | None = None) -> RMSNorm:
    return (MtpRMSNorm if c.norm_unit_offset else RMSNorm)(dim or c.hidden_size, c.rms_norm_eps)


class MtpAttention(nn.Module):
    def __init__(self, c: MtpConfig) -> None:
        super().__init__()
        self.c = c
        q_out = c.num_attention_heads * c.head_dim * (2 if c.attn_output_gate else 1)
        self.q_proj = nn.Linear(c.hidden_size, q_out, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        if c.qk_norm:
            self.q_norm = _norm(c, c.head_dim)
            self.k_norm = _norm(c, c.head_dim)
        self.rotary_dim = int(c.head_dim * c.partial_rotary_factor)

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate-half rope on the first rotary_dim channels of x [B, h, T, D]."""
        r = self.rotary_dim
        cos, sin = rope_cos_sin(positions, r, self.c.rope_theta)  # [B, 1, T, r]
        if r == x.shape[-1]:
            return apply_rope(x, cos, sin)
        return torch.cat([apply_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)

    def q(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Queries [B, h, T, D] and the output gate [B, T, h*D] (None without attn_output_gate)."""
        B, T, _ = x.shape
        c = self.c
        q = self.q_proj(x)
        gate = None
        if c.attn_output_gate:  # per head [q_h | gate_h] (Qwen3.5 layout)
            q, gate = q.view(B, T, c.num_attention_heads, 2 * c.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(B, T, -1)
        q = q.reshape(B, T, c.num_attention_heads, c.head_dim)  # [B, T, h, D]
        if c.qk_norm:
            q = self.q_norm(q)
        return self.rope(q.transpose(1, 2), positions), gate

    def kv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, kvh, T, D] (un-expanded)."""
        B, T, _ = x.shape
        c = self.c
        k = self.k_proj(x).view(B, T, c.num_key_value_heads, c.head_dim)
        if c.qk_norm:
            k = self.k_norm(k)
        v = self.v_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        return self.rope(k.transpose(1, 2), positions), v

    def out(self, o: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """o [B, h, T, D] -> [B, T, H]."""
        B, _, T, _ = o.shape
        o = o.transpose(1, 2).reshape(B, T, -1)  # [B, T, h*D]
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return self.o_proj(o)

    def expand_kv(self, t: torch.Tensor) -> torch.Tensor:
        rep = self.c.num_attention_heads // self.c.num_key_value_heads
        return t.repeat_interleave(rep, dim=1) if rep > 1 else t


class SharedHead(nn.Module):
    def __init__(self, c: MtpConfig) -> None:
        super().__init__()
        self.norm = _norm(c)
        self.head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)


class MtpModule(nn.Module):
    """One MTP depth: input projection + one pre-norm decoder layer + the shared head."""

    def __init__(self, c: MtpConfig) -> None:
        super().__init__()
        self.enorm = _norm(c)
        self.hnorm = _norm(c)
        self.eh_proj = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False)
        self.input_layernorm = _norm(c)
        self.self_attn = MtpAttention(c)
        self.post_attention_layernorm = _norm(c)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)
        self.shared_head = SharedHead(c)

    def mix(self, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """[B, T, H] token embeddings and previous hidden states -> block input [B, T, H]."""
        return self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(hidden.to(emb.dtype))], dim=-1))

    def finish(self, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Residual + MLP after attention: block input x [B, T, H], attention output [B, T, H]."""
        h = x + attn_out
        return h + self.mlp(self.post_attention_layernorm(h))


class MtpDrafter(OwnLayers, nn.Module):
    family = "mtp"
    features = "last"  # a prefix entry reads the target's last hidden state, not aux features
    # reads_target_head stays False: its shared head is saved with it (the export writes it back as the target's)

    def __init__(self, c: MtpConfig) -> None:
        super().__init__()
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)  # copied from target, frozen, not saved
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(MtpModule(c) for _ in range(c.stored_modules))
        if not c.train_head:
            for m in self.layers:
                m.shared_head.requires_grad_(False)

    # ---- what the trainer / runtime need to know -----------------------------------------------
    def capture_layer_ids(self) -> list[int]:
        return []

    def draft_to_target(self, idx: torch.Tensor) -> torch.Tensor:
        return idx  # full vocabulary

    @property
    def chain_modules(self) -> int:
        """Distinct modules a draft chain cycles through (each keeps its own KV cache in the runtime)."""
        return len(self.layers)

    @property
    def draft_modes(self) -> dict[str, DraftMode]:
        """Trees need one module: with several, each tree level would need its module's own prefix cache."""
        return {"chain": CHAIN, "tree": TREE} if self.chain_modules == 1 else {"chain": CHAIN}

    def check_target(self, tcfg: Any) -> list[str]:
        """Mismatches with a target's HF config, as messages (none: the draft fits)."""
        c, problems = self.config, []
        if c.hidden_size != tcfg.hidden_size:
            problems.append(f"hidden size: MTP draft has hidden_size={c.hidden_size}, target has {tcfg.hidden_size}")
        if c.vocab_size != tcfg.vocab_size:
            problems.append(f"vocab: draft expects vocab_size={c.vocab_size}, target has {tcfg.vocab_size}")
        return problems

    def draft_state(self, batch: int, capacity: int, device: torch.device) -> DraftState:
        return (ModuleChainRunner if self.chain_modules > 1 else DraftRunner)(self, batch, capacity, device)

    def module_for(self, depth: int) -> int:
        return depth % len(self.layers)

    def fuse(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """The target's last hidden state is the depth-0 input as it is."""
        return last_hidden.to(self.layers[0].eh_proj.weight.dtype)

    # ---- training ------------------------------------------------------------------------------
    def depth_hidden(self, input_ids: torch.Tensor, last_hidden: torch.Tensor) -> list[torch.Tensor]:
        """Per depth k the output hidden states [B, T, H] before the shared norm; row t predicts x_{t+2+k}.

        input_ids [B, T] (right-padded), last_hidden [B, T, H] target last hidden states (post final norm).
        """
        c = self.config
        B, T = input_ids.shape
        dev = input_ids.device
        hidden = self.fuse(last_hidden)  # [B, T, H]
        causal = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
        base = torch.arange(T, device=dev).expand(B, T)  # [B, T]
        ctx: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # chain: module -> depth-0 keys/values
        diag: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # chain: module -> later-depth k/v
        outs = []
        for k in range(c.num_draft_tokens):
            m = self.layers[self.module_for(k)]
            attn = m.self_attn
            emb = self.embed_tokens(shift(input_ids, 1 + k)).to(hidden.dtype)  # [B, T, H] x_{t+1+k}
            x = m.mix(emb, hidden)  # [B, T, H]
            xn = m.input_layernorm(x)
            q, gate = attn.q(xn, base + k)  # [B, h, T, D]
            kk, vv = attn.kv(xn, base + k)  # [B, kvh, T, D]
            if c.attention == "causal":
                o = F.scaled_dot_product_attention(q, attn.expand_kv(kk), attn.expand_kv(vv), is_causal=True)
            else:
                mi = self.module_for(k)
                if mi not in ctx:  # this module on depth-0 inputs (x_{t+1}, h_t) at rope t
                    if k == 0:
                        ctx[mi] = (kk, vv)
                    else:
                        e0 = self.embed_tokens(shift(input_ids, 1)).to(hidden.dtype)
                        ctx[mi] = attn.kv(m.input_layernorm(m.mix(e0, self.fuse(last_hidden))), base)
                    diag[mi] = []
                if k > 0:
                    diag[mi].append((kk, vv))
                k0, v0 = (attn.expand_kv(t) for t in ctx[mi])
                dk = [attn.expand_kv(a) for a, _ in diag[mi]]
                dv = [attn.expand_kv(b) for _, b in diag[mi]]
                o = ttt_attention(q, k0, v0, dk, dv, causal)  # [B, h, T, D]
            out = m.finish(x, attn.out(o, gate))  # [B, T, H]
            outs.append(out)
            hidden = m.shared_head.norm(out) if c.chain_normed else out
        return outs

    def forward(self, input_ids: torch.Tensor, last_hidden: torch.Tensor, teacher_probs: torch.Tensor,
                target_argmax: torch.Tensor, loss_mask: torch.Tensor, aux_hidden: torch.Tensor | None = None,
                objective: Objective | None = None) -> dict[str, Any]:
        """Weighted loss against the target over K depths (`objective`: `train.loss`, None = kl).

        Args:
            input_ids: [B, T] target token ids (right-padded).
            last_hidden: [B, T, H] the target's last hidden states (output of its final norm).
            teacher_probs: [B, T, V] fp32 target distribution over the FULL vocab at position j
                (predicting x_{j+1}); only rows j with loss_mask[j+1] are read.
            target_argmax: [B, T] target argmax at position j (-1 where unknown).
            loss_mask: [B, T] 1 on assistant tokens.
            aux_hidden: not read (MTP captures no aux layers).
        Returns dict with `loss` (scalar) and per depth `step_loss`, `correct`, `count` ([K] each); out of
        training also `alpha` [K], the expected acceptance sum min(p, q) summed per depth.
        """
        c = self.config
        if teacher_probs.shape[-1] != c.vocab_size:
            raise ValueError(f"MTP teacher probabilities must cover the full target vocab ({c.vocab_size}), got "
                             f"{teacher_probs.shape[-1]}: build TargetHead without draft ids")
        total = last_hidden.new_zeros((), dtype=torch.float32)
        step_loss, correct, count, alphas = [], [], [], []
        weights = c.step_weights
        assert weights is not None, "MtpConfig.__post_init__ sets the step weights"
        for k, out in enumerate(self.depth_hidden(input_ids, last_hidden)):
            m = self.layers[self.module_for(k)]
            mask_k = shift(loss_mask, 2 + k).bool()  # [B, T]  x_{t+2+k} is an assistant token
            b_idx, t_idx = mask_k.nonzero(as_tuple=True)  # M rows with a target to match
            logits = m.shared_head.head(m.shared_head.norm(out[b_idx, t_idx]))  # [M, V] (loss in fp32)
            teach = teacher_probs[b_idx, t_idx + 1 + k]  # [M, V]
            tgt = target_argmax[b_idx, t_idx + 1 + k]  # [M]
            ce, alpha = draft_loss(logits, teach, objective, not self.training)  # [M] each (alpha: eval only)
            n = max(int(b_idx.numel()), 1)
            lk = (ce * (tgt >= 0)).sum() / n
            total = total + weights[k] * lk
            step_loss.append(lk.detach())
            correct.append((logits.detach().max(-1).indices == tgt).sum())
            count.append(torch.tensor(b_idx.numel(), device=input_ids.device))
            if alpha is not None:
                alphas.append(alpha.sum())
        return with_alpha({"loss": total, "step_loss": torch.stack(step_loss), "correct": torch.stack(correct).float(),
                           "count": torch.stack(count).float()}, alphas)

    # ---- inference: one module with a KV cache -------------------------------------------------
    def decode(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
               kv: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
               attn_mask: torch.Tensor | None = None,
               logits_at: torch.Tensor | None = None, module: int = 0
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run module `module` on T new positions (the `Eagle3Drafter.decode` contract).

        Args:
            input_ids: [B, T] tokens x_{t+1} paired with `hidden` (the target's last hidden h_t, or the
                previous depth's output) at the same position.
            hidden: [B, T, H]; positions: [B, T] rope positions.
            kv: this module's (cache [B, 2*kvh, S, D], slots [B, T]), a cache an earlier call returned, or None
                (see `layers.kv_cache`); attn_mask [B, 1, T, S] over the cache.
            logits_at: [B] the one new position per request whose logits are wanted; None = all.
        Returns (full-vocab logits [B, T or 1, V], hidden for the next depth [B, T, H], the cache).
        """
        m = self.layers[module % len(self.layers)]
        attn = m.self_attn
        x = m.mix(self.embed_tokens(input_ids).to(m.eh_proj.weight.dtype), hidden)  # [B, T, H]
        xn = m.input_layernorm(x)
        q, gate = attn.q(xn, positions)
        k, v = attn.kv(xn, positions)  # [B, kvh, T, D] each
        cache, attn_mask = kv_cache(kv, k, v, attn_mask)
        kvh = k.shape[1]
        o = cached_attention(q, cache[:, :kvh], cache[:, kvh:], attn_mask)  # [B, h, T, D]
        out = m.finish(x, attn.out(o, gate))  # [B, T, H]
        normed = m.shared_head.norm(out)
        return m.shared_head.head(take_rows(normed, logits_at)), (normed if self.config.chain_normed else out), cache


# ---------------------------------------------------------------------------------------------------
# initialisation
def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"MTP init: {name} has shape {tuple(src.shape)} in the source, the drafter expects "
                         f"{tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src.to(dst.dtype))


def _last_attention_layer(layers: nn.ModuleList) -> nn.Module:
    """The last decoder layer with softmax attention (hybrid targets end on one, e.g. Qwen3.5)."""
    for layer in reversed(layers):
        if hasattr(layer, "self_attn"):
            return layer
    raise ValueError("MTP init: the target has no decoder layer with self_attn to copy")


@torch.no_grad()
def init_from_target(drafter: MtpDrafter, target_model: nn.Module, block: bool = True) -> None:
    """Embedding, shared head (final norm + lm_head) and, with `block`, every module's decoder layer
    from the target (its last attention layer). enorm/hnorm/eh_proj keep their fresh init."""
    from drafthead.split import whole_state
    from drafthead.target import decoder_layers, final_norm_weight, input_embedding_weight, lm_head_weight

    _copy(drafter.embed_tokens.weight, input_embedding_weight(target_model), "embed_tokens.weight")
    src = whole_state(_last_attention_layer(decoder_layers(target_model))) if block else {}
    if block and any(".experts." in k or k.startswith("mlp.experts") for k in src):
        raise ValueError("MTP init from the target: its last layer has a MoE MLP; the MTP block is dense "
                         "(use drafter.init=native or random)")
    for i, m in enumerate(drafter.layers):
        _copy(m.shared_head.norm.weight, final_norm_weight(target_model), "norm.weight")
        _copy(m.shared_head.head.weight, lm_head_weight(target_model), "lm_head.weight")
        if not block:
            continue
        own = {k: v for k, v in m.state_dict().items()
               if not k.startswith(("enorm.", "hnorm.", "eh_proj.", "shared_head."))}
        missing = sorted(set(own) - set(src))
        if missing:
            raise ValueError(f"MTP init from the target: its last layer lacks {missing} (the block flags do "
                             f"not match the target architecture)")
        for k, t in own.items():
            _copy(t, src[k], f"layers.{i}.{k}")


@torch.no_grad()
def init_from_native(drafter: MtpDrafter, state_dict: dict[str, torch.Tensor], config: Any) -> int:
    """Load native MTP weights (DeepSeek/GLM `model.layers.{N+i}.*`, Qwen3.5 `mtp.*`) into the drafter.

    `config` is the target's HF config. Module j takes native layer j % n (vLLM's cycling for more
    steps than layers). The shared head falls back to what is already there (call `init_from_target`
    first) when the checkpoint shares the target's lm_head. Returns n, the native layers found.
    """
    ours = to_ours(state_dict, config)
    n = 1 + max(int(k.split(".")[1]) for k in ours) if ours else 0
    if n == 0:
        raise ValueError("MTP init from native weights: the state dict has no MTP layer tensors")
    for j, m in enumerate(drafter.layers):
        want = m.state_dict()
        got = {k.split(".", 2)[2]: v for k, v in ours.items() if int(k.split(".")[1]) == j % n}
        extra = sorted(set(got) - set(want))
        if extra:
            raise ValueError(f"MTP init from native weights: layer {j % n} has tensors the dense MTP block "
                             f"cannot hold (MoE / MLA blocks are not supported): {extra[:6]}"
                             f"{' ...' if len(extra) > 6 else ''}")
        missing = sorted(k for k in set(want) - set(got) if not k.startswith("shared_head.head"))
        if missing:
            raise ValueError(f"MTP init from native weights: layer {j % n} lacks {missing} (do the block "
                             f"flags match the target architecture?)")
        for k, t in got.items():
            _copy(want[k], t, f"native layer {j % n}: {k}")
    return n


# ---------------------------------------------------------------------------------------------------
# the family record: what the trainer, runtime and exporters ask of MTP
def build(tcfg: Any, options: MtpOptions, layer_ids: list[int] | None, draft_vocab_size: int | None) -> MtpConfig:
    """Sized like one decoder layer of the target; MTP reads no aux layers and predicts the full vocab."""
    return MtpConfig.from_target(tcfg, intermediate_size=options.intermediate_size, **shared(options, MtpTraining))


def init(drafter: MtpDrafter, target: Any, options: MtpOptions) -> str:
    """The embedding and the shared head always; the block from `init`: "native" (the checkpoint's own
    MTP layers), "target" (its last decoder layer), "random", or "auto" (native when present, else target)."""
    from drafthead.target import resolve_target

    native = None
    if options.init in ("auto", "native"):
        path, gguf = resolve_target(target.name_or_path, target.gguf_file)
        native = None if gguf else read_native(path, target.config)
        if native is None and options.init == "native":
            raise ValueError(f"drafter.mtp.init=native: target {target.name_or_path!r} has no native MTP weights "
                             f"(needs a safetensors checkpoint declaring num_nextn_predict_layers / "
                             f"mtp_num_hidden_layers with those tensors)")
    init_from_target(drafter, target.model, block=options.init in ("auto", "target") and native is None)
    if native is not None:
        n = init_from_native(drafter, native, target.config)
        return f"native ({n} MTP layer{'s' if n > 1 else ''} from the checkpoint)"
    return "target (last decoder layer)" if options.init in ("auto", "target") else "random"


def describe(options: MtpOptions, config: MtpConfig) -> str:
    K = config.num_draft_tokens
    return f"{K} depths ({'one module applied K times' if config.recursive else f'{K} modules'})"


FAMILY = Family(
    name="mtp", options=MtpOptions, config=MtpConfig, model=MtpDrafter, build=build, init=init,
    losses=LOSSES, reduced_vocab=False, describe=describe,
    exporters={"hf": "drafthead.export.mtp:export_hf", "gguf": "drafthead.export.mtp:export_gguf"},
    readers={"hf": "drafthead.export.mtp:read_back"},
    vllm={"hf": "mtp"}, vllm_export={"layout": "served"}, vllm_in_target=True,
    renamed_keys={"num_modules": "num_draft_tokens"},
)

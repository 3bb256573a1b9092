"""LoRA self-drafter: the target drafts for itself through an early exit.

Draft = the target's own first E decoder layers (frozen and untouched, so their KV cache is the target's)
-> an exit block (a copy of the target's layers E..E+n-1 carrying peft LoRA adapters) -> the target's final
norm and lm_head. Training reads the hidden state at the input of layer E (the capture's aux feature) and
distils the target's next-token distribution over the full vocabulary. Only the adapters are trained and
saved; every other tensor is the target's, taken back from it on load (`target_tensors`, `attach_target`).

Why an early exit: the draft's cost is E+n layers plus the head, so the exit depth is what makes it pay
(Kangaroo exits after layer 2 of 32; a full-depth LoRA draft gives no speedup, PEFT-BD).

Runtime (`SelfDraftRunner`): a draft step runs the target's layers < E on the target's own KV cache,
writing past the verified length (the verify forward rewrites those slots with the same tokens), then the
exit block on its own small cache, which holds the verified prefix (extended from the verify's layer-E
features) and this round's speculative entries past it.
"""
from __future__ import annotations

import copy
import importlib
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from drafthead.family import Family
from drafthead.layers import apply_rope, shift, ttt_attention
from drafthead.losses import LOSSES, Objective, draft_loss, with_alpha
from drafthead.options import shared
from drafthead.runtime.contract import ChainDraft, ChainState, SessionView, TargetLayers, inference
from drafthead.runtime.draft import CHAIN

ARCHS = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}  # model_type -> transformers class prefix
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoraOptions:
    """`drafter.lora.*`: where the draft exits and what the adapters cover. Every option is kept in the draft's
    config (`LoraDraftConfig` extends this class, so each is declared once)."""
    exit_layer: int = 4  # E: the draft runs the target's layers 0..E-1, then the exit block
    num_exit_layers: int = 1  # n: the exit block copies the target's layers E..E+n-1
    rank: int = 16  # r of each adapter
    alpha: float = 32.0  # adapter scale alpha / r (peft's lora_alpha)
    dropout: float = 0.0  # dropout on the adapters' input while training
    target_modules: list[str] = field(default_factory=lambda: list(MODULES))  # projections with adapters
    lora_head: bool = False  # an adapter on the (otherwise frozen) lm_head too
    num_draft_tokens: int = 1  # draft depths trained: > 1 is the multi-step mode (steps 2.. on the draft's tokens)
    step_decay: float = 1.0  # loss weight of depth i: step_decay ** i

    def validate(self) -> None:
        if self.exit_layer < 0:
            raise ValueError(f"exit_layer: {self.exit_layer} (must be >= 0)")
        if self.num_exit_layers < 1:
            raise ValueError(f"num_exit_layers: {self.num_exit_layers} (must be >= 1)")
        if self.rank < 1:
            raise ValueError(f"rank: {self.rank} (must be >= 1)")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout: {self.dropout} (must be in [0, 1))")
        if self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens: {self.num_draft_tokens} (must be >= 1)")
        if not 0 < self.step_decay <= 1:
            raise ValueError(f"step_decay: {self.step_decay} (must be in (0, 1])")
        bad = sorted(set(self.target_modules) - set(MODULES))
        if bad or not self.target_modules:
            raise ValueError(f"target_modules: {bad or 'empty'} (choose from {', '.join(MODULES)})")


@dataclass(kw_only=True)
class LoraDraftConfig(LoraOptions):
    target_config: dict  # the target's HF config: the exit block is its architecture, layer for layer

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def model_type(self) -> str:
        return self.target_config["model_type"]

    @property
    def vocab_size(self) -> int:
        return self.target_config["vocab_size"]

    @property
    def hidden_size(self) -> int:
        return self.target_config["hidden_size"]

    @property
    def draft_vocab_size(self) -> int:  # the full vocabulary (the runtime's name for what the draft predicts)
        return self.vocab_size

    def hf_config(self) -> Any:
        from transformers import AutoConfig

        return AutoConfig.for_model(**self.target_config)


def arch_class(model_type: str, suffix: str) -> type:
    """transformers' `<Arch><suffix>` class (DecoderLayer, RMSNorm, RotaryEmbedding) of a target."""
    if model_type not in ARCHS:
        raise ValueError(f"the LoRA self-drafter supports {', '.join(ARCHS)} targets, not {model_type!r}")
    mod = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    return getattr(mod, ARCHS[model_type] + suffix)


def layer_forward(layer: nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  kv: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One pre-norm decoder layer of the target's architecture over h [B, T, H] (the module's own projections:
    peft-wrapped ones add their adapters). cos/sin [B, 1, T, D]. Returns (h, k, v), k and v [B, h, T, D] with
    the kv heads expanded (what a later depth attends to).

    kv None: causal attention over h (teacher forcing, positions 0..T-1). kv = (k0, v0, diag_k, diag_v,
    causal): a later draft depth of every row's chain at once (`ttt_attention`): row t attends to the teacher-
    forced entries 0..t and to its own row of each earlier depth, then its own entry."""
    B, T, _ = h.shape
    attn = layer.self_attn
    D = attn.head_dim
    x = layer.input_layernorm(h)
    q = attn.q_proj(x).view(B, T, -1, D)  # [B, T, h, D]
    k = attn.k_proj(x).view(B, T, -1, D)  # [B, T, kvh, D]
    v = attn.v_proj(x).view(B, T, -1, D).transpose(1, 2)  # [B, kvh, T, D]
    if hasattr(attn, "q_norm"):  # Qwen3
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin)
    if kv is None:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scaling, enable_gqa=True)  # [B, h, T, D]
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)  # [B, h, T, D]
    if kv is not None:
        k0, v0, diag_k, diag_v, causal = kv
        o = ttt_attention(q, k0, v0, diag_k + [k], diag_v + [v], causal, attn.scaling)  # [B, h, T, D]
    h = h + attn.o_proj(o.transpose(1, 2).reshape(B, T, -1))
    return h + layer.mlp(layer.post_attention_layernorm(h)), k, v


def lora_pattern(target_modules: list[str], lora_head: bool) -> str:
    """peft's `target_modules` as a full-match regex: the chosen projections of the exit layers only."""
    mods = "|".join(target_modules)
    return rf"layers\.\d+\.(self_attn|mlp)\.({mods})" + (r"|target_lm_head" if lora_head else "")


class LoraDrafter(nn.Module):
    """Exit block (the target's layers E..E+n-1 with LoRA) + the target's final norm and lm_head."""

    family = "lora"
    features = "aux"  # the input of layer E, which the verify forward captures
    draft_modes = {"chain": CHAIN}
    reads_target_head = True
    shares_target_layers = True  # its first layers are the target's: loading calls `attach_target`

    def __init__(self, config: LoraDraftConfig) -> None:
        super().__init__()
        from peft import LoraConfig, inject_adapter_in_model

        self.config = c = config
        tc = c.hf_config()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        layer_cls = arch_class(c.model_type, "DecoderLayer")
        self.layers = nn.ModuleList([layer_cls(tc, c.exit_layer + j) for j in range(c.num_exit_layers)])
        self.norm = arch_class(c.model_type, "RMSNorm")(c.hidden_size, eps=tc.rms_norm_eps)
        self.target_lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.rotary = arch_class(c.model_type, "RotaryEmbedding")(config=tc)
        self.shallow: list[nn.Module] | None = None  # the target's layers < E, for the multi-step mode
        inject_adapter_in_model(LoraConfig(r=c.rank, lora_alpha=c.alpha, lora_dropout=c.dropout, bias="none",
                                           target_modules=lora_pattern(c.target_modules, c.lora_head)), self)
        for name, p in self.named_parameters():
            p.requires_grad_(".lora_" in name)

    # ---- what is the target's ------------------------------------------------------------------
    def target_tensors(self) -> dict[str, str]:
        """Every state tensor that is the target's (not saved, taken back on load) -> its name in the
        target's state dict. What is left is the adapters."""
        E = self.config.exit_layer
        out = {}
        for k in self.state_dict():
            if ".lora_" in k:
                continue
            plain = k.replace(".base_layer.", ".")
            if plain.startswith("layers."):
                j, rest = plain.split(".", 2)[1:]
                out[k] = f"model.layers.{E + int(j)}.{rest}"
            elif plain == "target_lm_head.weight":
                out[k] = "lm_head.weight"
            else:  # embed_tokens, norm
                out[k] = f"model.{plain}"
        return out

    @torch.no_grad()
    def attach_target(self, target_model: nn.Module, share: bool = False) -> None:
        """Fill the target's tensors in. `share`: the drafter holds the target's own (frozen) tensors, so
        training keeps one copy in memory; otherwise copies (the runtime merges adapters into its copies)."""
        from drafthead.target import base_model, decoder_layers, lm_head_weight

        layers, base = decoder_layers(target_model), base_model(target_model)
        E, n = self.config.exit_layer, self.config.num_exit_layers
        if E + n > len(layers):
            raise ValueError(f"exit block layers {E}..{E + n - 1} are past the target's {len(layers)} layers")
        src = {"embed_tokens.weight": target_model.get_input_embeddings().weight,
               "norm.weight": base.norm.weight, "target_lm_head.weight": lm_head_weight(target_model)}
        for j in range(n):
            src.update({f"layers.{j}.{k}": v for k, v in layers[E + j].state_dict(keep_vars=True).items()})
        for name in self.target_tensors():
            t = src.get(name.replace(".base_layer.", "."))
            if t is None:
                raise ValueError(f"the target has no tensor for the draft's {name} (architecture mismatch)")
            mod_name, attr = name.rsplit(".", 1)
            mod = self.get_submodule(mod_name)
            old = getattr(mod, attr)
            if tuple(old.shape) != tuple(t.shape):
                raise ValueError(f"target tensor for {name} is {tuple(t.shape)}, the draft's is {tuple(old.shape)}")
            if share:
                setattr(mod, attr, nn.Parameter(t.detach(), requires_grad=False))
            else:
                if old.is_meta or old.dtype != t.dtype:
                    setattr(mod, attr, nn.Parameter(t.detach().clone(), requires_grad=False))
                else:
                    old.copy_(t)

    # ---- training ------------------------------------------------------------------------------
    def capture_layer_ids(self) -> list[int]:
        return [self.config.exit_layer]

    def draft_to_target(self, idx: torch.Tensor) -> torch.Tensor:
        return idx  # full vocabulary

    def check_data(self, samples: list[dict]) -> list[str]:
        return []  # any token ids train

    def check_target(self, tcfg: Any) -> list[str]:
        c, out = self.config, []
        for key in ("model_type", "hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads"):
            if getattr(tcfg, key, None) != c.target_config.get(key):
                out.append(f"{key}: target {getattr(tcfg, key, None)}, draft {c.target_config.get(key)}")
        if tcfg.num_hidden_layers < c.exit_layer + c.num_exit_layers:
            out.append(f"the exit block needs {c.exit_layer + c.num_exit_layers} target layers, the target has "
                       f"{tcfg.num_hidden_layers}")
        return out

    def exit_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """Exit block + final norm over h [B, T, H] (the input of layer E), causal, positions 0..T-1."""
        B, T, _ = h.shape
        cos, sin = self._rope(h, torch.arange(T, device=h.device)[None].expand(B, T))
        for layer in self.layers:
            h = layer_forward(layer, h, cos, sin)[0]
        return self.norm(h)  # [B, T, H]

    def attach_shallow(self, target_model: nn.Module) -> None:
        """The target's layers < E, for the multi-step mode (depths > 1 run them on the draft's own tokens).
        Held in a plain list: they are the target's (frozen, shared), never the drafter's state."""
        from drafthead.target import decoder_layers

        self.shallow = list(decoder_layers(target_model)[: self.config.exit_layer])

    def forward(self, input_ids: torch.Tensor, aux_hidden: torch.Tensor, teacher_probs: torch.Tensor,
                target_argmax: torch.Tensor, loss_mask: torch.Tensor, last_hidden: torch.Tensor | None = None,
                objective: Objective | None = None) -> dict[str, Any]:
        """The loss (`objective`: `train.loss`, None = kl) against the target's next-token distribution at every
        position whose next token is an assistant token. aux_hidden [B, T, H] the input of layer E; teacher_probs
        [B, T, V] (full vocabulary, position t predicts x_{t+1}); target_argmax [B, T]; input_ids [B, T].

        Depth i > 0 (the multi-step mode, num_draft_tokens > 1): row t's chain continues from the draft's
        own argmax of depth i-1, run through the target's frozen layers < E and the exit block as the
        runtime drafts it (attending to the teacher-forced entries 0..t and its own earlier depths), and
        is scored against x_{t+1+i}. Returns `loss` and per depth `step_loss`, `correct`, `count` [K]; out of
        training also `alpha` [K], the expected acceptance sum min(p, q) summed per depth."""
        c = self.config
        K = c.num_draft_tokens
        if teacher_probs.shape[-1] != c.vocab_size:
            raise ValueError(f"LoRA teacher probabilities must cover the full target vocab ({c.vocab_size}), got "
                             f"{teacher_probs.shape[-1]}")
        if K > 1 and self.shallow is None:
            raise ValueError("num_draft_tokens > 1 needs the target's layers < exit_layer (attach_shallow)")
        masks = [shift(loss_mask, 1 + i).bool() for i in range(K)]  # [B, T] x_{t+1+i} is an assistant token
        T = input_ids.shape[1]
        total = aux_hidden.new_zeros((), dtype=torch.float32)
        step_loss, correct, count, alphas = [], [], [], []
        for i, (b_i, t_i, logits) in enumerate(self.depths(input_ids, aux_hidden, masks)):
            scored = masks[i][b_i, t_i]  # [M] (the head also ran where only the next depth needs a token)
            t_next = (t_i + i).clamp(max=T - 1)  # [M] row (b, t+i) predicts x_{t+1+i}
            tgt = target_argmax[b_i, t_next]  # [M]
            ce, alpha = draft_loss(logits, teacher_probs[b_i, t_next], objective, not self.training)  # [M] each
            n = max(int(scored.sum()), 1)
            li = (ce * (scored & (tgt >= 0))).sum() / n
            total = total + (c.step_decay ** i) * li
            step_loss.append(li.detach())
            correct.append(((logits.detach().max(-1).indices == tgt) & scored).sum().float())
            count.append(scored.sum().float())
            if alpha is not None:
                alphas.append((alpha * scored).sum())
        return with_alpha({"loss": total, "step_loss": torch.stack(step_loss), "correct": torch.stack(correct),
                           "count": torch.stack(count)}, alphas)

    def depths(self, input_ids: torch.Tensor, aux_hidden: torch.Tensor, masks: list[torch.Tensor]
               ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per draft depth i < len(masks): (b, t, logits [M, V]) at the rows masks[i] or masks[i+1] hold
        (depth i+1 continues from depth i's argmax there; elsewhere it is not scored)."""
        B, T, _ = aux_hidden.shape
        K = len(masks)
        dtype = self.norm.weight.dtype
        pos = torch.arange(T, device=aux_hidden.device)[None].expand(B, T)  # [B, T]
        h = aux_hidden.to(dtype)  # [B, T, H]
        cache: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer (shallow, then exit): depth-0 k, v
        shallow = list(self.shallow) if self.shallow is not None else []
        if K > 1 and len(shallow) != self.config.exit_layer:
            raise ValueError(f"{K} draft depths run the target's layers < {self.config.exit_layer}: attach_shallow "
                             f"(done by the family's init) gives them")
        if K > 1:  # the teacher-forced entries of the shallow layers (frozen: no graph)
            with torch.no_grad():
                cos, sin = self._rope(h, pos)
                x = self.embed_tokens(input_ids).to(dtype)  # [B, T, H]
                for layer in shallow:
                    x, k, v = layer_forward(layer, x, cos, sin)
                    cache.append((k, v))
        causal = torch.ones(T, T, dtype=torch.bool, device=h.device).tril()
        diag: list[tuple[list, list]] = [([], []) for _ in range(len(cache) + len(self.layers))]
        drafted = None
        for i in range(K):
            cos, sin = self._rope(h, pos + i)
            if i == 0:
                for layer in self.layers:
                    h, k, v = layer_forward(layer, h, cos, sin)
                    cache.append((k, v))
            else:  # x_{t+i} is the draft's own token of depth i-1
                h = self.embed_tokens(drafted).to(dtype)  # [B, T, H]
                for j, layer in enumerate(shallow + list(self.layers)):
                    with torch.set_grad_enabled(torch.is_grad_enabled() and j >= len(shallow)):
                        h, k, v = layer_forward(layer, h, cos, sin, (*cache[j], *diag[j], causal))
                    diag[j][0].append(k)
                    diag[j][1].append(v)
            rows = masks[i] | masks[i + 1] if i + 1 < K else masks[i]
            b_i, t_i = rows.nonzero(as_tuple=True)
            logits = self.target_lm_head(self.norm(h[b_i, t_i]))  # [M, V]
            yield b_i, t_i, logits
            if i + 1 < K:
                drafted = shift(input_ids, 1 + i).clone()  # rows the head skipped: unscored, any token will do
                drafted[b_i, t_i] = logits.detach().max(-1).indices

    def _rope(self, h: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.rotary(h, pos)  # [B, T, D] each
        return cos[:, None].to(h.dtype), sin[:, None].to(h.dtype)

    # ---- runtime -------------------------------------------------------------------------------
    def merged(self) -> "LoraDrafter":
        """A copy with every adapter merged into its own copy of the base weight (plain Linear layers): what
        the runtime drafts with and the standalone export writes. The target's tensors are not touched."""
        from peft.tuners.lora import LoraLayer

        if not any(isinstance(mod, LoraLayer) for mod in self.modules()):
            return self
        out = copy.copy(self)  # shallow: embed / norm / rotary stay shared (frozen, read-only)
        out._modules = dict(self._modules)
        out.layers = copy.deepcopy(self.layers)
        if self.config.lora_head:
            out.target_lm_head = copy.deepcopy(self.target_lm_head)
        for root in ([out.layers] + ([out] if self.config.lora_head else [])):
            for name, mod in list(root.named_modules()):
                if isinstance(mod, LoraLayer) and name:
                    mod.merge()
                    parent, child = name.rsplit(".", 1) if "." in name else ("", name)
                    setattr(root.get_submodule(parent) if parent else root, child, mod.get_base_layer())
        return out

    def runtime_module(self) -> "LoraDrafter":
        """What the runtime drafts with: the adapters merged (its projections then run through the target
        runtime's own kernels, see `SelfDraftRunner`)."""
        return self.merged().eval()

    def schedule(self, step: int, total_steps: int) -> None:
        """Nothing moves with training's progress."""

    def head_rows(self) -> torch.Tensor | None:
        return None  # its head is the target's, every row

    def draft_state(self, batch: int, capacity: int, device: torch.device) -> ChainState:  # mypy checks the runner
        return SelfDraftRunner(self.merged(), batch, capacity, device)


class SelfDraftRunner:
    """Drafting state of a batch. `bind` (called by the runtime) gives it the target's layers and the session, whose
    KV cache the shallow layers extend past the verified length; the exit block keeps its own cache.

    stop_prob (> 0): a request stops drafting for the round at the first token whose draft probability is below
    it (the confidence stop, llama.cpp's draft `p_min`); that token and later ones are not proposed."""

    def __init__(self, drafter: LoraDrafter, batch: int, capacity: int, device: torch.device) -> None:
        c = drafter.config
        self.drafter = drafter
        self.n = c.num_exit_layers
        self.capacity, self.batch, self.device = capacity, batch, device
        self.exit_cache = torch.zeros(0)  # [B, n*2*kvh, S, D], made at bind (the target's layout)
        self.lens = torch.zeros(batch, dtype=torch.long, device=device)  # verified prefix entries per request
        self.target: TargetLayers | None = None
        self.session: SessionView | None = None
        self.stop_prob = 0.0

    def bind(self, target: TargetLayers, session: SessionView) -> None:
        """The target's layers (block math and KV layout) and the session (its `cache`, `lens` and `roots`,
        replaced as requests leave the batch, so read at each round)."""
        self.target, self.session = target, session
        self.exit_cache = torch.zeros(self.batch, self.n * 2 * target.num_kv_heads, self.capacity, target.head_dim,
                                      dtype=target.dtype, device=self.device)
        self.stop_prob = float(session.spec.draft_stop_prob or 0.0)

    def bound(self) -> tuple[TargetLayers, SessionView]:
        if self.target is None or self.session is None:
            raise RuntimeError("the self-draft state drafts after the runtime's bind(target, session)")
        return self.target, self.session

    def select(self, rows: torch.Tensor) -> None:
        self.exit_cache, self.lens = self.exit_cache[rows], self.lens[rows]

    def _inputs(self, h: torch.Tensor, lens: torch.Tensor) -> tuple:
        """(positions, cos, sin, aligned start, mask) of T new tokens at lens.. for a cache of the session's
        capacity: the same for the target's layers < E and the exit block (both caches have that capacity)."""
        target, _ = self.bound()
        T, S = h.shape[1], self.exit_cache.shape[2]
        pos = lens[:, None] + torch.arange(T, device=h.device)  # [B, T]
        cos, sin = target.rotary(h, pos)  # [B, T, D] each
        start = int(lens[0]) if bool((lens == lens[0]).all()) else None
        return pos, cos, sin, start, target.causal_mask(lens, T, S)

    def _exit(self, h: torch.Tensor, inputs: tuple, prefill: bool) -> torch.Tensor:
        """Exit block over h [B, T, H] (`inputs` from `_inputs`), writing the exit cache; -> final-norm hidden."""
        target, _ = self.bound()
        pos, cos, sin, start, mask = inputs
        for j, layer in enumerate(self.drafter.layers):
            h = target.block(j, layer, h, cos, sin, self.exit_cache, pos, start, self.exit_cache.shape[2], mask,
                             prefill)
        return target.norm(self.drafter.norm, h)

    @inference
    def extend(self, tokens: torch.Tensor, feats: torch.Tensor, counts: torch.Tensor) -> None:
        """Verified entries: feats [B, T, H] = the input of layer E at the next T positions (counts[b]
        valid). `tokens` are not read: the feature already is the token's, after the shallow layers."""
        T = feats.shape[1]
        if int((self.lens + counts).max()) > self.exit_cache.shape[2]:
            raise ValueError(f"draft context overflow: {int((self.lens + counts).max())} > capacity "
                             f"{self.exit_cache.shape[2]}")
        # padding past counts[b] lands past the verified prefix, where the next round writes over it
        h = feats.to(self.bound()[0].dtype)
        self._exit(h, self._inputs(h, self.lens), prefill=T > 1)
        self.lens = self.lens + counts

    @inference
    def chain(self, k: int, temperature: float, top_p: float, gen: torch.Generator | None
              ) -> ChainDraft:
        """k draft steps from the session's roots: each runs the target's layers < E on the target's cache
        (past its verified length) and the exit block. Returns drafts [B, k], q [B, k, V] | None, and the
        lengths [B] each request keeps (k unless the confidence stop cut it)."""
        from drafthead.runtime.sampling import probs, sample

        m, s = self.bound()
        d = self.drafter
        E = d.config.exit_layer
        head = d.target_lm_head if d.config.lora_head else m.lm_head  # the target's own when untouched
        x, base = s.roots, s.lens  # [B] the last accepted token, the target's verified length
        B, dev = x.shape[0], x.device
        S = s.cache.shape[2]
        drafts = torch.zeros(B, k, dtype=torch.long, device=dev)
        qs: list[torch.Tensor] = []  # sampled drafts' distributions
        lengths = torch.full((B,), k, dtype=torch.long, device=dev)
        live = torch.ones(B, dtype=torch.bool, device=dev)
        for j in range(k):
            lens = base + j
            h = m.embed(x[:, None])  # [B, 1, H]
            inputs = self._inputs(h, lens)  # rope and mask once for both caches
            pos, cos, sin, start, mask = inputs
            for i in range(E):
                h = m.block(i, m.layer(i), h, cos, sin, s.cache, pos, start, S, mask)
            h = self._exit(h, inputs, prefill=False)  # [B, 1, H]
            logits = m.linear(head, h)[:, 0].float()  # [B, V]
            if temperature > 0:
                p = probs(logits, temperature, top_p)  # [B, V]
                x = sample(p, torch.rand(B, generator=gen, device=dev))
                qs.append(p)
                top = p.max(-1).values
            else:
                x = logits.argmax(-1)
                top = torch.softmax(logits, -1).max(-1).values if self.stop_prob > 0 else None
            drafts[:, j] = x
            if self.stop_prob > 0:  # as llama.cpp's draft p_min: a token below it is not proposed
                stop = live & (top < self.stop_prob)
                lengths = torch.where(stop, torch.full_like(lengths, j), lengths)
                live = live & ~stop
                if not bool(live.any()):
                    drafts = drafts[:, : max(j, 1)]
                    break
        q = torch.stack(qs, 1)[:, : drafts.shape[1]] if qs else None  # [B, k, V] when sampled
        return ChainDraft(drafts, q, lengths.clamp(max=drafts.shape[1]))


# ---------------------------------------------------------------------------------------------------
# the family record
def build(tcfg: Any, options: LoraOptions, layer_ids: list[int] | None, draft_vocab_size: int | None
          ) -> LoraDraftConfig:
    if tcfg.model_type not in ARCHS:
        raise ValueError(f"the LoRA self-drafter supports {', '.join(ARCHS)} targets, not {tcfg.model_type!r}")
    if options.exit_layer + options.num_exit_layers > tcfg.num_hidden_layers:
        raise ValueError(f"drafter.lora.exit_layer={options.exit_layer} + num_exit_layers={options.num_exit_layers} "
                         f"is past the target's {tcfg.num_hidden_layers} layers")
    if layer_ids not in (None, [options.exit_layer]):
        raise ValueError(f"capture.layer_ids={layer_ids}: the LoRA self-drafter reads the input of its exit layer "
                         f"[{options.exit_layer}] (leave capture.layer_ids null)")
    d = tcfg.to_dict()
    keep = {k: v for k, v in d.items() if not k.startswith("_") and k not in ("transformers_version",)}
    return LoraDraftConfig(**{**shared(options, LoraOptions), "alpha": float(options.alpha),
                              "target_modules": list(options.target_modules)}, target_config=keep)


def init(drafter: LoraDrafter, target: Any, options: LoraOptions) -> str:
    """The target's own tensors, shared (one copy in memory); the adapters start as peft makes them (B = 0:
    the draft starts as the plain early exit after layer E+n-1)."""
    drafter.attach_target(target.model, share=True)
    c = drafter.config
    if c.num_draft_tokens > 1:
        drafter.attach_shallow(target.model)
    return f"exit after layer {c.exit_layer + c.num_exit_layers - 1} (target layers shared, adapters fresh)"


def describe(options: LoraOptions, config: LoraDraftConfig) -> str:
    E, n = config.exit_layer, config.num_exit_layers
    return (f"target layers 0..{E - 1} + exit block {E}..{E + n - 1} with LoRA r={config.rank} "
            f"alpha={config.alpha:g} on {', '.join(config.target_modules)}{' + lm_head' if config.lora_head else ''}")


FAMILY = Family(
    name="lora", options=LoraOptions, config=LoraDraftConfig, model=LoraDrafter, build=build, init=init,
    losses=LOSSES, reduced_vocab=False, describe=describe,
    exporters={"peft": "drafthead.export.lora:export_peft", "hf": "drafthead.export.lora:export_hf",
               "gguf": "drafthead.export.lora:export_gguf"},
    readers={"peft": "drafthead.export.lora:read_peft"},
    no_reader={"hf": "the adapters are merged into a standalone model; tests/test_lora.py compares its logits "
                     "with the draft's and runs it as HF generate's assistant_model",
               "gguf": "the standalone model as a llama GGUF; tests/test_lora.py reads it back against the to=hf "
                       "tensors and tests/test_llama_cpp_lora.py runs it as llama.cpp's -md draft"},
)

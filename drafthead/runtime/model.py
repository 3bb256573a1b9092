"""Lean decode-time forward of a HF Llama / Qwen2 / Qwen3 / Qwen3-MoE / Mixtral target over a static, ragged KV cache.

Why not HF `model(...)` with a `DynamicCache`: each call pays for mask/cache bookkeeping written for
generality, and a tree verify needs a custom 4D mask plus index-select rollback of every layer.
Here the decoder loop is ~20 lines (gpt-fast style) and reuses the HF submodules as they are (norms,
projections, MLP, rotary embedding, lm_head), so the weights are shared, not copied, and the math is
HF's. What we own is attention: K/V go into one preallocated tensor, each request at its own length.

Cache layout: one tensor [B, L*2*kvh, S, D]; layer i keys are channels [2i*kvh, (2i+1)*kvh), values
the next kvh. One tensor means a tree rollback is one `kv_compact` call for all layers.
"""
from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from drafthead import hardware
from drafthead.kernels import cpu_linear, extension, hugepages, packing, probe
from drafthead.runtime import graphs
from drafthead.layers import apply_rope, take_rows, write_kv
from drafthead.target import base_model, check_layer_ids, decoder_layers

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral")
# MoE layers run HF's own sparse block (router + experts) as they are; attention, norms and dense layers are ours
MOE_MODEL_TYPES = ("qwen3_moe", "mixtral")
UNSUPPORTED_HINT = ("heads for it still train (capture hooks any HF decoder) and report held-out acceptance "
                    "(eval/acc_*, eval/sim_accept_len in metrics.jsonl); measure tau and speedup in SGLang or vLLM "
                    "after `drafthead export` (docs/runtime.md, supported architectures)")
# oneDNN's bf16 matmul gives a row the same bits for any row count up to 32 on the AMX CPUs measured here
# (every SmolLM2 weight shape; at 33 or more rows some shapes switch kernels and rows change), so bf16 CPU
# prefills run their projections in chunks of at most this many rows.
INVARIANT_ROWS = 32


class TargetModel:
    """Forward of the frozen target for prefill / decode / verify with optional aux-feature capture.

    Args:
        model: HF causal LM (Llama, Qwen2 or Qwen3 architecture), frozen.
        aux_layer_ids: decoder layers whose *input* is returned as aux features.
        capture_last: return the last hidden state (after the final norm, what lm_head reads) as the
            features instead (drafters whose `features` is "last").
        weights: None (the weights as loaded) or "bf16" / "int8" (fp32 CPU targets): the decode kernel streams
            the projection weights compressed (half / a quarter of the bytes), and the model's own weights
            are rounded in place to the values that stand for them, so prompts, decode steps, verify blocks
            and HF `generate` on the same model all run one set of weights.
    """

    def __init__(self, model: nn.Module, aux_layer_ids: list[int] | tuple[int, ...] = (),
                 capture_last: bool = False, weights: str | None = None) -> None:
        c = model.config
        if c.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"target model_type {c.model_type!r} is not supported by the runtime "
                             f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)}); {UNSUPPORTED_HINT}")
        if any(t != "full_attention" for t in (getattr(c, "layer_types", None) or [])) or \
                getattr(c, "use_sliding_window", False) or (
                c.model_type == "mixtral" and (getattr(c, "sliding_window", None) or 1 << 62) < getattr(
                    c, "max_position_embeddings", 1 << 62)):
            raise ValueError("target uses sliding-window attention, which the runtime does not implement; "
                             + UNSUPPORTED_HINT)
        self.model = model
        self.base = base_model(model)
        self.layers = decoder_layers(model)
        # per layer: True where the MLP is a sparse MoE block (HF's, run as it is), False for a dense SwiGLU MLP
        self.moe = [moe_block(layer.mlp, c.model_type, i) for i, layer in enumerate(self.layers)]
        check_layer_ids(list(aux_layer_ids), len(self.layers))
        self.aux_layer_ids = list(aux_layer_ids)
        self.capture_last = capture_last
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.num_kv_heads = c.num_key_value_heads
        self.num_layers = len(self.layers)
        self.max_positions = int(getattr(c, "max_position_embeddings", 1 << 30))
        self.vocab_size = c.vocab_size
        self.hidden_size = c.hidden_size
        self.qk_norm = hasattr(attn, "q_norm")
        p = next(model.parameters())
        self.dtype, self.device = p.dtype, p.device
        self.chunk_rows = self.dtype == torch.bfloat16 and self.device.type == "cpu"
        # On CPU, generated tokens (decode steps, verify blocks) go through the packed kernel of the dtype
        # (bf16: AVX512-BF16 or AMX tiles; fp32: AVX2/FMA), and so do prompts except where oneDNN's AMX tiles are
        # faster (`prompt_kernel`); both are row-invariant, each on its own side.
        dims = (c.hidden_size, c.intermediate_size, self.head_dim * c.num_attention_heads)
        # the CPU decode kernels pack dense projections only: an MoE target runs oneDNN / HF's blocks, said once
        kind = cpu_linear.kind_for(self.dtype) if self.device.type == "cpu" and not any(self.moe) else None
        if any(self.moe) and self.device.type == "cpu":
            _say_moe_slow_path(c.model_type)
        self.decode_kernel = bool(kind and (kind == "fp32" or all(d % 2 == 0 for d in dims))
                                  and extension.available(kind))
        self.kernel = kind if self.decode_kernel else None  # for reports: which kernel runs generated tokens
        if self.kernel == "bf16":  # its tile path and prefetches as timed on this machine (once, then cached)
            probe.tuned()
        # generated tokens' attention, norms, RoPE and SiLU-and-multiply: the fp32 extension's row-invariant ops
        # (fp32 math for fp32 and bf16 tokens, one call each) where they run; else torch's, and SDPA calls of a
        # fixed query count for attention (`attend`)
        self.decode_ops = bool(self.decode_kernel and self.head_dim % 8 == 0 and extension.available("fp32"))
        # prompts through the decode kernels too (faster than oneDNN at every row count measured, 1-512, on the
        # AVX512-BF16 and AVX2 classes: docs/experiment_log.md, "Figures behind code choices"). On AMX CPUs oneDNN
        # runs AMX tiles: the bf16 kernel beats it at 32-512 rows when the probe put the kernel on AMX tiles too,
        # and loses from 128 rows on its AVX512-BF16 tiles, as the fp32 kernel does. Batched regeneration and
        # batched eval run these same paths; `paths()` says which in their logs.
        self.prompt_kernel = self.decode_ops and (hardware.cpu_class() != "AMX"
                                                  or (self.kernel == "bf16" and extension.amx()))
        self.silu = getattr(c, "hidden_act", None) == "silu"
        # generated tokens' layers in one call each (`packing.decode_layer`: the same kernels and ops, the same
        # bits, without the Python and dispatch between them); False runs them op by op (tests compare the two)
        self.fused = self.decode_ops and self.silu
        self._fused: dict[int, object] = {}  # layer index -> its DecodeLayer, or None where a group does not join
        # packed weights by decode group (`decode_groups`), or by one projection where a group does not join
        self._packed: dict[tuple[nn.Module, ...], packing.PackedLinear] = {}  # made on first decode use
        self._pages = hugepages.HugePages()  # where they go: 2 MB pages, in the order a forward reads them
        self.weights = weights or "fp32"
        if weights is not None and weights != "fp32":
            self._compress(weights)
        if self.kernel == "fp32":  # how it streams these weights, as timed on this machine (once, then cached)
            probe.fp32_tuned(self.weights)
        # decode and verify forwards through static buffers, replayed as CUDA graphs (`runtime/graphs.py`); None
        # runs every forward eagerly (CPU; CUDA with DRAFTHEAD_CUDA_GRAPHS=0). Tests set a graph-less one on CPU.
        self.static: graphs.StaticForward | None = (graphs.StaticForward(self, graphs=True)
                                                    if graphs.enabled(self.device) else None)

    def projections(self) -> list[nn.Linear]:
        """Every weight a generated token streams: the layers' projections and the head."""
        return [p for group in self.decode_groups() for p in group]

    def decode_groups(self) -> list[tuple[nn.Linear, ...]]:
        """The projections in the groups the decode kernel runs as one call each: q/k/v and gate/up read the
        same input, so each group is one packed weight (fewer kernel calls a step); o, down and the head alone."""
        out = []
        for layer, moe in zip(self.layers, self.moe):
            a, m = layer.self_attn, layer.mlp
            out += [(a.q_proj, a.k_proj, a.v_proj), (a.o_proj,)]
            out += [] if moe else [(m.gate_proj, m.up_proj), (m.down_proj,)]
        return out + [(self.model.lm_head,)]

    def _compress(self, weights: str) -> None:
        if weights not in cpu_linear.WEIGHTS:
            raise ValueError(f"weights={weights!r}: use one of {', '.join(cpu_linear.WEIGHTS)} (or null)")
        if self.kernel != "fp32":
            why = (f"the target is {str(self.dtype).removeprefix('torch.')} on {self.device.type}"
                   if cpu_linear.kind_for(self.dtype) != "fp32" or self.device.type != "cpu"
                   else f"the fp32 CPU kernel is unavailable ({extension.unavailable_reason('fp32')})")
            raise ValueError(f"weights={weights} needs an fp32 target on a CPU with the fp32 decode kernel: {why}")
        done: dict[nn.Module, packing.PackedLinear] = {}  # tied weights (a shared module) are compressed once
        for group in self.decode_groups():
            for proj in group:
                if proj not in done:
                    stored, scale, effective = cpu_linear.compress(proj.weight, weights)  # from the weight as loaded
                    done[proj] = packing.PackedLinear(proj, weights, compressed=(stored, scale))
                    with torch.no_grad():
                        proj.weight.copy_(effective)
            self._pack_group(group, [done[p] for p in group])

    def _pack_group(self, group: tuple[nn.Module, ...], parts: list[packing.PackedLinear]) -> None:
        """Store the group's packed weight: one joined weight where `packing.concat` can join the parts,
        else each part under its own projection."""
        if len(parts) > 1 and packing.can_concat(parts):
            parts = [packing.concat(parts)]
            self._packed[group] = parts[0]
        else:
            for proj, part in zip(group, parts):
                self._packed[(proj,)] = part
        for part in parts:  # each weight is read once a forward: streamed past the caches
            part.stream = True
            part.packed = self._pages.put(part.packed)

    def packed(self, *group: nn.Module) -> packing.PackedLinear | None:
        """The decode kernel's packed weight for `group` (one projection, or a group of `decode_groups`), made on
        first use; None when the group's parts do not join (then each part has its own)."""
        fast = self._packed.get(group)
        if fast is None and not any((p,) in self._packed for p in group):
            self._pack_group(group, [packing.PackedLinear(p) for p in group])
            fast = self._packed.get(group)
        return fast

    def packed_one(self, proj: nn.Module) -> packing.PackedLinear:
        """One projection's packed weight: `packed` of a single projection, which always packs."""
        fast = self.packed(proj)
        assert fast is not None, "a single projection always packs"
        return fast

    def streamed_bytes(self) -> int:
        """Bytes of projection weights one generated token streams (what bounds a decode step)."""
        if not self.decode_kernel:
            dense = sum(p.weight.numel() * p.weight.element_size() for p in dict.fromkeys(self.projections()))
            return dense + sum(moe_active_bytes(layer.mlp, self.model.config)
                               for layer, moe in zip(self.layers, self.moe) if moe)
        total = 0
        for group in dict.fromkeys(self.decode_groups()):
            joined = self.packed(*group)
            parts = [joined] if joined is not None else [self.packed(p) for p in group]
            total += sum(packing.packed_bytes(p) for p in parts)
        return total

    def paths(self) -> str:
        """Which code runs prompts and generated tokens' projections here, in words, for logs and reports."""
        if not self.decode_kernel:
            return "prompts and generated tokens: torch (oneDNN on CPU)"
        prompts = (f"the {self.kernel} decode kernel" if self.prompt_kernel
                   else "oneDNN (AMX tiles)")
        tuned = f" ({probe.describe() if self.kernel == 'bf16' else probe.fp32_describe(self.weights)})"
        return (f"prompts: {prompts}; generated tokens: the {self.kernel} decode kernel{tuned} (row-invariant), "
                f"packed weights on {hugepages.pages()}")

    def multiply_adds(self) -> int:
        """Multiply-adds one token takes in the projections and the head (MoE: the router and top-k experts): the
        compute side of a forward's roofline; attention, norms and the rest are left out."""
        dense = sum(p.weight.numel() for p in dict.fromkeys(self.projections()))
        moe = 0
        for layer, is_moe in zip(self.layers, self.moe):
            if is_moe:
                moe += moe_active_bytes(layer.mlp, self.model.config) // next(layer.mlp.parameters()).element_size()
        return dense + moe

    def layers_view(self) -> LayersView:
        """What a self-draft may run of this model (`contract.TargetLayers`)."""
        return LayersView(self)

    def new_cache(self, batch: int, capacity: int) -> torch.Tensor:
        """Zeroed KV cache [B, L*2*kvh, S, D] (with CUDA graphs on: the static one for (B, S), zeroed)."""
        if self.static is not None and self.static.graphs:
            return self.static.cache(batch, capacity)
        return torch.zeros(batch, self.num_layers * 2 * self.num_kv_heads, capacity, self.head_dim,
                           dtype=self.dtype, device=self.device)

    def layer_kv(self, cache: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of layer i's keys and values, each [B, kvh, S, D]."""
        h = self.num_kv_heads
        return cache[:, 2 * i * h: (2 * i + 1) * h], cache[:, (2 * i + 1) * h: (2 * i + 2) * h]

    @torch.inference_mode()
    def forward(self, cache: torch.Tensor, input_ids: torch.Tensor, lens: torch.Tensor,
                tree_mask: torch.Tensor | None = None, depth: torch.Tensor | None = None,
                logits_at: torch.Tensor | None = None, capture: bool = False, prefill: bool = False,
                static: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run T new tokens per request and write their K/V at slots lens[b] .. lens[b]+T-1.

        Args:
            cache: [B, L*2*kvh, S, D], updated in place.
            input_ids: [B, T] (right padding allowed: padded entries land after the valid ones).
            lens: [B] tokens already in the cache per request (= rope position of the first new token).
            tree_mask: [B, T, T] bool ancestor-or-self mask among the new tokens; None = causal.
            depth: [B, T] rope offset of each new token from lens (tree depth); None = 0..T-1.
            logits_at: [B] index of the single new token per request whose logits are wanted; None = all.
            capture: also return the aux features (inputs of `aux_layer_ids`), or with `capture_last`
                the last hidden states [B, T, H].
            prefill: the tokens are a prompt. Only changes which CPU kernels run where `prompt_kernel` is False
                (oneDNN for prompts, the packed decode kernels for generated tokens); a token must always be fed
                the same way, so the runtime passes True for prompts and False for every decode step and verify
                block.
            static: the call comes from `graphs.StaticForward` (and may be captured into a CUDA graph): no host
                syncs, K/V written by index; the caller checked the capacity.
        Returns (logits [B, T or 1, V], aux [B, T, len(aux)*H] or None).
        """
        if (not static and self.static is not None and not prefill and logits_at is None
                and self.static.usable(cache, input_ids, lens)):
            return self.static.run(cache, input_ids, lens, tree_mask, depth, capture)
        prefill = prefill and not self.prompt_kernel
        B, T = input_ids.shape
        offs = torch.arange(T, device=input_ids.device)
        positions = lens[:, None] + (offs if depth is None else depth)  # [B, T]
        # all requests aligned: slice writes (a host sync, so not in a static call)
        start = int(lens[0]) if not static and bool((lens == lens[0]).all()) else None
        # Batch invariance: a token's logits must not depend on how many tokens share its forward, or a
        # near-tie argmax can flip between a verify block and plain decoding. On CPU, generated tokens go through
        # the extension's projections, attention and small ops, each row-invariant by construction. Without them,
        # bf16 oneDNN matmuls are row-invariant up to INVARIANT_ROWS rows (`linear` chunks larger calls) and SDPA
        # runs in fixed-size query calls over the whole cache (`attend`); fp32 oneDNN matmuls switch kernels by
        # row count, so there equality holds up to rounding.
        S = cache.shape[2]
        if not static and int(lens.max()) + T > S:
            raise ValueError(f"KV cache overflow: {int(lens.max())} cached + {T} new tokens > capacity {S}")
        mask = attention_mask(lens, T, S, tree_mask)  # [B, 1, T, S]
        slots = lens[:, None] + offs  # [B, T]

        h = self.base.embed_tokens(input_ids)  # [B, T, H]
        cos, sin = self.base.rotary_emb(h, position_ids=positions)  # [B, T, D] each
        grabbed = []
        for i, layer in enumerate(self.layers):
            if capture and i in self.aux_layer_ids:
                grabbed.append(h)
            h = self.block(i, layer, h, cos, sin, cache, slots, start, S, mask, prefill)
        ops = self.decode_ops and not prefill
        last = rms_norm(self.base.norm, h, ops) if capture and self.capture_last else None  # [B, T, H]
        if logits_at is not None:
            h = take_rows(h, logits_at)  # [B, 1, H]
        logits = self.linear(self.model.lm_head, rms_norm(self.base.norm, h, ops), prefill)  # [B, T, V]
        aux = None
        if capture and self.aux_layer_ids:
            by_id = dict(zip([i for i in range(self.num_layers) if i in self.aux_layer_ids], grabbed))
            aux = torch.cat([by_id[i] for i in self.aux_layer_ids], dim=-1)  # [B, T, len*H]
        return logits, (last if last is not None else aux)

    def block(self, i: int, layer: nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              cache: torch.Tensor, slots: torch.Tensor, start: int | None, S: int,
              mask: torch.Tensor | None, prefill: bool = False) -> torch.Tensor:
        """One pre-norm decoder layer (Llama/Qwen2/Qwen3 share this shape). cos, sin: [B, T, D], as the fused layer
        takes them (squeezing a [B, 1, T, D] there cost two operators a layer)."""
        B, T, _ = h.shape
        attn = layer.self_attn
        ops = self.decode_ops and not prefill  # generated tokens on CPU: the extension's one-call ops
        # the one-call step holds layer i's own packed weights: another layer run on slot i of a cache (a self-draft's
        # exit block) goes op by op, never through them
        if ops and self.fused and layer is self.layers[i] and (step := self.fused_layer(i, layer)) is not None:
            return step.forward(h, cos, sin, cache, slots, mask)
        cos, sin = cos[:, None], sin[:, None]  # [B, 1, T, D]
        x = rms_norm(layer.input_layernorm, h, ops)
        q, k, v = self.project((attn.q_proj, attn.k_proj, attn.v_proj), x, prefill)
        q = q.view(B, T, -1, self.head_dim)  # [B, T, h, D]
        k = k.view(B, T, -1, self.head_dim)  # [B, T, kvh, D]
        v = v.view(B, T, -1, self.head_dim).transpose(1, 2)  # [B, kvh, T, D]
        if self.qk_norm:  # Qwen3: per-head RMSNorm before rope
            q, k = rms_norm(attn.q_norm, q, ops), rms_norm(attn.k_norm, k, ops)
        if ops:
            q = cpu_linear.rope(q, cos, sin).transpose(1, 2)  # [B, h, T, D]
            k = cpu_linear.rope(k, cos, sin).transpose(1, 2)  # [B, kvh, T, D]
        else:
            q = apply_rope(q.transpose(1, 2), cos, sin)  # [B, h, T, D]
            k = apply_rope(k.transpose(1, 2), cos, sin)  # [B, kvh, T, D]
        ck, cv = self.layer_kv(cache, i)
        write_kv(ck, k, slots, start)
        write_kv(cv, v, slots, start)
        if ops:  # fp32 math, one rounding to the dtype
            o = cpu_linear.attention_fp32(q, ck[:, :, :S], cv[:, :, :S], mask, attn.scaling).to(h.dtype)  # [B, h, T, D]
        else:  # prompts; generated CPU tokens without the kernel: SDPA calls of a fixed query count (row-invariant)
            per_query = not prefill and x.device.type == "cpu" and (x.dtype == torch.bfloat16 or self.decode_kernel)
            o = attend(q, ck[:, :, :S], cv[:, :, :S], mask, attn.scaling, per_query)  # [B, h, T, D]
        h = h + self.linear(attn.o_proj, o.transpose(1, 2).reshape(B, T, -1), prefill)
        mlp, x = layer.mlp, rms_norm(layer.post_attention_layernorm, h, ops)
        if self.moe[i]:  # router + top-k experts: HF's block, each token routed on its own
            return h + mlp(x)
        if ops and self.silu:
            joined = self.packed(mlp.gate_proj, mlp.up_proj)
            gate_up = joined(x) if joined is not None else torch.cat(self.project((mlp.gate_proj, mlp.up_proj), x), -1)
            act = cpu_linear.silu_mul(gate_up)  # [B, T, I]
        else:
            gate, up = self.project((mlp.gate_proj, mlp.up_proj), x, prefill)  # [B, T, I] each
            act = mlp.act_fn(gate) * up
        return h + self.linear(mlp.down_proj, act, prefill)

    def fused_layer(self, i: int, layer: nn.Module):
        """Layer i's one-call decode step (`packing.decode_layer`), made on first use; None where q/k/v or gate/up
        do not join into one packed weight (that layer then runs op by op)."""
        if i not in self._fused:
            a, m = layer.self_attn, layer.mlp
            qkv, gate_up = self.packed(a.q_proj, a.k_proj, a.v_proj), self.packed(m.gate_proj, m.up_proj)
            self._fused[i] = None if qkv is None or gate_up is None else packing.decode_layer(
                i, a.q_proj.out_features // a.head_dim, a.k_proj.out_features // a.head_dim, a.head_dim, a.scaling,
                layer.input_layernorm, layer.post_attention_layernorm, qkv, self.packed_one(a.o_proj), gate_up,
                self.packed_one(m.down_proj), getattr(a, "q_norm", None), getattr(a, "k_norm", None), stream=True)
        return self._fused[i]

    def project(self, group: tuple[nn.Module, ...], x: torch.Tensor, prefill: bool = False) -> list[torch.Tensor]:
        """[proj(x) for proj in group]; generated tokens take one call of the group's joined packed weight."""
        joined = self.packed(*group) if self.decode_kernel and not prefill else None
        if joined is None:
            return [self.linear(p, x, prefill) for p in group]
        return list(joined(x).split([p.out_features for p in group], dim=-1))

    def linear(self, proj: nn.Module, x: torch.Tensor, prefill: bool = False) -> torch.Tensor:
        """proj(x) for x [B, T, in] whose rows have the same bits whatever B*T is (a verify block = the same
        tokens decoded one by one). On CPU: generated tokens through the packed decode kernel of the dtype;
        bf16 prompts through oneDNN in chunks of INVARIANT_ROWS rows."""
        if self.decode_kernel and not prefill:
            return self.packed_one(proj)(x)
        rows = x.shape[0] * x.shape[1]
        if not self.chunk_rows or rows <= INVARIANT_ROWS:
            return proj(x)
        flat = x.reshape(rows, x.shape[-1])
        out = torch.cat([proj(flat[i: i + INVARIANT_ROWS]) for i in range(0, rows, INVARIANT_ROWS)])
        return out.view(*x.shape[:-1], out.shape[-1])


class LayersView:
    """A target model as `contract.TargetLayers`: the part of the runtime a self-draft runs (its block math, kernels
    and KV layout), and nothing it could change."""

    __slots__ = ("_m",)

    def __init__(self, model: TargetModel) -> None:
        self._m = model

    @property
    def dtype(self) -> torch.dtype:
        return self._m.dtype

    @property
    def num_kv_heads(self) -> int:
        return self._m.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self._m.head_dim

    @property
    def lm_head(self) -> nn.Module:
        return self._m.model.lm_head

    def layer(self, i: int) -> nn.Module:
        return self._m.layers[i]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self._m.base.embed_tokens(ids)

    def rotary(self, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._m.base.rotary_emb(h, position_ids=positions)

    def causal_mask(self, lens: torch.Tensor, T: int, S: int) -> torch.Tensor:
        return attention_mask(lens, T, S, None)

    def block(self, i: int, layer: nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              cache: torch.Tensor, positions: torch.Tensor, start: int | None, S: int, mask: torch.Tensor,
              prefill: bool = False) -> torch.Tensor:
        return self._m.block(i, layer, h, cos, sin, cache, positions, start, S, mask, prefill)

    def norm(self, norm: nn.Module, h: torch.Tensor) -> torch.Tensor:
        return rms_norm(norm, h)

    def linear(self, proj: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self._m.linear(proj, x)


def moe_block(mlp: nn.Module, model_type: str, i: int) -> bool:
    """Whether layer i's MLP is a sparse MoE block; a layer of an MoE model type that is neither a dense SwiGLU
    MLP nor a router + experts block is a named error (the runtime would not know how to run it)."""
    if all(isinstance(getattr(mlp, n, None), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj")):
        return False
    if model_type in MOE_MODEL_TYPES and isinstance(getattr(mlp, "gate", None), nn.Module) and isinstance(
            getattr(mlp, "experts", None), nn.Module):
        return True
    kids = ", ".join(n for n, _ in mlp.named_children()) or "none"
    raise ValueError(f"target layer {i}: {type(mlp).__name__} is neither a dense gate/up/down MLP nor an MoE block "
                     f"with `gate` (router) and `experts` (children: {kids}); {UNSUPPORTED_HINT}")


def moe_active_bytes(mlp: nn.Module, config) -> int:
    """Bytes one token reads in an MoE block: the router, and top-k of the experts' weights."""
    E = getattr(config, "num_experts", None) or getattr(config, "num_local_experts")
    k = config.num_experts_per_tok
    size = lambda m: sum(p.numel() * p.element_size() for p in m.parameters())  # noqa: E731
    return size(mlp.gate) + size(mlp.experts) * k // E


@functools.cache
def _say_moe_slow_path(model_type: str) -> None:
    warnings.warn(f"runtime: {model_type} target on CPU: the decode kernels cover dense layers only, so every "
                  "projection runs through oneDNN and MoE layers through HF's block (slower; bf16 rows not "
                  "guaranteed invariant to the block size: use fp32 for bit-exact verification)", stacklevel=3)


QUERY_BLOCK = 16  # queries per CPU SDPA call for generated bf16 tokens (see attend)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
           per_query: bool = False) -> torch.Tensor:
    """SDPA with GQA whose per-query result does not depend on the number of queries T.

    q [B, h, T, D], k/v [B, kvh, S, D], mask [B, 1, T, S] -> [B, h, T, D]. A lone query is sent as two
    copies: CPU SDPA has a separate q_len-1 kernel that can round differently (by one bf16 ulp, on real
    SmolLM2 activations; tests/assets/sdpa_q1_case.safetensors), which is enough to flip a near-tie argmax.
    `per_query`: every call has exactly QUERY_BLOCK queries (the last one repeated to fill it), whatever T
    is. On AMD EPYC (AVX512-BF16) CPUs, SDPA's result for a query also changed with the number of
    queries in the call (no row of a real SmolLM2 verify block of 10 matched single steps), so the runtime
    sets it for generated bf16 CPU tokens; one call per 16 queries, at about the cost of an unpadded call.
    """
    T = q.shape[2]
    if per_query:  # every call has QUERY_BLOCK queries (the last one repeated), whatever T is
        outs = []
        for s0 in range(0, T, QUERY_BLOCK):
            qs, ms = q[:, :, s0: s0 + QUERY_BLOCK], mask[:, :, s0: s0 + QUERY_BLOCK]
            n = qs.shape[2]
            if n < QUERY_BLOCK:
                qs = torch.cat([qs, qs[:, :, -1:].expand(-1, -1, QUERY_BLOCK - n, -1)], 2)
                ms = torch.cat([ms, ms[:, :, -1:].expand(-1, -1, QUERY_BLOCK - n, -1)], 2)
            outs.append(F.scaled_dot_product_attention(qs, k, v, attn_mask=ms, scale=scale, enable_gqa=True)[:, :, :n])
        return torch.cat(outs, 2)
    if T == 1:  # q as a copy (a stride-0 view takes the q_len-1 kernel too); the mask can stay a view
        q, mask = q.repeat(1, 1, 2, 1), mask.expand(-1, -1, 2, -1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)[:, :, :T]


def rms_norm(norm: nn.Module, x: torch.Tensor, kernel: bool = False) -> torch.Tensor:
    """HF Llama/Qwen RMSNorm (fp32 statistics, weight applied in the input dtype); `kernel`: in one call of the
    CPU extension (generated tokens), else with torch (F.rms_norm runs as ~8 operators on CPU)."""
    if kernel:
        return cpu_linear.rms_norm(x, norm.weight, norm.variance_epsilon)
    y = F.rms_norm(x.float(), (x.shape[-1],), eps=norm.variance_epsilon)
    return norm.weight * y.to(x.dtype)


def attention_mask(lens: torch.Tensor, T: int, S: int, tree_mask: torch.Tensor | None) -> torch.Tensor:
    """Bool [B, 1, T, S]: query i of request b sees its cached prefix (< lens[b]) and, among the block of N keys
    at lens[b]..lens[b]+N-1, the ones tree_mask [B, T, N] allows (N >= T: a verify block's tree is N = T; a draft
    step's block also holds the round's earlier speculative entries), or (None) every block key up to its own at
    lens[b] + i (causal, N = T)."""
    if tree_mask is None:  # causal: query t sees the keys before lens[b] + t + 1 (a few operators fewer a step)
        limit = lens[:, None] + torch.arange(1, T + 1, device=lens.device)  # [B, T]
        return (torch.arange(S, device=lens.device) < limit[:, :, None])[:, None]
    B = lens.shape[0]
    rel = torch.arange(S, device=lens.device)[None] - lens[:, None]  # [B, S] key index relative to new block
    prefix = rel < 0  # [B, S]
    N = tree_mask.shape[-1]
    in_new = (rel >= 0) & (rel < N)
    relc = rel.clamp(0, N - 1)
    new = tree_mask.gather(2, relc[:, None, :].expand(B, T, S))  # [B, T, S] query i's view of the block
    return (prefix[:, None, :] | (new & in_new[:, None, :]))[:, None]

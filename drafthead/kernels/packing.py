"""Packed weights as modules: `PackedLinear` (an nn.Linear's weight packed once for the decode kernel of its dtype),
joining the projections that read the same input into one packed weight (q/k/v, gate/up), and a copy of a module
with every linear packed (what the runtime drafts with on CPU)."""
from __future__ import annotations

import copy

import torch
from torch import nn

from drafthead.kernels import cpu_linear, extension, hugepages

def packed_bytes(module: nn.Module) -> int:
    """Bytes of packed weight (and scales) a forward through `module`'s PackedLinears streams."""
    return sum(m.packed.numel() * m.packed.element_size() + (m.scale.numel() * 4 if m.scale is not None else 0)
               for m in module.modules() if isinstance(m, PackedLinear))


class PackedLinear(nn.Module):
    """Inference-only stand-in for a CPU `nn.Linear` (bf16 or fp32) that runs through the packed kernel of its
    dtype. Keeps `weight` (and `bias`) as they were, so code that reads `.weight.dtype` still works.

    `weights` (fp32 layers only): how the kernel stores the weight it streams. With bf16 or int8 the kernel
    computes with the compressed weight, not `lin.weight`: `compress` gives the fp32 weight that stands for it.
    `compressed`: (stored, scale) from `cpu_linear.compress(lin.weight, weights)` when the caller made it already."""

    def __init__(self, lin: nn.Linear, weights: str = "fp32",
                 compressed: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = lin.in_features, lin.out_features
        self.weight, self.bias = lin.weight, lin.bias
        self.kind = cpu_linear.kind_for(lin.weight.dtype)
        if self.kind == "bf16":
            if weights != "fp32":
                raise ValueError(f"weights={weights!r} needs fp32 layers (this one is bf16)")
            self.register_buffer("packed", cpu_linear.pack(lin.weight), persistent=False)
            self.register_buffer("scale", None, persistent=False)
        elif self.kind == "fp32":
            stored, scale = compressed if compressed is not None else cpu_linear.compress(lin.weight, weights)[:2]
            self.register_buffer("packed", cpu_linear.pack_fp32(stored), persistent=False)
            self.register_buffer("scale", scale, persistent=False)
        else:
            raise ValueError(f"no CPU decode kernel for {lin.weight.dtype} layers")

    stream = False  # set by the owner of a weight read once a forward (the target): see `linear`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "bf16":
            return cpu_linear.linear(x, self.packed, self.out_features, self.bias, self.stream)
        return cpu_linear.linear_fp32(x, self.packed, self.out_features, self.scale, self.bias)


LANES = {"bf16": 16, "fp32": 8}  # outputs per packed block of each kernel


def _ungroup(packed: torch.Tensor, kind: str) -> torch.Tensor:
    """A packed weight with its blocks one after the other ([NB, ...], each block's bytes together) instead of in
    the kernel's groups of `GROUP` blocks side by side per k (the extension's kGroup)."""
    g, per = extension.ext(kind).GROUP, packed[0].numel()
    flat, out = packed.reshape(-1), []
    for b0 in range(0, packed.shape[0], g):
        w = min(g, packed.shape[0] - b0)
        out.append(flat[b0 * per: (b0 + w) * per].view(packed.shape[1], w, *packed.shape[2:]).transpose(0, 1))
    return torch.cat(out)


def _group(blocks: torch.Tensor, kind: str) -> torch.Tensor:
    """The inverse of `_ungroup`: blocks [NB, ...] -> the kernel's packed layout (same shape, group order)."""
    g = extension.ext(kind).GROUP
    parts = [blocks[b0: b0 + g].transpose(0, 1).reshape(-1) for b0 in range(0, blocks.shape[0], g)]
    return torch.cat(parts).view(blocks.shape)


def can_concat(parts: list[PackedLinear]) -> bool:
    """Whether `concat` can join these: one kind, input width and storage; every output count a whole number of
    packed blocks (so the packed tensors join with no padding between them); biases on all or none."""
    p0 = parts[0]
    return all(p.kind == p0.kind and p.in_features == p0.in_features and p.packed.dtype == p0.packed.dtype
               and p.out_features % LANES[p.kind] == 0 and (p.scale is None) == (p0.scale is None)
               and (p.bias is None) == (p0.bias is None) for p in parts)


def concat(parts: list[PackedLinear]) -> PackedLinear:
    """One PackedLinear computing the parts' outputs side by side (q/k/v, gate/up: one call instead of three or
    two, so a decode step makes fewer calls into the kernel). Each output is computed as in its part, bit for
    bit: the kernels compute every output on its own, whatever the tile it falls in."""
    if not can_concat(parts):
        raise ValueError("concat needs parts of one kernel kind, input width, storage and bias presence, with "
                     "output counts that are whole packed blocks: "
                     + ", ".join(f"{p.kind} {p.in_features}->{p.out_features}" for p in parts))
    out = PackedLinear.__new__(PackedLinear)
    nn.Module.__init__(out)
    out.kind, out.in_features = parts[0].kind, parts[0].in_features
    out.out_features = sum(p.out_features for p in parts)
    out.weight = None  # the parts' weights stay with their own modules
    out.bias = torch.cat([p.bias.detach() for p in parts]) if parts[0].bias is not None else None
    blocks = torch.cat([_ungroup(p.packed, out.kind) for p in parts])  # a part's end may split a group
    out.register_buffer("packed", _group(blocks, out.kind), persistent=False)
    out.register_buffer("scale", torch.cat([p.scale for p in parts]) if parts[0].scale is not None else None,
                        persistent=False)
    return out


def joined(*parts: nn.Module) -> PackedLinear | None:
    """The parts' one joined PackedLinear (`concat`), made on first use and kept on the first part; None unless
    every part is a PackedLinear and they join. A draft step's q/k/v and gate/up then take one kernel call each
    (SmolLM2's EAGLE3 draft: k and v were 192 outputs each, 12 blocks over 2 threads)."""
    if not all(isinstance(p, PackedLinear) for p in parts):
        return None
    cache = parts[0].__dict__.setdefault("_joined", {})  # plain attribute: not a submodule, not in state dicts
    key = tuple(id(p) for p in parts)
    if key not in cache:
        cache[key] = concat(list(parts)) if can_concat(list(parts)) else None
    return cache[key]


def with_packed_linears(module: nn.Module) -> nn.Module:
    """A copy of `module` (inference only) whose bf16 or fp32 CPU `nn.Linear` layers use the packed kernel of
    their dtype; the module itself when there is nothing to replace or the kernel is unavailable. Used for
    drafters at decode time, where each draft step multiplies one row per request by every draft weight."""
    def fits(m: nn.Module) -> bool:
        kind = cpu_linear.kind_for(m.weight.dtype) if type(m) is nn.Linear else None
        return (kind is not None and m.weight.device.type == "cpu" and extension.available(kind)
                and (kind == "fp32" or m.in_features % 2 == 0))

    if not any(fits(m) for m in module.modules()):
        return module
    out = copy.deepcopy(module)
    pages = hugepages.HugePages()  # a draft's head is tens of MB, past the caches: streamed as a target's weights are
    for parent in list(out.modules()):
        for name, child in list(parent.named_children()):
            if fits(child):
                packed = PackedLinear(child)
                packed.packed = pages.put(packed.packed)
                setattr(parent, name, packed)
    return out


def decode_layer(index: int, heads: int, kv_heads: int, head_dim: int, scaling: float, in_norm: nn.Module | None,
                 post_norm: nn.Module, qkv: PackedLinear, o: PackedLinear, gate_up: PackedLinear, down: PackedLinear,
                 q_norm: nn.Module | None = None, k_norm: nn.Module | None = None, stream: bool = False):
    """A generated token's whole Llama / Qwen2 / Qwen3 decoder layer in one call (`cpu_linear_avx2.cpp`,
    DecodeLayer): `.forward(h [B, T, H], cos, sin, cache, slots [B, T], mask [B, 1, T, S])` -> [B, T, H], writing
    the tokens' K/V at their slots of layer `index`. The same bits as running the layer op by op with this module's
    kernels and small ops (TargetModel.block); what it saves is the Python and dispatch between them.
    qkv and gate_up are the joined packed projections (`concat`); norms are RMSNorms (`weight` and HF's
    `variance_epsilon` or drafthead's `eps`); q_norm / k_norm are Qwen3's per-head norms.
    With `in_norm` None the layer runs by `.forward_input(x, residual, cos, sin, cache, slots, mask)`: x [B, T, K]
    is the attention's input as the caller made it (a draft's [norm(embedding); norm(hidden)]), residual [B, T, H]
    what the attention's output adds to; float32 cos / sin then give a bf16 layer a draft's fp32 RoPE.
    stream: bf16 weights are prefetched non-temporally (`linear`'s stream; a target's layers)."""
    ext = extension.ext("fp32")
    cap = extension.ext("bf16").LINEAR if qkv.kind == "bf16" else None

    def eps(norm: nn.Module | None) -> float:
        return 0.0 if norm is None else float(getattr(norm, "variance_epsilon", getattr(norm, "eps", None)))

    def weight(norm: nn.Module | None) -> torch.Tensor | None:
        return None if norm is None else norm.weight.detach()

    def proj(p: PackedLinear) -> tuple:
        return p.packed, p.out_features, p.scale, p.bias

    return ext.DecodeLayer(index, heads, kv_heads, head_dim, float(scaling), weight(in_norm), eps(in_norm),
                           weight(post_norm), eps(post_norm), weight(q_norm), weight(k_norm), eps(q_norm),
                           proj(qkv), proj(o), proj(gate_up), proj(down), cap, stream)

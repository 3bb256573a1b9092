"""Triton kernels for the verify step; `reference.py` is the spec they reproduce.

The tree walks are sequential per request, so each of them runs one program per request and sweeps the nodes
left to right, exactly like the reference (children always have larger indices than their parent, so the
sweep meets the candidates of the current node in the order the walk tries them). Vocab-wide work (residual
distributions, the final inverse-CDF draw) is tiled with BLOCK_V inside that program.

Chains reuse the tree kernels: `node_offset=1` says that tokens / draft_probs / uniforms have no root row
(chain inputs are [B, K] and [B, K, V]), so node c reads row c - 1; parents are the trivial chain.

Inputs are assumed checked (`verify.py` does it). On CPU these kernels run only when TRITON_INTERPRET=1 was
set before this module was imported (the `@triton.jit` decorator reads it) and is still set at launch (the
interpreter imports parts of triton lazily). `compile_for_gpu` builds Hopper cubins on a CPU-only machine.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

try:  # tells tests and the dispatcher whether the decorators below produced interpreted kernels
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # pragma: no cover - very old / very new triton
    InterpretedFunction = ()


# ------------------------------------------------------------------------------------------------ tree mask
@triton.jit
def _tree_mask_kernel(parents_ptr, num_nodes_ptr, mask_ptr, depth_ptr, N, BLOCK_N: tl.constexpr):
    """One program per (request, node): walk the ancestors of node i and write its mask row once."""
    b = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1)
    n = tl.load(num_nodes_ptr + b).to(tl.int32)
    offs = tl.arange(0, BLOCK_N)
    row = (offs == i).to(tl.int32)  # itself (the only True entry of a padding row)
    depth = 0
    j = -1  # next ancestor to add; padding slots have none
    if i < n:
        j = tl.load(parents_ptr + b * N + i).to(tl.int32)
    for _ in range(0, N):  # at most N - 1 ancestors; the bound also stops a corrupted (cyclic) parents array
        if (j >= 0) & (j < N):
            row = tl.where(offs == j, 1, row)
            depth += 1
            j = tl.load(parents_ptr + b * N + j).to(tl.int32)
    tl.store(mask_ptr + (b * N + i) * N + offs, row.to(tl.uint8), mask=offs < N)
    tl.store(depth_ptr + b * N + i, depth)


def build_tree_mask(parents: torch.Tensor, num_nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    B, N = parents.shape
    mask = torch.empty(B, N, N, dtype=torch.uint8, device=parents.device)
    depth = torch.empty(B, N, dtype=torch.long, device=parents.device)
    if B * N > 0:
        _tree_mask_kernel[(B, N)](
            parents.contiguous(), num_nodes.contiguous(), mask, depth, N,
            BLOCK_N=triton.next_power_of_2(N), num_warps=1,
        )
    return mask.view(torch.bool), depth


# ------------------------------------------------------------------------------------------------ greedy
@triton.jit
def _greedy_tree_kernel(
    tokens_ptr, parents_ptr, num_nodes_ptr, argmax_ptr, accept_len_ptr, path_ptr, next_token_ptr,
    N, NODE_OFF: tl.constexpr,
):
    """One program per request: accept the first child of the current node that matches the target argmax."""
    b = tl.program_id(0).to(tl.int64)
    NT = N - NODE_OFF  # tokens per request (chains have no root row)
    n = tl.load(num_nodes_ptr + b).to(tl.int32)
    cur = 0
    n_acc = 0
    want = tl.load(argmax_ptr + b * N)  # the target's token after the current node
    tl.store(path_ptr + b * N, 0)
    for c in range(1, n):
        parent = tl.load(parents_ptr + b * N + c)
        token = tl.load(tokens_ptr + b * NT + c - NODE_OFF)
        if (parent == cur) & (token == want):
            cur = c
            n_acc += 1
            tl.store(path_ptr + b * N + n_acc, c)
            want = tl.load(argmax_ptr + b * N + c)
    tl.store(accept_len_ptr + b, n_acc)
    tl.store(next_token_ptr + b, want)


def greedy_verify(
    tokens: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor, target_argmax: torch.Tensor,
    node_offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, N = parents.shape
    dev = parents.device
    accept_len = torch.empty(B, dtype=torch.long, device=dev)
    path = torch.full((B, N), -1, dtype=torch.long, device=dev)
    next_token = torch.empty(B, dtype=torch.long, device=dev)
    if B > 0:
        _greedy_tree_kernel[(B,)](
            tokens.contiguous(), parents.contiguous(), num_nodes.contiguous(), target_argmax.contiguous(),
            accept_len, path, next_token, N, NODE_OFF=node_offset, num_warps=1,
        )
    return accept_len, path, next_token


# ------------------------------------------------------------------------------------------------ rejection
@triton.jit
def _load_p(ws_row, tp_row, use_ws, offs, mask):
    """Current distribution on one vocab tile: the residual in the workspace, else the target row."""
    if use_ws != 0:
        p = tl.load(ws_row + offs, mask=mask, other=0.0)
    else:
        p = tl.load(tp_row + offs, mask=mask, other=0.0)
    return p


@triton.jit
def _load_q(dp_row, x, offs, mask, HAS_DRAFT_PROBS: tl.constexpr):
    """Draft distribution of a candidate on one vocab tile: its draft_probs row, else one-hot(x)."""
    if HAS_DRAFT_PROBS:
        q = tl.load(dp_row + offs, mask=mask, other=0.0)
    else:
        q = (offs == x).to(tl.float32)
    return q


@triton.jit
def _rejection_tree_kernel(
    tokens_ptr, parents_ptr, num_nodes_ptr, target_probs_ptr, draft_probs_ptr, uniforms_ptr, bonus_ptr,
    ws_ptr, accept_len_ptr, path_ptr, next_token_ptr,
    N, V,
    NODE_OFF: tl.constexpr, HAS_DRAFT_PROBS: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """One program per request: recursive rejection sampling down the tree, then the bonus draw.

    The current distribution p is either target_probs[b, cur] (use_ws == 0) or a residual normalize(max(p - q, 0))
    kept in the per-request workspace row ws[b] (use_ws == 1).
    """
    b = tl.program_id(0).to(tl.int64)
    NT = N - NODE_OFF  # rows of tokens / draft_probs / uniforms per request
    n = tl.load(num_nodes_ptr + b).to(tl.int32)
    tp_req = target_probs_ptr + b * N * V
    dp_req = draft_probs_ptr + b * NT * V
    ws_row = ws_ptr + b * V
    vocab = tl.arange(0, BLOCK_V)

    cur = 0
    n_acc = 0
    use_ws = 0
    tl.store(path_ptr + b * N, 0)
    for c in range(1, n):
        parent = tl.load(parents_ptr + b * N + c)
        if parent == cur:
            x = tl.load(tokens_ptr + b * NT + c - NODE_OFF)
            dp_row = dp_req + (c - NODE_OFF) * V
            if HAS_DRAFT_PROBS:
                q_x = tl.load(dp_row + x)
            else:
                q_x = 1.0
            if use_ws != 0:
                p_x = tl.load(ws_row + x)
            else:
                p_x = tl.load(tp_req + cur * V + x)
            u = tl.load(uniforms_ptr + b * NT + c - NODE_OFF)
            if u * q_x < p_x:  # accept: continue from this child with the target's distribution there
                cur = c
                n_acc += 1
                use_ws = 0
                tl.store(path_ptr + b * N + n_acc, c)
            else:  # reject: p <- normalize(max(p - q, 0)), unless that is all zero (then keep p)
                mass = 0.0
                for v0 in range(0, V, BLOCK_V):
                    offs = v0 + vocab
                    m = offs < V
                    p = _load_p(ws_row, tp_req + cur * V, use_ws, offs, m)
                    q = _load_q(dp_row, x, offs, m, HAS_DRAFT_PROBS)
                    mass += tl.sum(tl.maximum(p - q, 0.0), axis=0)
                if mass > 0.0:
                    for v0 in range(0, V, BLOCK_V):
                        offs = v0 + vocab
                        m = offs < V
                        p = _load_p(ws_row, tp_req + cur * V, use_ws, offs, m)
                        q = _load_q(dp_row, x, offs, m, HAS_DRAFT_PROBS)
                        tl.store(ws_row + offs, tl.maximum(p - q, 0.0) / mass, mask=m)
                    use_ws = 1
                    tl.debug_barrier()  # the next scalar read of ws may come from another thread

    # next_token ~ p by inverse CDF: first t with cdf[t] > u * total (last positive token if rounding misses)
    total = 0.0
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + vocab
        total += tl.sum(_load_p(ws_row, tp_req + cur * V, use_ws, offs, offs < V), axis=0)
    threshold = tl.load(bonus_ptr + b) * total
    running = 0.0  # cdf before this tile
    token = V  # V = not found yet
    last_positive = -1
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + vocab
        m = offs < V
        p = _load_p(ws_row, tp_req + cur * V, use_ws, offs, m)
        cdf = running + tl.cumsum(p, axis=0)
        token = tl.minimum(token, tl.min(tl.where((cdf > threshold) & m, offs, V), axis=0))
        last_positive = tl.maximum(last_positive, tl.max(tl.where((p > 0.0) & m, offs, -1), axis=0))
        running = tl.max(cdf, axis=0)  # cdf is non-decreasing and masked lanes add 0
    token = tl.where(token < V, token, last_positive)
    tl.store(accept_len_ptr + b, n_acc)
    tl.store(next_token_ptr + b, token)


def rejection_sample(
    tokens: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor, target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None, uniforms: torch.Tensor, bonus_uniforms: torch.Tensor,
    node_offset: int = 0, block_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, N, V = target_probs.shape
    dev = target_probs.device
    accept_len = torch.empty(B, dtype=torch.long, device=dev)
    path = torch.full((B, N), -1, dtype=torch.long, device=dev)
    next_token = torch.empty(B, dtype=torch.long, device=dev)
    workspace = torch.empty(B, V, dtype=torch.float32, device=dev)  # residual distribution per request
    if block_v is None:
        block_v = min(4096, triton.next_power_of_2(V))
    if B > 0:
        target_probs = target_probs.contiguous()
        _rejection_tree_kernel[(B,)](
            tokens.contiguous(), parents.contiguous(), num_nodes.contiguous(), target_probs,
            target_probs if draft_probs is None else draft_probs.contiguous(),  # dummy pointer when None
            uniforms.contiguous(), bonus_uniforms.contiguous(), workspace, accept_len, path, next_token,
            N, V, NODE_OFF=node_offset, HAS_DRAFT_PROBS=draft_probs is not None, BLOCK_V=block_v,
            num_warps=8 if block_v >= 2048 else 4,
        )
    return accept_len, path, next_token


# ------------------------------------------------------------------------------------------------ kv compact
@triton.jit
def _kv_compact_kernel(
    cache_ptr, src_ptr, lengths_ptr, dst_ptr, L, D,
    stride_b, stride_h, stride_s, stride_d,
    BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program per (request, head, D-chunk): gather all accepted rows, barrier, then write them."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    j = tl.arange(0, BLOCK_L)
    n = tl.load(lengths_ptr + b)
    dst = tl.load(dst_ptr + b)
    jm = j < n
    src = tl.load(src_ptr + b * L + j, mask=jm, other=0)  # [BLOCK_L] int64
    m = jm[:, None] & (d < D)[None, :]
    base = cache_ptr + b * stride_b + h * stride_h
    rows = tl.load(base + src[:, None] * stride_s + d[None, :] * stride_d, mask=m)  # [BLOCK_L, BLOCK_D]
    tl.debug_barrier()  # sources may overlap destinations: every thread has read before any thread writes
    tl.store(base + (dst + j)[:, None] * stride_s + d[None, :] * stride_d, rows, mask=m)


def kv_compact(
    cache: torch.Tensor, src_idx: torch.Tensor, lengths: torch.Tensor, dst_start: torch.Tensor
) -> torch.Tensor:
    B, H, S, D = cache.shape
    L = src_idx.shape[1]
    if B * H * D == 0 or L == 0:
        return cache
    block_l = triton.next_power_of_2(L)
    block_d = min(triton.next_power_of_2(D), max(16, 8192 // block_l))  # keep the register tile <= ~8k values
    grid = (B, H, triton.cdiv(D, block_d))
    _kv_compact_kernel[grid](
        cache, src_idx.contiguous(), lengths.contiguous(), dst_start.contiguous(), L, D,
        cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3),
        BLOCK_L=block_l, BLOCK_D=block_d, num_warps=4,
    )
    return cache


KERNELS = {
    "tree_mask": _tree_mask_kernel,
    "greedy": _greedy_tree_kernel,
    "rejection": _rejection_tree_kernel,
    "kv_compact": _kv_compact_kernel,
}
INTERPRETED = bool(InterpretedFunction) and isinstance(_tree_mask_kernel, InterpretedFunction)
# Triton 3.6's interpreter turns a scalar a kernel loaded into a 1-element array and cannot loop `range(1, n)`
# over it (TypeError in its __index__); 3.9's can. Compiled kernels are unaffected (under triton 3.6 on an H200
# every case of scripts/gpu_check.py equals the PyTorch reference), so only CPU runs through the interpreter
# (the tests, gpu_check --dry) need this.
INTERPRETER_LOOPS_OVER_LOADS = tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 7)


def compile_for_gpu(arch: int = 90) -> dict[str, int]:
    """Compile every kernel variant to a cubin for sm_<arch> without a GPU (catches compiled-mode errors
    that the interpreter does not). Needs TRITON_INTERPRET unset at import. Returns cubin sizes."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    signatures = {
        "tree_mask": {"parents_ptr": "*i64", "num_nodes_ptr": "*i64", "mask_ptr": "*u8", "depth_ptr": "*i64",
                      "N": "i32"},
        "greedy": {"tokens_ptr": "*i64", "parents_ptr": "*i64", "num_nodes_ptr": "*i64", "argmax_ptr": "*i64",
                   "accept_len_ptr": "*i64", "path_ptr": "*i64", "next_token_ptr": "*i64", "N": "i32"},
        "rejection": {"tokens_ptr": "*i64", "parents_ptr": "*i64", "num_nodes_ptr": "*i64", "target_probs_ptr": "*fp32",
                      "draft_probs_ptr": "*fp32", "uniforms_ptr": "*fp32", "bonus_ptr": "*fp32", "ws_ptr": "*fp32",
                      "accept_len_ptr": "*i64", "path_ptr": "*i64", "next_token_ptr": "*i64", "N": "i32", "V": "i32"},
        "kv_compact": {"cache_ptr": "*bf16", "src_ptr": "*i64", "lengths_ptr": "*i64", "dst_ptr": "*i64", "L": "i32",
                       "D": "i32", "stride_b": "i64", "stride_h": "i64", "stride_s": "i64", "stride_d": "i64"},
    }
    variants = [  # (kernel, constexprs, num_warps) as the launchers above use them
        ("tree_mask", {"BLOCK_N": 64}, 1),
        *[("greedy", {"NODE_OFF": o}, 1) for o in (0, 1)],
        *[("rejection", {"NODE_OFF": o, "HAS_DRAFT_PROBS": h, "BLOCK_V": 4096}, 8)
          for o in (0, 1) for h in (False, True)],
        ("rejection", {"NODE_OFF": 0, "HAS_DRAFT_PROBS": True, "BLOCK_V": 1024}, 4),
        ("kv_compact", {"BLOCK_L": 64, "BLOCK_D": 128}, 4),
    ]
    sizes = {}
    for name, constexprs, num_warps in variants:
        signature = {**signatures[name], **{k: "constexpr" for k in constexprs}}
        compiled = triton.compile(ASTSource(fn=KERNELS[name], signature=signature, constexprs=constexprs),
                                  target=target, options={"num_warps": num_warps})
        sizes[f"{name}{sorted(constexprs.items())}"] = len(compiled.asm["cubin"])
    return sizes

"""Public verify API: checks inputs, then runs the Triton kernels on CUDA tensors and the PyTorch reference on CPU.

Every function takes `backend`: "auto" (CUDA -> Triton, else the reference), "torch" (always the reference) or
"triton" (always the kernels; on CPU only under TRITON_INTERPRET=1, which is how the tests run them), and
`check`: validate tree structure and index ranges (one host sync). The runtime may pass check=False in its hot
loop once its own tree builder is trusted. Probability rows are not checked (that would read all of them):
they must be non-negative with a positive sum. See `reference.py` for the tree convention and the exact math.
"""
from __future__ import annotations

import functools
import warnings
from types import ModuleType
from typing import Literal

import torch

from drafthead.kernels import reference

Backend = Literal["auto", "torch", "triton"]
BACKENDS = ("auto", "torch", "triton")


# ------------------------------------------------------------------------------------------------ dispatch
def _triton_kernels() -> ModuleType:
    try:
        from drafthead.kernels import triton_kernels
    except ImportError as e:  # triton missing or broken
        raise RuntimeError(f"backend='triton' needs a working triton install ({e}); "
                           "pip install 'drafthead[triton]'") from e
    return triton_kernels


@functools.cache
def _say_no_triton(why: str) -> None:
    # once a process: CUDA tensors verified by the PyTorch reference is a slow path, never a silent one
    warnings.warn(f"verify kernels: {why}; CUDA tensors use the PyTorch reference (slower)", stacklevel=3)


def _resolve(backend: str, device: torch.device) -> str:
    """The backend that will run: 'torch' or 'triton'."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        if device.type != "cuda":
            return "torch"
        try:
            _triton_kernels()
        except RuntimeError as e:
            _say_no_triton(str(e))
            return "torch"
        return "triton"
    if backend == "triton":
        kernels = _triton_kernels()
        if device.type != "cuda" and not kernels.INTERPRETED:
            raise RuntimeError(
                f"backend='triton' with {device.type} tensors needs TRITON_INTERPRET=1 set before "
                "drafthead.kernels.triton_kernels is first imported (the Triton interpreter); use a CUDA device "
                "or backend='torch'"
            )
    return backend


# ------------------------------------------------------------------------------------------------ checks
def _check_tensor(
    name: str, t: object, dtype: torch.dtype, shape: tuple[int | None, ...], device: torch.device
) -> None:
    """dtype / rank / sizes (None = any) / device; free, no host sync."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if t.dim() != len(shape) or any(s is not None and s != got for s, got in zip(shape, t.shape)):
        want = ", ".join("*" if s is None else str(s) for s in shape)
        raise ValueError(f"{name} must have shape [{want}], got {list(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the other inputs are on {device}")


def _raise_first(problems: list[tuple[str, torch.Tensor]]) -> None:
    """problems: (message, bool mask); one host sync for all of them, details only on failure."""
    if not problems:
        return
    flags = torch.stack([m.any() for _, m in problems]).tolist()
    for (message, m), bad in zip(problems, flags):
        if bad:
            where = [int(i) for i in m.nonzero()[0]]
            raise ValueError(f"{message} (first at index {where})")


def _tree_problems(parents: torch.Tensor, num_nodes: torch.Tensor, tokens: torch.Tensor | None, vocab: int | None):
    N = parents.shape[1]
    idx = torch.arange(N, device=parents.device)
    draft = (idx >= 1) & (idx < num_nodes[:, None])  # [B, N] real non-root nodes
    problems = [
        (f"num_nodes must be in 1..{N} (node slots)", (num_nodes < 1) | (num_nodes > N)),
        ("parents[:, 0] must be -1 (node 0 is the root)", parents[:, 0] != -1),
        ("parents[b, i] must be in 0..i-1 for 1 <= i < num_nodes[b] (topological order)",
         draft & ((parents < 0) | (parents >= idx))),
    ]
    if tokens is not None and vocab is not None:
        problems.append((f"draft tokens must be in 0..{vocab - 1} (vocab)", draft & ((tokens < 0) | (tokens >= vocab))))
    return problems


def _check_tree_shapes(tokens, parents, num_nodes) -> tuple[int, int]:
    if not isinstance(parents, torch.Tensor) or parents.dim() != 2:
        raise ValueError(f"parents must be a [B, N] tensor, got {getattr(parents, 'shape', type(parents).__name__)}")
    B, N = parents.shape
    dev = parents.device
    _check_tensor("parents", parents, torch.long, (B, N), dev)
    _check_tensor("num_nodes", num_nodes, torch.long, (B,), dev)
    if tokens is not None:
        _check_tensor("tokens", tokens, torch.long, (B, N), dev)
    return B, N


# ------------------------------------------------------------------------------------------------ API
def build_tree_mask(
    parents: torch.Tensor, num_nodes: torch.Tensor, backend: Backend = "auto", check: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask [B, N, N] bool, depth [B, N] int64): mask[b, i, j] = j is i or an ancestor of i.

    Padding slots get depth 0 and only their diagonal set (see `reference.build_tree_mask`).
    """
    _check_tree_shapes(None, parents, num_nodes)
    if check:
        _raise_first(_tree_problems(parents, num_nodes, None, None))
    if _resolve(backend, parents.device) == "triton":
        return _triton_kernels().build_tree_mask(parents, num_nodes)
    return reference.build_tree_mask(parents, num_nodes)


def greedy_verify_tree(
    tokens: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor, target_argmax: torch.Tensor,
    backend: Backend = "auto", check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(accept_len [B], path [B, N], next_token [B]) of greedy tree acceptance against the target argmax."""
    B, N = _check_tree_shapes(tokens, parents, num_nodes)
    _check_tensor("target_argmax", target_argmax, torch.long, (B, N), parents.device)
    if check:
        _raise_first(_tree_problems(parents, num_nodes, None, None))
    if _resolve(backend, parents.device) == "triton":
        return _triton_kernels().greedy_verify(tokens, parents, num_nodes, target_argmax)
    return reference.greedy_verify_tree(tokens, parents, num_nodes, target_argmax)


def rejection_sample_tree(
    tokens: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor, target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None, uniforms: torch.Tensor, bonus_uniforms: torch.Tensor,
    backend: Backend = "auto", check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(accept_len [B], path [B, N], next_token [B]) of lossless recursive rejection sampling over the tree."""
    if not isinstance(target_probs, torch.Tensor) or target_probs.dim() != 3:
        raise ValueError(f"target_probs must be a [B, N, V] tensor, got {getattr(target_probs, 'shape', None)}")
    V = target_probs.shape[2]
    B, N = _check_tree_shapes(tokens, parents, num_nodes)
    dev = parents.device
    _check_tensor("target_probs", target_probs, torch.float32, (B, N, V), dev)
    if draft_probs is not None:
        _check_tensor("draft_probs", draft_probs, torch.float32, (B, N, V), dev)
    _check_tensor("uniforms", uniforms, torch.float32, (B, N), dev)
    _check_tensor("bonus_uniforms", bonus_uniforms, torch.float32, (B,), dev)
    if check:
        _raise_first(_tree_problems(parents, num_nodes, tokens, V))
    if _resolve(backend, dev) == "triton":
        return _triton_kernels().rejection_sample(
            tokens, parents, num_nodes, target_probs, draft_probs, uniforms, bonus_uniforms
        )
    return reference.rejection_sample_tree(
        tokens, parents, num_nodes, target_probs, draft_probs, uniforms, bonus_uniforms
    )


def chain_tree(
    batch: int, num_draft_tokens: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(parents [B, K+1], num_nodes [B]) of a chain of K drafts behind the root: parents[i] = i - 1."""
    parents = torch.arange(-1, num_draft_tokens, device=device).expand(batch, -1).contiguous()
    return parents, torch.full((batch,), num_draft_tokens + 1, dtype=torch.long, device=device)


def _check_chain_shape(draft_tokens: torch.Tensor) -> tuple[int, int]:
    if not isinstance(draft_tokens, torch.Tensor) or draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must be a [B, K] tensor, got {getattr(draft_tokens, 'shape', None)}")
    B, K = draft_tokens.shape
    _check_tensor("draft_tokens", draft_tokens, torch.long, (B, K), draft_tokens.device)
    return B, K


def greedy_verify_chain(
    draft_tokens: torch.Tensor, target_argmax: torch.Tensor, backend: Backend = "auto", check: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(accept_len [B], next_token [B]): longest prefix of draft_tokens [B, K] matching target_argmax [B, K+1].

    `check` is accepted for a uniform API; shapes are all there is to check here (tokens are only compared).
    """
    B, K = _check_chain_shape(draft_tokens)
    dev = draft_tokens.device
    _check_tensor("target_argmax", target_argmax, torch.long, (B, K + 1), dev)
    if _resolve(backend, dev) == "triton":
        parents, num_nodes = chain_tree(B, K, dev)
        accept_len, _, next_token = _triton_kernels().greedy_verify(
            draft_tokens, parents, num_nodes, target_argmax, node_offset=1
        )
        return accept_len, next_token
    return reference.greedy_verify_chain(draft_tokens, target_argmax)


def rejection_sample_chain(
    draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
    uniforms: torch.Tensor, bonus_uniforms: torch.Tensor, backend: Backend = "auto", check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(accept_len [B], next_token [B]) of speculative sampling on a chain (Leviathan/Chen).

    draft_tokens [B, K], draft_probs [B, K, V] | None (one-hot drafts), target_probs [B, K+1, V],
    uniforms [B, K], bonus_uniforms [B].
    """
    if not isinstance(target_probs, torch.Tensor) or target_probs.dim() != 3:
        raise ValueError(f"target_probs must be a [B, K+1, V] tensor, got {getattr(target_probs, 'shape', None)}")
    V = target_probs.shape[2]
    B, K = _check_chain_shape(draft_tokens)
    dev = draft_tokens.device
    _check_tensor("target_probs", target_probs, torch.float32, (B, K + 1, V), dev)
    if draft_probs is not None:
        _check_tensor("draft_probs", draft_probs, torch.float32, (B, K, V), dev)
    _check_tensor("uniforms", uniforms, torch.float32, (B, K), dev)
    _check_tensor("bonus_uniforms", bonus_uniforms, torch.float32, (B,), dev)
    if check:
        _raise_first([(f"draft_tokens must be in 0..{V - 1} (vocab)", (draft_tokens < 0) | (draft_tokens >= V))])
    if _resolve(backend, dev) == "triton":
        parents, num_nodes = chain_tree(B, K, dev)
        accept_len, _, next_token = _triton_kernels().rejection_sample(
            draft_tokens, parents, num_nodes, target_probs, draft_probs, uniforms, bonus_uniforms, node_offset=1
        )
        return accept_len, next_token
    return reference.rejection_sample_chain(draft_tokens, draft_probs, target_probs, uniforms, bonus_uniforms)


def kv_compact(
    cache: torch.Tensor, src_idx: torch.Tensor, lengths: torch.Tensor, dst_start: torch.Tensor,
    backend: Backend = "auto", check: bool = True,
) -> torch.Tensor:
    """In place: cache[b, :, dst_start[b] + j] = cache[b, :, src_idx[b, j]] for j < lengths[b]. Returns cache.

    cache [B, H, S, D] (any float dtype, any strides), src_idx [B, L] int64 with src_idx[b, j] >= dst_start[b] + j
    (the accepted path moves towards the front), lengths [B] int64, dst_start [B] int64.
    """
    if not isinstance(cache, torch.Tensor) or cache.dim() != 4:
        raise ValueError(f"cache must be a [B, H, S, D] tensor, got {getattr(cache, 'shape', None)}")
    B, H, S, D = cache.shape
    dev = cache.device
    if not isinstance(src_idx, torch.Tensor) or src_idx.dim() != 2:
        raise ValueError(f"src_idx must be a [B, L] tensor, got {getattr(src_idx, 'shape', None)}")
    L = src_idx.shape[1]
    _check_tensor("src_idx", src_idx, torch.long, (B, L), dev)
    _check_tensor("lengths", lengths, torch.long, (B,), dev)
    _check_tensor("dst_start", dst_start, torch.long, (B,), dev)
    if check:
        j = torch.arange(L, device=dev)
        used = j < lengths[:, None]  # [B, L]
        _raise_first([
            (f"lengths must be in 0..{L} (columns of src_idx)", (lengths < 0) | (lengths > L)),
            (f"dst_start must be >= 0 and dst_start + lengths <= {S} (cache length)",
             (dst_start < 0) | (dst_start + lengths > S)),
            (f"src_idx[b, j] must be < {S} (cache length)", used & (src_idx >= S)),
            ("src_idx[b, j] must be >= dst_start[b] + j (entries only move towards the front)",
             used & (src_idx < dst_start[:, None] + j)),
        ])
    if _resolve(backend, dev) == "triton":
        return _triton_kernels().kv_compact(cache, src_idx, lengths, dst_start)
    return reference.kv_compact(cache, src_idx, lengths, dst_start)

"""Verify-side ops used by the runtime: tree masks, acceptance, sampling, KV compaction.

One import point so the runtime never cares whether the Triton kernels (`drafthead.kernels.verify`,
which dispatch to their eager reference on CPU) or the plain PyTorch reference are in use; both have
the same signatures and semantics (see `drafthead/kernels/reference.py`).
"""
from __future__ import annotations

try:
    from drafthead.kernels import verify as _impl
except ImportError:  # kernels not available: the eager reference has the same contract
    from drafthead.kernels import reference as _impl

build_tree_mask = _impl.build_tree_mask
greedy_verify_tree = _impl.greedy_verify_tree
greedy_verify_chain = _impl.greedy_verify_chain
rejection_sample_tree = _impl.rejection_sample_tree
rejection_sample_chain = _impl.rejection_sample_chain
kv_compact = _impl.kv_compact

__all__ = ["build_tree_mask", "greedy_verify_tree", "greedy_verify_chain", "rejection_sample_tree",
           "rejection_sample_chain", "kv_compact"]

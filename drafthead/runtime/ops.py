"""Verify-side ops used by the runtime: tree masks, acceptance, sampling, KV compaction.

One import point, so the runtime never cares which backend runs: `drafthead.kernels.verify` dispatches to
the Triton kernels on CUDA and to their eager reference elsewhere (`drafthead/kernels/reference.py`), with
the same signatures and semantics.
"""
from __future__ import annotations

from drafthead.kernels import verify as _impl  # imports triton only when a CUDA kernel is first called

build_tree_mask = _impl.build_tree_mask
greedy_verify_tree = _impl.greedy_verify_tree
greedy_verify_chain = _impl.greedy_verify_chain
rejection_sample_tree = _impl.rejection_sample_tree
rejection_sample_chain = _impl.rejection_sample_chain
kv_compact = _impl.kv_compact

__all__ = ["build_tree_mask", "greedy_verify_tree", "greedy_verify_chain", "rejection_sample_tree",
           "rejection_sample_chain", "kv_compact"]

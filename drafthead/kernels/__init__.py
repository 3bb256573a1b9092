"""Verify-step kernels for speculative decoding: tree mask, greedy and lossless rejection-sampling acceptance
over draft trees and chains, and K/V compaction of the accepted path.

`verify` is the public API (Triton on CUDA, PyTorch reference elsewhere); `reference` is the readable spec.
"""
from drafthead.kernels.verify import (
    BACKENDS,
    build_tree_mask,
    chain_tree,
    greedy_verify_chain,
    greedy_verify_tree,
    kv_compact,
    rejection_sample_chain,
    rejection_sample_tree,
)

__all__ = [
    "BACKENDS",
    "build_tree_mask",
    "chain_tree",
    "greedy_verify_chain",
    "greedy_verify_tree",
    "kv_compact",
    "rejection_sample_chain",
    "rejection_sample_tree",
]

"""Kernels: the verify step, and the CPU decode kernels.

- Verify (exported here): tree mask, greedy and lossless rejection-sampling acceptance over draft trees and
  chains, K/V compaction of the accepted path. `verify` is the public API (Triton on CUDA, the PyTorch
  reference elsewhere); `reference` is the readable spec; `triton_kernels` the CUDA kernels.
- CPU decode, imported where used, one concern a module: `extension` (building `cpu_linear.cpp` (AVX512-BF16)
  and `cpu_linear_avx2.cpp` (fp32 on AVX2/FMA, with AVX-512 paths where the CPU has them) on first use, whether
  this CPU runs them, the tile-path switches), `cpu_linear` (the ops: packed bf16 / fp32 projections, attention,
  norms, RoPE, SiLU-and-multiply, the kernel's peak rate), `packing` (`PackedLinear`, joined projections, one-call
  decoder layers, a module with its linears packed) and `hugepages` (2 MB pages for the packed weights).
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

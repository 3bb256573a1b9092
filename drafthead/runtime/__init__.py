"""Speculative decoding runtime: lean target forward, chain / EAGLE-2 tree / n-gram drafting,
lossless verification, KV rollback, batching, adaptive draft length."""
from drafthead.runtime.generate import GenerationResult, SpecConfig, SpeculativeGenerator
from drafthead.runtime.model import TargetModel

__all__ = ["GenerationResult", "SpecConfig", "SpeculativeGenerator", "TargetModel"]

"""Speculative decoding runtime: lean target forward, chain / EAGLE-2 tree / n-gram drafting,
lossless verification, KV rollback, batching, adaptive draft length."""
from drafthead.runtime.contract import SpecConfig
from drafthead.runtime.generate import GenerationResult, SpeculativeGenerator
from drafthead.runtime.model import TargetModel

__all__ = ["GenerationResult", "SpecConfig", "SpeculativeGenerator", "TargetModel"]

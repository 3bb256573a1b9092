"""GGUF writing every family's `to=gguf` shares: the output types, the llama-style keys, the target's tokenizer
copied, tensors encoded, the file written atomically, and llama.cpp's RoPE row order.

Written with the PyPI `gguf` writer; names, keys and layouts were read from the llama.cpp tree vendored in
llama-cpp-python 0.3.36 (each family's own file says which parts of it).
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from drafthead.export.common import ExportError, default_mode
from drafthead.export.gguf_meta import read_gguf_metadata
from drafthead.io import writing

OUTTYPES = ("f32", "f16", "bf16", "q8_0")
# general.file_type values (llama.cpp `llama_ftype`)
FILE_TYPES = {"f32": 0, "f16": 1, "q8_0": 7, "bf16": 32}


def rope_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF rotate-half row order -> llama.cpp's interleaved pairs, per head. w: [n_heads*D, in]."""
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, d // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def rope_unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of `rope_permute`."""
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, d // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def encode_tensor(name: str, t: torch.Tensor, outtype: str):
    """(array, raw_dtype) for GGUFWriter.add_tensor. 1-D tensors stay f32 (norms) / i64 (d2t)."""
    import gguf
    from gguf import quants

    q = gguf.GGMLQuantizationType
    if t.dtype == torch.int64:
        return t.numpy(), q.I64
    a = t.detach().float().contiguous().numpy()
    if a.ndim < 2 or outtype == "f32":
        return a, q.F32
    if outtype == "f16":
        return a.astype(np.float16), q.F16
    if outtype == "bf16":
        return quants.quantize(a, q.BF16), q.BF16
    block = gguf.GGML_QUANT_SIZES[q.Q8_0][0]
    if a.shape[-1] % block:  # rows that do not split into 32-blocks: f16, as llama.cpp's converter does
        return a.astype(np.float16), q.F16
    return quants.quantize(a, q.Q8_0), q.Q8_0


def add_model_keys(w, cfg, name: str, block_count: int, outtype: str) -> None:
    """The general and llama-style keys every draft GGUF carries (`{arch}.*` under the writer's arch), from a
    config with hidden_size, intermediate_size, heads, head_dim, rope_theta, rms_norm_eps, vocab_size."""
    import gguf

    w.add_type("model")
    w.add_name(name)
    w.add_file_type(FILE_TYPES[outtype])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(block_count)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)


def copy_tokenizer(target_gguf: Path, writer) -> int:
    """Copy every `tokenizer.*` key of the target GGUF (same value types); returns how many."""
    import gguf

    n = 0
    for key, (vtype, sub, value) in read_gguf_metadata(target_gguf).items():
        if not key.startswith("tokenizer."):
            continue
        if sub is None:
            writer.add_key_value(key, value, gguf.GGUFValueType(vtype))
        else:
            writer.add_key_value(key, value, gguf.GGUFValueType(vtype), sub_type=gguf.GGUFValueType(sub))
        n += 1
    if not n:
        raise ExportError(f"{target_gguf}: no tokenizer.* metadata to copy")
    return n


def write_tensors(w, tensors: dict[str, torch.Tensor], outtype: str) -> None:
    """Add `tensors` (llama.cpp names) encoded as `outtype`, then write the header, keys and tensors and close."""
    for name, t in tensors.items():
        arr, raw = encode_tensor(name, t, outtype)
        w.add_tensor(name, arr, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_atomic(out: Path, write) -> Path:
    """`write(tmp_path)` a GGUF next to `out`, fsync it, give it umask permissions and rename it to `out`:
    a failed export leaves nothing at `out`."""
    with writing(out):
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.tmp-", dir=out.parent)
        os.close(fd)
    try:
        with writing(out):
            write(Path(tmp))
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            default_mode(tmp)
            os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out

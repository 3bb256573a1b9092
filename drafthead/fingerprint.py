"""Which target a draft was trained on, so a draft refuses another one of the same shape.

A draft reads the target's hidden states: trained on one checkpoint and run on another (a fine-tune, another
quantisation, another size with the same hidden width) it decodes without a word and its τ is garbage. The
fingerprint has three parts, each a short sha256:
- `config`: the target's geometry (model type, layers, widths, heads, vocab size);
- `weights`: every parameter's first, middle and last rows (a 1-D parameter whole), rounded to bf16, so the
  same checkpoint loaded in fp32 or bf16 gives the same value and a fine-tune or another quantisation does not;
- `vocab`: the tokenizer's token -> id map.
Computing it reads ~1 MB of a 135M target and ~35 MB of a 70B one. A target on disk keeps its fingerprint in
the cache, keyed by its files' names, sizes and modification times, so an export need not load it again.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

CONFIG_FIELDS = ("model_type", "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                 "num_key_value_heads", "vocab_size", "tie_word_embeddings")
PARTS = ("config", "weights", "vocab")


class TargetMismatch(ValueError):
    """The target at hand is not the one the draft (or checkpoint) was trained on."""


def _short(h: Any) -> str:
    return h.hexdigest()[:16]


@torch.no_grad()
def compute(model: torch.nn.Module, tokenizer: Any) -> dict[str, str]:
    """The fingerprint of a loaded target (see the module docstring)."""
    cfg = model.config
    geometry = {k: getattr(cfg, k, None) for k in CONFIG_FIELDS}
    w = hashlib.sha256()
    from drafthead.split import whole

    for name, p in sorted(model.named_parameters()):  # a split target: every rank gathers, one weight at a time
        x = whole(p.detach())
        rows = x.reshape(-1) if x.ndim < 2 else x[[0, x.shape[0] // 2, x.shape[0] - 1]]
        w.update(f"{name}{tuple(x.shape)}".encode())
        w.update(rows.to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes())
    vocab = sorted(tokenizer.get_vocab().items()) if tokenizer is not None else []
    return {"config": _short(hashlib.sha256(json.dumps(geometry, sort_keys=True).encode())), "weights": _short(w),
            "vocab": _short(hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()))}


def render(fp: dict[str, str] | None) -> str:
    return "none recorded" if not fp else " ".join(f"{k}:{fp.get(k, '?')}" for k in PARTS)


def compare(recorded: dict[str, str] | None, actual: dict[str, str], allow: bool, what: str,
            option: str) -> str | None:
    """None when `actual` is the recorded target; otherwise raise TargetMismatch naming both and the differing
    parts, or, with `allow`, return that text as a note for the report. A draft written before fingerprints
    were recorded gives a note, never an error."""
    if not recorded:
        return f"{what} records no target fingerprint: the target's identity was not checked"
    differ = [k for k in PARTS if recorded.get(k) != actual.get(k)]
    if not differ:
        return None
    msg = (f"{what} was trained on another target: its {', '.join(differ)} differ (trained on {render(recorded)}; "
           f"this target is {render(actual)})")
    if not allow:
        raise TargetMismatch(f"{msg}. If both are the same model in another format, pass {option}=true")
    return msg + f"; run anyway ({option}=true)"


# ---------------------------------------------------------------------------------------------
# cache for targets on disk (exports check a target without loading it a second time)

def _files_key(path: Path, gguf_file: str | None) -> str | None:
    """Names, sizes and mtimes of the files that make up the target at `path`; None if it is not on disk."""
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = [path / gguf_file] if gguf_file else sorted(
            p for p in path.iterdir() if p.suffix in (".json", ".safetensors", ".bin", ".gguf", ".model"))
    else:
        return None
    h = hashlib.sha256()
    for f in files:
        if not f.is_file():
            return None
        st = f.stat()
        h.update(f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:32]


def _cache_file(key: str) -> Path:
    from drafthead.assets import cache_dir

    return cache_dir() / "fingerprints" / f"{key}.json"


def remember(path: str | os.PathLike, gguf_file: str | None, fp: dict[str, str]) -> None:
    key = _files_key(Path(path), gguf_file)
    if key is not None:
        from drafthead.io import atomic_write_json

        try:
            atomic_write_json(_cache_file(key), fp)
        except OSError:  # a read-only cache only costs the next export a target load
            pass


def recall(path: str | os.PathLike, gguf_file: str | None) -> dict[str, str] | None:
    key = _files_key(Path(path), gguf_file)
    if key is None or not _cache_file(key).is_file():
        return None
    try:
        fp = json.loads(_cache_file(key).read_text())
    except (OSError, ValueError):
        return None
    return fp if isinstance(fp, dict) and set(PARTS) <= set(fp) else None

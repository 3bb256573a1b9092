"""Which target an export is for, and its dimensions: a built-in name, a .gguf file, a local HF directory, or the
numbers the draft recorded at training time when the target is not on this machine."""
from __future__ import annotations

import json
import logging
from pathlib import Path

from drafthead.export.common import ExportError, TargetInfo
from drafthead.export.gguf_meta import read_gguf_metadata

log = logging.getLogger(__name__)


def gguf_target_info(path: Path, name: str) -> TargetInfo:
    kv = {k: v[2] for k, v in read_gguf_metadata(path).items()}
    arch = kv.get("general.architecture")
    if arch is None:
        raise ExportError(f"{path}: not a model GGUF (no general.architecture)")
    tokens = kv.get("tokenizer.ggml.tokens")
    vocab = len(tokens) if tokens is not None else kv.get(f"{arch}.vocab_size")
    hidden, layers = kv.get(f"{arch}.embedding_length"), kv.get(f"{arch}.block_count")
    if vocab is None or hidden is None or layers is None:
        raise ExportError(f"{path}: GGUF lacks tokenizer.ggml.tokens/{arch}.vocab_size, "
                          f"{arch}.embedding_length or {arch}.block_count")
    return TargetInfo(name, int(vocab), int(hidden), int(layers), [_hf_arch(arch)], path, f"GGUF {path}")


def _hf_arch(gguf_arch: str) -> str:
    return {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "mistral": "MistralForCausalLM"}.get(gguf_arch, gguf_arch)


def hf_dir_target_info(path: Path, name: str, gguf_file: str | None) -> TargetInfo:
    cfg = json.loads((path / "config.json").read_text())
    cfg = {**cfg, **cfg.get("text_config", {})}
    try:
        info = TargetInfo(name, int(cfg["vocab_size"]), int(cfg["hidden_size"]), int(cfg["num_hidden_layers"]),
                          list(cfg.get("architectures") or ["LlamaForCausalLM"]), None, f"{path}/config.json",
                          cfg.get("torch_dtype") or cfg.get("dtype"))
    except KeyError as e:
        raise ExportError(f"{path}/config.json has no {e.args[0]}") from None
    g = path / gguf_file if gguf_file else None
    if g is None:
        found = sorted(path.glob("*.gguf"))
        g = found[0] if len(found) == 1 else None
    info.gguf_path = g if g is not None and g.is_file() else None
    return info


def export_target_info(target: str | None, meta: dict) -> TargetInfo:
    """The target named by `target=` or, by default, the one recorded in the draft's config.json.

    A built-in name, a `.gguf` file, or a local HF directory (config.json). When the recorded default
    cannot be found on this machine, the dimensions recorded at training time are used.
    """
    from drafthead.target import BUILTIN_TARGETS

    recorded = meta.get("target") or {}
    explicit = target is not None
    name = target if explicit else recorded.get("name_or_path")
    if not name:
        raise ExportError("no target: pass target=NAME_OR_PATH (the draft's config.json names none)")
    gguf_file = None if explicit else recorded.get("gguf_file")
    if name in BUILTIN_TARGETS:
        from drafthead.assets import asset_path

        return gguf_target_info(asset_path(name), name)
    p = Path(name)
    if p.suffix == ".gguf" and p.is_file():
        return gguf_target_info(p, name)
    if p.is_dir() and (p / "config.json").is_file():
        return hf_dir_target_info(p, name, gguf_file)
    if p.is_dir() and gguf_file and (p / gguf_file).is_file():
        return gguf_target_info(p / gguf_file, name)
    if explicit:
        raise ExportError(f"target {name!r} not found: give a built-in name, a .gguf file or a local HF "
                          f"directory with config.json")
    try:
        info = TargetInfo(name, int(recorded["vocab_size"]), int(recorded["hidden_size"]),
                          int(recorded["num_hidden_layers"]),
                          [recorded.get("architecture") or "LlamaForCausalLM"], None, "the draft's config.json")
    except KeyError as e:
        raise ExportError(f"target {name!r} is not on this machine and the draft records no {e.args[0]}; "
                          f"pass target=") from None
    log.warning("target %r not found locally; using the dimensions recorded in the draft", name)
    return info

"""What every exporter needs: the target's dimensions, GGUF metadata, output types, atomic writes.

An export never starts writing before all of this has passed, so a bad draft or a mismatched target
leaves nothing at `out`.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch


log = logging.getLogger(__name__)


class ExportError(ValueError):
    """A draft, target or option that cannot be exported as asked."""


@dataclass
class TargetInfo:
    """The target's dimensions as far as exports need them."""

    name_or_path: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    architectures: list[str] = field(default_factory=lambda: ["LlamaForCausalLM"])
    gguf_path: Path | None = None  # the target as one GGUF file (tokenizer metadata for to=gguf)
    source: str = ""  # where the numbers came from, for messages
    dtype: str | None = None  # the checkpoint's declared torch_dtype (HF config.json); None: not declared (GGUF)


def absolute_d2t(d2t: torch.Tensor) -> torch.Tensor:
    """SGLang/vLLM offsets -> absolute target ids (what llama.cpp stores). [N]"""
    return d2t + torch.arange(d2t.numel(), dtype=d2t.dtype)


# ---------------------------------------------------------------------------------------------
# target

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
STRING, ARRAY = 8, 9


def read_gguf_metadata(path: str | os.PathLike) -> dict[str, tuple[int, int | None, Any]]:
    """All key/values of a GGUF file: {key: (value type, array item type or None, value)}.

    Our own reader of the KV section (little-endian GGUF v2/v3): `gguf.GGUFReader` builds a numpy
    view per string and needs ~1 min for a 49k-token vocabulary on a busy 2-core machine; this ~0.1 s.
    """
    import mmap
    import struct

    with open(path, "rb") as f:
        head = f.read(24)
        if len(head) < 24 or head[:4] != b"GGUF":
            raise ExportError(f"{path}: not a GGUF file")
        version, _, n_kv = struct.unpack("<IQQ", head[4:])
        if version not in (2, 3):
            raise ExportError(f"{path}: unsupported GGUF version {version} (or big-endian file)")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # only the metadata pages are read
    try:
        return _parse_kv(buf, 24, n_kv, str(path))
    finally:
        buf.close()


def _parse_kv(buf, pos: int, n_kv: int, path: str) -> dict[str, tuple[int, int | None, Any]]:
    import struct

    def take(fmt: str):
        nonlocal pos
        v = struct.unpack_from(fmt, buf, pos)[0]
        pos += struct.calcsize(fmt)
        return v

    def string() -> str:
        nonlocal pos
        n = take("<Q")
        pos += n
        return bytes(buf[pos - n: pos]).decode("utf-8")

    def value(t: int):
        if t == STRING:
            return string()
        if t in _SCALARS:
            return take(_SCALARS[t])
        raise ExportError(f"{path}: unexpected GGUF value type {t}")

    out: dict[str, tuple[int, int | None, Any]] = {}
    for _ in range(n_kv):
        key = string()
        t = take("<I")
        if t != ARRAY:
            out[key] = (t, None, value(t))
            continue
        sub, n = take("<I"), take("<Q")
        if sub in _NUMPY:
            arr = np.frombuffer(buf, dtype=_NUMPY[sub], count=n, offset=pos)
            pos += arr.nbytes
            items = arr.tolist()
            del arr  # release the mmap export before close
        else:
            items = [value(sub) for _ in range(n)]
        out[key] = (t, sub, items)
    return out


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


# ---------------------------------------------------------------------------------------------
# shared config pieces

SPECULATORS_VERSION = "0.1.0"  # the speculators config schema the `to=speculators` layouts follow
# built-in target names -> the public model id a vLLM user would serve as the verifier
VERIFIER_IDS = {"smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}

def llama_fields(cfg: Any) -> dict[str, Any]:
    """The HF LlamaConfig fields of a one-layer draft (hidden_size, heads, ...: SGLang/vLLM/speculators read these)."""
    return {
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    }


SAFETENSORS_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def check_gguf_out(out: str | os.PathLike, outtype: str, allowed) -> Path:
    """The checks every `to=gguf` export makes before any work: a known output type, a .gguf file name."""
    if outtype not in allowed:
        raise ExportError(f"outtype={outtype!r} is not a GGUF output type; choose one of {list(allowed)}")
    out = Path(out)
    if out.suffix != ".gguf":
        raise ExportError(f"to=gguf writes one file: out={str(out)!r} must end in .gguf")
    return out


def serving_outtype(outtype: str | None, target: TargetInfo) -> str:
    """The dtype a draft for vLLM / SGLang is written in: `outtype` where given, else what the engines serve it
    in: fp16 beside a target whose checkpoint is fp16, bf16 otherwise (half an fp32 file, and the engine casts
    nothing on load). `outtype=f32` keeps a draft's fp32 weights (an fp32 engine run, as `drafthead eval
    engine=vllm dtype=float32` makes)."""
    if outtype is not None:
        return outtype
    return "f16" if target.dtype == "float16" else "bf16"


def cast_state(state: dict[str, torch.Tensor], outtype: str | None, target: TargetInfo) -> dict[str, torch.Tensor]:
    """Float tensors cast for the vLLM / SGLang safetensors formats (`serving_outtype`; d2t/t2d keep int64/bool)."""
    outtype = serving_outtype(outtype, target)
    if outtype not in SAFETENSORS_DTYPES:
        raise ExportError(f"outtype={outtype!r} is not available for safetensors exports; "
                          f"choose one of {sorted(SAFETENSORS_DTYPES)}")
    dt = SAFETENSORS_DTYPES[outtype]
    return {k: (v.to(dt) if v.is_floating_point() else v) for k, v in state.items()}


def default_mode(path: str | os.PathLike, directory: bool = False) -> None:
    """Give a temp file/dir (mkstemp/mkdtemp: 0600/0700) and, for a dir, its files the permissions a
    plain open/mkdir would: an export is meant to be read by servers running as other users."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, (0o777 if directory else 0o666) & ~mask)
    if directory:
        for f in Path(path).iterdir():
            if f.is_file():
                os.chmod(f, 0o666 & ~mask)


def dtype_name(state: dict[str, torch.Tensor]) -> str:
    dt = state["fc.weight"].dtype if "fc.weight" in state else torch.float32
    return str(dt).removeprefix("torch.")


FINGERPRINT_KEY = "drafthead_target_fingerprint"  # a config field the engines ignore
GGUF_FINGERPRINT_KEY = "drafthead.target_fingerprint"  # llama.cpp ignores keys it does not know


def target_fingerprint(meta: dict) -> str | None:
    """The fingerprint of the target the draft was trained on, as exports carry it (None if not recorded)."""
    from drafthead.fingerprint import render

    fp = (meta.get("target") or {}).get("fingerprint")
    return render(fp) if fp else None


def write_hf_dir(out: str | os.PathLike, state: dict, config: dict, meta: dict | None = None) -> Path:
    """`model.safetensors` + `config.json` into `out`, atomically, with umask permissions; `meta` (the draft's
    config.json) adds the target's fingerprint."""
    from safetensors.torch import save_file

    from drafthead.io import atomic_dir

    fp = target_fingerprint(meta or {})
    config = {**config, FINGERPRINT_KEY: fp} if fp else config
    with atomic_dir(out) as tmp:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        default_mode(tmp, directory=True)
    return Path(out)

"""What every exporter writes with: its error, the target's dimensions (`TargetInfo`, found by
`export.target_info`), output types, file modes, the fingerprint a written export carries, the HF directory writer.

An export never starts writing before all of this has passed, so a bad draft or a mismatched target
leaves nothing at `out`.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


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

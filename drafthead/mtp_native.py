"""Native MTP weights in target checkpoints: how many layers a config declares, their names <-> drafthead's
MTP names, and reading them from safetensors.

Three layouts exist (reference notes, section 3; transformers `conversion_mapping` "MtpModel"; vLLM's
`mimo_mtp.py`):
- "nextn" (DeepSeek-V3, GLM-4.5/4.7, ...): extra decoder layers `model.layers.{N+i}.*` with
  `enorm`, `hnorm`, `eh_proj`, the block's usual names, `shared_head.{norm,head}` and a copy of
  `embed_tokens`; `num_nextn_predict_layers` = how many. Ours: `layers.{i}.*`, a prefix rename (the
  per-layer embedding copy is dropped: the drafter shares the target's).
- "mtp" (Qwen3.5 / Qwen3-Next): `mtp.fc` (= eh_proj), `mtp.pre_fc_norm_embedding` (= enorm),
  `mtp.pre_fc_norm_hidden` (= hnorm), `mtp.norm` (= shared_head.norm) shared by all MTP layers, and
  `mtp.layers.{i}.*` decoder layers; `mtp_num_hidden_layers` = how many. The head is the target's lm_head.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

# model types whose MTP/decoder blocks use a gated attention output and (1 + w) RMSNorms
QWEN_NEXT_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
MIMO_ARCH = "MiMoForCausalLM"
MIMO_NAMES = {"token_layernorm.weight": "enorm.weight", "hidden_layernorm.weight": "hnorm.weight",
              "input_proj.weight": "eh_proj.weight", "final_layernorm.weight": "shared_head.norm.weight"}
QWEN_SHARED = {"fc.weight": "eh_proj.weight", "pre_fc_norm_embedding.weight": "enorm.weight",
               "pre_fc_norm_hidden.weight": "hnorm.weight", "norm.weight": "shared_head.norm.weight"}


def native_mtp_layers(text_config: Any) -> int:
    """MTP layers a checkpoint declares: DeepSeek/GLM/MiMo `num_nextn_predict_layers`, Qwen3.5
    `mtp_num_hidden_layers`, MiniMax `num_mtp_modules` (transformers' alias `num_mtp_layers`)."""
    for name in ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_modules", "num_mtp_layers"):
        n = getattr(text_config, name, None)
        if isinstance(n, int) and n > 0:
            return n
    return 0


def _text(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def layout(config: Any) -> str:
    """'mtp' for Qwen3.5 / Qwen3-Next checkpoints, 'mimo' for MiMo ones, else 'nextn'."""
    model_type = getattr(_text(config), "model_type", "")
    if model_type in QWEN_NEXT_TYPES:
        return "mtp"
    archs = [*(getattr(config, "architectures", None) or []), *(getattr(_text(config), "architectures", None) or [])]
    return "mimo" if model_type == "mimo" or MIMO_ARCH in archs else "nextn"


def _swap_halves(w: torch.Tensor) -> torch.Tensor:
    """[H, 2H] with column halves (a; b) -> (b; a): MiMo's input_proj <-> our eh_proj, both ways."""
    h = w.shape[1] // 2
    return torch.cat([w[:, h:], w[:, :h]], dim=1)


def native_prefixes(config: Any) -> tuple[str, ...]:
    """Key prefixes that hold MTP tensors in the target checkpoint."""
    t = _text(config)
    if layout(config) == "mtp":
        return ("mtp.",)
    N, n = t.num_hidden_layers, native_mtp_layers(t)
    if layout(config) == "mimo":
        return tuple(f"model.mtp_layers.{i}." for i in range(n))
    return tuple(f"model.layers.{N + i}." for i in range(n))


def to_ours(state: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """Native MTP tensors -> `layers.{i}.*` (other keys in `state` are ignored)."""
    t = _text(config)
    out: dict[str, torch.Tensor] = {}
    if layout(config) == "mtp":
        layer_ids = sorted({int(m.group(1)) for k in state if (m := re.match(r"mtp\.layers\.(\d+)\.", k))})
        for k, v in state.items():
            if m := re.match(r"mtp\.layers\.(\d+)\.(.+)$", k):
                out[f"layers.{m.group(1)}.{m.group(2)}"] = v
        for theirs, ours in QWEN_SHARED.items():
            if f"mtp.{theirs}" in state:
                for i in layer_ids:
                    out[f"layers.{i}.{ours}"] = state[f"mtp.{theirs}"]
        return out
    if layout(config) == "mimo":
        for k, v in state.items():
            if m := re.match(r"model\.mtp_layers\.(\d+)\.(.+)$", k):
                rest = m.group(2)
                out[f"layers.{m.group(1)}.{MIMO_NAMES.get(rest, rest)}"] = (
                    _swap_halves(v) if rest == "input_proj.weight" else v)
        return out
    N = t.num_hidden_layers
    for k, v in state.items():
        m = re.match(r"model\.layers\.(\d+)\.(.+)$", k)
        if m and int(m.group(1)) >= N and m.group(2) != "embed_tokens.weight":
            out[f"layers.{int(m.group(1)) - N}.{m.group(2)}"] = v
    return out


def to_native(ours: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """`layers.{i}.*` -> the target checkpoint's MTP names (the inverse of `to_ours`).

    The Qwen layout has one fc/pre-norms/norm for all layers: they must be equal across our modules.
    Its head and MiMo's are the target's lm_head, so `shared_head.head` is not written there.
    """
    t = _text(config)
    out: dict[str, torch.Tensor] = {}
    if layout(config) == "mimo":
        theirs = {v: k for k, v in MIMO_NAMES.items()}
        for k, v in ours.items():
            i, rest = k.split(".", 2)[1:]
            if not rest.startswith("shared_head.head"):
                out[f"model.mtp_layers.{i}.{theirs.get(rest, rest)}"] = (
                    _swap_halves(v) if rest == "eh_proj.weight" else v)
        return out
    if layout(config) == "nextn":
        N = t.num_hidden_layers
        for k, v in ours.items():
            i, rest = k.split(".", 2)[1:]
            out[f"model.layers.{N + int(i)}.{rest}"] = v
        return out
    shared = {v: k for k, v in QWEN_SHARED.items()}
    for k, v in ours.items():
        i, rest = k.split(".", 2)[1:]
        if rest in shared:
            name = f"mtp.{shared[rest]}"
            if name in out and not torch.equal(out[name], v):
                raise ValueError(f"Qwen MTP layout shares {name} across layers, but layer {i} differs")
            out[name] = v
        elif not rest.startswith("shared_head.head"):
            out[f"mtp.layers.{i}.{rest}"] = v
    return out


def checkpoint_dir(name_or_path: str) -> Path | None:
    """Local folder of a target checkpoint: the path itself, or the HF cache snapshot of a hub id
    (never downloads; the target was loaded from it already)."""
    p = Path(name_or_path)
    if p.is_dir():
        return p
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name_or_path, local_files_only=True,
                                      allow_patterns=["*.json", "*.safetensors"]))
    except Exception:  # not cached / not a hub id
        return None


def read_native(name_or_path: str, config: Any) -> dict[str, torch.Tensor] | None:
    """The MTP tensors of a safetensors checkpoint, or None when it has none (or is not safetensors)."""
    from safetensors import safe_open

    if not native_mtp_layers(_text(config)):
        return None
    folder = checkpoint_dir(name_or_path)
    if folder is None:
        return None
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
    else:
        files = sorted(folder.glob("*.safetensors"))
        weight_map = {}
        for f in files:
            with safe_open(str(f), "pt") as h:
                weight_map.update({k: f.name for k in h.keys()})
    prefixes = native_prefixes(config)
    keys = [k for k in weight_map if k.startswith(prefixes)]
    if not keys:
        return None
    out: dict[str, torch.Tensor] = {}
    for file in sorted({weight_map[k] for k in keys}):
        with safe_open(str(folder / file), "pt") as h:
            for k in keys:
                if weight_map[k] == file:
                    out[k] = h.get_tensor(k)
    return out

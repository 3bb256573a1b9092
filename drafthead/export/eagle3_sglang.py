"""`to=sglang`: the SpecForge/SGLang EAGLE3 checkpoint (also what vLLM loads with `method: eagle3`).

Layout: `config.json` (`LlamaForCausalLMEagle3`, llama fields of the one draft layer, `draft_vocab_size`,
`target_hidden_size`, `eagle_config`, `norm_before_residual`) + `model.safetensors` with our own names
(`fc.weight`, `midlayer.*`, `norm.weight`, `lm_head.weight`, `d2t` int64 offsets, `t2d` bool). No
embedding: SGLang and vLLM take the target's. A draft trained with `norm_before_residual=true` is refused:
SGLang's reader has no such field and would silently run the other residual (use `to=speculators`).

Aux layer ids. drafthead id `i` = the INPUT of target decoder layer `i` (HF `hidden_states[i]`). Readers:
- vLLM (`gpu_model_runner._get_eagle3_aux_layers_from_config`) reads the top-level
  `eagle_aux_hidden_state_layer_ids` first and captures the input of layer `i`: written as ours.
- llama.cpp's `convert_hf_to_gguf.py` (`conversion/llama.py`) reads the same top-level key: as ours.
- SGLang (`model_runner` -> `set_eagle3_layers_to_capture`) reads `eagle_config.eagle_aux_hidden_state_layer_ids`
  as OUTPUT-of-layer ids and adds 1 (SpecForge's convention); since sglang PR #25454 it adds 1 only when
  the first id is 1. Writing ours - 1 is right for every SGLang version when our first id is 2 (the
  default `[2, N//2, N-3]`); other lists are written for current SGLang (see `sglang_aux_ids`).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from drafthead.eagle3 import Eagle3Config
from drafthead.export.common import (write_hf_dir, ExportError, TargetInfo, cast_state, dtype_name,
                                     llama_fields)
from drafthead.registry import LoadedDraft

log = logging.getLogger(__name__)

ARCHITECTURE = "LlamaForCausalLMEagle3"
READ_ARCHITECTURES = {"LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle"}
LAYER_ID_MEANING = "input of target decoder layer i (HF hidden_states[i])"


def sglang_aux_ids(ours: list[int]) -> list[int]:
    """Our input-of-layer ids -> the ids SGLang's `eagle_config` must hold to capture the same states."""
    if ours[0] == 2:
        return [i - 1 for i in ours]  # output-of-layer ids starting at 1: +1 in old and new SGLang
    if ours[0] == 1:
        log.warning("aux layer ids %s start at 1: SGLang reads a first id of 1 as output-of-layer and "
                    "shifts all ids; the eagle_config ids will be wrong for SGLang", ours)
        return [i - 1 for i in ours]
    log.warning("aux layer ids %s do not start at 2: eagle_config holds them unshifted, which SGLang "
                ">= PR #25454 reads as input-of-layer ids (older SGLang shifts them by one)", ours)
    return list(ours)


def ours_from_sglang_ids(ids: list[int]) -> list[int]:
    """Inverse of `sglang_aux_ids` under current SGLang semantics (first id 1 = output-of-layer)."""
    return [i + 1 for i in ids] if ids and ids[0] == 1 else list(ids)


def build_config(cfg: Eagle3Config, target: TargetInfo, meta: dict, dtype: str) -> dict[str, Any]:
    ids = list(cfg.aux_layer_ids)
    return {
        "architectures": [ARCHITECTURE],
        **llama_fields(cfg),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": sglang_aux_ids(ids), "use_aux_hidden_state": True},
        "eagle_aux_hidden_state_layer_ids": ids,
        "norm_before_residual": cfg.norm_before_residual,
        "fc_norm": cfg.fc_norm,  # EAGLE 3.1 (SGLang's and vLLM's llama_eagle3 read both; weights `fc_norm.{i}.weight`)
        "norm_output": cfg.norm_output,
        "torch_dtype": dtype,
        # ignored by servers; lets `load_exported` rebuild the exact drafthead config
        "drafthead": {"format": "sglang", "family": "eagle3", "aux_layer_ids_meaning": LAYER_ID_MEANING,
                      "draft": cfg.to_dict(), "target": target_record(target, meta)},
    }


def target_record(target: TargetInfo, meta: dict) -> dict:
    rec = dict(meta.get("target") or {})
    rec.update(name_or_path=target.name_or_path, vocab_size=target.vocab_size, hidden_size=target.hidden_size,
               num_hidden_layers=target.num_hidden_layers)
    return rec


def export(src: LoadedDraft, target: TargetInfo, out: str | os.PathLike, outtype: str | None = None) -> Path:
    if src.config.norm_before_residual:
        # SGLang's LlamaForCausalLMEagle3 has no such field and always keeps the un-normed fc output as the
        # residual, so it would silently compute another draft; refuse before anything is written
        raise ExportError(f"{src.path}: this draft was trained with norm_before_residual=true, which the SGLang "
                          f"layout cannot express (SGLang's EAGLE3 reader has no norm_before_residual field and "
                          f"would silently compute a different draft); export it with to=speculators, whose "
                          f"config carries norm_before_residual (vLLM serves it), or to=gguf for llama.cpp")
    state = cast_state(src.state, outtype, target)
    config = build_config(src.config, target, src.meta, dtype_name(state))
    return write_hf_dir(out, state, config, src.meta)


def to_internal(config: dict, state: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
    """An SGLang-layout checkpoint -> (Eagle3Config kwargs, our state dict)."""
    archs = set(config.get("architectures") or [])
    if not archs & READ_ARCHITECTURES:
        raise ExportError(f"not an SGLang EAGLE3 checkpoint: architectures {sorted(archs)}")
    state = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in state.items()}
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        eagle = config.get("eagle_config") or {}
        ids = ours_from_sglang_ids(list(eagle.get("eagle_aux_hidden_state_layer_ids") or []))
    return config_from_llama_fields(config, config, ids), state


def config_from_llama_fields(layer: dict, top: dict, aux_ids: list[int] | None,
                             norm_before_residual_default: bool = False) -> dict:
    """Eagle3Config kwargs from HF llama fields (`layer`) and EAGLE3 fields (`top`)."""
    own = (top.get("drafthead") or {}).get("draft")
    if own:
        return dict(own)
    try:
        hidden, heads = int(layer["hidden_size"]), int(layer["num_attention_heads"])
        vocab = int(layer.get("vocab_size") or top["vocab_size"])
        rope = layer.get("rope_parameters") or {}
        n_target = int(top.get("target_num_layers") or 0)
        if not aux_ids:
            if not n_target:
                raise ExportError("checkpoint names no eagle_aux_hidden_state_layer_ids and no target layer count")
            aux_ids = Eagle3Config.default_aux_layer_ids(n_target)
        return dict(
            hidden_size=hidden,
            intermediate_size=int(layer["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(layer.get("num_key_value_heads") or heads),
            head_dim=int(layer.get("head_dim") or hidden // heads),
            vocab_size=vocab,
            draft_vocab_size=int(top.get("draft_vocab_size") or vocab),
            target_hidden_size=int(top.get("target_hidden_size") or hidden),
            aux_layer_ids=[int(i) for i in aux_ids],
            target_num_layers=n_target,
            rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", layer.get("rope_theta", 10000.0))),
            max_position_embeddings=int(layer.get("max_position_embeddings", 2048)),
            norm_before_residual=bool(top.get("norm_before_residual", norm_before_residual_default)),
            fc_norm=bool(top.get("fc_norm", False)),
            norm_output=bool(top.get("norm_output", False)),
        )
    except KeyError as e:
        raise ExportError(f"checkpoint config lacks {e.args[0]}") from None

"""`to=speculators`: the vllm-project/speculators `Eagle3Speculator` format (`vllm serve <dir>`).

`config.json` holds the speculators fields (`speculators_model_type: eagle3`, `draft_vocab_size`,
`eagle_aux_hidden_state_layer_ids`, `target_hidden_size`, `norm_before_residual`, the llama fields of
the draft layer under `transformer_layer_config`, and `speculators_config` with the greedy proposal
method and the verifier). vLLM's `SpeculatorsConfig` turns it into an `Eagle3LlamaForCausalLM` config;
its `update_eagle3` copies `eagle_aux_hidden_state_layer_ids` through unchanged, and vLLM captures the
input of those decoder layers: our ids as they are. Weights: `layers.0.*` instead of `midlayer.*`.
vLLM defaults `norm_before_residual` to true when absent, so it is always written.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from drafthead.eagle3 import Eagle3Config
from drafthead.export.common import (write_hf_dir, DraftSource, ExportError, TargetInfo, cast_state, dtype_name,
                                     llama_fields)
from drafthead.export.sglang import LAYER_ID_MEANING, _target_record, config_from_llama_fields

ARCHITECTURE = "Eagle3Speculator"
SPECULATORS_VERSION = "0.1.0"  # the config schema we follow (Eagle3SpeculatorConfig)
# built-in target names -> the public model id a vLLM user would serve as the verifier
VERIFIER_IDS = {"smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}

# every key `build_config` writes, as the speculators schema names them (tests pin the layout)
TOP_LEVEL_FIELDS = ("speculators_model_type", "speculators_version", "architectures", "transformer_layer_config",
                    "draft_vocab_size", "norm_before_residual", "target_hidden_size",
                    "eagle_aux_hidden_state_layer_ids", "embed_requires_grad", "speculators_config")


def rename_out(name: str) -> str:
    return "layers.0." + name[len("midlayer."):] if name.startswith("midlayer.") else name


def rename_in(name: str) -> str:
    return "midlayer." + name[len("layers.0."):] if name.startswith("layers.0.") else name


def build_config(cfg: Eagle3Config, target: TargetInfo, meta: dict, dtype: str,
                 num_draft_tokens: int = 3, verifier: str | None = None) -> dict[str, Any]:
    if num_draft_tokens < 1:
        raise ExportError(f"num_draft_tokens={num_draft_tokens} must be >= 1")
    layer = {**llama_fields(cfg), "torch_dtype": dtype}
    return {
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "architectures": [ARCHITECTURE],
        "transformer_layer_config": layer,
        "draft_vocab_size": cfg.draft_vocab_size,
        "norm_before_residual": cfg.norm_before_residual,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "embed_requires_grad": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(num_draft_tokens),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier or VERIFIER_IDS.get(target.name_or_path, target.name_or_path),
                         "architectures": list(target.architectures)},
        },
        "torch_dtype": dtype,
        "drafthead": {"format": "speculators", "family": "eagle3", "aux_layer_ids_meaning": LAYER_ID_MEANING,
                      "draft": cfg.to_dict(), "target": _target_record(target, meta)},
    }


def export(src: DraftSource, target: TargetInfo, out: str | os.PathLike, outtype: str | None = None,
           num_draft_tokens: int = 3, verifier: str | None = None) -> Path:
    cast = cast_state(src.state, outtype)
    config = build_config(src.config, target, src.meta, dtype_name(cast), num_draft_tokens=num_draft_tokens,
                          verifier=verifier)
    state = {rename_out(k): v for k, v in cast.items()}
    return write_hf_dir(out, state, config)


def to_internal(config: dict, state: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
    """A speculators EAGLE3 checkpoint -> (Eagle3Config kwargs, our state dict)."""
    if config.get("speculators_model_type") != "eagle3":
        raise ExportError(f"not a speculators EAGLE3 checkpoint: speculators_model_type "
                          f"{config.get('speculators_model_type')!r}")
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ExportError("speculators config has no transformer_layer_config")
    state = {rename_in(k): v for k, v in state.items() if k not in ("verifier_lm_head.weight", "verifier_norm.weight")}
    kw = config_from_llama_fields(layer, config, config.get("eagle_aux_hidden_state_layer_ids"),
                                  norm_before_residual_default=True)
    return kw, state

"""`to=speculators`: the vllm-project/speculators `Eagle3Speculator` format (`vllm serve <dir>`).

`config.json` holds the speculators fields (`speculators_model_type: eagle3`, `draft_vocab_size`,
`eagle_aux_hidden_state_layer_ids`, `target_hidden_size`, `norm_before_residual`, the llama fields of
the draft layer under `transformer_layer_config`, and `speculators_config` with the greedy proposal
method and the verifier). vLLM's `SpeculatorsConfig` turns it into an `Eagle3LlamaForCausalLM` config;
its `update_eagle3` copies `eagle_aux_hidden_state_layer_ids` through unchanged, and vLLM captures the
input of those decoder layers: our ids as they are. Weights: `layers.0.*` instead of `midlayer.*`.
vLLM defaults `norm_before_residual` to true when absent, so it is always written.

`store_embedding=True` also writes the target's token embedding as `embed_tokens.weight` (the name
speculators' `Eagle3Speculator` / `Eagle3DraftModel` and vLLM's Eagle3 loader use; `embed_requires_grad`
stays false: it is the target's frozen embedding). Without it, speculators 0.1.x's `from_pretrained`
leaves the embedding at its random init; later releases (0.3.0, 0.9.0 read) fill it from the verifier's
weights. 0.9.0 also reads the verifier's config and lm_head/norm on load, so offline it needs
`verifier=/local/target_dir` whether or not the embedding is stored (tests/test_export_engines.py).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from drafthead.eagle3 import Eagle3Config
from drafthead.export.common import (SPECULATORS_VERSION, VERIFIER_IDS, ExportError, TargetInfo, cast_state,
                                     dtype_name, llama_fields, write_hf_dir)
from drafthead.export.eagle3_sglang import LAYER_ID_MEANING, target_record, config_from_llama_fields
from drafthead.registry import LoadedDraft

ARCHITECTURE = "Eagle3Speculator"

# every key `build_config` writes, as the speculators schema names them (tests pin the layout)
TOP_LEVEL_FIELDS = ("speculators_model_type", "speculators_version", "architectures", "transformer_layer_config",
                    "draft_vocab_size", "norm_before_residual", "target_hidden_size",
                    "eagle_aux_hidden_state_layer_ids", "fc_norm", "norm_output", "embed_requires_grad",
                    "speculators_config")


def rename_out(name: str) -> str:
    return "layers.0." + name[len("midlayer."):] if name.startswith("midlayer.") else name


def rename_in(name: str) -> str:
    return "midlayer." + name[len("layers.0."):] if name.startswith("layers.0.") else name


def build_config(cfg: Eagle3Config, target: TargetInfo, meta: dict, dtype: str,
                 num_speculative_tokens: int = 3, verifier: str | None = None) -> dict[str, Any]:
    if num_speculative_tokens < 1:
        raise ExportError(f"num_speculative_tokens={num_speculative_tokens} must be >= 1")
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
        "fc_norm": cfg.fc_norm,  # EAGLE 3.1; weights `fc_norm.{i}.weight`, as speculators' Eagle3DraftModel names them
        "norm_output": cfg.norm_output,
        "embed_requires_grad": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(num_speculative_tokens),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier or VERIFIER_IDS.get(target.name_or_path, target.name_or_path),
                         "architectures": list(target.architectures)},
        },
        "torch_dtype": dtype,
        "drafthead": {"format": "speculators", "family": "eagle3", "aux_layer_ids_meaning": LAYER_ID_MEANING,
                      "draft": cfg.to_dict(), "target": target_record(target, meta)},
    }


def export(src: LoadedDraft, target: TargetInfo, out: str | os.PathLike, outtype: str | None = None,
           num_speculative_tokens: int = 3, verifier: str | None = None, store_embedding: bool = False) -> Path:
    if not isinstance(store_embedding, bool):
        raise ExportError(f"store_embedding={store_embedding!r} must be true or false")
    state = dict(src.state)
    if store_embedding:
        state[EMBEDDING] = target_embedding(target, src.config)  # cast with the rest
    cast = cast_state(state, outtype, target)
    config = build_config(src.config, target, src.meta, dtype_name(cast), num_speculative_tokens=num_speculative_tokens,
                          verifier=verifier)
    state = {rename_out(k): v for k, v in cast.items()}
    return write_hf_dir(out, state, config, src.meta)


EMBEDDING = "embed_tokens.weight"  # speculators' Eagle3 models: `self.embed_tokens = nn.Embedding(...)` at top level


def target_embedding(target: TargetInfo, cfg: Eagle3Config) -> torch.Tensor:
    """The target's token embedding [V, H] in fp32, as `drafthead.target.load_target` loads the target.

    An HF directory with safetensors/bin weights is read as HF weights even when a GGUF lies next to it;
    a directory holding only config.json and a GGUF (and a built-in name or a .gguf path) reads the GGUF.
    """
    from drafthead.target import load_target

    p = Path(target.name_or_path)
    gguf_file = None
    if target.gguf_path is not None and p.is_dir() and not _has_hf_weights(p):
        gguf_file = Path(target.gguf_path).name
    try:
        t = load_target(target.name_or_path, gguf_file, dtype="float32")
    except Exception as e:  # noqa: BLE001 - any loader failure becomes one clear export error
        raise ExportError(f"store_embedding=true reads the target's token embedding, but target "
                          f"{target.name_or_path!r} could not be loaded ({type(e).__name__}: {e}); pass "
                          f"target=LOCAL_HF_DIR (or a .gguf file)") from None
    emb = t.model.get_input_embeddings().weight.detach().to("cpu", torch.float32).contiguous()
    del t
    want = (cfg.vocab_size, cfg.hidden_size)
    if tuple(emb.shape) != want:
        raise ExportError(f"target {target.name_or_path!r} has a token embedding of shape {tuple(emb.shape)}; the "
                          f"draft needs (vocab_size, hidden_size) = {want}")
    if not bool(torch.isfinite(emb).all()):
        raise ExportError(f"target {target.name_or_path!r}: token embedding has NaN/inf values")
    return emb.clone()


def _has_hf_weights(d: Path) -> bool:
    return any(d.glob("*.safetensors")) or any(d.glob("pytorch_model*.bin"))


def to_internal(config: dict, state: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
    """A speculators EAGLE3 checkpoint -> (Eagle3Config kwargs, our state dict)."""
    if config.get("speculators_model_type") != "eagle3":
        raise ExportError(f"not a speculators EAGLE3 checkpoint: speculators_model_type "
                          f"{config.get('speculators_model_type')!r}")
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ExportError("speculators config has no transformer_layer_config")
    if config.get("norm_before_fc"):
        raise ExportError("speculators config sets norm_before_fc (one RMSNorm over the concatenated captured "
                          "states, gpt-oss style), which drafthead's EAGLE3 cannot express; it has fc_norm (one "
                          "norm per captured state, EAGLE 3.1)")
    state = {rename_in(k): v for k, v in state.items() if k not in ("verifier_lm_head.weight", "verifier_norm.weight")}
    kw = config_from_llama_fields(layer, config, config.get("eagle_aux_hidden_state_layer_ids"),
                                  norm_before_residual_default=True)
    return kw, state

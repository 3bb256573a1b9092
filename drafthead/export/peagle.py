"""P-EAGLE exports: EAGLE3's two safetensors layouts with the parallel-drafting fields added.

- `to=speculators`: speculators' `peagle` format (`speculators_model_type: peagle`, `architectures:
  [PEagleSpeculator]`, `mask_token_id`, `speculators_config.algorithm: peagle`, the proposal's
  `speculative_tokens` = the trained K), read by speculators 0.9.0's `PEagleDraftModel`; vLLM turns it into
  eagle3 with `parallel_drafting: true` (its `update_peagle` copies `mask_token_id` to `pard_token`).
- `to=eagle3`: the EAGLE3 (SGLang-style) layout (`architectures: [LlamaForCausalLMEagle3]`) with `mask_token_id`,
  which vLLM loads as `Eagle3LlamaForCausalLM`; pass `"parallel_drafting": true` in vLLM's speculative config
  (vLLM does not read it from the draft's config.json). SGLang does not serve P-EAGLE. (vLLM 0.32 refuses the
  name `PEagleDraftModel` with method eagle3: it looks it up as `Eagle3PEagleDraftModel`.)

Both carry `mask_hidden` [1, 1, A*Ht] as speculators and vLLM name and shape it (stored before `fc`: vLLM projects
it through `fc` once at load). llama.cpp has no P-EAGLE architecture (docs/export.md).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file

from drafthead.export import eagle3_sglang, eagle3_speculators
from drafthead.export.common import ExportError, cast_state, dtype_name, write_hf_dir
from drafthead.export.eagle3 import prepare
from drafthead.peagle import FAMILY, PeagleConfig, PeagleDrafter
from drafthead.registry import NOT_SAVED, LoadedDraft, attach_embedding, check_state

SPECULATORS_ARCHITECTURE = "PEagleSpeculator"
# the EAGLE3 layout's name: with method eagle3 vLLM prefixes "Eagle3" to any architecture that neither starts nor ends
# with it, so `PEagleDraftModel` (in its registry) would be looked up as `Eagle3PEagleDraftModel` and refused
EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"


def _draft_record(config: dict, cfg: PeagleConfig) -> None:
    config["drafthead"].update(family="peagle", draft=cfg.to_dict())


def to_speculators(draft: LoadedDraft, out: str | os.PathLike, target: str | None = None,
                   outtype: str | None = None, num_speculative_tokens: int | None = None, verifier: str | None = None,
                   store_embedding: bool = False) -> Path:
    cfg: PeagleConfig = draft.config
    tinfo = prepare(draft, target)
    k = cfg.num_draft_tokens if num_speculative_tokens is None else num_speculative_tokens
    if not 1 <= k <= cfg.num_draft_tokens:
        raise ExportError(f"num_speculative_tokens={k}: a P-EAGLE draft proposes 1..{cfg.num_draft_tokens} tokens a "
                          f"round (the depths it was trained with)")
    if not isinstance(store_embedding, bool):
        raise ExportError(f"store_embedding={store_embedding!r} must be true or false")
    state = dict(draft.state)
    if store_embedding:
        state[eagle3_speculators.EMBEDDING] = eagle3_speculators.target_embedding(tinfo, cfg)
    cast = cast_state(state, outtype, tinfo)
    config = eagle3_speculators.build_config(cfg, tinfo, draft.meta, dtype_name(cast), num_speculative_tokens=k,
                                             verifier=verifier)
    config.update(speculators_model_type="peagle", architectures=[SPECULATORS_ARCHITECTURE],
                  mask_token_id=cfg.mask_token_id)
    config["speculators_config"]["algorithm"] = "peagle"
    _draft_record(config, cfg)
    return write_hf_dir(out, {eagle3_speculators.rename_out(n): v for n, v in cast.items()}, config, draft.meta)


def to_eagle3(draft: LoadedDraft, out: str | os.PathLike, target: str | None = None,
              outtype: str | None = None) -> Path:
    cfg: PeagleConfig = draft.config
    tinfo = prepare(draft, target)
    if cfg.norm_before_residual:
        raise ExportError(f"{draft.path}: norm_before_residual=true cannot be expressed in the EAGLE3 layout; "
                          f"export with to=speculators")
    state = cast_state(draft.state, outtype, tinfo)
    config = eagle3_sglang.build_config(cfg, tinfo, draft.meta, dtype_name(state))
    config.update(architectures=[EAGLE3_ARCHITECTURE], mask_token_id=cfg.mask_token_id)
    config["drafthead"]["format"] = "eagle3"
    _draft_record(config, cfg)
    return write_hf_dir(out, state, config, draft.meta)


def load_exported(path: str | os.PathLike, embed_weight: torch.Tensor | None = None) -> PeagleDrafter:
    """Rebuild a `PeagleDrafter` from either export (ours; the fields above are what it needs)."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    state = load_file(str(path / "model.safetensors"))
    if "mask_token_id" not in config or "mask_hidden" not in state:
        raise ExportError(f"{path}: not a P-EAGLE export (config.json mask_token_id and the mask_hidden tensor)")
    if config.get("speculators_model_type") == "peagle":
        kw, state = eagle3_speculators.to_internal({**config, "speculators_model_type": "eagle3"}, state)
    else:
        kw, state = eagle3_sglang.to_internal(config, state)
    stored_embedding = state.pop(eagle3_speculators.EMBEDDING, None)
    cfg = PeagleConfig(**{**kw, "mask_token_id": int(config["mask_token_id"])})
    check_state(state, FAMILY, cfg, str(path), ExportError)
    drafter = PeagleDrafter(cfg)
    drafter.load_state_dict(state, strict=False)
    attach_embedding(drafter, embed_weight if embed_weight is not None else stored_embedding, ExportError)
    return drafter.eval()


def read_back(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """A P-EAGLE export -> our tensor names (the stored embedding, if any, left out)."""
    return {k: v for k, v in load_exported(path).state_dict().items() if k not in NOT_SAVED}

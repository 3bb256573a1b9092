"""Domino export: `to=dflash`, the DFlash `DFlashDraftModel` directory with the Domino fields SGLang reads (its
DFlash worker serves it: `--speculative-algorithm DFLASH`, the rollout chosen by `dflash_config.projector_type`).

Layout (SGLang `srt/speculative/dflash_utils.py` `parse_dflash_draft_config`, `srt/models/dflash.py`; ModelOpt's
`DominoExporter` writes the same): DFlash's config.json and tensors (architecture `DFlashDraftModel`: SGLang picks
the head by `projector_type`), plus `dflash_config` keys `projector_type: "domino"`, `gru_hidden_dim`, `emb_dim`
(repeated at the top level; SGLang refuses the two differing), `pure_draft_prefix_len` (SGLang requires 1) and
`shift_label: true`,
and the tensors `prefix_gru.weight_ih_l0` [3G, H], `prefix_gru.weight_hh_l0` [3G, G] (no biases),
`embed_proj.0.weight` [E, H+G], `embed_proj.2.weight` [V, E]: our own names, in bf16 by default (SGLang serves
Domino in bf16 only, on CUDA, TP 1). vLLM (0.32) serves no Domino draft and
llama.cpp has no Domino architecture, so this is the one format (docs/export.md).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file

from drafthead.domino import DominoConfig
from drafthead.export.common import ExportError, cast_state, write_hf_dir
from drafthead.export.dflash import backbone, check_target, config_from_hf, hf_config
from drafthead.export.target_info import export_target_info
from drafthead.registry import LoadedDraft
from drafthead.vocab import draft_ids

PROJECTOR = "domino"
LEGACY_PROJECTORS = ("causal_v5",)  # the head's name in early checkpoints (SGLang issue 28977); read, never written
# the Domino head's keys of `dflash_config` (SpecForge's DOMINO_DFLASH_FIELDS), beside `projector_type`
HEAD_KEYS = ("emb_dim", "gru_hidden_dim", "pure_draft_prefix_len", "shift_label")


def domino_hf_config(cfg: DominoConfig) -> dict:
    """DFlash's `DFlashDraftModel` config with the Domino head's fields."""
    base = hf_config(cfg)
    return {**base, "emb_dim": cfg.emb_dim,
            "dflash_config": {**base["dflash_config"], "projector_type": PROJECTOR, "emb_dim": cfg.emb_dim,
                              "gru_hidden_dim": cfg.gru_hidden_dim,
                              "pure_draft_prefix_len": cfg.pure_draft_prefix_len, "shift_label": True}}


def to_dflash(draft: LoadedDraft, out: str | os.PathLike, target: str | None = None,
              outtype: str | None = None) -> Path:
    """The HF directory SGLang's DFlash worker loads as a Domino draft (config.json + model.safetensors)."""
    cfg: DominoConfig = draft.config
    tinfo = export_target_info(target, draft.meta)
    check_target(cfg, tinfo)
    if cfg.pure_draft_prefix_len != 1:
        raise ExportError(f"pure_draft_prefix_len={cfg.pure_draft_prefix_len}: SGLang's Domino reader requires "
                          f"pure_draft_prefix_len=1 (its rollout corrects every draft after the first); train with 1")
    return write_hf_dir(out, cast_state(serving_state(draft.state, cfg), outtype, tinfo), domino_hf_config(cfg),
                        draft.meta)


def serving_state(state: dict[str, torch.Tensor], cfg: DominoConfig) -> dict[str, torch.Tensor]:
    """The tensors SGLang reads: the backbone (DFlash's, without a draft vocabulary's d2t / t2d) and the head, W2
    widened from the draft vocabulary's N rows to the target's V with zero rows elsewhere (SGLang's W2 is [V, E];
    a zero row leaves that token's score the backbone's, which is what the draft trained on, scoring N rows)."""
    out = backbone(state)
    if "d2t" in state:
        w2 = state["embed_proj.2.weight"]  # [N, E]
        rows = draft_ids(state["d2t"])  # [N] target ids
        out["embed_proj.2.weight"] = w2.new_zeros(cfg.vocab_size, w2.shape[1]).index_copy_(0, rows, w2)  # [V, E]
    return out


def config_from_domino_hf(config: dict) -> DominoConfig:
    """A Domino `DFlashDraftModel` config.json (ours, SpecForge's or ModelOpt's) -> our config."""
    dc = config.get("dflash_config") or {}
    kind = dc.get("projector_type")
    if kind != PROJECTOR and kind not in LEGACY_PROJECTORS:
        raise ExportError(f"not a Domino draft: dflash_config.projector_type is {kind!r} (want {PROJECTOR!r})")
    if dc.get("shift_label") is not True:
        raise ExportError(f"dflash_config.shift_label is {dc.get('shift_label')!r}: only the anchor-first layout "
                          f"(true) is a Domino draft drafthead and SGLang run")
    emb = dc.get("emb_dim", config.get("emb_dim"))
    if "emb_dim" in dc and config.get("emb_dim") not in (None, dc["emb_dim"]):
        raise ExportError(f"emb_dim differs: {config['emb_dim']} at the top level, {dc['emb_dim']} in dflash_config")
    missing = [k for k, v in (("emb_dim", emb), ("gru_hidden_dim", dc.get("gru_hidden_dim"))) if v is None]
    if missing:
        raise ExportError(f"not a Domino draft config: no {', '.join(missing)}")
    base = config_from_hf(config)
    fields = {f: getattr(base, f) for f in base.__dataclass_fields__}
    return DominoConfig(**{**fields, "emb_dim": int(emb), "gru_hidden_dim": int(dc["gru_hidden_dim"]),
                           "pure_draft_prefix_len": int(dc.get("pure_draft_prefix_len", 0))})


def read_exported(path: str | os.PathLike) -> tuple[DominoConfig, dict[str, torch.Tensor]]:
    """(our config, our tensors) of a `to=dflash` Domino directory (the tensor names are SGLang's and ours)."""
    path = Path(path)
    cfg = config_from_domino_hf(json.loads((path / "config.json").read_text()))
    return cfg, dict(load_file(str(path / "model.safetensors")))


def read_back(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    return read_exported(path)[1]

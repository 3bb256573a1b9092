"""DSpark exports: `to=speculators` (vllm-project/speculators 0.9.0 `DSparkSpeculatorConfig`, what vLLM serves
with `method: dspark` and what llama.cpp's converter reads) and `to=gguf` (llama.cpp's `--spec-type draft-dspark`).

speculators (models/dspark/config.py): the DFlash speculators fields (`transformer_layer_config`, `block_size`,
`aux_hidden_state_layer_ids` = our z-lab ids + 1, `mask_token_id`, `draft_vocab_size`) plus `sample_from_anchor`,
`markov_rank`, `markov_head_type: vanilla`, `enable_confidence_head`, `confidence_head_with_markov: true`.
Weights are ours by name: the DFlash backbone, `markov_head.markov_w1.weight` [V, r],
`markov_head.markov_w2.weight` [V, r], `confidence_head.proj.{weight [1, H+r], bias [1]}`; the full vocabulary,
so no lm_head (the verifier's is used).

GGUF (read from the llama.cpp vendored in llama-cpp-python 0.3.36: src/models/dflash.cpp, common/speculative.cpp,
gguf-py constants.py): the DFlash GGUF (`general.architecture = dflash`) plus `markov_w1.weight`,
`markov_w2.weight`, `conf_proj.weight`, `conf_proj.bias`, and the keys `dflash.sample_from_anchor` and
`dflash.has_confidence_head` (both written: an absent key reads as true there). llama.cpp picks draft-dspark when
`markov_w1.weight` is present; its confidence stop is `--spec-draft-p-min`.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file

from drafthead.dspark import DsparkConfig
from drafthead.export import dflash as dflash_export
from drafthead.export.common import (GGUF_FINGERPRINT_KEY, ExportError, TargetInfo, cast_state, check_gguf_out,
                                     dtype_name, target_fingerprint, write_hf_dir)
from drafthead.export.target_info import export_target_info
from drafthead.export.gguf import OUTTYPES, add_model_keys, copy_tokenizer, write_atomic, write_tensors
from drafthead.registry import LoadedDraft

ARCH = dflash_export.ARCH  # llama.cpp serves DSpark under the DFlash architecture
HEAD_NAMES = {  # ours -> llama.cpp's
    "markov_head.markov_w1.weight": "markov_w1.weight",
    "markov_head.markov_w2.weight": "markov_w2.weight",
    "confidence_head.proj.weight": "conf_proj.weight",
    "confidence_head.proj.bias": "conf_proj.bias",
}
# the fields speculators' DSparkSpeculatorConfig adds to DFlash's (tests pin them against the package)
DSPARK_FIELDS = ("sample_from_anchor", "markov_rank", "markov_head_type", "enable_confidence_head",
                 "confidence_head_with_markov")


def speculators_config(cfg: DsparkConfig, target: TargetInfo, dtype: str, verifier: str | None) -> dict:
    base = dflash_export.speculators_config(cfg, target, dtype, verifier)
    base.update(speculators_model_type="dspark", architectures=["DSparkSpeculator"],
                sample_from_anchor=cfg.sample_from_anchor, markov_rank=cfg.markov_rank, markov_head_type="vanilla",
                enable_confidence_head=cfg.confidence_head, confidence_head_with_markov=True)
    sc = base["speculators_config"]
    sc["algorithm"] = "dspark"
    sc["proposal_methods"][0]["speculative_tokens"] = cfg.num_draft_tokens
    base["drafthead"] = {"format": "speculators", "family": "dspark", "draft": cfg.to_dict()}
    return base


def to_speculators(draft: LoadedDraft, out: str | os.PathLike, target: str | None = None,
                   outtype: str | None = None, verifier: str | None = None) -> Path:
    """The speculators DSpark checkpoint (`vllm serve DIR`; llama.cpp's converter reads it too)."""
    tinfo = export_target_info(target, draft.meta)
    dflash_export.check_target(draft.config, tinfo)
    state = cast_state(draft.state, outtype, tinfo)
    return write_hf_dir(out, state, speculators_config(draft.config, tinfo, dtype_name(state), verifier), draft.meta)


def config_from_speculators(config: dict) -> DsparkConfig:
    """A speculators DSpark config.json (ours or another trainer's) -> our config."""
    if config.get("speculators_model_type") != "dspark":
        raise ExportError(f"not a speculators DSpark checkpoint: speculators_model_type "
                          f"{config.get('speculators_model_type')!r}")
    own = (config.get("drafthead") or {}).get("draft")
    if own:
        return DsparkConfig(**own)
    if config.get("markov_head_type", "vanilla") != "vanilla":
        raise ExportError(f"markov_head_type {config['markov_head_type']!r}: drafthead's DSpark has the vanilla "
                          f"head only (as llama.cpp)")
    if config.get("enable_confidence_head", True) and not config.get("confidence_head_with_markov", True):
        raise ExportError("confidence_head_with_markov false: drafthead's confidence head reads [h; W1[prev]] "
                          "(as llama.cpp)")
    vocab = config["transformer_layer_config"].get("vocab_size")
    if config.get("draft_vocab_size", vocab) != vocab:
        raise ExportError(f"draft_vocab_size {config['draft_vocab_size']} < vocab {vocab}: drafthead's DSpark drafts "
                          f"over the target's full vocabulary")
    base = dflash_export.config_from_speculators({**config, "speculators_model_type": "dflash"})
    return DsparkConfig(**{**base.to_dict(), "markov_rank": int(config.get("markov_rank", 256)),
                           "confidence_head": bool(config.get("enable_confidence_head", True)),
                           "sample_from_anchor": bool(config.get("sample_from_anchor", True))})


def read_exported(path: str | os.PathLike) -> tuple[DsparkConfig, dict[str, torch.Tensor]]:
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    return config_from_speculators(config), dict(load_file(str(path / "model.safetensors")))


def read_back(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """A `to=speculators` directory -> our tensor names (they are speculators')."""
    return read_exported(path)[1]


def write_gguf(draft: LoadedDraft, target: TargetInfo, path: Path, outtype: str) -> None:
    import gguf

    cfg: DsparkConfig = draft.config
    w = gguf.GGUFWriter(str(path), ARCH)
    add_model_keys(w, cfg, f"{Path(target.name_or_path).name} DSpark draft (drafthead)", cfg.num_hidden_layers,
                   outtype)
    w.add_uint32(f"{ARCH}.block_size", cfg.block_size)
    w.add_bool(f"{ARCH}.sample_from_anchor", cfg.sample_from_anchor)
    w.add_bool(f"{ARCH}.has_confidence_head", cfg.confidence_head)
    if fp := target_fingerprint(draft.meta):
        w.add_string(GGUF_FINGERPRINT_KEY, fp)
    w.add_key_value(f"{ARCH}.target_layers", [i + 1 for i in cfg.target_layer_ids], gguf.GGUFValueType.ARRAY,
                    sub_type=gguf.GGUFValueType.INT32)
    copy_tokenizer(target.gguf_path, w)
    w.add_uint32("tokenizer.ggml.mask_token_id", cfg.mask_token_id)
    tensors = dflash_export.gguf_tensors(draft.state, cfg.num_hidden_layers)
    tensors.update({theirs: draft.state[ours].float() for ours, theirs in HEAD_NAMES.items() if ours in draft.state})
    write_tensors(w, tensors, outtype)


def to_gguf(draft: LoadedDraft, out: str | os.PathLike, target: str | None = None,
            outtype: str | None = None) -> Path:
    """One GGUF file for llama.cpp's `-md draft.gguf --spec-type draft-dspark` (tokenizer from the target GGUF)."""
    outtype = outtype or "f32"
    out = check_gguf_out(out, outtype, OUTTYPES)
    tinfo = export_target_info(target, draft.meta)
    dflash_export.check_target(draft.config, tinfo)
    if tinfo.gguf_path is None:
        raise ExportError(f"to=gguf copies the tokenizer from the target's GGUF, but target {tinfo.name_or_path!r} "
                          f"({tinfo.source}) is not a GGUF file: pass target=PATH.gguf")
    return write_atomic(out, lambda tmp: write_gguf(draft, tinfo, tmp, outtype))


def read_back_gguf(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """A DSpark GGUF -> our tensor names (the DFlash backbone's reader, then the two heads)."""
    import gguf
    import numpy as np

    out = dflash_export.read_back_gguf(path)
    r = gguf.GGUFReader(str(path))
    q = gguf.GGMLQuantizationType
    names = {theirs: ours for ours, theirs in HEAD_NAMES.items()}
    for t in r.tensors:
        if t.name in names:
            shape = tuple(int(x) for x in reversed(t.shape))
            a = np.asarray(t.data) if t.tensor_type in (q.F32, q.F16) else gguf.quants.dequantize(
                np.asarray(t.data), t.tensor_type)
            out[names[t.name]] = torch.from_numpy(a.reshape(shape).astype(np.float32))
    if "markov_head.markov_w1.weight" not in out:
        raise ExportError(f"{path}: a DFlash GGUF without markov_w1.weight, not a DSpark one")
    return out

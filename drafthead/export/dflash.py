"""DFlash exports: `to=dflash` (z-lab's HF `DFlashDraftModel` directory: what the `dflash` package, SGLang
and vLLM load), `to=speculators` (vllm-project/speculators' `DFlashSpeculatorConfig` layout) and `to=gguf`
(`general.architecture = dflash`, what llama.cpp's `--spec-type draft-dflash` loads).

Layer ids: drafthead stores z-lab's `target_layer_ids` (the OUTPUT of target layer i = HF
`hidden_states[i + 1]`). `to=dflash` writes them as they are (`dflash_config.target_layer_ids`); llama.cpp
stores the layer whose INPUT it extracts (`dflash.target_layers`, its converter writes ids + 1:
conversion/qwen.py `DFlashModel.set_gguf_parameters`), so `to=gguf` writes ids + 1 and reads back - 1;
speculators' `aux_hidden_state_layer_ids` are vLLM's capture ids (HF `hidden_states[i]`): ids + 1 too.

GGUF names and keys, read from the llama.cpp tree vendored in llama-cpp-python 0.3.36
(`src/models/dflash.cpp` `load_arch_hparams` / `load_arch_tensors`, gguf-py `constants.py`): `fc.weight`
{M*H, H}, `enc.output_norm` (hidden_norm), per layer `blk.i.attn_norm`, `attn_q/k/v`, `attn_output`,
`attn_q_norm`, `attn_k_norm`, `ffn_norm`, `ffn_gate/up/down`, then `output_norm`; no `token_embd` or
`output` (the target's are used); keys `dflash.block_size`, `dflash.target_layers`,
`tokenizer.ggml.mask_token_id` and the target's tokenizer. Qwen3 layers rope NeoX-style (rotate-half),
as HF stores them, so q/k rows are written unpermuted.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from drafthead.dflash import DflashConfig, mask_token_problem
from drafthead.export.common import (GGUF_FINGERPRINT_KEY, ExportError, TargetInfo, cast_state, check_gguf_out,
                                     target_fingerprint, write_hf_dir)
from drafthead.export.target_info import export_target_info
from drafthead.export.gguf import OUTTYPES, add_model_keys, copy_tokenizer, write_atomic, write_tensors
from drafthead.registry import LoadedDraft

ARCH = "dflash"
LAYER_NAMES = {  # ours (after `layers.{i}.`) -> llama.cpp (after `blk.{i}.`)
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
TOP_NAMES = {"fc.weight": "fc.weight", "hidden_norm.weight": "enc.output_norm.weight",
             "norm.weight": "output_norm.weight"}


def check_target(cfg: DflashConfig, t: TargetInfo) -> None:
    if t.vocab_size != cfg.vocab_size:
        raise ExportError(f"target vocab size {t.vocab_size} ({t.source}) does not match the draft's {cfg.vocab_size}: "
                          f"the draft was trained for another target")
    if t.hidden_size != cfg.hidden_size:
        raise ExportError(f"target hidden size {t.hidden_size} ({t.source}) does not match the draft's "
                          f"{cfg.hidden_size}")
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < t.num_hidden_layers - 1]
    if bad:
        raise ExportError(f"target layer ids {bad} out of range for a target with {t.num_hidden_layers} layers")
    if (bad_mask := mask_token_problem(cfg.mask_token_id, t.vocab_size)) is not None:
        raise ExportError(bad_mask)


def hf_config(cfg: DflashConfig) -> dict:
    """z-lab's `DFlashDraftModel` config: Qwen3 layer fields + `block_size` + `dflash_config`."""
    return {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "block_size": cfg.block_size,
        "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids),
                          "block_size": cfg.block_size},
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_target_layers": cfg.target_num_layers,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "layer_types": ["full_attention"] * cfg.num_hidden_layers,
    }


def to_dflash(draft: LoadedDraft, out: str | os.PathLike, target: str | None = None,
              outtype: str | None = None) -> Path:
    """The HF `DFlashDraftModel` directory (config.json + model.safetensors, our tensor names are z-lab's)."""
    tinfo = export_target_info(target, draft.meta)
    check_target(draft.config, tinfo)
    return write_hf_dir(out, cast_state(backbone(draft.state), outtype, tinfo), hf_config(draft.config), draft.meta)


def backbone(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors engines read: a draft vocabulary's d2t / t2d stay behind. Every engine (z-lab, SGLang, vLLM,
    llama.cpp) drafts a DFlash block through the target's whole head, so a draft trained over a draft vocabulary
    serves there over all V rows: the same argmax wherever the target's top token is in the draft vocabulary."""
    return {k: v for k, v in state.items() if k not in ("d2t", "t2d")}


def config_from_hf(config: dict) -> DflashConfig:
    """A `DFlashDraftModel` config.json (ours or z-lab's) -> our config."""
    dc = config.get("dflash_config", {})
    rope = config.get("rope_parameters") or {}
    try:
        return DflashConfig(
            hidden_size=config["hidden_size"], intermediate_size=config["intermediate_size"],
            num_attention_heads=config["num_attention_heads"], num_key_value_heads=config["num_key_value_heads"],
            head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
            vocab_size=config["vocab_size"], num_hidden_layers=config["num_hidden_layers"],
            block_size=int(dc.get("block_size", config.get("block_size", 16))), mask_token_id=int(dc["mask_token_id"]),
            target_layer_ids=list(dc["target_layer_ids"]), target_num_layers=int(config.get("num_target_layers", 0)),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)))
    except KeyError as e:
        raise ExportError(f"not a DFlash draft config: no {e.args[0]}") from None


def read_back(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """A `to=dflash` or `to=speculators` directory -> our tensor names (they are z-lab's)."""
    return read_exported(path)[1]


def read_exported(path: str | os.PathLike) -> tuple[DflashConfig, dict[str, torch.Tensor]]:
    """(our config, our tensors) of a `to=dflash` or `to=speculators` directory."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    cfg = config_from_speculators(config) if "speculators_model_type" in config else config_from_hf(config)
    return cfg, dict(load_file(str(path / "model.safetensors")))


def speculators_config(cfg: DflashConfig, target: TargetInfo, dtype: str, verifier: str | None) -> dict:
    """vllm-project/speculators `DFlashSpeculatorConfig` (speculators_model_type "dflash"): the draft layers'
    Qwen3 fields under `transformer_layer_config`, `aux_hidden_state_layer_ids` in vLLM's capture convention
    (HF `hidden_states[i]`, the input of layer i: ours + 1), full vocabulary (no lm_head stored: it is the
    verifier's), slot 0 = the bonus token (`sample_from_anchor` false: B-1 drafts per block)."""
    from drafthead.export.common import SPECULATORS_VERSION, VERIFIER_IDS

    layer = {k: v for k, v in hf_config(cfg).items() if k not in ("architectures", "auto_map", "dflash_config",
                                                                  "block_size")}
    return {
        "speculators_model_type": "dflash",
        "speculators_version": SPECULATORS_VERSION,
        "architectures": ["DFlashSpeculator"],
        "transformer_layer_config": {**layer, "torch_dtype": dtype},
        "draft_vocab_size": cfg.vocab_size,
        "block_size": cfg.block_size,
        "target_hidden_size": cfg.hidden_size,
        "aux_hidden_state_layer_ids": [i + 1 for i in cfg.target_layer_ids],
        "mask_token_id": cfg.mask_token_id,
        "sample_from_anchor": False,
        "speculators_config": {
            "algorithm": "dflash",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg.block_size - 1,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier or VERIFIER_IDS.get(target.name_or_path, target.name_or_path),
                         "architectures": list(target.architectures)},
        },
        "torch_dtype": dtype,
        "drafthead": {"format": "speculators", "family": "dflash", "draft": cfg.to_dict()},
    }


def to_speculators(draft: LoadedDraft, out: str | os.PathLike, target: str | None = None,
                   outtype: str | None = None, verifier: str | None = None) -> Path:
    """The speculators DFlash checkpoint (`vllm serve DIR`): config.json + model.safetensors with z-lab's names."""
    from drafthead.export.common import dtype_name

    tinfo = export_target_info(target, draft.meta)
    check_target(draft.config, tinfo)
    state = cast_state(backbone(draft.state), outtype, tinfo)
    return write_hf_dir(out, state, speculators_config(draft.config, tinfo, dtype_name(state), verifier), draft.meta)


def config_from_speculators(config: dict) -> DflashConfig:
    if config.get("speculators_model_type") != "dflash":
        raise ExportError(f"not a speculators DFlash checkpoint: speculators_model_type "
                          f"{config.get('speculators_model_type')!r}")
    layer = dict(config["transformer_layer_config"])
    ids = [i - 1 for i in config["aux_hidden_state_layer_ids"]]  # vLLM capture ids -> ours
    return config_from_hf({**layer, "dflash_config": {"mask_token_id": config["mask_token_id"],
                                                      "target_layer_ids": ids, "block_size": config["block_size"]}})


def gguf_tensors(state: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    out = {theirs: state[ours].float() for ours, theirs in TOP_NAMES.items()}
    for i in range(num_layers):
        for ours, theirs in LAYER_NAMES.items():
            out[f"blk.{i}.{theirs}"] = state[f"layers.{i}.{ours}"].float()
    return out


def write_gguf(draft: LoadedDraft, target: TargetInfo, path: Path, outtype: str) -> None:
    import gguf

    cfg: DflashConfig = draft.config
    w = gguf.GGUFWriter(str(path), ARCH)
    add_model_keys(w, cfg, f"{Path(target.name_or_path).name} DFlash draft (drafthead)", cfg.num_hidden_layers,
                   outtype)
    w.add_uint32(f"{ARCH}.block_size", cfg.block_size)
    if fp := target_fingerprint(draft.meta):
        w.add_string(GGUF_FINGERPRINT_KEY, fp)
    w.add_key_value(f"{ARCH}.target_layers", [i + 1 for i in cfg.target_layer_ids], gguf.GGUFValueType.ARRAY,
                    sub_type=gguf.GGUFValueType.INT32)  # llama.cpp extracts layer INPUTS: ours + 1
    copy_tokenizer(target.gguf_path, w)
    w.add_uint32("tokenizer.ggml.mask_token_id", cfg.mask_token_id)
    write_tensors(w, gguf_tensors(draft.state, cfg.num_hidden_layers), outtype)


def to_gguf(draft: LoadedDraft, out: str | os.PathLike, target: str | None = None,
            outtype: str | None = None) -> Path:
    """One GGUF file for llama.cpp's `-md draft.gguf --spec-type draft-dflash` (tokenizer from the target GGUF)."""
    outtype = outtype or "f32"
    out = check_gguf_out(out, outtype, OUTTYPES)
    tinfo = export_target_info(target, draft.meta)
    check_target(draft.config, tinfo)
    if tinfo.gguf_path is None:
        raise ExportError(f"to=gguf copies the tokenizer from the target's GGUF, but target {tinfo.name_or_path!r} "
                          f"({tinfo.source}) is not a GGUF file: pass target=PATH.gguf")
    return write_atomic(out, lambda tmp: write_gguf(draft, tinfo, tmp, outtype))


def read_back_gguf(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """A DFlash GGUF -> our tensor names (quantized types dequantized to fp32)."""
    import gguf

    r = gguf.GGUFReader(str(path))
    arch = r.fields["general.architecture"].contents()
    if arch != ARCH:
        raise ExportError(f"{path}: general.architecture is {arch!r}, not {ARCH!r}")
    q = gguf.GGMLQuantizationType
    theirs = {}
    for t in r.tensors:
        shape = tuple(int(x) for x in reversed(t.shape))
        a = np.asarray(t.data) if t.tensor_type in (q.F32, q.F16) else gguf.quants.dequantize(np.asarray(t.data),
                                                                                               t.tensor_type)
        theirs[t.name] = torch.from_numpy(a.reshape(shape).astype(np.float32))
    n = int(r.fields[f"{ARCH}.block_count"].contents())
    out = {ours: theirs[name] for ours, name in TOP_NAMES.items()}
    for i in range(n):
        for ours, name in LAYER_NAMES.items():
            out[f"layers.{i}.{ours}"] = theirs[f"blk.{i}.{name}"]
    return out


def gguf_target_layer_ids(path: str | os.PathLike) -> list[int]:
    """Our (z-lab) target layer ids from a DFlash GGUF's `dflash.target_layers` (llama.cpp's, - 1)."""
    import gguf

    r = gguf.GGUFReader(str(path))
    return [int(i) - 1 for i in r.fields[f"{ARCH}.target_layers"].contents()]

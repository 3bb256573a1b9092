"""`to=hf` / `to=gguf` for MTP drafts: the target's own checkpoint with the MTP layers added.

MTP layers live inside the target checkpoint (vLLM `method=mtp`, SGLang's EAGLE worker and llama.cpp
`--spec-type draft-mtp` all read them from the target), so an MTP export is the target plus our layers
under the target family's names:

- "mtp" layout (Qwen3.5 / Qwen3-Next): `mtp.fc`, `mtp.pre_fc_norm_{embedding,hidden}`, `mtp.norm` shared by
  all MTP layers, `mtp.layers.{i}.*`; config `mtp_num_hidden_layers` (in `text_config` when nested). The
  head is the target's `lm_head`, so the draft's shared head must still equal it.
- "nextn" layout (DeepSeek-V3 / GLM-4.5): extra decoder layers `model.layers.{N+i}.*` with `enorm`,
  `hnorm`, `eh_proj`, the block, `shared_head.{norm,head}` and `embed_tokens` (a copy of the target's, as
  DeepSeek-V3 ships it and vLLM's DeepSeek MTP loader reads it); config `num_nextn_predict_layers`.
- "mimo" layout (MiMo-7B, a dense Qwen2 model): `model.mtp_layers.{i}.*` (`token_layernorm`,
  `hidden_layernorm`, `input_proj`, `final_layernorm`, the block); config `num_nextn_predict_layers`; the head
  is the target's `lm_head`.
- llama / qwen2 / qwen3 (the SmolLM2 default included) have no MTP convention of their own. By default
  (`layout=auto`) they get the nextn layout, which keeps the target's own config and which
  `drafter.init=native` reads back; no engine serves MTP layers for these model types (vLLM maps only MTP
  model types such as deepseek_v3 / mimo / glm4_moe / qwen3_next to an MTP drafter). `layout=mimo` (or
  `served`: the target's own layout where an engine serves it, else MiMo) writes a llama or qwen2 target as
  MiMo: a Qwen2 config with architecture `MiMoForCausalLM` and, for a llama target, q/k/v biases of zero
  (Qwen2's attention always has them; adding zero changes no output). vLLM and SGLang serve that export
  with `method=mtp`; vLLM's MiMo MTP runs its first MTP layer for every draft token, so train with
  `drafter.mtp.recursive=true` (one layer).

Names come from `drafthead.mtp_native.to_native` (the inverse of what `drafter.init=native` loads), so
export -> native load is a round trip. `out/draft/` also holds the draft in drafthead's own format.

`to=gguf` writes that HF directory to a temp dir and runs llama.cpp's own `convert_hf_to_gguf.py` (from
the llama-cpp-python 0.3.36 sdist, `drafthead.export.llama_cpp.llama_cpp_source`), which renames our
tensors to `blk.{N+i}.nextn.{eh_proj,enorm,hnorm,shared_head_norm}` + the block's usual names and writes
`{arch}.nextn_predict_layers`. Only architectures whose llama.cpp graph runs a *dense* MTP block are
accepted: `qwen35` (`src/models/qwen35.cpp` `graph_mtp`, one MTP block). llama.cpp's other MTP graphs
(deepseek2/32/4, glm4-moe, glm-dsa, glm5-next, qwen35moe, qwen3next, step35, mimo2, hy-v3, ...) have
MoE / MLA MTP blocks that drafthead's dense block cannot fill; dense `glm4` loads nextn tensors but
builds no MTP graph (`src/models/glm4.cpp`: "preserved but unused"); llama/qwen2/qwen3 have none.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from drafthead import mtp_native
from drafthead.export.common import SAFETENSORS_DTYPES, ExportError, check_gguf_out, default_mode
from drafthead.export.gguf_meta import read_gguf_metadata
from drafthead.io import atomic_dir, writing
from drafthead.mtp import MtpConfig, MtpDrafter
from drafthead.mtp_native import MIMO_ARCH, layout, native_mtp_layers, native_prefixes, to_native, to_ours
from drafthead.registry import LoadedDraft, save_draft

# HF model_type -> the llama.cpp architecture whose graph runs our dense MTP block (see module docstring)
GGUF_ARCHS = {"qwen3_5": "qwen35", "qwen3_5_text": "qwen35"}
GGUF_MAX_LAYERS = {"qwen35": 1}  # src/models/qwen35.cpp: "QWEN35 MTP currently only supports a single MTP block"
GGUF_OUTTYPES = ("auto", "f32", "f16", "bf16", "q8_0")
LAYOUTS = ("auto", "mimo", "served")  # `to=hf`'s layout option (module docstring)
MIMO_SOURCES = ("llama", "qwen2")  # model types whose decoder blocks a Qwen2 (MiMo) checkpoint holds exactly
MIMO_BIAS_SHARD = "model-mimo-bias.safetensors"
CONVERTED_FROM = "drafthead_converted_from"  # config.json key of a target written as MiMo: its own model type
MTP_SHARD = "model-mtp.safetensors"
# a single-file target's weights, renamed: beside `model.safetensors` transformers reads that file alone and never the
# index, so the shards the export adds (the MTP layers, MiMo's biases) would be left out
SINGLE_FILE, TARGET_SHARD = "model.safetensors", "model-target.safetensors"
INDEX = "model.safetensors.index.json"
# block fields the engines take from the target config, not from ours: they must agree
BLOCK_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "vocab_size", "attention_bias", "qk_norm", "attn_output_gate", "norm_unit_offset",
                "partial_rotary_factor")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")


# ---------------------------------------------------------------------------------------------
# the draft



# ---------------------------------------------------------------------------------------------
# the target checkpoint

@dataclass
class TargetCheckpoint:
    """The target as an HF checkpoint: its config.json, its HF config object and where the weights are."""

    name: str
    config: dict  # config.json as written
    hf_config: Any  # transformers config (model_type, layer count, MTP fields)
    folder: Path | None = None  # HF directory with safetensors shards
    gguf_path: Path | None = None  # or a GGUF file (weights dequantized through transformers)
    loaded: Any = None  # the `drafthead.target.Target` loaded from gguf_path
    zero_qkv_bias: bool = False  # a llama target written as MiMo: q/k/v biases of zero are added
    stale: tuple[str, ...] = ()  # prefixes of MTP tensors the target had in its own layout (dropped)

    @property
    def model_type(self) -> str:
        t = self.hf_config.get_text_config() if hasattr(self.hf_config, "get_text_config") else self.hf_config
        return getattr(t, "model_type", "")


def _local_snapshot(name: str) -> Path | None:
    """A hub id's cached snapshot (never downloads)."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, local_files_only=True))
    except Exception:  # not cached / not a hub id
        return None


def locate(target: str | None, meta: dict) -> tuple[str, Path | None, Path | None]:
    """(name, HF folder, GGUF file) of `target=` or the draft's recorded target; exactly one path is set."""
    from drafthead.target import BUILTIN_TARGETS

    recorded = meta.get("target") or {}
    name = target if target is not None else recorded.get("name_or_path")
    gguf_file = None if target is not None else recorded.get("gguf_file")
    if not name:
        raise ExportError("no target: pass target=NAME_OR_PATH (the draft's config.json names none)")
    if name in BUILTIN_TARGETS:
        from drafthead.assets import asset_path

        return name, None, asset_path(name)
    p = Path(name)
    if p.suffix == ".gguf" and p.is_file():
        return name, None, p
    if p.is_dir() and gguf_file and (p / gguf_file).is_file():
        return name, None, p / gguf_file
    folder = p if p.is_dir() else _local_snapshot(name)
    if folder is None or not (folder / "config.json").is_file():
        raise ExportError(f"target {name!r} not found: MTP exports need the target's checkpoint (an HF directory "
                          f"with config.json and safetensors, a cached hub id, a built-in name or a .gguf file)")
    return name, folder, None


def resolve_checkpoint(target: str | None, meta: dict) -> TargetCheckpoint:
    """The target as a checkpoint: an HF directory (or cached hub id) with safetensors, or a built-in name /
    `.gguf` file loaded (dequantized) through transformers."""
    from transformers import AutoConfig

    name, folder, gguf_path = locate(target, meta)
    if gguf_path is not None:
        from drafthead.target import drop_quantization, load_target

        loaded = load_target(str(gguf_path), dtype="float32")
        drop_quantization(loaded.config)
        cfg = loaded.config.to_dict()
        cfg["architectures"] = cfg.get("architectures") or [type(loaded.model).__name__]
        return TargetCheckpoint(name, cfg, loaded.config, None, gguf_path, loaded)
    assert folder is not None
    if not any(folder.glob("*.safetensors")):
        raise ExportError(f"target {folder} has no *.safetensors weights: MTP exports copy the target's "
                          f"safetensors checkpoint")
    try:
        hf_config = AutoConfig.from_pretrained(folder)
    except Exception as e:  # unknown model_type etc.
        raise ExportError(f"{folder}/config.json: transformers cannot read it ({type(e).__name__}: {e})") from None
    return TargetCheckpoint(name, json.loads((folder / "config.json").read_text()), hf_config, folder, None)


def check_block(cfg: MtpConfig, tgt: TargetCheckpoint) -> None:
    """The engines build the MTP layer from the target's config: our block must have those shapes/flags."""
    try:
        want = MtpConfig.from_target(tgt.hf_config)
    except ValueError as e:
        raise ExportError(f"target {tgt.name!r}: {e}") from None
    bad = [f"{f}={getattr(cfg, f)!r} (target {getattr(want, f)!r})" for f in BLOCK_FIELDS
           if getattr(cfg, f) != getattr(want, f)]
    if cfg.target_num_layers and cfg.target_num_layers != want.target_num_layers:
        bad.append(f"target_num_layers={cfg.target_num_layers} (target {want.target_num_layers})")
    if bad:
        raise ExportError(f"the MTP draft does not fit target {tgt.name!r} ({tgt.model_type}), whose engines build "
                          f"the MTP layer from the target config: {', '.join(bad)}")


# ---------------------------------------------------------------------------------------------
# safetensors plumbing

def shard_tensors(path: Path) -> dict[str, int]:
    """{name: bytes} from a safetensors header, without reading tensor data."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}


def _target_weight_map(folder: Path) -> dict[str, str]:
    index = folder / INDEX
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    out: dict[str, str] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update({k: f.name for k in shard_tensors(f)})
    return out


def _empty_like_stored(folder: Path, weight_map: dict[str, str], key: str) -> torch.Tensor:
    """An empty tensor of a stored tensor's shape and dtype (read from the header, not the data)."""
    with safe_open(str(folder / weight_map[key]), "pt") as h:
        sl = h.get_slice(key)
        dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[sl.get_dtype()]
        return torch.empty(sl.get_shape(), dtype=dtype)


def _read_tensor(folder: Path, weight_map: dict[str, str], key: str) -> torch.Tensor | None:
    if key not in weight_map:
        return None
    with safe_open(str(folder / weight_map[key]), "pt") as h:
        return h.get_tensor(key)


def _mtp_dtype(tgt: TargetCheckpoint, outtype: str | None) -> torch.dtype | None:
    """outtype, else the dtype the target checkpoint declares (None = keep the draft's)."""
    if outtype is not None:
        if outtype not in SAFETENSORS_DTYPES:
            raise ExportError(f"outtype={outtype!r} is not available for to=hf; "
                              f"choose one of {sorted(SAFETENSORS_DTYPES)}")
        return SAFETENSORS_DTYPES[outtype]
    declared = tgt.config.get("dtype") or tgt.config.get("torch_dtype")
    if declared is None and isinstance(tgt.config.get("text_config"), dict):
        declared = tgt.config["text_config"].get("dtype") or tgt.config["text_config"].get("torch_dtype")
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}.get(str(declared))


# ---------------------------------------------------------------------------------------------
# names and config

def native_tensors(src: LoadedDraft, tgt: TargetCheckpoint, embed: torch.Tensor | None,
                   lm_head: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Our `layers.{i}.*` under the target family's MTP names (+ the nextn layout's embedding copy)."""
    hf = tgt.hf_config
    if layout(hf) in ("mtp", "mimo") and lm_head is not None:  # no head of their own: they read the target's
        for i in range(src.config.stored_modules):
            head = src.state[f"layers.{i}.shared_head.head.weight"]
            if not (torch.equal(head.to(lm_head.dtype), lm_head) or torch.equal(head, lm_head.to(head.dtype))):
                raise ExportError(f"the {layout(hf)} MTP layout has no head of its own (it uses the target's "
                                  f"lm_head), but the draft's layers.{i}.shared_head.head differs from it "
                                  f"(trained with drafter.train_head=true?)")
    if layout(hf) == "mimo":
        state = dict(src.state)
        if tgt.zero_qkv_bias:
            state.update(zero_qkv_bias(state, [f"layers.{i}.self_attn" for i in range(src.config.stored_modules)]))
        return to_native(state, hf)
    if layout(hf) == "mtp":
        try:
            return to_native(src.state, hf)
        except ValueError as e:  # layers whose shared fc / pre-norms / norm differ
            raise ExportError(f"{e}: the {tgt.model_type} MTP layout stores them once") from None
    out = to_native(src.state, hf)
    if embed is not None:
        N = _text(hf).num_hidden_layers
        for i in range(src.config.stored_modules):
            out[f"model.layers.{N + i}.embed_tokens.weight"] = embed
    return out


def _text(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def zero_qkv_bias(state: dict[str, torch.Tensor], attns: list[str]) -> dict[str, torch.Tensor]:
    """Zero q/k/v biases for the attention modules named in `attns`, sized and typed as their weights."""
    return {f"{a}.{p}_proj.bias": torch.zeros(state[f"{a}.{p}_proj.weight"].shape[0],
                                              dtype=state[f"{a}.{p}_proj.weight"].dtype)
            for a in attns for p in ("q", "k", "v")}


def as_layout(tgt: TargetCheckpoint, want: str) -> TargetCheckpoint:
    """The target as the export writes it for `layout=want`, one of LAYOUTS (module docstring): itself, or written
    as MiMo."""
    own = layout(tgt.hf_config)
    # served as it is: an MTP model type (a config that declares MTP layers, not one drafthead gave them)
    served = own in ("mtp", "mimo") or (native_mtp_layers(_text(tgt.hf_config)) > 0
                                        and tgt.model_type not in MIMO_SOURCES + ("qwen3",))
    if want == "auto" or own == "mimo" or (want == "served" and served):
        return tgt
    if tgt.model_type not in MIMO_SOURCES:
        raise ExportError(f"layout={want}: a {tgt.model_type or 'unknown'} target ({tgt.name}) cannot be written as "
                          f"MiMo (a Qwen2 model; {' and '.join(MIMO_SOURCES)} targets can) and no engine serves MTP "
                          f"layers in its own config; use layout=auto")
    t = _text(tgt.hf_config)
    heads, hidden = t.num_attention_heads, t.hidden_size
    bad = []
    if (getattr(t, "head_dim", None) or hidden // heads) * heads != hidden:
        bad.append(f"head_dim={getattr(t, 'head_dim', None)} (hidden / heads = {hidden // heads})")
    if getattr(t, "mlp_bias", False):
        bad.append("mlp_bias=true")
    if tgt.model_type == "llama" and getattr(t, "attention_bias", False):
        bad.append("attention_bias=true")
    if bad:
        raise ExportError(f"layout={want}: target {tgt.name!r} ({tgt.model_type}) has {', '.join(bad)}, which a "
                          f"Qwen2 (MiMo) block cannot hold (head_dim = hidden / heads, no MLP bias)")
    from transformers import AutoConfig

    drop = ("attention_bias", "mlp_bias", "pretraining_tp", "head_dim", "auto_map", "model_type")
    cfg = {k: v for k, v in json.loads(json.dumps(tgt.config)).items() if k not in drop}
    hf = AutoConfig.for_model("qwen2", **cfg)
    hf.architectures, hf.use_sliding_window = [MIMO_ARCH], False
    cfg.update(model_type="qwen2", architectures=[MIMO_ARCH], use_sliding_window=False,
               **{CONVERTED_FROM: tgt.model_type})
    return TargetCheckpoint(tgt.name, cfg, hf, tgt.folder, tgt.gguf_path, tgt.loaded,
                            zero_qkv_bias=tgt.model_type == "llama", stale=native_prefixes(tgt.hf_config))


def mtp_config_json(tgt: TargetCheckpoint, n: int) -> dict:
    """The target's config.json with the MTP layer count set under its family's field."""
    cfg = json.loads(json.dumps(tgt.config))
    field = "mtp_num_hidden_layers" if layout(tgt.hf_config) == "mtp" else "num_nextn_predict_layers"
    holder = cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg
    for other in ("num_nextn_predict_layers", "mtp_num_hidden_layers"):
        if other != field:
            holder.pop(other, None)
    holder[field] = n
    return cfg


# ---------------------------------------------------------------------------------------------
# to=hf

def write_hf(src: LoadedDraft, tgt: TargetCheckpoint, folder: Path, outtype: str | None = None,
             with_draft: bool = True) -> None:
    """Fill `folder` (empty, not atomic: callers wrap it): target files + weights, the MTP shard, the index,
    config.json with the MTP field and, with `with_draft`, `draft/` in drafthead's format."""
    dtype = _mtp_dtype(tgt, outtype)
    old = native_prefixes(tgt.hf_config) + tgt.stale  # MTP layers the target already declares: replaced by ours
    weight_map: dict[str, str] = {}
    qkv: dict[str, torch.Tensor] = {}  # the target's q/k/v weights (or empty ones of their shape and dtype)
    if tgt.folder is not None:
        tmap = _target_weight_map(tgt.folder)
        if tgt.zero_qkv_bias:
            qkv = {k: _empty_like_stored(tgt.folder, tmap, k) for k in tmap
                   if k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")) and not k.startswith(old)}
        embed = _read_tensor(tgt.folder, tmap, "model.embed_tokens.weight")
        lm_head = _read_tensor(tgt.folder, tmap, "lm_head.weight")
        for f in sorted(tgt.folder.iterdir()):
            if f.is_file() and f.name not in ("config.json", INDEX) and not f.name.endswith(_WEIGHT_SUFFIXES):
                shutil.copyfile(f, folder / f.name)  # tokenizer, generation config, chat template, ...
        for shard in sorted(set(tmap.values())):
            keys = [k for k, v in tmap.items() if v == shard]
            name = TARGET_SHARD if shard == SINGLE_FILE else shard
            if any(k.startswith(old) for k in keys):  # drop the target's own MTP tensors
                kept = {k: v for k, v in load_file(str(tgt.folder / shard)).items() if not k.startswith(old)}
                save_file(kept, str(folder / name), metadata={"format": "pt"})
                keys = list(kept)
            else:
                shutil.copyfile(tgt.folder / shard, folder / name)
            weight_map.update({k: name for k in keys})
    else:  # a GGUF target: its weights as transformers dequantized them, one shard
        t = tgt.loaded
        state = {k: v.contiguous() for k, v in t.model.state_dict().items() if not k.startswith(old)}
        if getattr(t.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)  # tied: stored once, as HF checkpoints do
        embed, lm_head = state.get("model.embed_tokens.weight"), state.get("lm_head.weight")
        qkv = {k: v for k, v in state.items() if k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight"))}
        save_file(state, str(folder / TARGET_SHARD), metadata={"format": "pt"})
        weight_map.update({k: TARGET_SHARD for k in state})
        t.tokenizer.save_pretrained(folder)
    hf = tgt.hf_config
    tied = getattr(hf, "tie_word_embeddings", False) or getattr(_text(hf), "tie_word_embeddings", False)
    if lm_head is None and tied:
        lm_head = embed  # tied: the head is the embedding
    mtp = native_tensors(src, tgt, embed, lm_head)
    mtp = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).contiguous() for k, v in mtp.items()}
    seen: set[int] = set()
    for k, v in mtp.items():  # safetensors stores no aliases (e.g. the per-layer embedding copies)
        if v.data_ptr() in seen:
            mtp[k] = v.clone()
        seen.add(v.data_ptr())
    clash = sorted(set(mtp) & set(weight_map))
    if clash:
        raise ExportError(f"target {tgt.name!r} already has tensors named like the MTP layers: {clash[:4]}")
    save_file(mtp, str(folder / MTP_SHARD), metadata={"format": "pt"})
    weight_map.update({k: MTP_SHARD for k in mtp})
    if tgt.zero_qkv_bias:  # the target's own layers as Qwen2 blocks: q/k/v biases of zero
        layers = sorted({k.rsplit(".", 2)[0] for k in qkv})  # model.layers.{j}.self_attn
        bias = zero_qkv_bias(qkv, layers)
        save_file(bias, str(folder / MIMO_BIAS_SHARD), metadata={"format": "pt"})
        weight_map.update({k: MIMO_BIAS_SHARD for k in bias})
    total = sum(n for f in set(weight_map.values()) for n in shard_tensors(folder / f).values())
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                            "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
    (folder / "config.json").write_text(json.dumps(mtp_config_json(tgt, src.config.stored_modules), indent=2) + "\n")
    if with_draft:
        drafter = MtpDrafter(src.config)
        drafter.load_state_dict(src.state, strict=False)  # the embedding is not saved (it is the target's)
        extra = {k: v for k, v in src.meta.items() if k not in ("family", "draft", "target", "drafthead_version")}
        save_draft(drafter, folder / "draft", src.meta.get("target") or {}, extra)
    default_mode(folder, directory=True)


def _export_hf(src: LoadedDraft, tgt: TargetCheckpoint, out: str | os.PathLike, outtype: str | None = None) -> Path:
    with atomic_dir(out) as tmp:
        write_hf(src, tgt, tmp, outtype)
    return Path(out)


# ---------------------------------------------------------------------------------------------
# to=gguf

def gguf_arch(model_type: str, name: str) -> str:
    """The llama.cpp architecture that runs MTP layers for an HF `model_type` (or a llama.cpp arch name),
    else a one-line error naming the supported ones."""
    if model_type in GGUF_ARCHS.values():
        return model_type
    arch = GGUF_ARCHS.get(model_type)
    if arch is None:
        by_arch: dict[str, list[str]] = {}
        for k, v in GGUF_ARCHS.items():
            by_arch.setdefault(v, []).append(k)
        supported = ", ".join(f"HF {'/'.join(ks)} = llama.cpp {v}" for v, ks in by_arch.items())
        raise ExportError(f"to=gguf: llama.cpp cannot run MTP layers for a {model_type or 'unknown'} target "
                          f"({name}); its draft-mtp graphs with a dense MTP block exist for: {supported} "
                          f"(to=hf writes the layers for drafthead's own runtime)")
    return arch


def run_converter(hf_dir: Path, out_file: Path, outtype: str) -> None:
    """llama.cpp's convert_hf_to_gguf.py (vendored copy, with its own gguf-py) on `hf_dir`."""
    from drafthead.export.llama_cpp import llama_cpp_source

    src = llama_cpp_source()
    script = src / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise ExportError(f"to=gguf runs llama.cpp's convert_hf_to_gguf.py, not found at {script}: run "
                          f"scripts/build_llama_cpp.sh (it unpacks the llama-cpp-python 0.3.36 sdist)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src / "gguf-py"), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, str(script), str(hf_dir), "--outtype", outtype, "--outfile", str(out_file)],
                         capture_output=True, text=True, env=env)
    if res.returncode != 0:
        raise ExportError(f"llama.cpp's convert_hf_to_gguf.py failed ({res.returncode}): "
                          f"{res.stderr.strip().splitlines()[-1] if res.stderr.strip() else ''}\n{res.stderr[-3000:]}")


def _export_gguf(src: LoadedDraft, tgt: TargetCheckpoint, out: str | os.PathLike, outtype: str | None = None) -> Path:
    outtype = outtype or "auto"
    out = check_gguf_out(out, outtype, GGUF_OUTTYPES)
    arch = gguf_arch(tgt.model_type, tgt.name)
    n = src.config.stored_modules
    if n > GGUF_MAX_LAYERS.get(arch, n):
        raise ExportError(f"to=gguf: llama.cpp's {arch} graph runs {GGUF_MAX_LAYERS[arch]} MTP layer, this draft "
                          f"stores {n} (train with drafter.recursive=true)")
    if tgt.folder is None:
        raise ExportError(f"to=gguf converts the target's HF checkpoint with the MTP layers added; target "
                          f"{tgt.name!r} is a GGUF file: pass target=HF_DIR")
    with writing(out):
        out.parent.mkdir(parents=True, exist_ok=True)
    with writing(out), tempfile.TemporaryDirectory(prefix=f".{out.name}.hf-", dir=out.parent) as work:
        hf_dir = Path(work) / "hf"
        hf_dir.mkdir()
        write_hf(src, tgt, hf_dir, None, with_draft=False)
        tmp = Path(work) / out.name
        run_converter(hf_dir, tmp, outtype)
        kv = read_gguf_metadata(tmp)
        got_arch = kv.get("general.architecture", (0, None, None))[2]
        got_n = kv.get(f"{got_arch}.nextn_predict_layers", (0, None, 0))[2]
        if got_arch != arch or got_n != n:
            raise ExportError(f"llama.cpp's converter wrote architecture {got_arch!r} with nextn_predict_layers="
                              f"{got_n}; expected {arch!r} with {n}")
        default_mode(tmp)
        os.replace(tmp, out)
    return out


# ---------------------------------------------------------------------------------------------
# the family's entry points (`drafthead export to=hf|gguf`)

def export_hf(draft: LoadedDraft, out: str | os.PathLike, target: str | None = None,
              outtype: str | None = None, layout: str = "auto") -> Path:
    """The target checkpoint with our MTP layers added, in `out` (a directory); nothing there on an error.
    `layout`: auto (the target's own), mimo or served (module docstring)."""
    if layout not in LAYOUTS:  # before the target loads
        raise ExportError(f"layout={layout!r}: choose one of {', '.join(LAYOUTS)}")
    tgt = resolve_checkpoint(target, draft.meta)
    check_block(draft.config, tgt)
    tgt = as_layout(tgt, layout)
    n = draft.config.stored_modules
    if mtp_native.layout(tgt.hf_config) == "mimo" and n > 1:  # (`layout` is the option here)
        raise ExportError(f"the MiMo MTP layout: vLLM's and SGLang's MiMo MTP run the first MTP layer for every draft "
                          f"token, and this draft stores {n} (train with drafter.mtp.recursive=true)")
    return _export_hf(draft, tgt, out, outtype)


def export_gguf(draft: LoadedDraft, out: str | os.PathLike, target: str | None = None,
                outtype: str | None = None) -> Path:
    """That checkpoint converted by llama.cpp's own converter, in `out` (a .gguf file)."""
    name, _, gguf_path = locate(target, draft.meta)  # cheap checks first: a GGUF target loads slowly
    if gguf_path is not None:
        kv = read_gguf_metadata(gguf_path)
        gguf_arch(str(kv.get("general.architecture", (0, None, ""))[2]), name)
        raise ExportError(f"to=gguf converts the target's HF checkpoint with the MTP layers added; target "
                          f"{name!r} is a GGUF file: pass target=HF_DIR")
    tgt = resolve_checkpoint(target, draft.meta)
    gguf_arch(tgt.model_type, tgt.name)
    check_block(draft.config, tgt)
    return _export_gguf(draft, tgt, out, outtype)


def read_native_export(folder: str | os.PathLike) -> tuple[Any, dict[str, torch.Tensor]]:
    """(HF config, our `layers.{i}.*` tensors) read back from a `to=hf` export via the native loader's names."""
    from transformers import AutoConfig

    from drafthead.mtp_native import read_native

    folder = Path(folder)
    config = AutoConfig.from_pretrained(folder)
    native = read_native(str(folder), config)
    if native is None:
        raise ExportError(f"{folder}: no MTP tensors found")
    ours = to_ours(native, config)
    if getattr(config, CONVERTED_FROM, None) == "llama":  # the zero q/k/v biases the MiMo layout added
        ours = {k: v for k, v in ours.items()
                if not (k.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")) and not v.any())}
    return config, ours


__all__ = ["GGUF_ARCHS", "export_gguf", "export_hf", "read_native_export", "resolve_checkpoint"]


def read_back(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """A `to=hf` export -> our `layers.{i}.*` tensors, through the native loader's names."""
    return read_native_export(path)[1]

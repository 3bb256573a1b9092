"""EAGLE3 `to=gguf`: a draft llama.cpp loads with `-md draft.gguf --spec-type draft-eagle3`.

Written with the PyPI `gguf` writer (drafthead/export/gguf.py) under explicit names (the PyPI package has no
EAGLE3 constants).
Every name, shape and key below was read from the llama.cpp tree vendored in llama-cpp-python 0.3.36:
- `src/models/eagle3.cpp` `llama_model_eagle3::load_arch_hparams`: `eagle3.target_layers` (array of
  exactly 3 ints, required), `eagle3.target_hidden_size` (u32), optional `eagle3.norm_before_residual`;
  `llama_model_base::load_hparams` (src/llama-model.cpp) the usual `eagle3.*` llama keys.
- `load_arch_tensors`: `fc.weight` {3*Ht, H}, `blk.0.attn_norm` (embedding norm), `blk.0.attn_norm_2`
  (hidden_norm), `blk.0.attn_q/k/v` {2H, ..}, `attn_output`, `ffn_norm/gate/up/down`, `output_norm`,
  `output` {H, N} and `d2t` {N} (I64, absolute target ids: `ggml_set_rows` scatters draft logits to
  these rows); `token_embd` is optional (the target's is used).
- The graph ropes with `LLAMA_ROPE_TYPE_NORM` (adjacent pairs), so q/k rows are permuted from HF's
  rotate-half order exactly as llama.cpp's HF converter does for Llama (`LlamaModel.permute`).
- `common/speculative.cpp` (`common_speculative_impl_draft_eagle3`) reads the layer ids from OUR file
  (`llama_model_target_layer_ids(model_dft)`) and turns on `llama_set_embeddings_layer_inp(ctx_tgt, id)`;
  `src/models/llama.cpp` records `res->t_layer_inp[il] = inpL` at the top of decoder layer `il`: the
  input of layer `id` = HF `hidden_states[id]` = drafthead's aux id. So `target_layers` = our ids as is.
Tokenizer metadata (`tokenizer.*`) is copied from the target GGUF so both models share one vocabulary.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from drafthead.export.common import (GGUF_FINGERPRINT_KEY, ExportError, TargetInfo, absolute_d2t, check_gguf_out,
                                     target_fingerprint)
from drafthead.export.gguf import (OUTTYPES, add_model_keys, copy_tokenizer, rope_permute, rope_unpermute,
                                   write_atomic, write_tensors)
from drafthead.registry import LoadedDraft

ARCH = "eagle3"

# our name -> llama.cpp name (without the `.weight` suffix where llama.cpp's tn() adds one)
TENSOR_NAMES = {
    "fc.weight": "fc.weight",
    "midlayer.input_layernorm.weight": "blk.0.attn_norm.weight",
    "midlayer.hidden_norm.weight": "blk.0.attn_norm_2.weight",
    "midlayer.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "midlayer.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "midlayer.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "midlayer.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "midlayer.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "midlayer.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "midlayer.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "midlayer.mlp.down_proj.weight": "blk.0.ffn_down.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "d2t": "d2t",
}
NOT_WRITTEN = ("t2d",)  # llama.cpp has no use for it



def gguf_tensors(src: LoadedDraft) -> dict[str, torch.Tensor]:
    """The draft's tensors under llama.cpp names, in llama.cpp layout (fp32 / int64)."""
    cfg, sd = src.config, src.state
    out = {}
    for ours, theirs in TENSOR_NAMES.items():
        t = sd[ours]
        if ours == "midlayer.self_attn.q_proj.weight":
            t = rope_permute(t, cfg.num_attention_heads)
        elif ours == "midlayer.self_attn.k_proj.weight":
            t = rope_permute(t, cfg.num_key_value_heads)
        elif ours == "d2t":
            t = absolute_d2t(t)
        out[theirs] = t.to(torch.int64) if ours == "d2t" else t.float()
    return out



def write_gguf(src: LoadedDraft, target: TargetInfo, path: Path, outtype: str = "f32") -> None:
    """Write the file (not atomic; `export` wraps it)."""
    import gguf

    cfg = src.config
    layers = list(cfg.aux_layer_ids)  # inputs of these target layers: what llama.cpp extracts, see above
    w = gguf.GGUFWriter(str(path), ARCH)
    add_model_keys(w, cfg, f"{Path(target.name_or_path).name} EAGLE3 draft (drafthead)", 1, outtype)
    w.add_key_value(f"{ARCH}.target_layers", layers, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT32)
    w.add_uint32(f"{ARCH}.target_hidden_size", cfg.target_hidden_size)
    w.add_bool(f"{ARCH}.norm_before_residual", cfg.norm_before_residual)
    if fp := target_fingerprint(src.meta):
        w.add_string(GGUF_FINGERPRINT_KEY, fp)
    copy_tokenizer(target.gguf_path, w)
    write_tensors(w, gguf_tensors(src), outtype)


def export(src: LoadedDraft, target: TargetInfo, out: str | os.PathLike, outtype: str | None = None) -> Path:
    eagle31 = [name for name in ("fc_norm", "norm_output") if getattr(src.config, name)]
    if eagle31:
        # neither is linear, so neither folds into fc or the head; llama.cpp would silently run plain EAGLE3
        raise ExportError(f"{src.path}: this draft was trained with EAGLE 3.1 {' and '.join(eagle31)}, which "
                          f"llama.cpp's EAGLE3 graph (llama-cpp-python 0.3.36) has no key or tensor for; export "
                          f"it with to=speculators or to=sglang (vLLM and SGLang read both)")
    outtype = outtype or "f32"
    out = check_gguf_out(out, outtype, OUTTYPES)
    if target.gguf_path is None:
        raise ExportError(f"to=gguf copies the tokenizer from the target's GGUF, but target "
                          f"{target.name_or_path!r} ({target.source}) is not a GGUF file: pass target=PATH.gguf")
    return write_atomic(out, lambda tmp: write_gguf(src, target, tmp, outtype))



def read_back(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """An EAGLE3 draft GGUF (ours or llama.cpp's) -> our tensor names and layout (HF rotate-half q/k rows,
    d2t offsets, t2d rebuilt): what `gguf_tensors` wrote, read back (quantized types dequantized to fp32)."""
    import gguf

    r = gguf.GGUFReader(str(path))
    arch = r.fields["general.architecture"].contents()
    if arch != ARCH:
        raise ExportError(f"{path}: general.architecture is {arch!r}, not {ARCH!r}")
    q = gguf.GGMLQuantizationType
    theirs = {t.name: t for t in r.tensors}
    n_head = int(r.fields[f"{ARCH}.attention.head_count"].contents())
    n_kv = int(r.fields[f"{ARCH}.attention.head_count_kv"].contents())
    out: dict[str, torch.Tensor] = {}
    for ours, name in TENSOR_NAMES.items():
        t = theirs[name]
        shape = tuple(int(x) for x in reversed(t.shape))
        if t.tensor_type in (q.F32, q.F16, q.I64):
            a = np.asarray(t.data).reshape(shape)
        else:
            a = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(shape)
        w = torch.from_numpy(a.astype(np.int64 if t.tensor_type == q.I64 else np.float32))
        if ours == "midlayer.self_attn.q_proj.weight":
            w = rope_unpermute(w, n_head)
        elif ours == "midlayer.self_attn.k_proj.weight":
            w = rope_unpermute(w, n_kv)
        elif ours == "d2t":
            w = w - torch.arange(w.numel())  # absolute target ids -> offsets
        out[ours] = w
    vocab = int(r.fields[f"{ARCH}.vocab_size"].contents())
    out["t2d"] = torch.zeros(vocab, dtype=torch.bool)
    out["t2d"][out["d2t"] + torch.arange(out["d2t"].numel())] = True
    return out

"""The frozen target: loading (HF dir / hub id / GGUF / built-in names) and hidden-state capture.

Capture uses forward hooks on the chosen decoder layers, never `output_hidden_states` of every layer.
Layer id convention: id `i` captures the *input* of decoder layer `i` (= HF `hidden_states[i]`, the
output of layer i-1), which is what SGLang, vLLM and llama.cpp mean by
`eagle_aux_hidden_state_layer_ids`. The "last hidden state" is the output of the final norm, i.e.
what the target's `lm_head` reads, so teacher logits can be recomputed from it.
"""
from __future__ import annotations

import contextlib
import functools
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from drafthead.assets import asset_path
from drafthead.split import whole

BUILTIN_TARGETS = {"smollm2-135m-instruct"}


@dataclass
class Target:
    model: nn.Module  # HF causal LM, frozen, eval mode
    tokenizer: Any
    name_or_path: str
    gguf_file: str | None = None

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def num_layers(self) -> int:
        return self.model.config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.model.config.hidden_size

    @functools.cached_property
    def fingerprint(self) -> dict[str, str]:
        """Which target this is (drafthead/fingerprint.py): recorded in every draft and checkpoint, checked by
        eval, bench, export and resume. Computed once per load and remembered for the target's files."""
        from drafthead import fingerprint

        fp = fingerprint.compute(self.model, self.tokenizer)
        with contextlib.suppress(FileNotFoundError):
            fingerprint.remember(*resolve_target(self.name_or_path, self.gguf_file), fp)
        return fp

    def info(self) -> dict:
        c = self.model.config
        return {"name_or_path": self.name_or_path, "gguf_file": self.gguf_file,
                "architecture": (getattr(c, "architectures", None) or [type(self.model).__name__])[0],
                "model_type": c.model_type, "num_hidden_layers": c.num_hidden_layers,
                "hidden_size": c.hidden_size, "vocab_size": c.vocab_size, "fingerprint": self.fingerprint}


def resolve_target(name_or_path: str, gguf_file: str | None = None) -> tuple[str, str | None]:
    """Map built-in names and `.gguf` paths to (directory or hub id, gguf file name or None)."""
    if name_or_path in BUILTIN_TARGETS:
        p = asset_path(name_or_path)
        return str(p.parent), p.name
    p = Path(name_or_path)
    if p.suffix == ".gguf":
        if not p.is_file():
            raise FileNotFoundError(f"target GGUF not found: {p}")
        return str(p.parent), p.name
    return name_or_path, gguf_file


def load_target(name_or_path: str, gguf_file: str | None = None, dtype: str = "auto",
                device: str | torch.device = "cpu", tp_mesh: Any = None) -> Target:
    """Load a frozen target once. dtype 'auto' = bf16 where bf16 is native (CUDA, AMX / AVX512-BF16 CPUs),
    fp32 elsewhere (`drafthead.hardware.resolve_dtype`). `tp_mesh`: a 1-D DeviceMesh the target is split over
    with transformers' tensor-parallel plan (every rank of the mesh calls this together); its weights are then
    DTensors, its hidden states and logits whole on every rank."""
    from transformers import AutoModelForCausalLM

    from drafthead.hardware import resolve_dtype_name

    path, gguf = resolve_target(name_or_path, gguf_file)
    dtype = resolve_dtype_name(dtype, device, "target")
    tok = load_tokenizer(path, gguf)
    if tp_mesh is not None:
        check_split(path, tp_mesh.size())
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), tp_plan="auto",
                                                     device_mesh=tp_mesh)
        return freeze(Target(model, tok, name_or_path, gguf))
    source = dequantized_dir(path, gguf) if gguf else path
    model = AutoModelForCausalLM.from_pretrained(source, dtype=getattr(torch, dtype))
    return freeze(Target(model.to(device), tok, name_or_path, gguf))


def _cache_key(src: Path) -> str:
    """A cached conversion of `src` is valid while the file and the transformers release are the same."""
    import hashlib

    import transformers

    st = src.stat()
    key = hashlib.sha1(f"{src.resolve()}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}".encode())
    return f"{src.stem}-{key.hexdigest()[:16]}"


def drop_quantization(config: Any) -> None:
    """A GGUF-loaded config names the quantization its weights came in; the folders drafthead writes from it (the
    de-quantized cache, vLLM's target, MTP exports) hold plain weights, so the key goes."""
    if hasattr(config, "quantization_config"):
        del config.quantization_config


def dequantized_dir(path: str, gguf: str) -> Path:
    """A GGUF target's weights de-quantized to fp32, as an HF model folder in the cache, written on first use.

    transformers parses a GGUF's metadata and de-quantizes its tensors on every load (half a minute for
    SmolLM2-135M on a 2-core machine, most of it reading the vocabulary's strings); a safetensors folder loads in
    a second or two. The weights are the ones transformers de-quantizes, stored in fp32, so loading the folder in
    any dtype rounds them exactly as loading the GGUF in that dtype does (tested)."""
    from transformers import AutoModelForCausalLM

    from drafthead.assets import cache_dir
    from drafthead.io import atomic_dir

    out = cache_dir() / "gguf-models" / _cache_key(Path(path) / gguf)
    if (out / "config.json").exists():
        return out
    from safetensors.torch import save_model

    model = AutoModelForCausalLM.from_pretrained(path, gguf_file=gguf, dtype=torch.float32)
    config = model.config
    drop_quantization(config)  # the folder holds plain fp32 weights
    with atomic_dir(out) as tmp:  # transformers refuses to save a GGUF-loaded model: its tensors are written here
        save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
    return out


def check_split(path: str, tp: int) -> None:
    """A target splits over `tp` ranks when every head count divides (q/k/v are split by heads)."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(path)
    c = getattr(c, "text_config", c)
    heads = {"attention heads": c.num_attention_heads,
             "key/value heads": getattr(c, "num_key_value_heads", None) or c.num_attention_heads}
    bad = [f"{n} {name}" for name, n in heads.items() if n % tp]
    if bad:
        raise ValueError(f"target.tensor_parallel={tp} does not divide the target's {' and '.join(bad)}: "
                         f"use a tensor_parallel that divides both")


def local_target_fingerprint(name_or_path: str, gguf_file: str | None = None
                             ) -> tuple[dict[str, str] | None, str]:
    """(the fingerprint of a target on this machine, from the cache or by loading it on the CPU; why not,
    when None: not on this machine, e.g. a hub id not downloaded, or not loadable as a model)."""
    from drafthead.fingerprint import recall

    try:
        path, gguf = resolve_target(name_or_path, gguf_file)
    except FileNotFoundError:
        return None, f"target {name_or_path!r} is not on this machine"
    if not Path(path, gguf or "").exists():
        return None, f"target {name_or_path!r} is not on this machine"
    fp = recall(path, gguf)
    if fp is None:
        print(f"target {name_or_path!r}: no fingerprint cached for its files; loading it once to compute one",
              file=sys.stderr)
        try:
            fp = load_target(name_or_path, gguf_file, dtype="auto").fingerprint  # caches it
        except (OSError, ValueError, KeyError, RuntimeError) as e:  # e.g. a folder holding only a tokenizer GGUF
            return None, f"target {name_or_path!r} could not be loaded ({type(e).__name__}: {str(e)[:200]})"
    return fp, ""


def load_tokenizer(path: str, gguf: str | None = None) -> Any:
    """AutoTokenizer; a GGUF vocabulary is converted once (~10-20 s) and cached as an HF tokenizer."""
    from transformers import AutoTokenizer

    from drafthead.assets import cache_dir
    from drafthead.io import atomic_dir

    if not gguf:
        return AutoTokenizer.from_pretrained(path)
    out = cache_dir() / "tokenizers" / _cache_key(Path(path) / gguf)
    if (out / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(path, gguf_file=gguf)
    with atomic_dir(out) as tmp:
        tok.save_pretrained(tmp)
    return tok


def freeze(target: Target) -> Target:
    target.model.eval()
    for p in target.model.parameters():
        p.requires_grad_(False)
    if target.tokenizer is not None and target.tokenizer.pad_token_id is None:
        target.tokenizer.pad_token = target.tokenizer.eos_token
    return target


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    base = getattr(model, "model", model)
    if not hasattr(base, "layers"):
        raise TypeError(f"{type(model).__name__}: no decoder layer list at .model.layers")
    return base.layers


def base_model(model: nn.Module) -> nn.Module:
    return getattr(model, "model", model)


def lm_head_weight(model: nn.Module) -> torch.Tensor:
    """[V, H]. A split head is gathered once and kept (teacher logits and the argmax read it every batch)."""
    head = model.get_output_embeddings()
    kept = head.__dict__.get("_drafthead_whole")
    if kept is None:
        kept = whole(head.weight)
        if kept is not head.weight:
            head.__dict__["_drafthead_whole"] = kept
    return kept


def input_embedding_weight(model: nn.Module) -> torch.Tensor:
    return whole(model.get_input_embeddings().weight)  # [V, H]


def final_norm_weight(model: nn.Module) -> torch.Tensor:
    return whole(base_model(model).norm.weight)  # [H]


def check_layer_ids(layer_ids: list[int], num_layers: int) -> None:
    bad = [i for i in layer_ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"capture layer ids {bad} out of range: the target has {num_layers} decoder layers "
                         f"(ids are inputs of layers 0..{num_layers - 1})")


@torch.no_grad()
def capture(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
            layer_ids: list[int], dtype: torch.dtype | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
    """One target forward with hooks.

    Returns (aux [B, T, len(layer_ids)*H] or None when no ids, last [B, T, H]) in `dtype` (default:
    the model's). The lm_head is not run.
    """
    layers = decoder_layers(model)
    check_layer_ids(layer_ids, len(layers))
    grabbed: dict[int, torch.Tensor] = {}
    hooks = []
    for i in sorted(set(layer_ids)):
        def pre(mod, args, kwargs, i=i):
            grabbed[i] = (args[0] if args else kwargs["hidden_states"])
        hooks.append(layers[i].register_forward_pre_hook(pre, with_kwargs=True))
    try:
        out = base_model(model)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    last = out.last_hidden_state  # [B, T, H] after the final norm
    dtype = dtype or last.dtype
    aux = torch.cat([grabbed[i] for i in layer_ids], dim=-1).to(dtype) if layer_ids else None  # [B, T, 3H]
    return aux, last.to(dtype)


def full_argmax(weight: torch.Tensor, hidden: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """Full-vocabulary argmax of the target's lm_head over `hidden` [M, H] -> [M], in chunks of rows.
    Capture stores it once per token, so training passes over stored features skip the [M, V] matmul."""
    h = hidden.to(weight.dtype)
    out = [(h[s: s + chunk] @ weight.T).max(-1).indices for s in range(0, h.shape[0], chunk)]  # [m] each
    # max(-1).indices: the same first-maximum index as argmax, and a faster CPU path for bf16 than argmax
    return torch.cat(out) if out else h.new_zeros(0, dtype=torch.long)


class TargetHead(nn.Module):
    """Frozen target lm_head, for teacher logits restricted to the draft vocab and the full argmax.
    `draft_token_ids=None`: teacher logits over the full vocab (MTP)."""

    def __init__(self, lm_head: torch.Tensor, draft_token_ids: torch.Tensor | None, chunk: int = 4096) -> None:
        super().__init__()
        self.register_buffer("weight", lm_head.detach().clone(), persistent=False)  # [V, H]
        self.full = draft_token_ids is None
        ids = torch.arange(lm_head.shape[0]) if self.full else draft_token_ids.long().clone()
        self.register_buffer("draft_ids", ids, persistent=False)  # [N]
        # the N draft rows, gathered once: a second, small matmul beats gathering N columns of the full
        # logits on CPU
        self.register_buffer("draft_weight", None if self.full else self.weight[ids], persistent=False)  # [N, H]
        self.chunk = chunk

    @torch.no_grad()
    def forward(self, hidden: torch.Tensor, argmax: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden [M, H] -> (logits over draft vocab [M, N] fp32, full-vocab argmax [M] or None when
        `argmax=False`, i.e. when the capture stored it)."""
        h = hidden.to(self.weight.dtype)
        w = self.weight if self.full else self.draft_weight  # [N, H]
        chunks = [(h[s: s + self.chunk] @ w.T).float() for s in range(0, h.shape[0], self.chunk)]  # [m, N] each
        logits = torch.cat(chunks) if chunks else h.new_zeros(0, w.shape[0], dtype=torch.float32)
        if not argmax:
            return logits, None
        # a full head has the argmax in its logits (bf16 -> fp32 is exact, so the same first maximum)
        return logits, (logits.max(-1).indices if self.full else full_argmax(self.weight, h, self.chunk))

"""What the llama.cpp draft tests (DFlash, DSpark, the LoRA self-draft) share: the SmolLM2 target's own greedy
continuations of a few chat prompts, from llama.cpp itself, as one batch to overfit drafts on, with a one-hot teacher
of llama.cpp's next token (so an overfit draft proposes exactly what llama.cpp's target will verify)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from drafthead.assets import asset_path
from drafthead.export import llama_cpp as lc
from drafthead.target import load_target


@dataclass
class Continuations:
    target: Any  # drafthead Target (fp32), the model the drafts are trained against
    target_gguf: Path
    prompts: list[str]  # chat-templated
    alone: list[Any]  # llama-completion runs of n_predict tokens (what speculative decoding must reproduce)
    longer: list[Any]  # the same, `extra` tokens longer (llama.cpp may emit a few tokens past n_predict)
    input_ids: torch.Tensor  # [B, T] prompt + longer continuation, right-padded
    attn: torch.Tensor  # [B, T]
    loss_mask: torch.Tensor  # [B, T] from `mask_from` tokens after the last prompt token on
    argmax: torch.Tensor  # [B, T] llama.cpp's next token at j (-1 past the end)
    teacher: torch.Tensor  # [B, T, V] its one-hot


def continuations(bins: Path, questions: list[str], n_predict: int, extra: int, threads: int, mask_from: int = 0,
                  poll: int | None = 0) -> Continuations:
    """mask_from: where the loss starts, relative to the last prompt token (0: there, where a block drafter's first
    block starts; 1: the first generated token). poll: llama-completion's --poll (None: llama.cpp's default)."""
    target_gguf = asset_path("smollm2-135m-instruct")
    target = load_target("smollm2-135m-instruct", dtype="float32")
    tok = target.tokenizer
    prompts = [lc.chat_prompt(tok, q) for q in questions]
    alone = [lc.run_target(bins, target_gguf, p, n_predict, threads, poll=poll) for p in prompts]
    longer = [lc.run_target(bins, target_gguf, p, n_predict + extra, threads, poll=poll) for p in prompts]
    seqs, n_prompts = [], []
    for p, c in zip(prompts, longer, strict=True):
        n_prompts.append(len(tok(p, add_special_tokens=False).input_ids))
        seqs.append(torch.tensor(tok(p + c.text, add_special_tokens=False).input_ids))
    T = max(len(s) for s in seqs)
    input_ids = torch.zeros(len(seqs), T, dtype=torch.long)
    attn = torch.zeros(len(seqs), T, dtype=torch.long)
    loss_mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for i, s in enumerate(seqs):
        input_ids[i, : len(s)], attn[i, : len(s)] = s, 1
        loss_mask[i, n_prompts[i] - 1 + mask_from: len(s)] = 1
    nxt = torch.roll(input_ids, -1, dims=1)
    argmax = nxt.masked_fill(~torch.roll(attn, -1, dims=1).bool(), -1)
    teacher = torch.zeros(*input_ids.shape, target.config.vocab_size).scatter_(-1, nxt[..., None], 1.0)
    return Continuations(target, target_gguf, prompts, alone, longer, input_ids, attn, loss_mask, argmax, teacher)

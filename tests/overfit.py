"""An EAGLE3 draft overfit on an engine's own greedy continuations, for the tests that run our exports in an engine
(llama.cpp, vLLM): the draft learns exactly the tokens that engine's target will verify, so its acceptance there is
high, and a misread export (a layer id, a norm, the vocabulary map) shows as acceptance falling towards an untrained
draft's."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from drafthead.eagle3 import Eagle3Config, Eagle3Drafter
from drafthead.target import capture
from drafthead.vocab import build_vocab_mapping, draft_ids


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] prompt + continuation, right-padded
    attn: torch.Tensor  # [B, T]
    loss_mask: torch.Tensor  # [B, T] 1 on the continuation


def batch(seqs: list[list[int]], n_prompts: list[int]) -> Batch:
    """Sequences of token ids (prompt then continuation) as one right-padded batch, the loss on the continuation."""
    T = max(len(s) for s in seqs)
    input_ids = torch.zeros(len(seqs), T, dtype=torch.long)
    attn = torch.zeros(len(seqs), T, dtype=torch.long)
    loss_mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for i, (s, n) in enumerate(zip(seqs, n_prompts, strict=True)):
        input_ids[i, : len(s)], attn[i, : len(s)] = torch.tensor(s), 1
        loss_mask[i, n: len(s)] = 1
    return Batch(input_ids, attn, loss_mask)


@dataclass
class Eagle3Overfit:
    trained: Eagle3Drafter
    random: Eagle3Drafter  # the same start, untrained
    train_acc: list[float]  # per TTT step, at the last training step
    aux: torch.Tensor  # [B, T, 3H] the target features it was trained on


def overfit_eagle3(target: Any, data: Batch, draft_vocab: int, steps: int, ttt_steps: int, lr: float = 5e-3,
                   drafter_cls: type = Eagle3Drafter, config_cls: type = Eagle3Config, **config: Any) -> Eagle3Overfit:
    """Train an EAGLE3 draft `steps` AdamW steps on `data`, with a sharp one-hot teacher of the next token (what the
    engine's verifier accepts). `config`: Eagle3Config overrides (an MLP twice the target's, say). `drafter_cls`,
    `config_cls`: a family built on EAGLE3's forward (P-EAGLE: its mask entries from the second position on)."""
    cfg = config_cls.from_target(target.config, draft_vocab_size=draft_vocab, **config)
    counts = torch.bincount(data.input_ids[data.attn.bool()], minlength=cfg.vocab_size)
    d2t, t2d = build_vocab_mapping(counts, cfg.draft_vocab_size)  # holds every token of these sequences
    aux, _ = capture(target.model, data.input_ids, data.attn, cfg.aux_layer_ids)  # [B, T, 3H]
    nxt = torch.roll(data.input_ids, -1, dims=1)  # [B, T] x_{j+1} at j
    draft_of = torch.full((cfg.vocab_size,), -1, dtype=torch.long)
    draft_of[draft_ids(d2t)] = torch.arange(cfg.draft_vocab_size)
    teacher = torch.full((*data.input_ids.shape, cfg.draft_vocab_size), -20.0)  # [B, T, N]
    teacher.scatter_(-1, draft_of[nxt].clamp(min=0)[..., None], 20.0)
    teacher = teacher.softmax(-1)  # the drafter trains on the teacher's distribution
    argmax = nxt.masked_fill(~torch.roll(data.attn, -1, dims=1).bool(), -1)  # [B, T]

    def new_drafter() -> Eagle3Drafter:
        d = drafter_cls(cfg)
        d.embed_tokens.weight.data.copy_(target.model.get_input_embeddings().weight)
        d.d2t.copy_(d2t)
        d.t2d.copy_(t2d)
        return d

    random_draft = new_drafter().eval()
    trained = new_drafter()
    opt = torch.optim.AdamW([p for p in trained.parameters() if p.requires_grad], lr=lr)
    for _ in range(steps):
        out = trained(data.input_ids, aux, teacher, argmax, data.loss_mask, num_draft_tokens=ttt_steps)
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
    print(f"overfit EAGLE3: {steps} steps, loss {out['loss'].item():.3f}")
    return Eagle3Overfit(trained.eval(), random_draft, (out["correct"] / out["count"].clamp(min=1)).tolist(), aux)

"""What the llama.cpp draft tests (DFlash, DSpark, the LoRA self-draft) share: the SmolLM2 target's own greedy
continuations of a few chat prompts, from llama.cpp itself, as one batch to overfit drafts on, with a one-hot teacher
of llama.cpp's next token (so an overfit draft proposes exactly what llama.cpp's target will verify); and for the
block drafters, training them on it, running them in llama.cpp and our runtime's acceptance by draft position."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from drafthead.assets import asset_path
from drafthead.export import export
from drafthead.export import llama_cpp as lc
from drafthead.registry import save_draft
from drafthead.runtime import SpecConfig, SpeculativeGenerator
from drafthead.target import capture, lm_head_weight, load_target


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
    return Continuations(target, target_gguf, prompts, alone, longer,
                         *one_hot_batch(target, seqs, n_prompts, mask_from))


def one_hot_batch(target: Any, seqs: list[torch.Tensor], n_prompts: list[int], mask_from: int = 0
                  ) -> tuple[torch.Tensor, ...]:
    """Prompt + continuation token sequences -> (input_ids, attn, loss_mask, argmax, teacher) to overfit a draft on:
    right-padded, the loss from `mask_from` tokens after each last prompt token on, the teacher the one-hot of the
    next token (what the target decoded)."""
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
    return input_ids, attn, loss_mask, argmax, teacher


def overfit_drafts(new_drafter: Callable[[], Any], data: Continuations, aux: torch.Tensor, steps: dict[str, int],
                   root: Path, untrained: str | None, summary: Callable[[dict], str], gguf: bool = True
                   ) -> tuple[dict[str, Any], dict[str, Path]]:
    """Drafts from `new_drafter()` (each call the same seeded start), one per name in `steps`, trained that many AdamW
    steps on `data` with target features `aux`, plus one left untrained under the name `untrained` (None: none);
    `summary(out)` says what to print of a draft's last step. Returns the drafts and their GGUF exports under `root`
    (none where `gguf` is False)."""
    t0 = time.perf_counter()
    drafters = {untrained: new_drafter().eval()} if untrained else {}
    for name, n in steps.items():
        d = new_drafter()
        opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=1e-3)  # 3e-3 stalls (loss ~3.7)
        for i in range(n):
            out = d(data.input_ids, aux, data.teacher, data.argmax, data.loss_mask)
            opt.zero_grad()
            out["loss"].backward()
            opt.step()
            if (i + 1) % 25 == 0 and i + 1 < n:  # how fast it gets there (pytest -s)
                print(f"[{time.perf_counter() - t0:.0f}s] {name}: step {i + 1}, loss {out['loss'].item():.3f}, "
                      f"{summary(out)}")
        drafters[name] = d.eval()
        print(f"[{time.perf_counter() - t0:.0f}s] {name}: {n} steps, loss {out['loss'].item():.3f}, {summary(out)}")
    files = {name: export(save_draft(d, root / name, data.target.info()), "gguf", root / f"{name}.gguf")
             for name, d in drafters.items()} if gguf else {}
    return drafters, files


def overfit_block_drafts(model_cls: type, cfg: Any, data: Any, steps: dict[str, int], root: Path,
                         untrained: bool = False, gguf: bool = True) -> tuple[dict[str, Any], dict[str, Path]]:
    """Block drafts (DFlash, DSpark) of `cfg` through `overfit_drafts`, each starting from seed 1 with the target's
    embedding, head and final norm, plus an untrained "random" one where asked. `data`: a `Continuations`, or anything
    with its `target` and batch fields."""
    target = data.target
    aux, _ = capture(target.model, data.input_ids, data.attn, [i + 1 for i in cfg.target_layer_ids])  # [B, T, 3H]

    def new_drafter() -> Any:
        torch.manual_seed(1)
        d = model_cls(cfg)
        with torch.no_grad():
            d.embed_tokens.weight.copy_(target.model.get_input_embeddings().weight)
            d.target_lm_head.weight.copy_(lm_head_weight(target.model))
            d.norm.weight.copy_(target.model.model.norm.weight)
        return d

    return overfit_drafts(new_drafter, data, aux, steps, root, "random" if untrained else None,
                          lambda out: "block accept {:.2f}".format(float(out["ratios"]["block_accept_len"][0]
                                                                         / out["ratios"]["block_accept_len"][1])),
                          gguf=gguf)


def run_block_drafts(bins: Path, data: Continuations, draft: Path, n_predict: int, n_draft: int, threads: int,
                     spec_type: str, verbose: bool = False) -> tuple[float, list[float], list[str], str]:
    """One draft in llama-speculative-simple on every prompt: (acceptance, acceptance by draft position averaged over
    prompts, texts, the first run's log)."""
    drafted = accepted = 0
    by_pos, texts, logs = [], [], []
    for prompt in data.prompts:
        r = lc.run_speculative(bins, data.target_gguf, draft, prompt, n_predict, n_draft, threads, verbose=verbose,
                               poll=0, spec_type=spec_type)
        assert r.n_drafted > 0
        texts.append(r.text.strip())
        logs.append(r.log)
        drafted, accepted = drafted + r.n_drafted, accepted + r.n_accept
        if r.accept_by_pos is not None:
            by_pos.append(r.accept_by_pos + [0.0] * (n_draft - len(r.accept_by_pos)))
    mean = [sum(c) / len(c) for c in zip(*by_pos)] if by_pos else []
    return accepted / drafted, mean, texts, logs[0]


def assert_lossless(texts: list[str], data: Continuations, name: str) -> None:
    """Greedy speculative decoding does not change the text (llama.cpp may emit a few tokens past n_predict)."""
    for got, alone, longer in zip(texts, data.alone, data.longer, strict=True):
        assert got.startswith(alone.text.strip()) and longer.text.strip().startswith(got), (name, got)


def our_block_acceptance_by_position(data: Continuations, drafter: Any, n_predict: int, n_draft: int) -> list[float]:
    """Our runtime's share of rounds accepting draft position i (block mode, `n_draft` drafts verified), averaged over
    the same prompts llama.cpp ran."""
    tok = data.target.tokenizer
    prompts = [tok(p, add_special_tokens=False).input_ids for p in data.prompts]
    res = SpeculativeGenerator(data.target, drafter).generate(prompts, n_predict,
                                                              SpecConfig(mode="block", num_speculative_tokens=n_draft))
    ours = [[sum(a > i for a in r.accept_lens) / len(r.accept_lens) for i in range(n_draft)] for r in res]
    return [sum(c) / len(c) for c in zip(*ours)]

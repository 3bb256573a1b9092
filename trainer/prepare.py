"""Conversations -> token samples (+ held-out split, optional regeneration), shared by train.py and
`drafthead capture`, so both see the same samples in the same order."""
from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from drafthead.target import Target
from drafthead.trainer import data as tdata
from drafthead.trainer import regenerate as tregen
from drafthead.trainer.config import RunConfig
from drafthead.trainer.dist import Dist, barrier


@dataclass
class Prepared:
    train: list[dict]  # {"id", "input_ids", "loss_mask"}
    heldout: list[dict]
    heldout_convs: list  # Conversation objects, written to <run_dir>/heldout.jsonl


def prepare_samples(cfg: RunConfig, target: Target, d: Dist, run_dir: Path, log=print) -> Prepared:
    dc = cfg.data
    # max_samples caps the training conversations; the held-out ones are read in addition
    most = None if dc.max_samples is None else dc.max_samples + dc.num_holdout
    convs, stats = tdata.load_conversations(dc.dataset, most)
    if d.main:
        log(stats.summary(dc.dataset))
    if len(convs) <= dc.num_holdout:
        raise ValueError(f"data.dataset={dc.dataset!r} has {len(convs)} usable conversations, not more than "
                         f"data.num_holdout={dc.num_holdout}: nothing left to train on")
    train_convs, held_convs = tdata.split_holdout(convs, dc.num_holdout, dc.split_seed)
    regen_held = dc.regenerate.enabled and dc.regenerate.heldout
    if dc.regenerate.enabled:
        if regen_held:  # every held-out prompt, whatever `fraction` says
            held_convs = _regenerate(cfg, target, held_convs, d, run_dir, log, fraction=1.0, tag="heldout-")
        train_convs = _regenerate(cfg, target, train_convs, d, run_dir, log)
    key = f"{dc.dataset}|{target.name_or_path}|{dc.max_samples}|{dc.split_seed}|{dc.num_holdout}"
    kw = dict(max_length=dc.max_length, overlong=dc.overlong, chat_template=dc.chat_template,
              enable_thinking=dc.enable_thinking)
    train, tstats = tdata.tokenize_conversations(target.tokenizer, train_convs,
                                             cache_key=None if dc.regenerate.enabled else key + "|train", **kw)
    held, hstats = tdata.tokenize_conversations(target.tokenizer, held_convs, **kw,
                                            cache_key=None if regen_held else key + "|heldout")
    if d.main:
        log(tstats.summary("train tokens"))
        log(hstats.summary("held-out tokens"))
    return Prepared(train, held, held_convs)


def _regenerate(cfg: RunConfig, target: Target, convs: list, d: Dist, run_dir: Path, log,
                fraction: float | None = None, tag: str = "") -> list:
    """Rank 0 rewrites a fraction of the answers with the target (resumable file); others wait and read."""
    rc = cfg.data.regenerate
    rng = random.Random(cfg.seed)
    frac = rc.fraction if fraction is None else fraction
    pick = set(rng.sample(range(len(convs)), k=int(round(frac * len(convs)))))
    chosen = [c for i, c in enumerate(convs) if i in pick]
    digest = hashlib.sha256("".join(c.id for c in chosen).encode()).hexdigest()[:10]
    out = run_dir / f"regenerated-{tag}{digest}.jsonl"
    if d.main:
        log(f"regenerating {len(chosen)} of {len(convs)} conversations with the target -> {out}")
        tregen.regenerate(target, chosen, str(out), regenerate_options(cfg))
    barrier(d)
    regen = {c.id: c for c in tdata.read_jsonl(out)}
    return [regen.get(c.id, c) if i in pick else c for i, c in enumerate(convs)]


def regenerate_options(cfg: RunConfig) -> tregen.AnswerOptions:
    """`data.regenerate` as the answering engine's options (the run's regeneration and the budget's probe)."""
    rc = cfg.data.regenerate
    return tregen.AnswerOptions(max_new_tokens=rc.max_new_tokens, temperature=rc.temperature, top_p=rc.top_p,
                                batch_size=rc.batch_size, seed=cfg.seed, max_turns=rc.max_turns,
                                chat_template=cfg.data.chat_template, enable_thinking=cfg.data.enable_thinking,
                                max_prompt_tokens=rc.max_prompt_tokens or max(cfg.data.max_length - 32, 1),
                                engine=rc.engine, vllm_python=rc.vllm_python)


@dataclass
class DraftSetup:
    drafter: torch.nn.Module
    head: torch.nn.Module  # the frozen target head the teacher distribution comes from
    init: str
    d2t: torch.Tensor | None
    t2d: torch.Tensor | None


def build_draft(cfg: RunConfig, target: Target, train: list[dict], device: torch.device, log=print,
                heldout: list[dict] = ()) -> DraftSetup:
    """Draft vocabulary from the loss-masked training tokens (families with a reduced vocabulary; the others
    predict the full one), then the drafter built and initialised from the target, and the teacher head
    over its vocabulary."""
    from drafthead.registry import family
    from drafthead.target import TargetHead, lm_head_weight
    from drafthead.vocab import build_vocab_mapping, count_tokens, draft_ids

    fam = family(cfg.drafter.family)
    options = getattr(cfg.drafter, fam.name)
    d2t = t2d = None
    if fam.predicts_draft_vocab(options):
        counts = count_tokens(((s["input_ids"], s["loss_mask"]) for s in train), target.config.vocab_size)
        d2t, t2d = build_vocab_mapping(counts, min(options.draft_vocab_size, target.config.vocab_size))
        covered = counts[t2d].sum().item() / max(counts.sum().item(), 1)
        log(f"draft vocab: {d2t.numel()} tokens cover {covered:.1%} of {counts.sum().item()} assistant tokens")
    config = fam.build(target.config, options, cfg.capture.layer_ids, None if d2t is None else d2t.numel())
    drafter = fam.model(config)
    if d2t is not None:
        with torch.no_grad():
            drafter.d2t.copy_(d2t)
            drafter.t2d.copy_(t2d)
    problems = drafter.check_data([*train, *heldout])  # held-out batches go through the same forward
    if problems:
        raise ValueError("; ".join(problems))
    init = fam.init(drafter, target, options)
    drafter.to(device).train()
    head = TargetHead(lm_head_weight(target.model), None if d2t is None else draft_ids(d2t)).to(device)
    return DraftSetup(drafter, head, init, d2t, t2d)


def feature_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"capture.dtype={name!r} is not a torch dtype (use bfloat16, float16 or float32)")
    return dt

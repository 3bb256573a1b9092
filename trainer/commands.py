"""`drafthead capture`: the trainer's command-line entry (the other commands: drafthead/cli.py)."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from drafthead.trainer.interrupt import GracefulStop, Interrupted
from drafthead.trainer.runlock import run_lock_on_rank0


def help_text(argv: list[str]) -> str:
    from drafthead.trainer.config import help_text as recipe_help

    return recipe_help(argv, "drafthead capture")


def capture(argv: list[str]) -> int:
    """`drafthead capture [recipe=NAME] key=value ...`: offline capture for a recipe (resumable), with the
    features and the stored argmax the recipe's drafter family reads."""
    from drafthead.registry import family
    from drafthead.target import check_layer_ids, load_target
    from drafthead.trainer.capture import capture_offline
    from drafthead.trainer.config import load_config
    from drafthead.trainer.dist import Dist
    from drafthead.trainer.prepare import feature_dtype, prepare_samples

    cfg = load_config(argv)  # a bad key or value: a ConfigError, one line from drafthead/cli.py
    fam = family(cfg.drafter.family)
    run_dir = Path(cfg.output_dir)
    out = Path(cfg.capture.dir or run_dir / "capture")
    try:
        with run_lock_on_rank0([run_dir, out], Dist()), GracefulStop() as stop:
            target = load_target(cfg.target.name_or_path, cfg.target.gguf_file, cfg.target.dtype)
            prep = prepare_samples(cfg, target, Dist(), run_dir)
            # the layer ids the family's drafter would capture for this target (its config, never its weights)
            config = fam.build(target.config, getattr(cfg.drafter, fam.name), cfg.capture.layer_ids, None)
            with torch.device("meta"):
                layer_ids = fam.model(config).capture_layer_ids()
            check_layer_ids(layer_ids, target.num_layers)
            m = capture_offline(target, prep.train, out, layer_ids, feature_dtype(cfg.capture.dtype),
                                cfg.capture.shard_samples, cfg.capture.batch_tokens, progress=cfg.logging.progress,
                                argmax=fam.predicts_draft_vocab(getattr(cfg.drafter, fam.name)), stop=stop)
    except Interrupted as e:  # the shards on disk are kept; the same command resumes
        print(f"drafthead capture: {e}", file=sys.stderr)
        return e.code
    print(f"captured {m['num_samples']} samples, {m['num_tokens']} tokens, {len(m['shards'])} shards -> {out}\n"
          f"next: drafthead train recipe={cfg.recipe} capture.mode=offline capture.dir={out}")
    return 0

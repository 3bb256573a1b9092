"""Where a run's numbers go: metrics.jsonl (always, cut back to the checkpoint on resume), wandb when enabled,
and the tokens/s meter.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from drafthead.io import atomic_write_bytes, writing
from drafthead.trainer.config import RunConfig
from drafthead.trainer.dist import Dist


class Logger:
    """metrics.jsonl always; wandb (offline unless a key is configured) when enabled; rank 0 only."""

    def __init__(self, run_dir: Path, cfg: RunConfig, d: Dist, config_dict: dict, start_step: int = 0) -> None:
        self.main = d.main
        self.path = run_dir / "metrics.jsonl"
        self.wandb = None
        if self.main:
            cut_metrics(self.path, start_step)
        if self.main and cfg.logging.wandb:
            try:
                from drafthead.optional import require

                wandb = require("wandb", "logging.wandb=true")
                if not os.environ.get("WANDB_API_KEY"):
                    os.environ.setdefault("WANDB_MODE", "offline")
                self.wandb = wandb.init(project=cfg.logging.project, dir=str(run_dir), config=config_dict,
                                        name=Path(cfg.output_dir).name, resume="allow")
            except Exception as e:  # wandb is optional: say so, keep metrics.jsonl
                print(f"wandb disabled (metrics go to {self.path} only): {e}")

    def log(self, row: dict) -> None:
        if not self.main:
            return
        with writing(self.path), open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()


def cut_metrics(path: Path, step: int) -> int:
    """Cut an append-only metrics file back to what a run starting at `step` (0: a fresh run; N: resumed from
    checkpoint step_N) keeps: rows up to that step, less the end-of-run budget record, which the run writes
    again. Rows logged after the checkpoint by the run that stopped would otherwise appear twice. A line cut
    short by a kill is dropped. Returns the number of rows removed."""
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            dropped += 1
            continue
        if step > 0 and row.get("step", 0) <= step and "budget" not in row:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        atomic_write_bytes(path, "".join(line + "\n" for line in kept).encode())
    return dropped


class Throughput:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.tokens = 0

    def add(self, n: int) -> None:
        self.tokens += n

    def rate(self) -> float:
        dt = time.perf_counter() - self.t0
        r = self.tokens / dt if dt > 0 else 0.0
        self.t0, self.tokens = time.perf_counter(), 0
        return r

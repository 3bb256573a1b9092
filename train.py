"""Train a speculative-decoding draft head for a frozen target: the repository's entry, the same run as the
installed `drafthead train` (the trainer itself reads top to bottom in trainer/run.py).

    python train.py                                      # the embedded default: 1 CPU process, 60 min
    python train.py data.max_samples=16 train.max_steps=4
    torchrun --nproc_per_node 8 train.py recipe=NAME     # a GPU recipe from recipes/ (DeepSpeed ZeRO-2)
    torchrun --nproc_per_node 2 train.py train.deepspeed=zero2   # CPU: DS_ACCELERATOR=cpu is set for you
"""
from __future__ import annotations

import sys
from pathlib import Path

from drafthead.trainer import run


def main(argv: list[str]) -> Path:
    return run.main(argv, entry="python train.py")


if __name__ == "__main__":
    sys.exit(run.cli(entry="python train.py"))

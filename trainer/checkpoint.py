"""Checkpoints and exact resume: engine state, every rank's RNGs and the trainer's counters, written atomically
across ranks (a shared temp name that rank 0 renames), checked against the target on load.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from drafthead.fingerprint import compare
from drafthead.io import writing
from drafthead.trainer.dist import Dist, barrier


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(st: dict) -> None:
    torch.set_rng_state(st["torch"])
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    if st.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def save_checkpoint(run_dir: Path, step: int, engine: Any, state: dict, d: Dist, keep: int,
                    target_fingerprint: dict | None = None) -> Path:
    """Write `checkpoints/step_N` atomically (a shared temp name, rank 0 renames). A full or read-only disk
    raises a WriteError naming it; the last complete checkpoint stands."""
    ckpts = run_dir / "checkpoints"
    final = ckpts / f"step_{step}"
    with writing(final):
        _write_checkpoint(run_dir, ckpts, final, step, engine, state, d, keep, target_fingerprint)
    return final


def _write_checkpoint(run_dir: Path, ckpts: Path, final: Path, step: int, engine: Any, state: dict, d: Dist,
                      keep: int, target_fingerprint: dict | None) -> None:
    tmp = ckpts / f".step_{step}.tmp"
    if d.main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(d)
    engine.save(tmp)
    torch.save(rng_state(), tmp / f"rng_rank{d.rank}.pt")
    barrier(d)
    if d.main:
        (tmp / "trainer_state.json").write_text(json.dumps({**state, "step": step, "world": d.world,
                                                            "tensor_parallel": d.tp, "engine": engine.kind,
                                                            "target_fingerprint": target_fingerprint}, indent=2))
        shutil.copy(run_dir / "config.yaml", tmp / "config.yaml")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    barrier(d)


def list_checkpoints(run_dir: Path) -> list[Path]:
    ckpts = run_dir / "checkpoints"
    if not ckpts.is_dir():
        return []
    found = [p for p in ckpts.glob("step_*") if p.is_dir() and (p / "trainer_state.json").exists()]
    return sorted(found, key=lambda p: int(p.name.split("_")[1]))


def load_checkpoint(folder: Path, engine: Any, d: Dist, target_fingerprint: dict | None = None,
                    allow_mismatch: bool = False, log=print) -> dict:
    """Restore `engine` and the RNGs from `folder`; a checkpoint written against another target is an error
    (TargetMismatch) unless `allow_mismatch`."""
    state = json.loads((folder / "trainer_state.json").read_text())
    if target_fingerprint is not None:
        note = compare(state.pop("target_fingerprint", None), target_fingerprint, allow_mismatch,
                       f"checkpoint {folder}", "target.allow_mismatch")
        if note:
            log(f"warning: {note}")
    was_tp = state.get("tensor_parallel", 1)
    if was_tp != d.tp:
        raise ValueError(f"checkpoint {folder} was written with target.tensor_parallel={was_tp}; resume with the "
                         f"same (now {d.tp}): the data order depends on the data-parallel size")
    if state["world"] != d.world:
        raise ValueError(f"checkpoint {folder} was written by {state['world']} ranks; resume with the same "
                         f"--nproc_per_node (now {d.world})")
    if state["engine"] != engine.kind:
        raise ValueError(f"checkpoint {folder} is a {state['engine']} checkpoint; this run uses {engine.kind}")
    engine.load(folder)
    rng = folder / f"rng_rank{d.rank}.pt"
    if rng.exists():
        set_rng_state(torch.load(rng, weights_only=False))
    return state

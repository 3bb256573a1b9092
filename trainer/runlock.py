"""One writer per run folder: an OS lock held for the life of a training run or a capture.

Two runs pointed at one `output_dir` would interleave their metrics, overwrite each other's checkpoints and
both write `final/`. `flock` is released by the kernel when its holder dies (kill -9 included), so a lock
can never outlive its process; the holder's pid, host, start time and command are written into the lock
file so a refused run can say who holds it, and a file still naming a holder when the lock is free means
that holder died without cleaning up (the lock is taken over with a warning). On Linux NFS clients `flock`
is carried by the server's byte-range locks, so runs on two nodes sharing a folder exclude each other too.
Readers (eval of `final/`, export) never take it.
"""
from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from drafthead.io import writing
from drafthead.trainer.dist import Dist, all_reduce_sum

LOCK_NAME = ".drafthead.lock"


class RunLockError(OSError):
    """Another live process holds the folder (an OSError, as the busy lock underneath it is)."""


def _holder(text: str) -> str:
    try:
        h = json.loads(text)
        return f"pid {h['pid']} on {h['host']}, started {h['started']}: {h['command']}"
    except (ValueError, KeyError, TypeError):
        return "a process that left no details"


@contextlib.contextmanager
def run_lock(folder: str | os.PathLike, log=print) -> Iterator[Path]:
    """Hold `folder`'s lock for the block; raise RunLockError naming the holder if another process has it."""
    folder = Path(folder)
    path = folder / LOCK_NAME
    with writing(path):
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunLockError(f"{folder} is in use by another run ({_holder(os.pread(fd, 65536, 0).decode())}); "
                               f"wait for it, stop it, or choose another output_dir") from None
        stale = os.pread(fd, 65536, 0).decode().strip()
        if stale:
            log(f"warning: took over the lock on {folder} left by {_holder(stale)}; that process is gone")
        me = {"pid": os.getpid(), "host": socket.gethostname(),
              "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
              "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])[:500]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        os.fsync(fd)
        try:
            yield path
        finally:
            os.ftruncate(fd, 0)  # released cleanly: nothing for the next holder to warn about
    finally:
        os.close(fd)  # closing drops the flock


@contextlib.contextmanager
def run_lock_on_rank0(folders: list[Path], d: Dist, log=print) -> Iterator[None]:
    """Rank 0 holds every folder's lock; the other ranks learn whether it got them and stop with it if not
    (else they would wait in the next barrier until its timeout)."""
    with contextlib.ExitStack() as stack:
        err: RunLockError | None = None
        if d.main:
            try:
                for f in dict.fromkeys(Path(f).resolve() for f in folders):
                    stack.enter_context(run_lock(f, log))
            except RunLockError as e:
                err = e
        failed = all_reduce_sum(torch.tensor([1.0 if err else 0.0]), d)
        if err is not None:
            raise err
        if float(failed[0]) > 0:
            raise RunLockError(f"{folders[0]}: rank 0 could not lock the run folder (its log says who holds it)")
        yield

"""Ctrl-C and SIGTERM: finish the step in flight, save, say how to resume, exit 128 + signal.

Cluster schedulers (SLURM preemption, Kubernetes) send SIGTERM and wait a grace period before SIGKILL, and a
person presses Ctrl-C: either way the work since the last checkpoint should not be lost. Inside `deferred()`
(the training loop, a capture shard) a signal only raises a flag that the loop reads at its next step
boundary, where it saves and raises `Interrupted`. Outside it (loading, planning, regenerating) there is
nothing worth a checkpoint, and everything written so far is already atomic or resumable: the signal raises
`Interrupted` at once. A second signal always raises at once (the last checkpoint stands).
"""
from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType

import torch

from drafthead.trainer.dist import Dist, all_reduce_sum

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    """The run stopped on a signal; `code` is the conventional exit status (128 + signal number). A
    BaseException, as KeyboardInterrupt is, so no `except Exception` on the way up swallows it."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum
        self.code = 128 + signum


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class GracefulStop:
    """Installed around a run with `with GracefulStop() as stop:`; previous handlers come back on exit."""

    def __init__(self) -> None:
        self.requested: int | None = None  # the first signal seen inside deferred()
        self._defer = 0
        self._what = ""  # what the deferred block finishes before it stops, for the message
        self._saved: dict[int, object] = {}

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
            for s in SIGNALS:
                self._saved[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, h in self._saved.items():
            signal.signal(s, h)  # type: ignore[arg-type]
        self._saved.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._defer and self.requested is None:
            self.requested = signum
            print(f"\n{signal_name(signum)}: {self._what} (send it again to stop now)", file=sys.stderr, flush=True)
            return
        raise Interrupted(signum, f"stopped by {signal_name(signum)}"
                          + ("" if self.requested is None else " (a second time: not saved since the last checkpoint)"))

    @contextlib.contextmanager
    def deferred(self, what: str) -> Iterator[None]:
        """A signal inside the block only sets `requested`, for the loop to read at its next step boundary;
        `what` says what the loop finishes first (printed when the signal comes)."""
        self._defer += 1
        self._what = what
        try:
            yield
        finally:
            self._defer -= 1

    def stop_now(self, d: Dist) -> int | None:
        """The signal to stop on at this step boundary, agreed by every rank (all stop at the same step:
        schedulers signal the ranks at slightly different moments)."""
        if d.world == 1:
            return self.requested
        seen = all_reduce_sum(torch.tensor([float(self.requested == s) for s in SIGNALS]), d)  # ranks per signal
        if self.requested is not None or float(seen.sum()) == 0:
            return self.requested
        return SIGNALS[int(seen.argmax())]  # a rank that saw none stops on a signal the others saw


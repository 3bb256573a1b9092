"""Sharing the CPU with other busy processes: use only the cores the others leave free.

torch's CPU threads meet at a barrier after every parallel region (each of the decode kernel's calls is one,
a few hundred a token), and libgomp's threads spin there before they sleep. When another busy process holds
one of the cores, each barrier waits for a thread the OS has descheduled while its partner spins away the
core that thread needs, so two 2-thread processes on 2 cores run several times slower each instead of about
2x. One thread per process has no barrier to wait at.

So the runtime's decode loop calls `tick()`: every `WINDOW_S` it reads how much
CPU time processes other than this one took on the cores this process may run on (Linux `/proc/stat`
less this process's own CPU time, steal included), and sets torch's thread count to the cores left free,
between 1 and the count the caller had set. A change needs two windows in a row that agree, so one burst
of someone else's work does not flip it. `shared()` wraps a run: it restores the caller's count when the
run ends, and a run that starts within a few windows of the last one's decision starts with it.

`DRAFTHEAD_SHARE_CORES=0` turns it off. Off Linux, or with one thread, it does nothing. Changing the
count changes no decode result: the runtime's kernels split a matmul's outputs between threads, never a sum
(tests check logits and greedy output at 1 and 2 threads are equal). Training keeps the count it was given:
oneDNN may split a weight gradient's sum over tokens between threads, and a resumed run must end bit-identical
to one never stopped whatever else ran beside it (`train.num_threads=1` shares a machine there).
"""
from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

WINDOW_S = 0.5  # long enough for /proc/stat's 10 ms ticks to count a core's use within a few percent
FRESH_S = 4 * WINDOW_S  # a decision this recent still describes the machine for the next run
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user nice system irq softirq steal (guest time is inside user)


def enabled() -> bool:
    return os.environ.get("DRAFTHEAD_SHARE_CORES", "1") != "0"


def _cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return []


def _busy_seconds(cpus: list[int]) -> float | None:
    """CPU seconds every process spent on `cpus` since boot (None where /proc/stat is unreadable)."""
    try:
        text = Path("/proc/stat").read_text()
    except OSError:
        return None
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    want = {f"cpu{c}" for c in cpus}
    ticks = 0
    for line in text.splitlines():
        name, *vals = line.split()
        if name in want:
            ticks += sum(int(vals[i]) for i in _BUSY_FIELDS if i < len(vals))
    return ticks / hz


@dataclass
class CoreShare:
    """The thread count decision for this process; one per process (`watcher()`)."""

    cpus: list[int] = field(default_factory=_cpus)
    ceiling: int = 0  # the caller's thread count: never more than this
    want: int = 0  # the count the last window asked for (0: none yet)
    decided: int = 0  # the count in force
    decided_at: float = float("-inf")
    changes: int = 0  # how often the count changed, for reports
    readable: bool = True  # /proc/stat could be read
    depth: int = 0  # runs open (a run inside a run follows the outer one)
    _sample: tuple[float, float, float] | None = None  # (wall, everyone's busy seconds, ours)

    def active(self) -> bool:
        return enabled() and self.readable and len(self.cpus) > 1 and self.ceiling > 1

    def start(self) -> None:
        self.depth += 1
        if self.depth > 1:
            return
        self.ceiling = torch.get_num_threads()
        self._sample, self.want = None, 0
        recent = time.perf_counter() - self.decided_at < FRESH_S
        if self.active() and recent and 0 < self.decided < self.ceiling:
            torch.set_num_threads(self.decided)
        else:
            self.decided = self.ceiling

    def tick(self) -> None:
        if self.depth == 0 or not self.active():
            return
        now = time.perf_counter()
        if self._sample is not None and now - self._sample[0] < WINDOW_S:
            return
        busy = _busy_seconds(self.cpus)
        if busy is None:
            self.readable = False  # nothing to measure with from here on: the caller's count again
            torch.set_num_threads(self.ceiling)
            return
        ours = time.process_time()
        prev, self._sample = self._sample, (now, busy, ours)
        if prev is None:
            return
        others = max(0.0, (busy - prev[1]) - (ours - prev[2])) / (now - prev[0])  # cores kept busy by others
        want = max(1, min(self.ceiling, round(len(self.cpus) - others)))
        if want == self.want and want != self.decided:
            torch.set_num_threads(want)
            self.decided = want
            self.changes += 1
        if want == self.decided:
            self.decided_at = now
        self.want = want

    def stop(self) -> None:
        self.depth -= 1
        if self.depth == 0 and self.ceiling > 0 and torch.get_num_threads() != self.ceiling:
            torch.set_num_threads(self.ceiling)


_WATCHER = CoreShare()


def watcher() -> CoreShare:
    return _WATCHER


def tick() -> None:
    """Call once per decode round: cheap (a clock read) except once a window."""
    _WATCHER.tick()


@contextlib.contextmanager
def shared(device: torch.device | str = "cpu") -> Iterator[CoreShare]:
    """A run on `device` that follows the cores others leave free (on a CPU; elsewhere nothing changes);
    the caller's thread count is back afterwards."""
    if torch.device(device).type != "cpu":
        yield _WATCHER
        return
    _WATCHER.start()
    try:
        yield _WATCHER
    finally:
        _WATCHER.stop()

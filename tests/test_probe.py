"""The kernel probe (`kernels/probe.py`: the bf16 kernel's tile path and prefetches, the fp32 kernel's stream): its
choice from timings (fake ones here, so the logic is checked on every CPU class), its cache, and its switches.
Bits on each path it can pick: tests/test_runtime.py, forced; the fp32 stream's: tests/test_cpu_linear.py."""
from __future__ import annotations

import fcntl
import json
import threading
import time

import pytest

from drafthead import hardware
from drafthead.kernels import extension, probe
from drafthead.kernels.probe import Setting


def _ms(table: dict[Setting, tuple[float, ...]]) -> dict[Setting, dict[int, float]]:
    return {s: dict(zip(probe.ROWS, v)) for s, v in table.items()}


def test_the_choice_weighs_every_row_count_not_the_fastest_single_row() -> None:
    """The tile path is one for all row counts (the two paths round differently): a path fastest at 1 row by 10%
    but 2.3x slower at 16 loses to one that is close everywhere; each row count's fastest is still reported."""
    avx = Setting("avx512", "t1", 32)
    amx = Setting("amx", "t0", 16)
    ms = _ms({avx: (9.3, 10.6, 23.4), amx: (10.4, 10.2, 10.6), probe.BUILT_IN: (22.0, 18.3, 55.6)})
    pick, rows = probe.choose(ms)
    assert pick == amx
    assert rows["1"]["fastest"] == avx.name() and rows["1"]["chosen_ms"] == 10.4 and rows["1"]["built_in_ms"] == 22.0
    assert rows["16"]["fastest"] == Setting("amx", "t0", 16).name()
    # a tie keeps the built-in setting
    assert probe.choose(_ms({avx: (10, 10, 10), probe.BUILT_IN: (10, 10, 10)}))[0] == probe.BUILT_IN


def test_measure_takes_turns_and_keeps_the_median() -> None:
    """Candidates take turns round by round, the order rotating, and the median of the rounds is kept: one slow
    reading (the machine busy for a moment) does not decide."""
    a, b = Setting("avx512", "t0", 16), Setting("avx512", "t1", 64)
    calls: list[tuple[Setting, int]] = []
    slow_once = {"done": False}

    def timer(s: Setting, rows: int) -> float:
        calls.append((s, rows))
        if s == b and not slow_once["done"]:
            slow_once["done"] = True
            return 100.0
        return {a: 2.0, b: 1.0}[s] * rows

    ms = probe.measure([a, b], rows=(1, 4), rounds=3, timer=timer)
    assert [s for s, r in calls if r == 1] == [a, b, b, a, a, b]  # rotated each round
    assert ms[b] == {1: 1.0, 4: 4.0} and ms[a] == {1: 2.0, 4: 8.0}


@pytest.fixture
def fresh_probe(tmp_path, monkeypatch: pytest.MonkeyPatch):
    if not extension.available("bf16"):
        pytest.skip(f"bf16 kernel: {extension.unavailable_reason('bf16')}")
    monkeypatch.setenv("DRAFTHEAD_KERNEL_CACHE", str(tmp_path))
    monkeypatch.delenv("DRAFTHEAD_KERNEL_PROBE", raising=False)
    monkeypatch.delenv("DRAFTHEAD_AMX", raising=False)
    before = (extension.amx(), extension.prefetch())
    # A test may swap extension.amx for a fake; the teardown runs before monkeypatch undoes it, so it puts the
    # process's setting back through the real functions.
    amx, prefetch = extension.amx, extension.prefetch
    monkeypatch.setattr(probe, "_applied", None)
    monkeypatch.setattr(probe, "_report", None)
    yield tmp_path
    amx(before[0])
    prefetch(**before[1])


def _fake_timer(calls: list):
    def make(probe_mb: int):
        def timer(s: Setting, rows: int) -> float:
            calls.append(s)
            return 1.0 if s == Setting("avx512", "t1", 64) else 2.0
        return timer
    return make


def test_tuned_measures_once_caches_and_applies(fresh_probe, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Setting] = []
    monkeypatch.setattr(probe, "_pass_timer", _fake_timer(calls))
    s = probe.tuned()
    assert s == Setting("avx512", "t1", 64) and calls
    assert extension.amx() is False and extension.prefetch() == {"plain": ("t1", 64), "stream": ("t1", 64)}
    on_disk = json.loads(probe.cache_path().read_text())
    assert on_disk["chosen"] == {"path": "avx512", "hint": "t1", "ahead": 64}
    assert on_disk["cpu_class"] == hardware.cpu_class() and set(on_disk["rows"]) == {"1", "4", "16"}
    assert len(on_disk["candidates"]) == len(probe.candidates())
    # a new process (state reset) reads the cache and measures nothing
    monkeypatch.setattr(probe, "_applied", None)
    extension.prefetch(plain=("t0", 32), stream=("nta", 32))
    n = len(calls)
    assert probe.tuned() == s and len(calls) == n
    assert extension.prefetch()["stream"] == ("t1", 64)
    assert "probed here" in probe.describe() and "T1 64 ahead" in probe.describe()
    # a damaged cache file is measured again, not trusted
    probe.cache_path().write_text("{not json")
    monkeypatch.setattr(probe, "_applied", None)
    assert probe.tuned() == s and len(calls) > n


def test_a_second_process_waits_for_the_first_probe_and_reads_its_choice(fresh_probe,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Processes started together on a new machine: one measures (holding the cache's lock), the others wait and
    read its choice instead of timing each other's load."""
    calls: list[Setting] = []
    monkeypatch.setattr(probe, "_pass_timer", _fake_timer(calls))
    path = probe.cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / ".lock", "w") as lock:  # another process is measuring
        fcntl.flock(lock, fcntl.LOCK_EX)
        got: dict[str, Setting] = {}
        waiter = threading.Thread(target=lambda: got.setdefault("s", probe.tuned()))
        waiter.start()
        time.sleep(0.3)
        assert waiter.is_alive() and not calls  # waiting on the lock, not measuring
        path.write_text(json.dumps({"chosen": {"path": "avx512", "hint": "t0", "ahead": 64}}))
        fcntl.flock(lock, fcntl.LOCK_UN)
    waiter.join(10)
    assert got["s"] == Setting("avx512", "t0", 64) and not calls


def test_probe_off_and_forced_paths(fresh_probe, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DRAFTHEAD_KERNEL_PROBE", "0")
    monkeypatch.setattr(probe, "_pass_timer", lambda mb: pytest.fail("the probe is off: nothing is timed"))
    assert probe.tuned() == probe.BUILT_IN
    assert extension.prefetch() == {"plain": ("t0", 32), "stream": ("nta", 32)} and extension.amx() is False
    assert not list(fresh_probe.glob("kernel_probe/*"))
    monkeypatch.setenv("DRAFTHEAD_AMX", "0")
    assert {c.path for c in probe.candidates()} == {"avx512"}
    if "amx" in probe.cpu_paths():
        monkeypatch.setenv("DRAFTHEAD_AMX", "1")
        assert {c.path for c in probe.candidates()} == {"amx"}
        assert len(probe.candidates()) == len(extension.HINTS) * len(probe.AHEAD)


def test_amx_refused_by_linux_leaves_the_avx512_candidates(fresh_probe, monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU with AMX flags whose kernel refuses the tile state (a VM, an old Linux): the probe offers AVX512-BF16
    candidates only, and says why, instead of failing the run that asked for the setting."""
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"amx_bf16", "amx_tile", "avx512_bf16"}))

    def refuse(on=None):
        if on:
            raise RuntimeError("AMX tiles: the kernel refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)")
        return False
    monkeypatch.setattr(extension, "amx", refuse)
    probe.amx_refused.cache_clear()
    try:
        assert "refused the AMX tile state" in probe.amx_refused()
        assert probe.cpu_paths() == ["avx512"] and {c.path for c in probe.candidates()} == {"avx512"}
    finally:
        probe.amx_refused.cache_clear()


def test_use_forces_a_setting_and_puts_back_the_one_before(fresh_probe) -> None:
    before = (extension.amx(), extension.prefetch())
    for path in probe.cpu_paths():
        with probe.use(Setting(path, "t1", 16)):
            assert extension.amx() is (path == "amx") and extension.prefetch()["stream"] == ("t1", 16)
        assert (extension.amx(), extension.prefetch()) == before


def test_prefetch_settings_are_checked(fresh_probe) -> None:
    with pytest.raises(ValueError, match="hint is one of nta, t0, t1"):
        extension.prefetch(stream=("t3", 32))
    with pytest.raises(ValueError, match="ahead 1..1024"):
        extension.prefetch(plain=("t0", 0))


# ---- the fp32 kernel's stream (every class with AVX2/FMA; fake timings, so the logic is checked anywhere) ----

@pytest.fixture
def fresh_fp32_probe(tmp_path, monkeypatch: pytest.MonkeyPatch):
    if not extension.available("fp32"):
        pytest.skip(f"fp32 kernel: {extension.unavailable_reason('fp32')}")
    monkeypatch.setenv("DRAFTHEAD_KERNEL_CACHE", str(tmp_path))
    monkeypatch.delenv("DRAFTHEAD_KERNEL_PROBE", raising=False)
    before = extension.fp32_stream()
    monkeypatch.setattr(probe, "_fp32_applied", {})
    monkeypatch.setattr(probe, "_fp32_report", {})
    yield tmp_path
    extension.fp32_stream(**before)


def test_fp32_stream_is_measured_once_per_weight_storage_cached_and_applied(fresh_fp32_probe,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The candidates cross how far a lone row prefetches with the multi-row tiles' K chunks (none where the AVX-512
    tiles run); the one best over 1, 4 and 16 rows is applied, cached per weight storage, and read back by a later
    process without timing anything."""
    from drafthead.kernels.probe import Fp32Stream
    fast = Fp32Stream(64, 128 if not extension.avx512_tiles() else 0)
    calls: list[tuple[Fp32Stream, int]] = []

    def make(probe_mb: int, weights: str):
        def timer(s: Fp32Stream, rows: int) -> float:
            calls.append((s, rows))
            return (1.0 if s.ahead == fast.ahead else 1.5) * (1.0 if s.kc == fast.kc or rows == 1 else 1.4) * rows
        return timer
    monkeypatch.setattr(probe, "_fp32_pass_timer", make)
    cands = probe.fp32_candidates()
    assert len(cands) == len(probe.FP32_AHEAD) * (1 if extension.avx512_tiles() else len(probe.FP32_KC))
    assert probe.fp32_tuned() == fast and extension.fp32_stream() == {"ahead": fast.ahead, "kc": fast.kc}
    assert len(calls) == len(cands) * len(probe.ROWS) * probe.ROUNDS
    on_disk = json.loads(probe.fp32_cache_path().read_text())
    assert on_disk["chosen"] == {"ahead": fast.ahead, "kc": fast.kc} and on_disk["weights"] == "fp32"
    assert on_disk["rows"]["16"]["built_in_ms"] is not None and "probed here" in probe.fp32_describe()
    monkeypatch.setattr(probe, "_fp32_applied", {})  # a new process
    extension.fp32_stream(ahead=32, kc=0)
    n = len(calls)
    assert probe.fp32_tuned() == fast and len(calls) == n and extension.fp32_stream()["ahead"] == fast.ahead
    assert probe.fp32_cache_path("int8") != probe.fp32_cache_path()  # another storage streams other bytes per k
    probe.fp32_tuned("int8")  # in the same process: measured for its own storage, not the fp32 choice reused
    assert len(calls) > n and probe.fp32_cache_path("int8").is_file() and probe.fp32_report("int8")["weights"] == "int8"
    assert probe.fp32_report()["weights"] == "fp32"


def test_fp32_probe_off_keeps_the_built_in_stream(fresh_fp32_probe, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DRAFTHEAD_KERNEL_PROBE", "0")
    monkeypatch.setattr(probe, "_fp32_pass_timer", lambda *a: pytest.fail("the probe is off: nothing is timed"))
    extension.fp32_stream(ahead=64, kc=128)
    assert probe.fp32_tuned() == probe.FP32_BUILT_IN and extension.fp32_stream() == {"ahead": 32, "kc": 0}
    assert not list(fresh_fp32_probe.glob("kernel_probe/*")) and "built in" in probe.fp32_describe()


def test_a_bf16_setting_within_the_margin_keeps_the_built_in_one() -> None:
    """The probe's passes stream weights alone, so a T0/T1 prefetch that evicts a forward's own data looks free
    there: a candidate ahead of the built-in setting by less than BF16_MARGIN (here the EPYC's real table: T1 64 ahead
    by 0.8% of the sum) leaves it in place; AMX tiles twice as fast still replace it."""
    from drafthead.kernels.probe import BF16_MARGIN, BUILT_IN
    t1, amx = Setting("avx512", "t1", 64), Setting("amx", "t0", 16)
    epyc = _ms({BUILT_IN: (7.110, 7.274, 11.877), t1: (7.179, 7.205, 11.612),
                Setting("avx512", "t1", 32): (6.809, 7.203, 12.284)})
    assert probe.choose(epyc)[0] != BUILT_IN  # the least sum alone follows the noise
    assert probe.choose(epyc, BUILT_IN, BF16_MARGIN)[0] == BUILT_IN
    xeon = _ms({BUILT_IN: (22.4, 19.1, 56.9), amx: (10.6, 10.7, 11.4)})
    assert probe.choose(xeon, BUILT_IN, BF16_MARGIN)[0] == amx


def test_a_candidate_within_the_margin_keeps_the_built_in_stream() -> None:
    """Stream settings that time within the noise of one another: the built-in one stays (a choice made by noise
    would differ from machine to machine for nothing); one faster beyond the margin replaces it."""
    from drafthead.kernels.probe import FP32_BUILT_IN, FP32_MARGIN, Fp32Stream
    a = Fp32Stream(64, 0)
    near = _ms({FP32_BUILT_IN: (10.0, 10.0, 10.0), a: (9.8, 9.8, 9.9)})
    assert probe.choose(near, FP32_BUILT_IN, FP32_MARGIN)[0] == FP32_BUILT_IN
    assert probe.choose(near, FP32_BUILT_IN)[0] == a  # no margin: the least sum
    far = _ms({FP32_BUILT_IN: (10.0, 10.0, 10.0), a: (9.0, 9.5, 9.5)})
    assert probe.choose(far, FP32_BUILT_IN, FP32_MARGIN)[0] == a

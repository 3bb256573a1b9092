"""Sharing the CPU (`drafthead.cores`): the thread count follows the cores other processes leave free, on
measured (here: faked) CPU time, and changing it mid-run changes no result."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from drafthead import cores
from drafthead.kernels import extension
from drafthead.runtime import SpecConfig, SpeculativeGenerator, TargetModel
from drafthead.target import Target, freeze


class Machine:
    """A fake clock and /proc/stat: `others` cores kept busy by other processes, ours fully busy."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, cpus: int = 2) -> None:
        self.now = self.busy = self.ours = 0.0
        self.cpus = cpus
        monkeypatch.setattr(cores, "time", SimpleNamespace(perf_counter=lambda: self.now,
                                                           process_time=lambda: self.ours))
        monkeypatch.setattr(cores, "_busy_seconds", lambda cpus: self.busy)

    def window(self, others: float, seconds: float = cores.WINDOW_S) -> None:
        mine = min(torch.get_num_threads(), self.cpus - others)
        self.now += seconds
        self.ours += mine * seconds
        self.busy += (mine + others) * seconds


@pytest.fixture
def two_threads():
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(n)


def run(machine: Machine, share: cores.CoreShare, others: list[float]) -> list[int]:
    """Threads in force after each window with `others` busy cores in it."""
    seen = []
    share.tick()  # the first sample
    for o in others:
        machine.window(o)
        share.tick()
        seen.append(torch.get_num_threads())
    return seen


def test_threads_follow_the_cores_others_leave(monkeypatch: pytest.MonkeyPatch, two_threads) -> None:
    m = Machine(monkeypatch)
    share = cores.CoreShare(cpus=[0, 1])
    share.start()
    # alone: stays at 2; another busy process: 1 after two agreeing windows; a one-window burst flips nothing;
    # the other gone: back to 2
    assert run(m, share, [0.05, 0.1]) == [2, 2]
    assert run(m, share, [1.0, 1.0, 1.0]) == [2, 1, 1]
    assert run(m, share, [0.0, 1.0, 0.1, 0.0]) == [1, 1, 1, 2]
    assert run(m, share, [1.0, 0.0, 1.0, 0.0]) == [2, 2, 2, 2]
    assert share.changes == 2
    share.stop()
    assert torch.get_num_threads() == 2


def test_a_run_ends_with_the_callers_count_and_the_next_starts_from_a_fresh_decision(
        monkeypatch: pytest.MonkeyPatch, two_threads) -> None:
    m = Machine(monkeypatch)
    share = cores.CoreShare(cpus=[0, 1])
    share.start()
    assert run(m, share, [1.0, 1.0]) == [2, 1]
    share.stop()
    assert torch.get_num_threads() == 2  # the caller's count outside a run
    share.start()
    assert torch.get_num_threads() == 1  # the next run follows a decision that is still fresh
    share.stop()
    m.now += cores.FRESH_S + 1
    share.start()
    assert torch.get_num_threads() == 2  # a stale one is dropped
    share.stop()


def test_nested_runs_follow_the_outer_one(monkeypatch: pytest.MonkeyPatch, two_threads) -> None:
    m = Machine(monkeypatch)
    share = cores.CoreShare(cpus=[0, 1])
    share.start()
    run(m, share, [1.0, 1.0])
    share.start()  # a generate() inside a training run, say: its ceiling stays the outer caller's 2
    assert share.ceiling == 2 and torch.get_num_threads() == 1
    share.stop()
    assert torch.get_num_threads() == 1
    share.stop()
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize("why", ["env", "one_cpu", "one_thread", "no_proc"])
def test_it_does_nothing_when_off_or_blind(monkeypatch: pytest.MonkeyPatch, two_threads, why: str) -> None:
    m = Machine(monkeypatch, cpus=1 if why == "one_cpu" else 2)
    if why == "env":
        monkeypatch.setenv("DRAFTHEAD_SHARE_CORES", "0")
    if why == "one_thread":
        torch.set_num_threads(1)
    if why == "no_proc":
        monkeypatch.setattr(cores, "_busy_seconds", lambda cpus: None)
    share = cores.CoreShare(cpus=list(range(m.cpus)))
    share.start()
    start = torch.get_num_threads()
    assert run(m, share, [1.0, 1.0, 1.0]) == [start] * 3
    assert share.changes == 0
    share.stop()


def test_busy_seconds_reads_proc_stat_of_the_given_cpus(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    stat = tmp_path / "stat"
    stat.write_text("cpu  9 9 9 9 9 9 9 9 0 0\n"
                    "cpu0 100 1 10 500 7 2 3 4 0 0\n"  # busy: user nice system irq softirq steal = 120
                    "cpu1 200 0 0 500 0 0 0 0 0 0\n"
                    "intr 1 2 3\n")
    real = cores.Path
    monkeypatch.setattr(cores, "Path", lambda p: stat if p == "/proc/stat" else real(p))
    hz = cores.os.sysconf("SC_CLK_TCK")
    assert cores._busy_seconds([0]) == pytest.approx(120 / hz)
    assert cores._busy_seconds([0, 1]) == pytest.approx(320 / hz)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_thread_count_changes_no_bit(dtype: torch.dtype) -> None:
    """Prompt, decode step and verify block logits at 1 thread equal those at 2, and so do greedy tokens: the
    count may change between any two rounds. Wide enough that the kernels split outputs between threads."""
    if dtype == torch.bfloat16 and not extension.available():
        pytest.skip("bf16 CPU kernel unavailable")
    cfg = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, eos_token_id=2,
                      bos_token_id=1)
    torch.manual_seed(0)
    target = freeze(Target(LlamaForCausalLM(cfg).eval().to(dtype), None, "tiny-llama-wide"))
    tm = TargetModel(target.model)
    seq = torch.randint(3, 1024, (1, 40), generator=torch.Generator().manual_seed(1))
    n = torch.get_num_threads()
    out = {}
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            cache, lens = tm.new_cache(1, 48), torch.zeros(1, dtype=torch.long)
            with torch.inference_mode():
                prompt, _ = tm.forward(cache, seq[:, :32], lens, prefill=True)  # [1, 32, V]
                step, _ = tm.forward(cache, seq[:, 32:33], lens + 32)  # [1, 1, V]
                block, _ = tm.forward(cache, seq[:, 33:], lens + 33)  # [1, 7, V]
            gen = SpeculativeGenerator(target)
            tokens = gen.generate([seq[0, :20].tolist()], 24, SpecConfig(mode="ar"))[0].tokens
            out[threads] = (prompt, step, block, tokens)
    finally:
        torch.set_num_threads(n)
    # prompts through oneDNN (on AMX CPUs, `prompt_kernel` False, or without the kernel) are not checked here
    first = 0 if tm.prompt_kernel else 1
    for a, b in zip(out[1][first:3], out[2][first:3]):
        assert torch.equal(a, b)
    assert out[1][3] == out[2][3]

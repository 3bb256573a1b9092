"""The one dtype decision (drafthead.hardware): per CPU class, monkeypatched, and the forced-bf16 warning."""
from __future__ import annotations

import pytest
import torch

from drafthead import hardware
from drafthead.kernels import extension
from drafthead.trainer.step import autocast

CASES = [  # (torch capability, cpuinfo flags, class, auto dtype)
    ("AVX2", {"avx2", "fma"}, "AVX2", torch.float32),
    ("AVX2", {"avx2", "avx512f", "avx512_bf16"}, "AVX2", torch.float32),  # ATEN_CPU_CAPABILITY=avx2 on a newer CPU
    ("AVX512", {"avx512f", "avx512bw"}, "AVX512", torch.float32),  # Skylake-class: bf16 emulated
    ("AVX512", {"avx512f", "avx512bw", "avx512_bf16"}, "AVX512-BF16", torch.bfloat16),  # EPYC Zen 4
    ("AVX512", {"avx512f", "avx512bw", "avx512_bf16", "amx_bf16", "amx_tile"}, "AMX", torch.bfloat16),  # Xeon
    ("DEFAULT", set(), "DEFAULT", torch.float32),
]


def fake_cpu(monkeypatch, cap: str, flags: set[str]) -> None:
    monkeypatch.setattr(hardware, "cpu_capability", lambda: cap)
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(hardware, "_said", set())


@pytest.mark.parametrize("cap,flags,cls,auto", CASES)
def test_auto_dtype_per_cpu_class(monkeypatch, capsys, cap, flags, cls, auto):
    fake_cpu(monkeypatch, cap, flags)
    assert hardware.cpu_class() == cls
    assert hardware.native_bf16() == (auto == torch.bfloat16)
    assert hardware.resolve_dtype("auto", "cpu", "target") == auto
    out = capsys.readouterr().out.strip()
    name = str(auto).removeprefix("torch.")
    want = f"target dtype: {name} (CPU capability {cap}, " + (f"{cls}: native bf16)" if auto == torch.bfloat16
                                                              else "no native bf16)")
    assert out == want
    # said once per process, however many loaders ask
    hardware.resolve_dtype("auto", "cpu", "target")
    assert capsys.readouterr().out == ""
    assert hardware.describe()["cpu_class"] == cls


def test_cuda_is_bf16_whatever_the_cpu(monkeypatch, capsys):
    fake_cpu(monkeypatch, "AVX2", {"avx2"})
    assert hardware.resolve_dtype("auto", "cuda", "train") == torch.bfloat16
    assert capsys.readouterr().out.strip() == "train dtype: bfloat16 (CUDA)"


def test_forced_bf16_without_native_support_warns_and_runs(monkeypatch, capsys):
    fake_cpu(monkeypatch, "AVX2", {"avx2", "fma"})
    assert hardware.resolve_dtype("bfloat16", "cpu", "target") == torch.bfloat16
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("warning: target dtype bfloat16 was asked for on a CPU without native bf16 "
                             "(CPU capability AVX2, no native bf16): bf16 matmuls run ~7x slower than float32")
    # fp32 and native bf16 say nothing on stderr
    assert hardware.resolve_dtype("float32", "cpu") == torch.float32
    fake_cpu(monkeypatch, "AVX512", {"avx512f", "avx512bw", "avx512_bf16"})
    assert hardware.resolve_dtype("bfloat16", "cpu") == torch.bfloat16
    assert capsys.readouterr().err == ""


def test_unknown_dtype_is_named():
    with pytest.raises(ValueError, match="unknown dtype 'half'; valid: auto, float32, bfloat16"):
        hardware.resolve_dtype("half")


@pytest.mark.parametrize("cap,flags,cls,auto", CASES)
def test_training_autocast_follows_the_decision(monkeypatch, cap, flags, cls, auto):
    fake_cpu(monkeypatch, cap, flags)
    with autocast("auto", torch.device("cpu"), "torch"):
        assert torch.is_autocast_enabled("cpu") == (auto == torch.bfloat16)
    with autocast("float32", torch.device("cpu"), "torch"):
        assert not torch.is_autocast_enabled("cpu")
    with pytest.raises(ValueError, match="train.dtype='fp16'"):
        autocast("fp16", torch.device("cpu"), "torch")


@pytest.mark.parametrize("cap,flags,cls,auto", CASES)
def test_decode_kernel_only_where_avx512_bf16_is_dispatched(monkeypatch, cap, flags, cls, auto):
    """The packed bf16 kernel follows the same class: an emulated AVX2 machine falls back to oneDNN."""
    fake_cpu(monkeypatch, cap, flags)
    assert extension._cpu_has_avx512_bf16() == ("avx512_bf16" in flags and cls in ("AVX512-BF16", "AMX"))


def test_load_target_auto_uses_the_decision(monkeypatch, tiny_llama_dir):
    from drafthead.target import load_target

    fake_cpu(monkeypatch, "AVX2", {"avx2"})
    assert load_target(str(tiny_llama_dir)).model.dtype == torch.float32
    fake_cpu(monkeypatch, "AVX512", {"avx512f", "avx512bw", "avx512_bf16"})
    assert load_target(str(tiny_llama_dir)).model.dtype == torch.bfloat16

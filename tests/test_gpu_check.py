"""scripts/gpu_check.py --dry: every section of the GPU check runs on CPU with tiny models, so the one command
kept for a GPU slice cannot rot between the slices."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_runs_every_section(tmp_path: Path) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # a fresh process: the interpreter must be on before triton loads
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--dry", "--out", str(tmp_path)],
                       capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    from drafthead.kernels.triton_kernels import INTERPRETER_LOOPS_OVER_LOADS

    kernels = res["status"].pop("kernels")
    assert res["status"] == {s: "ok" for s in ("env", "eagle3", "zero2", "dflash", "mtp", "runtime")}
    s = res["sections"]
    if not INTERPRETER_LOOPS_OVER_LOADS:  # an old Triton's interpreter (3.6): named, not failed
        assert kernels.startswith("skipped: triton 3.") and "kernels" not in s
    else:
        assert kernels == "ok"
        kinds = {r["kernel"] for r in s["kernels"]["rows"]}
        assert kinds == {"tree_mask", "greedy_tree", "greedy_chain", "rejection_tree", "rejection_chain", "kv_compact"}
        assert all(r["check"].startswith("ok") for r in s["kernels"]["rows"])
    for name in ("eagle3", "zero2", "dflash", "mtp"):
        assert s[name]["tokens_per_s"] > 0 and all(math.isfinite(x) for x in s[name]["losses"]), name
    assert s["zero2"]["engine"] == "deepspeed" and s["eagle3"]["engine"] == "torch"
    assert s["eagle3"]["flops_per_micro_step"] > 0 and s["eagle3"]["achieved_tflops"] >= 0
    modes = {(c["mode"], c["path"], c["batch"]) for c in s["runtime"]["lossless_fp64"]}
    assert modes == {(m, p, b) for m in ("ar", "chain", "tree", "block") for p in ("eager", "static") for b in (1, 3)}
    assert all(c["equal_to_hf_greedy"] for c in s["runtime"]["lossless_fp64"])
    curve = s["runtime"]["verify_curve"]
    assert [r["T"] for r in curve] == [1, 2, 4, 8]
    # the static-cache path (CUDA graphs on a GPU) run eagerly on CPU: the eager forward's logits, timed beside it
    assert all(r["static_argmax_equal"] and r["static_max_abs_diff"] == 0 and r["static_ms"] > 0 for r in curve)
    assert s["runtime"]["bound"]["bound_ms"] > 0 and s["runtime"]["bound"]["static_T1_x_bound"] > 0
    assert set(s["runtime"]["ar_tokens_per_s"]) == {"ours_eager", "ours_static", "hf_generate", "static_vs_hf"}
    md = (tmp_path / "gpu_check.md").read_text()
    assert "| runtime | ok |" in md and ("| kernels | ok |" in md or not INTERPRETER_LOOPS_OVER_LOADS)


def test_gpu_check_without_a_gpu_says_so(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--out", str(tmp_path)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 2 and "no CUDA device here; use --dry" in p.stderr


def test_gpu_check_unknown_section_is_named(tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--dry", "--only", "kernel",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "unknown section(s) ['kernel']" in p.stderr

"""Measuring drafts: `drafthead eval` (tau, acceptance by position, speedup, losslessness, in our runtime and in
vLLM) and `drafthead bench` (decoding speed of every method on the same prompts).

    from drafthead.eval import EvalConfig, run_eval
    report = run_eval(EvalConfig(draft="runs/eagle3_smollm2/final", max_prompts=8))

command.py the eval command · models.py loading a target and its draft · datasets.py the prompts ·
acceptance.py decoding and its counts · report.py report.json / report.md · bench.py `drafthead bench` ·
vllm.py (+ vllm_worker.py) vLLM as a second engine.
"""
from drafthead.eval.command import EvalConfig, help_text, main, run_eval, validate
from drafthead.eval.models import load_models, resolve_device

__all__ = ["EvalConfig", "help_text", "load_models", "main", "resolve_device", "run_eval", "validate"]

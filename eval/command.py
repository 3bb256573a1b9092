"""`drafthead eval`: how much a draft speeds up its target on real prompts, and whether it stays lossless.

    drafthead eval draft=runs/NAME/final dataset=mt_bench max_prompts=16 max_new_tokens=128 out=eval_out

One run decodes every prompt twice with the same runtime: speculatively (mode chain/tree/ngram) and
autoregressively (mode ar, the baseline), then writes out/report.json, report.md and two plots.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from drafthead import options
from drafthead.hardware import check_dtype
from drafthead.runtime.generate import OWN_MODES  # the others are the drafter's (its `draft_modes` table)
from drafthead.eval.acceptance import generate_runs, warmup
from drafthead.eval.datasets import DATASETS, load_eval_dataset
from drafthead.eval.models import load_models, resolve_device, runtime_settings, served
from drafthead.eval.report import build_report, machine_info, write_report

@dataclass
class EvalConfig:
    draft: str | None = None  # <run_dir>/final, or none: n-gram drafter / AR alone
    dataset: str = "mt_bench"  # mt_bench | humaneval | sharegpt
    max_prompts: int | None = None  # default: the whole dataset
    max_new_tokens: int = 256  # new tokens per turn, at most
    temperature: float = 0.0  # 0 = greedy (then speculative output must equal AR output token for token)
    top_p: float = 1.0  # nucleus sampling when temperature > 0 (lossless by rejection sampling)
    out: str = "eval_out"  # folder for report.json, report.md and the plots
    target: str | None = None  # default: the draft's config.json target.name_or_path
    gguf_file: str | None = None  # the .gguf file inside target, when it is a folder or hub id holding several
    heldout: str | None = None  # sharegpt: default <draft>/../heldout.jsonl

    # default: the mode the trainer chose for the draft (its config.json "serving"), else the draft's first (chain;
    # block for DFlash); ngram without a draft
    mode: str | None = None

    # drafts per round along one path (chain length, deepest tree path, block slots verified); vLLM's name. Not the
    # depth a draft was trained to (its config's num_draft_tokens). null: the length the trainer chose for the draft
    # (its config.json "serving"), else 2
    num_speculative_tokens: int | None = None
    tree_nodes: int | None = None  # tree: draft nodes verified per round (null: the draft's serving record, else 8)
    topk: int | None = None  # tree: children expanded per node (null: the draft's serving record, else 4)
    adaptive: bool = False  # adaptive draft length (chain: k in [1, num_speculative_tokens]; tree: depth)
    draft_stop_prob: float = 0.0  # chain: end a request's drafts before the first below this draft probability
    ngram: bool = False  # stack prompt lookup (n-gram) with the draft: the longer proposal wins
    ngram_n: int = 3  # n-gram: match length of the prompt lookup
    seed: int = 0  # sampling seed
    batch_size: int = 1  # requests verified together
    device: str = "auto"  # auto = cuda if available, else cpu
    dtype: str = "auto"  # target and draft weights: auto (bf16 where native: CUDA, AMX/AVX512-BF16) | float32 |
    # bfloat16
    threads: int | None = None  # torch CPU threads (default: torch's)
    weights: str | None = None  # fp32 CPU targets: the decode kernel streams the target's weights as bf16 or int8
    # (rounded in place for prompts too); null = as loaded
    allow_target_mismatch: bool = False  # run a draft on a target whose fingerprint is not the one it was
    # trained on (the same model in another format, say); the report states the mismatch
    progress: bool = True  # progress bars
    engine: str = "ours"  # ours | vllm | ours,vllm: our runtime, vLLM's CPU build (the draft exported on the
    # fly, beside vLLM alone and vLLM's n-gram drafter), or both on the same conversations
    vllm_python: str | None = None  # vLLM's interpreter (default: the one scripts/make_vllm_env.sh made)


ENGINES = ("ours", "vllm")


def engines(cfg: EvalConfig) -> list[str]:
    """The engines `engine=` names, in order; an unknown one is an error naming the known ones."""
    names = [e.strip() for e in str(cfg.engine).split(",") if e.strip()]
    bad = [e for e in names if e not in ENGINES]
    if bad or not names:
        raise ValueError(f"engine={cfg.engine}: unknown engine {', '.join(map(repr, bad)) or '(none)'}; each must be "
                         f"one of {', '.join(ENGINES)} (comma-separated)")
    return names


def resolve_mode(cfg: EvalConfig, has_draft: bool | None = None) -> str:
    """The runtime's own modes (ar, ngram) run without a draft; any other is the drafter's (its `draft_modes`
    table, which the runtime checks once the draft is loaded: an unknown name is an error naming its modes)."""
    has_draft = bool(cfg.draft) if has_draft is None else has_draft
    mode = cfg.mode or ("chain" if has_draft else "ngram")
    if mode not in OWN_MODES and not has_draft:
        raise ValueError(f"mode={mode} needs a trained draft (draft=<run_dir>/final); with draft=none use "
                         f"mode=ngram or mode=ar")
    return mode


def validate(cfg: EvalConfig, models_given: bool = False, has_draft: bool | None = None) -> None:
    """Fail before loading anything. `models_given`: run_eval got target/drafter objects, not names."""
    if cfg.dataset not in DATASETS:
        raise ValueError(f"unknown dataset {cfg.dataset!r}; valid: {', '.join(DATASETS)}")
    checks = [("max_new_tokens", cfg.max_new_tokens, cfg.max_new_tokens > 0, "> 0"),
              ("max_prompts", cfg.max_prompts, cfg.max_prompts is None or cfg.max_prompts > 0, "> 0"),
              ("temperature", cfg.temperature, cfg.temperature >= 0, ">= 0"),
              ("top_p", cfg.top_p, 0 < cfg.top_p <= 1, "in (0, 1]"),
              ("num_speculative_tokens", cfg.num_speculative_tokens,
               cfg.num_speculative_tokens is None or cfg.num_speculative_tokens >= 1, ">= 1"),
              ("tree_nodes", cfg.tree_nodes, cfg.tree_nodes is None or cfg.tree_nodes >= 1, ">= 1"),
              ("topk", cfg.topk, cfg.topk is None or cfg.topk >= 1, ">= 1"),
              ("ngram_n", cfg.ngram_n, cfg.ngram_n >= 1, ">= 1"),
              ("batch_size", cfg.batch_size, cfg.batch_size >= 1, ">= 1")]
    for name, value, ok, rule in checks:
        if not ok:
            raise ValueError(f"{name} must be {rule}, got {value}")
    check_dtype(cfg.dtype)
    if cfg.draft and not models_given and not (Path(cfg.draft) / "config.json").is_file():
        raise FileNotFoundError(f"draft={cfg.draft} is not a draft directory (no config.json); pass "
                                f"<run_dir>/final or draft=none")
    if not cfg.draft and not cfg.target and not models_given:
        raise ValueError("draft=none needs target=NAME_OR_PATH (there is no draft config to read it from)")
    resolve_mode(cfg, has_draft)
    engines(cfg)


def spec_configs(cfg: EvalConfig, mode: str) -> tuple[Any, Any, str]:
    """(speculative SpecConfig, the AR SpecConfig of the baseline, where the draft length and tree shape come from)
    from the eval keys and the draft's serving record."""
    from drafthead.runtime import SpecConfig

    names = {f.name for f in dataclasses.fields(SpecConfig)}
    kw = {k: v for k, v in dataclasses.asdict(cfg).items() if k in names}
    settings, source = runtime_settings(mode, {k: kw.get(k) for k in ("num_speculative_tokens", "tree_nodes", "topk")},
                                        cfg.draft)
    spec = SpecConfig(**{**kw, **settings, "mode": mode})
    return spec, dataclasses.replace(spec, mode="ar"), source


def run_eval(cfg: EvalConfig, target: Any = None, drafter: Any = None, generator: Any = None) -> dict:
    """Decode the dataset speculatively and autoregressively, write the report, return it.

    `target`/`drafter`/`generator` may be given (tests, notebooks); otherwise they are loaded from
    cfg.target / cfg.draft and built with drafthead.runtime.SpeculativeGenerator.
    """
    has_draft = drafter is not None if target is not None else bool(cfg.draft)
    validate(cfg, models_given=target is not None, has_draft=has_draft)
    mode = resolve_mode(cfg, has_draft)
    use = engines(cfg)
    vllm_python = None
    if "vllm" in use:  # a missing vLLM or a family it cannot serve is named before anything slow loads
        from drafthead.eval import vllm as vllm_engine
        from drafthead.registry import family, read_draft_config

        vllm_python = vllm_engine.find_python(cfg.vllm_python)
        if cfg.draft:
            vllm_engine.check_family(family(read_draft_config(cfg.draft)["family"]))
    samples = load_eval_dataset(cfg.dataset, cfg.max_prompts, cfg.draft, cfg.heldout)  # before the slow loads
    device = resolve_device(cfg.device)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    target_check = "not checked: the caller passed the target object" if target is not None else None
    if target is None:
        print(f"loading target {cfg.target or '(from the draft config)'} and draft {cfg.draft} on {device} ...")
        target, drafter, target_check = load_models(cfg.draft, cfg.target, cfg.gguf_file, device, cfg.dtype,
                                                    cfg.allow_target_mismatch)
        target_check = target_check or ("same target as the draft's (fingerprint)" if drafter is not None else None)
    if cfg.mode is None and drafter is not None:
        chosen = served(cfg.draft).get("mode")  # the trainer's choice, else the drafter's default mode
        mode = chosen if chosen in drafter.draft_modes else next(iter(drafter.draft_modes))
    if generator is None:
        from drafthead.runtime import SpeculativeGenerator
        generator = SpeculativeGenerator(target, drafter, device=device, weights=cfg.weights)
    spec, ar, source = spec_configs(cfg, mode)
    tok = target.tokenizer
    print(f"runtime: {generator.model.paths()}; {spec.num_speculative_tokens} drafts a round ({source})")

    specs = {"speculative": spec, "autoregressive": ar}
    runs: dict[str, list] = {"speculative": [], "autoregressive": []}
    if "ours" in use:
        for sc in specs.values():
            warmup(generator, tok, samples[0], sc)
        torch.manual_seed(cfg.seed)
        t0 = time.perf_counter()
        runs = generate_runs(generator, tok, samples, cfg.max_new_tokens, specs,
                             desc=f"{cfg.dataset} {spec.mode} + ar", progress=cfg.progress)
        print(f"{spec.mode} and ar, taking turns: {len(runs['speculative'])} turns each in "
              f"{time.perf_counter() - t0:.1f} s")

    settings = {"dataset": cfg.dataset, "max_prompts": cfg.max_prompts, "max_new_tokens": cfg.max_new_tokens,
                "draft": str(Path(cfg.draft).resolve()) if cfg.draft else None,
                "target": getattr(target, "name_or_path", None), "gguf_file": getattr(target, "gguf_file", None),
                "drafter_family": drafter.family if drafter is not None else None,
                "dtype": str(target.model.dtype).removeprefix("torch."),
                "target_check": target_check,
                "runtime_paths": generator.model.paths(),
                "runtime_settings_from": source,
                "machine": machine_info(device)}
    if settings["machine"]["thread_changes"]:
        print(f"note: other processes held cores during the run: drafthead.cores changed the decode's thread count "
              f"(changes: {settings['machine']['thread_changes']}); tokens/s are not this machine's alone")
    report = build_report(runs["speculative"], runs["autoregressive"], dataclasses.asdict(spec), settings,
                          num_prompts=len(samples)) if "ours" in use else \
        {"settings": {"spec": dataclasses.asdict(spec), **settings}, "num_prompts": len(samples)}
    if "vllm" in use:
        print(f"vLLM ({vllm_python}): target alone, "
              + (f"the draft at {spec.num_speculative_tokens} tokens a round, " if drafter is not None else "")
              + "n-gram, one process each ...")
        report["vllm"] = vllm_engine.evaluate(
            vllm_python, target, [list(s.turns) for s in samples], cfg.draft if drafter is not None else None,
            family(drafter.family) if drafter is not None else None, Path(cfg.out), spec.num_speculative_tokens,
            cfg.max_new_tokens, settings["dtype"], cfg.temperature, cfg.top_p, cfg.seed, cfg.ngram_n,
            cfg.batch_size)
        if report.get("mean_accepted_per_round") is not None:  # our tau as vLLM counts it, for the side by side
            report["vllm"]["ours_accept_length"] = 1 + report["mean_accepted_per_round"]
    paths = write_report(report, cfg.out, runs["speculative"])
    print_summary(report)
    print(f"report: {paths['report.json']} (+ report.md, plots, generations.jsonl)")
    return report


def print_summary(r: dict) -> None:
    f = lambda x, nd=2: "n/a" if x is None else f"{x:.{nd}f}"  # noqa: E731
    for name, v in r.get("vllm", {}).get("runs", {}).items():
        print(f"vLLM {name:<15} tau {f(v['acceptance_length'])} | {f(v['tokens_per_s'], 1)} tok/s | speedup "
              f"{f(v.get('speedup'))}x | lossless {v.get('lossless', 'n/a')}")
    if "acceptance_length" not in r:
        return
    print(f"tau {f(r['acceptance_length'])} | {f(r['tokens_per_s'], 1)} tok/s vs AR "
          f"{f(r['baseline_tokens_per_s'], 1)} tok/s | speedup {f(r['speedup'])}x | lossless {r['lossless']}")
    for c, v in r["by_category"].items():
        print(f"  {c:<12} tau {f(v['acceptance_length'])}  {f(v['tokens_per_s'], 1)} tok/s  "
              f"speedup {f(v['speedup'])}x")
    if r["pays_off"]:
        print(r["verdict"])
    else:
        print(f"WARNING: {r['verdict']}")
    if r["lossless"] is False:
        print(f"WARNING: not lossless: {r['lossless_note']}")


def help_text(argv: list[str]) -> str:
    return options.help_text("drafthead eval key=value ...", __doc__, EvalConfig())


def main(argv: list[str]) -> int:
    cfg = options.parse(EvalConfig, argv)
    run_eval(cfg)
    return 0

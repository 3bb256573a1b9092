"""The evaluation report: report.json (numbers + settings), report.md (tables) and two plots.

Every file is written atomically (temp file + rename), so a reader never sees half a report.
"""
from __future__ import annotations

import io
import json
import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from drafthead import cores, hardware
from drafthead.io import atomic_write_bytes, atomic_write_json
from drafthead.eval.acceptance import (Generation, acceptance_rate_by_position, by_category, compare_outputs,
                                      conditional_acceptance_by_position, summarize)

DEFINITIONS = {
    "acceptance_length": "tau = generated tokens / target verify forwards, bonus token included: a round that "
                         "accepts a drafted tokens emits a + 1 tokens, so AR decoding has tau = 1 and a draft of "
                         "k tokens that is always accepted has tau = k + 1. The first token of each turn comes "
                         "from the prefill forward, which verifies nothing: it is left out of both counts",
    "target_forwards": "verify rounds + one prefill forward per turn",
    "mean_accepted_per_round": "mean number of drafted tokens accepted per round, bonus token excluded",
    "acceptance_rate_by_position": "entry i (0-based): fraction of rounds in which draft token i was accepted, among "
                                   "the rounds that drafted at least i + 1 tokens (null: no round drafted that many)",
    "conditional_acceptance_by_position": "entry i: fraction of rounds in which draft token i was accepted, among "
                                          "the rounds that drafted at least i + 1 tokens and accepted tokens 0..i-1; "
                                          "a curve that stays near entry 0 means the drafted tokens are "
                                          "independent guesses",
    "tokens_per_s": "generated tokens / wall time of the generate calls (prompt prefill included)",
    "baseline_tokens_per_s": "the same target decoding autoregressively in the same runtime (SpecConfig mode='ar'), "
                             "same prompts, same machine",
    "speedup": "tokens_per_s / baseline_tokens_per_s",
    "pays_off": "speedup > 1",
    "lossless": "greedy decoding only: every speculative output equals the AR output token for token; null when "
                "temperature > 0 (sampled outputs differ run to run)",
}


def machine_info(device: str | torch.device) -> dict:
    dev = torch.device(device)
    # thread_changes: how often drafthead.cores moved the decode's thread count because other processes held
    # cores; above 0, the speeds are not this machine's alone
    info = {"device": str(dev), "torch_threads": torch.get_num_threads(), "thread_changes": cores.watcher().changes,
            "torch": torch.__version__,
            "python": platform.python_version(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
            **hardware.describe(dev)}
    if dev.type == "cuda" and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(dev)
    import transformers

    info["transformers"] = transformers.__version__
    return info


def build_report(spec_gens: Sequence[Generation], ar_gens: Sequence[Generation], spec: dict, settings: dict,
                 num_prompts: int) -> dict:
    """All numbers of one eval run. `spec` = the SpecConfig fields; `settings` = dataset, draft, target, machine."""
    s, b = summarize(spec_gens), summarize(ar_gens)
    speedup = s["tokens_per_s"] / b["tokens_per_s"] if s["tokens_per_s"] and b["tokens_per_s"] else None
    greedy = float(spec.get("temperature", 0.0)) == 0.0
    diffs = compare_outputs(spec_gens, ar_gens) if greedy else []
    cats_s, cats_b = by_category(spec_gens), by_category(ar_gens)
    cats = {}
    for c, v in cats_s.items():
        base = cats_b.get(c, {}).get("tokens_per_s")
        cats[c] = {"acceptance_length": v["acceptance_length"], "tokens_per_s": v["tokens_per_s"],
                   "baseline_tokens_per_s": base,
                   "speedup": v["tokens_per_s"] / base if v["tokens_per_s"] and base else None,
                   "num_generations": v["num_generations"], "generated_tokens": v["generated_tokens"]}
    pays_off = bool(speedup is not None and speedup > 1.0)
    verdict = (f"the draft pays off: {speedup:.2f}x the AR tokens/s" if pays_off else
               "the draft does not pay for itself: " + (f"{speedup:.2f}x the AR tokens/s (<= 1)" if speedup
                                                         else "no speedup could be measured"))
    return {
        "acceptance_length": s["acceptance_length"],
        "mean_accepted_per_round": s["mean_accepted_per_round"],
        "acceptance_rate_by_position": acceptance_rate_by_position([g.result for g in spec_gens]),
        "conditional_acceptance_by_position": conditional_acceptance_by_position([g.result for g in spec_gens]),
        "by_category": cats,
        "tokens_per_s": s["tokens_per_s"],
        "baseline_tokens_per_s": b["tokens_per_s"],
        "speedup": speedup,
        "pays_off": pays_off,
        "verdict": verdict,
        "lossless": (not diffs) if greedy else None,
        "lossless_note": (f"{len(diffs)} of {len(spec_gens)} outputs differ from AR" if diffs else
                          "all outputs equal AR token for token") if greedy else
                         "not checked: temperature > 0 samples, so outputs differ from AR by design",
        "mismatches": diffs[:20],
        "num_prompts": num_prompts,
        "num_generations": s["num_generations"],
        "generated_tokens": s["generated_tokens"],
        "baseline_generated_tokens": b["generated_tokens"],
        "verify_rounds": s["verify_rounds"],
        "baseline_verify_rounds": b["verify_rounds"],
        "target_forwards": s["target_forwards"],
        "baseline_target_forwards": b["target_forwards"],
        "time_s": s["time_s"],
        "baseline_time_s": b["time_s"],
        "settings": {"spec": spec, **settings},
        "definitions": DEFINITIONS,
    }


def _fmt(x: Any, nd: int = 3) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, bool):
        return str(x).lower()
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def render_markdown(r: dict) -> str:
    st = r["settings"]
    spec = st["spec"]
    lines = [f"# drafthead eval: {st.get('dataset')}", "",
             f"draft `{st.get('draft')}` on target `{st.get('target')}`, mode `{spec.get('mode')}`, "
             f"{r['num_prompts']} prompts, max_new_tokens "
             f"{st.get('max_new_tokens')}, temperature {spec.get('temperature')}, device "
             f"{st.get('machine', {}).get('device')} (CPU class {st.get('machine', {}).get('cpu_class')}), "
             f"{st.get('machine', {}).get('torch_threads')} torch threads, dtype {st.get('dtype')}.",
             "", f"Target check: {st.get('target_check') or 'n/a'}."]
    if "acceptance_length" in r:
        lines += ours_markdown(r)
    if "vllm" in r:
        lines += vllm_markdown(r["vllm"], r.get("acceptance_rate_by_position"))
    if "definitions" in r:
        lines += ["", "## Definitions", ""] + [f"- `{k}`: {v}" for k, v in r["definitions"].items()]
    if r.get("lossless") is False or ("lossless" in r and r["lossless"] is None):
        lines += ["", f"Lossless check: {r['lossless_note']}."]
    return "\n".join(lines) + "\n"


def ours_markdown(r: dict) -> list[str]:
    lines = ["", f"**{r['verdict']}** ({r['num_generations']} turns)", "", "| metric | value |", "|---|---|"]
    for k in ("acceptance_length", "mean_accepted_per_round", "tokens_per_s", "baseline_tokens_per_s", "speedup",
              "pays_off", "lossless", "generated_tokens", "target_forwards"):
        lines.append(f"| {k} | {_fmt(r[k])} |")
    lines += ["", "## By category", "", "| category | tau | tokens/s | AR tokens/s | speedup | turns |",
              "|---|---|---|---|---|---|"]
    for c, v in r["by_category"].items():
        lines.append(f"| {c} | {_fmt(v['acceptance_length'])} | {_fmt(v['tokens_per_s'], 1)} | "
                     f"{_fmt(v['baseline_tokens_per_s'], 1)} | {_fmt(v['speedup'], 2)} | {v['num_generations']} |")
    lines += ["", "## Acceptance rate by draft position", "",
              "| position | rate | given the earlier positions accepted |", "|---|---|---|"]
    lines += [f"| {i} | {_fmt(x)} | {_fmt(c)} |" for i, (x, c) in
              enumerate(zip(r["acceptance_rate_by_position"], r["conditional_acceptance_by_position"], strict=True))]
    return lines


def vllm_markdown(v: dict, our_by_pos: list | None) -> list[str]:
    """vLLM's rows: the target alone, our draft and vLLM's own n-gram drafter, on the same conversations."""
    lines = ["", f"## In vLLM {v['vllm_version']} (CPU build, torch {v['torch']}, dtype {v['dtype']}, "
             f"{v['num_speculative_tokens']} speculative tokens, threads bound {v['omp_threads_bind']})", "",
             "| run | tau | tokens/s | speedup vs vLLM alone | lossless | acceptance by position |",
             "|---|---|---|---|---|---|"]
    for name, row in v["runs"].items():
        label = f"draft ({v['draft_export']} export)" if name == "draft" else name
        pos = row.get("acceptance_rate_by_position")
        lines.append(f"| {label} | {_fmt(row['acceptance_length'])} | {_fmt(row['tokens_per_s'], 1)} | "
                     f"{_fmt(row.get('speedup'), 2)} | {_fmt(row.get('lossless'))} | "
                     f"{' / '.join(_fmt(p) for p in pos) if pos else 'n/a'} |")
    draft = v["runs"].get("draft")
    if draft is not None and v.get("ours_accept_length") is not None:
        lines += ["", f"tau of the draft as vLLM counts it (1 + accepted drafts per verify round): ours "
                  f"{_fmt(v['ours_accept_length'])}, vLLM {_fmt(draft['acceptance_length'])}; ours by position "
                  f"{' / '.join(_fmt(p) for p in (our_by_pos or []))}."]
    notes = [f"{name}: {row['lossless_note']}" for name, row in v["runs"].items() if row.get("lossless") is False]
    if notes:
        lines += ["", "Not lossless in vLLM (" + "; ".join(notes) + "): where vLLM's own n-gram drafter parts from "
                  "vLLM alone too, its kernels round a verify of several tokens differently from a step of one "
                  "(our runtime's decode kernels are row-invariant; vLLM's are not at this dtype)."]
    if draft is not None and "speedup" in draft and "speedup" in v["runs"]["ngram"]:
        lines += ["", f"In vLLM the draft runs {_fmt(draft['speedup'], 2)}x vLLM alone; vLLM's free n-gram drafter "
                  f"{_fmt(v['runs']['ngram']['speedup'], 2)}x."]
    return lines


def _png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    return buf.getvalue()


def _figure() -> Any:
    # the Agg canvas directly, never pyplot: no GUI backend and no global figure state
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(6, 3.5))
    FigureCanvasAgg(fig)
    return fig


def plot_acceptance_by_position(rates: Sequence[float | None], conditional: Sequence[float | None] = (),
                                title: str = "") -> bytes:
    """Bars: P(token i accepted); line: P(token i accepted | tokens before it accepted)."""
    fig = _figure()
    ax = fig.add_subplot()
    xs = list(range(len(rates)))
    bars = ax.bar(xs, [x if x is not None else 0.0 for x in rates], color="#4c72b0", label="accepted")
    ax.bar_label(bars, labels=["n/a" if x is None else f"{x:.2f}" for x in rates], fontsize=8)
    known = [(i, c) for i, c in enumerate(conditional) if c is not None]
    if known:
        ax.plot([i for i, _ in known], [c for _, c in known], "o-", color="#dd8452",
                label="accepted, given the earlier ones were")
        ax.legend(loc="upper right", fontsize=8)
    ax.set_xticks(xs)
    ax.set_ylim(0, 1)
    ax.set_xlabel("draft position (0 = first drafted token)")
    ax.set_ylabel("acceptance rate")
    ax.set_title(title or "acceptance rate by draft position")
    return _png(fig)


def plot_tau_by_category(cats: dict[str, dict], title: str = "") -> bytes:
    fig = _figure()
    ax = fig.add_subplot()
    names = list(cats)
    taus = [cats[c]["acceptance_length"] for c in names]
    bars = ax.bar(range(len(names)), [t or 0.0 for t in taus], color="#55a868")
    ax.bar_label(bars, labels=["n/a" if t is None else f"{t:.2f}" for t in taus], fontsize=8)
    ax.axhline(1.0, color="gray", lw=0.8, ls="--", label="AR (tau = 1)")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax.set_ylabel("acceptance length tau")
    ax.set_title(title or "acceptance length by category")
    return _png(fig)


def write_report(r: dict, out_dir: str | os.PathLike, spec_gens: Sequence[Generation] = ()) -> dict[str, Path]:
    """report.json, report.md, the two plots and generations.jsonl (the speculative outputs) under out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {name: out / name for name in ("report.json", "report.md", "acceptance_by_position.png",
                                           "tau_by_category.png", "generations.jsonl")}
    label = f"{r['settings'].get('dataset')}, mode {r['settings']['spec'].get('mode')}"
    if "acceptance_rate_by_position" in r:  # our runtime ran (engine=vllm alone has only vLLM's rows)
        atomic_write_bytes(paths["acceptance_by_position.png"], plot_acceptance_by_position(
            r["acceptance_rate_by_position"], r["conditional_acceptance_by_position"],
            f"acceptance by position ({label})"))
        atomic_write_bytes(paths["tau_by_category.png"], plot_tau_by_category(
            r["by_category"], f"tau by category ({label})"))
    rows = [json.dumps({"sample_id": g.sample_id, "category": g.category, "turn": g.turn, "prompt_len": g.prompt_len,
                        "num_tokens": g.num_tokens, "num_rounds": g.result.num_rounds,
                        "accept_lens": list(g.result.accept_lens), "stopped_eos": bool(g.result.stopped_eos),
                        "text": g.text}, ensure_ascii=False) for g in spec_gens]
    atomic_write_bytes(paths["generations.jsonl"], ("\n".join(rows) + "\n" if rows else "").encode())
    atomic_write_bytes(paths["report.md"], render_markdown(r).encode())
    atomic_write_json(paths["report.json"], r)  # last: its presence means the report is complete
    return paths

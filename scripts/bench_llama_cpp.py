"""llama.cpp with and without our draft (EAGLE3, DFlash or a LoRA self-draft's standalone GGUF) on MT-Bench first
turns (SmolLM2 chat template).

    python scripts/bench_llama_cpp.py draft=runs/eagle3_smollm2/final            # a draft dir (exported here)
    python scripts/bench_llama_cpp.py draft=draft.gguf max_prompts=8 max_new_tokens=128 threads=2
    python scripts/bench_llama_cpp.py draft=... outtype=q8_0 n_draft=[1,2,3,4] out=bench_llama_cpp.json
    python scripts/bench_llama_cpp.py draft=runs/dflash_smollm2/final n_draft=[7]   # DFlash: n_draft = B-1
    python scripts/bench_llama_cpp.py draft=runs/lora_smollm2/final p_min=0.75       # -md draft-simple

Prints, for n_draft 1..4: llama.cpp's acceptance (n_accept / n_drafted), tau (tokens per verify round =
accepted + 1) and decode tokens/s (llama.cpp's own timer), against the target alone; then llama.cpp's verify-cost curve
(llama-bench: time to evaluate 1..8 tokens in one batch after `depth` tokens of context) and the n_draft
it predicts to be best: tokens per round / (verify(n_draft+1) + n_draft * draft step). Our runtime's
numbers (drafthead.runtime, the draft's first mode: chain for EAGLE3, block for DFlash; same draft and
prompts) are printed beside when available, with the acceptance by draft position from both (llama.cpp's
`#acc rate/pos`, read from a second, verbose pass: the share of verify rounds that accepted position i).
llama.cpp drafts a DFlash block of n_draft + 1 positions; the draft was trained on blocks of B, so
n_draft = B - 1 compares like with like. A standalone llama draft (LoRA) runs as draft-simple with
`--spec-draft-p-min p_min` (0 by default: every position drafted, as our chain mode does).
"""
from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from drafthead import hardware, options
from drafthead.assets import asset_path
from drafthead.export import export
from drafthead.export.llama_cpp import (chat_prompt, default_threads, llama_cpp_bin, run_speculative, run_target,
                                       verify_cost)

USAGE = "python scripts/bench_llama_cpp.py draft=DIR_OR_GGUF [key=value ...]"


@dataclass
class Config:
    draft: str | None = None  # the draft: a run's folder (exported to GGUF here) or a GGUF file (required)
    target: str = "smollm2-135m-instruct"  # the target: a built-in name, a GGUF file or a model folder
    outtype: str = "f32"  # GGUF tensor type of the exported draft (f32, f16, bf16, q8_0)
    max_prompts: int = 8  # MT-Bench first turns
    max_new_tokens: int = 128  # tokens each prompt decodes
    n_draft: list[int] = field(default_factory=lambda: [1, 2, 3, 4])  # llama.cpp's drafts per round, each timed
    threads: int | None = None  # llama.cpp threads (null: 2, or 1 when the machine is busy)
    depth: int = 256  # context tokens before the verify-cost curve's batch
    verify_sizes: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 5, 8])  # batch sizes of that curve
    repetitions: int = 5  # llama-bench repetitions per batch size
    ours: bool = True  # also run our runtime on the same draft and prompts
    by_position: bool = True  # a verbose llama.cpp pass for its acceptance by draft position
    out: str | None = None  # write the figures to this JSON file
    p_min: float = 0.0  # --spec-draft-p-min of a standalone (draft-simple) draft


# GGUF general.architecture -> --spec-type ("llama": a standalone draft model, llama.cpp's classic -md draft)
SPEC_TYPES = {"eagle3": "draft-eagle3", "dflash": "draft-dflash", "llama": "draft-simple"}


def spec_type(gguf: Path) -> str:
    from drafthead.export.gguf_meta import read_gguf_metadata

    arch = read_gguf_metadata(gguf).get("general.architecture", (0, None, None))[2]
    if arch not in SPEC_TYPES:
        raise SystemExit(f"{gguf}: general.architecture {arch!r} is not a draft llama.cpp runs here "
                         f"({', '.join(SPEC_TYPES)})")
    return SPEC_TYPES[arch]


def by_position(rounds: list[list[int]], k: int) -> list[float]:
    """Share of verify rounds that accepted draft position i (i < k), over every prompt's rounds."""
    flat = [a for r in rounds for a in r]
    return [sum(a > i for a in flat) / len(flat) if flat else 0.0 for i in range(k)]


def mt_bench_first_turns(n: int) -> list[str]:
    rows = [json.loads(line) for line in asset_path("mt_bench").read_text().splitlines() if line.strip()]
    return [r["turns"][0] for r in rows[:n]]


def target_gguf(name: str) -> Path:
    p = Path(name)
    return p if p.suffix == ".gguf" else asset_path(name)


def load_tokenizer(gguf: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def draft_gguf(draft: str, target: str, outtype: str, tmp: Path) -> Path:
    p = Path(draft)
    if p.suffix == ".gguf":
        return p
    return export(p, "gguf", tmp / f"draft-{outtype}.gguf", target=target, outtype=outtype)


def predict_best(rows: dict[int, dict], curve: dict[int, float]) -> tuple[int | None, dict[int, float], float]:
    """Tokens/s each n_draft should reach from llama.cpp's verify-cost curve.

    A round of n_draft=k costs verify(k+1) + k * draft_step and yields (accepted per round + 1) tokens.
    draft_step (one draft forward + sampling) is the median over the runs of
    (measured time per round - verify(k+1)) / k. Returns (best k, {k: tokens/s}, draft_step seconds).
    """
    steps = [max(0.0, (r["decode_s"] / r["rounds"] - curve[k + 1]) / k)
             for k, r in rows.items() if k + 1 in curve and r["rounds"]]
    if not steps:
        return None, {}, float("nan")
    draft_step = statistics.median(steps)
    pred = {k: (r["accepted_per_round"] + 1) / (curve[k + 1] + k * draft_step)
            for k, r in rows.items() if k + 1 in curve}
    return max(pred, key=pred.get), pred, draft_step


def ours_runtime(draft: str, prompts: list[str], max_new: int, ks: list[int], threads: int, p_min: float = 0.0
                 ) -> dict | str:
    """Our runtime (drafthead.runtime, the draft's first mode) on the same prompts and draft, when available."""
    if Path(draft).suffix == ".gguf":
        return "skipped: draft given as .gguf (needs the draft directory)"
    try:
        import time

        import torch
        from drafthead.runtime import SpecConfig, SpeculativeGenerator
        from drafthead.eval import load_models
    except Exception as e:  # the runtime is optional here
        return f"unavailable: {type(e).__name__}: {e}"
    torch.set_num_threads(threads)
    target, drafter, _ = load_models(draft, None, None, "cpu")
    gen = SpeculativeGenerator(target, drafter, device="cpu")
    ids = [target.tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
    mode = next(iter(drafter.draft_modes))
    out: dict = {"mode": mode}
    for key, spec in [("ar", SpecConfig(mode="ar", temperature=0.0))] + \
            [(k, SpecConfig(mode=mode, num_speculative_tokens=k, temperature=0.0, draft_stop_prob=p_min)) for k in ks]:
        gen.generate([ids[0]], 8, spec)  # warm-up
        tokens = rounds = 0
        accepts = []
        t0 = time.perf_counter()
        for p in ids:
            r = gen.generate([p], max_new, spec)[0]
            tokens, rounds = tokens + len(r.tokens), rounds + r.num_rounds
            accepts.append(r.accept_lens)
        wall = time.perf_counter() - t0
        # tau: tokens per verify round (the first token of each prompt comes from prefill)
        out[key] = {"tokens_per_s": tokens / wall,
                    "acceptance_length": (tokens - len(ids)) / rounds if rounds else None}
        if key != "ar":
            out[key]["accept_by_position"] = by_position(accepts, key)
    return out


def _prefix_equal(a: str, b: str) -> bool:
    """Same greedy text up to the shorter one (speculative runs may emit a few tokens more)."""
    a, b = a.strip(), b.strip()
    return a.startswith(b) or b.startswith(a)


def main(argv: list[str]) -> int:
    cfg = options.script_options(Config, argv, USAGE, __doc__)
    if cfg is None:
        return 0
    if not cfg.draft:
        print(f"usage: {USAGE}: draft= is required (--help lists the options)", file=sys.stderr)
        return 2
    if cfg.threads is None:
        cfg.threads = default_threads()  # 2, or 1 when the machine is busy (see default_threads)
    bins = llama_cpp_bin(build=True)
    tgt = target_gguf(cfg.target)
    tok = load_tokenizer(tgt)
    users = mt_bench_first_turns(cfg.max_prompts)
    prompts = [chat_prompt(tok, u) for u in users]
    with tempfile.TemporaryDirectory() as tmp:
        dft = draft_gguf(str(cfg.draft), cfg.target, cfg.outtype, Path(tmp))
        st = spec_type(dft)
        extra = ["--spec-draft-p-min", str(cfg.p_min)] if st == "draft-simple" else []
        print(f"llama.cpp: {bins}\ntarget: {tgt}\ndraft: {cfg.draft} -> {dft.name} (--spec-type {st})\n"
              f"{len(prompts)} MT-Bench first turns, max_new_tokens {cfg.max_new_tokens}, {cfg.threads} threads")

        base = [run_target(bins, tgt, p, cfg.max_new_tokens, cfg.threads) for p in prompts]
        base_tok_s = sum(r.n_decoded for r in base) / sum(r.decode_s for r in base)
        rows: dict[int, dict] = {}
        first: list[str] | None = None  # texts of the first n_draft: every other n_draft must equal them
        for k in cfg.n_draft:
            runs = [run_speculative(bins, tgt, dft, p, cfg.max_new_tokens, k, cfg.threads, spec_type=st, extra=extra)
                    for p in prompts]
            drafted, accepted = sum(r.n_drafted for r in runs), sum(r.n_accept for r in runs)
            decoded, secs = sum(r.n_decoded for r in runs), sum(r.decode_s for r in runs)
            first = first or [r.text for r in runs]
            rows[k] = {"accept_rate": accepted / drafted if drafted else None, "rounds": drafted / k,
                       "accepted_per_round": accepted / (drafted / k) if drafted else 0.0,
                       "tokens_per_s": decoded / secs, "speedup": decoded / secs / base_tok_s,
                       "decode_s": secs,
                       "same_as_alone": sum(_prefix_equal(r.text, b.text) for r, b in zip(runs, base)),
                       "same_across_n_draft": sum(_prefix_equal(r.text, t) for r, t in zip(runs, first))}
            if cfg.by_position:  # a verbose pass (slower: its timings are not used) for llama.cpp's per-position counts
                pos = [run_speculative(bins, tgt, dft, p, cfg.max_new_tokens, k, cfg.threads, spec_type=st,
                                       verbose=True, extra=extra).accept_by_pos for p in prompts]
                pos = [x + [0.0] * (k - len(x)) for x in pos if x is not None]
                rows[k]["accept_by_position"] = [sum(c) / len(c) for c in zip(*pos)] if pos else None
        curve = verify_cost(bins, tgt, list(cfg.verify_sizes), cfg.depth, cfg.threads, cfg.repetitions)
    best, pred, draft_step = predict_best(rows, curve)
    ours = ours_runtime(str(cfg.draft), prompts, cfg.max_new_tokens, list(cfg.n_draft), cfg.threads,
                        cfg.p_min) if cfg.ours else "skipped: ours=false"

    f = lambda x, nd=2: "n/a" if x is None else f"{x:.{nd}f}"  # noqa: E731
    print(f"\nCPU class {hardware.cpu_class()} (capability {hardware.cpu_capability()}), {cfg.threads} threads")
    print(f"target alone (llama.cpp): {base_tok_s:.1f} tok/s decode")
    print(f"{'n_draft':>7} {'accept':>7} {'tau':>6} {'tok/s':>7} {'speedup':>8} {'pred tok/s':>10} "
          f"{'=alone':>6} {'=n1':>5} | {'ours tau':>8} {'ours tok/s':>10}")
    for k, r in rows.items():
        o = ours.get(k, {}) if isinstance(ours, dict) else {}
        print(f"{k:>7} {f(r['accept_rate'], 3):>7} {f(r['accepted_per_round'] + 1):>6} {f(r['tokens_per_s'], 1):>7} "
              f"{f(r['speedup']):>8} {f(pred.get(k), 1):>10} {r['same_as_alone']:>3}/{len(prompts):<2} "
              f"{r['same_across_n_draft']:>2}/{len(prompts):<2} | "
              f"{f(o.get('acceptance_length')):>8} {f(o.get('tokens_per_s'), 1):>10}")
    for k, r in rows.items():
        o = ours.get(k, {}) if isinstance(ours, dict) else {}
        if r.get("accept_by_position") or o.get("accept_by_position"):
            fmt = lambda xs: "n/a" if not xs else "[" + ", ".join(f"{x:.3f}" for x in xs) + "]"  # noqa: E731
            print(f"acceptance by position, n_draft {k}: llama.cpp {fmt(r.get('accept_by_position'))} (mean over "
                  f"prompts), ours {fmt(o.get('accept_by_position'))} (over rounds)")
    if isinstance(ours, str):
        print(f"our runtime: {ours}")
    elif "ar" in ours:
        print(f"our runtime AR: {f(ours['ar']['tokens_per_s'], 1)} tok/s")
    one = curve.get(1)
    print(f"llama.cpp verify cost after {cfg.depth} tokens of context (llama-bench): " +
          "  ".join(f"{n}:{1e3 * s:.1f}ms({s / one:.2f}x)" for n, s in sorted(curve.items())))
    measured_best = max(rows, key=lambda k: rows[k]["tokens_per_s"]) if rows else None
    print(f"draft step (one draft forward + sampling in llama.cpp): {1e3 * draft_step:.1f} ms")
    print(f"best n_draft: {best} from the verify curve, {measured_best} measured")
    print("=alone: prompts whose text equals llama-completion's (the target alone); llama-speculative-simple "
          "feeds the prompt in two batches, so near-tie tokens may differ from it for any draft.\n"
          "=n1: prompts whose text equals the first n_draft's run (greedy speculation must not depend on the draft)")
    if cfg.out:
        from drafthead.io import atomic_write_json

        atomic_write_json(cfg.out, {"settings": dataclasses.asdict(cfg), "target_alone_tok_s": base_tok_s,
                                    "llama_cpp": rows, "verify_cost_s": curve, "predicted_tok_s": pred,
                                    "draft_step_s": draft_step,
                                    "best_n_draft_curve": best, "best_n_draft_measured": measured_best,
                                    "ours": ours})
        print(f"wrote {cfg.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

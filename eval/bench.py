"""`drafthead bench`: decoding speed of every method on the same prompts and machine, in one run.

    drafthead bench draft=runs/NAME/final dataset=mt_bench max_prompts=8 max_new_tokens=128 out=bench.json
    drafthead bench draft=none target=smollm2-135m-instruct

Methods: our AR decoding, HF `generate` greedy, HF prompt-lookup decoding, our n-gram drafter, and our
runtime with the trained draft (chain of k and tree). All greedy, so every output should equal our AR
output; the table says where it does not. The methods take turns prompt by prompt, so a machine whose speed
drifts during the run slows them alike. Then the target verify-cost curve: the time of one forward
of n tokens appended to a cached prefix. Speculation pays when tau exceeds the cost of verifying
k+1 tokens relative to 1 (plus drafting), so that curve is what any tau has to beat.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from drafthead import options
from drafthead.io import atomic_write_json
from drafthead.eval.models import load_models, resolve_device, runtime_settings
from drafthead.hardware import check_dtype
from drafthead.eval.datasets import DATASETS, chat_prompt, load_eval_dataset
from drafthead.eval.report import machine_info


@dataclass
class BenchConfig:
    draft: str | None = None  # <run_dir>/final or none (then the EAGLE rows are skipped)
    target: str | None = None  # default: the draft's config.json target
    gguf_file: str | None = None  # the .gguf file inside target, when it is a folder or hub id holding several
    dataset: str = "mt_bench"  # mt_bench | humaneval | sharegpt
    heldout: str | None = None  # sharegpt: default <draft>/../heldout.jsonl
    max_prompts: int = 8  # first user turn of each
    max_new_tokens: int = 128  # new tokens per prompt, at most

    # drafts per round: chain length, deepest tree path, n-gram proposal; null: the length the trainer chose for the
    # draft (its config.json "serving"), else 2
    num_speculative_tokens: int | None = None
    tree_nodes: int | None = None  # tree: draft nodes verified per round (null: the draft's serving record, else 8)
    topk: int | None = None  # tree: children expanded per node (null: the draft's serving record, else 4)
    ngram_n: int = 3  # n-gram: match length of the prompt lookup
    prompt_lookup_num_tokens: int = 10  # HF prompt lookup: tokens proposed a step
    block_drafts: list[int] | None = None  # block drafters: how many of the block's B-1 drafts to verify, one row
    # each (null: 1, 2, 4, .., B-1). A verify of n tokens costs more than a step as n grows (the curve below), so
    # the best n is measured.
    verify_sizes: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64])  # tokens
    # per forward of the verify-cost curve
    verify_prefix: int = 256  # cached prefix length of the verify-cost curve
    verify_repeats: int = 5  # timings per point of the curve (the median is kept)
    device: str = "auto"  # auto = cuda if available, else cpu
    dtype: str = "auto"  # auto (bf16 where native: CUDA, AMX/AVX512-BF16) | float32 | bfloat16; HF generate runs
    # the same weights
    threads: int | None = None  # torch CPU threads (default: torch's)
    weights: str | None = None  # fp32 CPU targets: bf16 | int8 weights in the decode kernel (see drafthead eval)
    out: str | None = None  # bench.json path, or a directory to write bench.json into
    allow_target_mismatch: bool = False  # as in drafthead eval: the mismatch is then stated in bench.json
    progress: bool = True  # progress bars


def validate(cfg: BenchConfig) -> None:
    if cfg.dataset not in DATASETS:
        raise ValueError(f"unknown dataset {cfg.dataset!r}; valid: {', '.join(DATASETS)}")
    for name in ("max_prompts", "max_new_tokens", "ngram_n",
                 "prompt_lookup_num_tokens", "verify_prefix", "verify_repeats"):
        if getattr(cfg, name) <= 0:
            raise ValueError(f"{name} must be > 0, got {getattr(cfg, name)}")
    for name in ("num_speculative_tokens", "tree_nodes", "topk"):
        if getattr(cfg, name) is not None and getattr(cfg, name) <= 0:
            raise ValueError(f"{name} must be > 0, got {getattr(cfg, name)}")
    if not cfg.verify_sizes or min(cfg.verify_sizes) <= 0:
        raise ValueError(f"verify_sizes must be positive token counts, got {cfg.verify_sizes}")
    check_dtype(cfg.dtype)
    if cfg.draft and not (Path(cfg.draft) / "config.json").is_file():
        raise FileNotFoundError(f"draft={cfg.draft} is not a draft directory (no config.json)")
    if not cfg.draft and not cfg.target:
        raise ValueError("draft=none needs target=NAME_OR_PATH")


def block_sizes(cfg: BenchConfig, slots: int) -> list[int]:
    """Drafts verified per block, one bench row each: `block_drafts`, else 1, 2, 4, .. and all `slots`."""
    if cfg.block_drafts:
        bad = [n for n in cfg.block_drafts if not 1 <= n <= slots]
        if bad:
            raise ValueError(f"block_drafts {bad}: this draft's block has {slots} draft slots (1..{slots})")
        return sorted(set(cfg.block_drafts))
    return sorted({min(2 ** i, slots) for i in range(slots.bit_length() + 1)})


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------- methods
# each method: (prompt ids, max_new_tokens) -> (new tokens, verify rounds after prefill or None)

def runtime_method(generator: Any, spec: Any) -> Callable[[list[int], int], tuple[list[int], int | None]]:
    def run(prompt: list[int], max_new: int) -> tuple[list[int], int | None]:
        r = generator.generate([prompt], max_new, spec)[0]
        return list(r.tokens), r.num_rounds
    return run


def hf_method(model: Any, device: str, **gen_kw: Any) -> Callable[[list[int], int], tuple[list[int], int | None]]:
    """HF `generate` greedy; stops at the model's EOS like our runtime."""
    pad = model.generation_config.pad_token_id
    eos = model.generation_config.eos_token_id
    pad = pad if pad is not None else (eos[0] if isinstance(eos, list) else eos)

    @torch.no_grad()
    def run(prompt: list[int], max_new: int) -> tuple[list[int], int | None]:
        ids = torch.tensor([prompt], device=device)  # [1, T]
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                             pad_token_id=pad, **gen_kw)  # [1, T + n]
        return out[0, len(prompt):].tolist(), None
    return run


def time_methods(methods: dict[str, Callable], prompts: list[list[int]], max_new: int, device: str,
                 progress: bool) -> dict[str, dict]:
    """Every method on every prompt, the methods taking turns prompt by prompt (the order rotating), so a machine
    whose speed drifts between minutes (shared VMs did, by up to 2x) slows every method alike: timed one method
    after the other, the drift landed in the ratios between them."""
    names = list(methods)
    for name in names:
        methods[name](prompts[0], min(8, max_new))  # warm-up, untimed
    outputs: dict[str, list] = {n: [] for n in names}
    forwards = dict.fromkeys(names, 0)
    wall = dict.fromkeys(names, 0.0)
    counted = dict.fromkeys(names, True)
    for i, p in enumerate(tqdm(prompts, desc="methods taking turns", unit="prompt", disable=not progress,
                               leave=False, dynamic_ncols=True)):
        for name in names[i % len(names):] + names[: i % len(names)]:
            _sync(device)
            t0 = time.perf_counter()
            toks, fw = methods[name](p, max_new)
            _sync(device)
            wall[name] += time.perf_counter() - t0
            outputs[name].append(toks)
            counted[name] = counted[name] and fw is not None
            forwards[name] += fw or 0
    rows = {}
    for name in names:
        tokens = sum(len(o) for o in outputs[name])
        verified = sum(max(0, len(o) - 1) for o in outputs[name])  # the first token of each comes from prefill
        ok, w = counted[name], wall[name]
        rows[name] = {"generated_tokens": tokens, "time_s": w, "tokens_per_s": tokens / w if w > 0 else None,
                      "verify_rounds": forwards[name] if ok else None,
                      "acceptance_length": verified / forwards[name] if ok and forwards[name] else None,
                      "outputs": outputs[name]}
    return rows


def _turn_times(calls: list[tuple[Callable[[], None], Callable[[], None]]], repeats: int, device: str
                ) -> list[list[float]]:
    """Wall times (s) of each (call, undo) pair over `repeats` rounds. The calls take turns (one of each per round,
    the first round a warm-up), so a machine whose speed drifts between minutes (shared VMs did, by 2x) slows
    every call alike and the ratios between them stay fair."""
    times: list[list[float]] = [[] for _ in calls]
    for rep in range(repeats + 1):
        for i, (call, undo) in enumerate(calls):
            _sync(device)
            t0 = time.perf_counter()
            call()
            _sync(device)
            if rep:
                times[i].append(time.perf_counter() - t0)
            undo()
    return times


def _median_ms(calls: list[tuple[Callable[[], None], Callable[[], None]]], repeats: int, device: str
               ) -> list[float]:
    """Median wall time of each (call, undo) pair in ms, the calls taking turns (`_turn_times`)."""
    return [1000 * statistics.median(t) for t in _turn_times(calls, repeats, device)]


def _relative(rows: list[dict]) -> list[dict]:
    for r in rows:
        r["relative_to_first"] = r["ms"] / rows[0]["ms"]
    return rows


@torch.no_grad()
def verify_cost_curve(target_model: Any, prefix: list[int], sizes: list[int], repeats: int, device: str,
                      read_mib: int = 0) -> tuple[list[dict], dict | None]:
    """Median time of one verify forward of n tokens on a cached prefix, in our runtime's target forward.

    The n tokens are written at slots P..P+n-1 each time and the length stays P, so every call sees the
    same prefix and nothing needs rolling back.
    read_mib > 0: a sum over a `read_mib` MiB tensor takes its turn in every round too, and the second value is the
    read bandwidth it measured (median and range, bytes/s). The bound then divides by a bandwidth read in the same
    minutes as the forwards it is compared with: on a shared VM a reading taken apart from them can move by half
    while the forward holds still. An untimed forward follows each sum: the sum evicts the KV cache and the small
    tensors that a forward (its weights prefetched non-temporally) leaves cached, and in decoding a forward
    follows a forward, never such a read (a forward timed straight after the sum reads ~10% slow). Figures:
    docs/experiment_log.md, "Figures behind code choices".
    """
    cache = target_model.new_cache(1, len(prefix) + max(sizes))
    lens = torch.zeros(1, dtype=torch.long, device=device)
    target_model.forward(cache, torch.tensor([prefix], device=device), lens, logits_at=lens, prefill=True)
    lens = lens + len(prefix)
    def forward(n: int) -> Callable[[], None]:
        new = torch.tensor([[prefix[i % len(prefix)] for i in range(n)]], device=device)  # [1, n]
        return lambda: target_model.forward(cache, new, lens)

    calls = [(forward(n), lambda: None) for n in sizes]
    if read_mib:
        x = read_buffer(read_mib, device)  # more than any last-level cache here
        calls.append((lambda: x.sum(), forward(sizes[0])))  # undo: the untimed forward that settles the caches
    times = _turn_times(calls, repeats, device)
    curve = _relative([{"num_tokens": n, "ms": 1000 * statistics.median(t)} for n, t in zip(sizes, times)])
    if not read_mib:
        return curve, None
    rates = [x.numel() * 4 / t for t in times[-1]]
    return curve, {"median": statistics.median(rates), "min": min(rates), "max": max(rates), "readings": len(rates),
                   "mib": read_mib}


@torch.no_grad()
def hf_verify_cost_curve(model: Any, prefix: list[int], sizes: list[int], repeats: int, device: str) -> list[dict]:
    """The same curve through HF `model(...)` with its DynamicCache (cropped back after each call)."""
    import inspect
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"  # HF 5.x
    ids = torch.tensor([prefix], device=device)  # [1, P]
    cache = getattr(model(input_ids=ids, use_cache=True), cache_kw)
    if cache.get_seq_length() != len(prefix):
        raise RuntimeError(f"verify-cost curve: the cache holds {cache.get_seq_length()} of {len(prefix)} tokens")
    def forward(n: int) -> tuple[Callable[[], None], Callable[[], None]]:
        new = torch.tensor([[prefix[i % len(prefix)] for i in range(n)]], device=device)  # [1, n]
        return (lambda: model(input_ids=new, use_cache=True, **{cache_kw: cache}),
                lambda: cache.crop(-n))  # crop: drop the n appended entries

    ms = _median_ms([forward(n) for n in sizes], repeats, device)
    return _relative([{"num_tokens": n, "ms": t} for n, t in zip(sizes, ms)])


def read_buffer(mib: int, device: str) -> torch.Tensor:
    """`mib` MiB of fp32 ones to sum for the read bandwidth. On CPU it lies on the pages the decode kernels' packed
    weights get (2 MB where transparent huge pages are on, `hugepages.HugePages`), so the bound reads memory as the
    weights are read: on the AVX512-BF16 EPYC a sum over 4 KB pages read 40 GB/s and one over 2 MB pages 59 GB/s
    (20 alternating rounds, docs/experiment_log.md)."""
    if device != "cpu":
        return torch.ones(mib << 18, device=device)
    from drafthead.kernels import hugepages
    return hugepages.HugePages(chunk=0).empty((mib << 18,), torch.float32).fill_(1)


def read_bandwidth(device: str, mib: int = 512, repeats: int = 5) -> float:
    """Measured memory read rate in bytes/s: the best of `repeats` sums over a `mib` MiB fp32 tensor (larger
    than any last-level cache here, so it streams from memory; `read_buffer`)."""
    x = read_buffer(mib, device)
    best = float("inf")
    for _ in range(repeats + 1):
        _sync(device)
        t0 = time.perf_counter()
        x.sum()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best


def bandwidth_bound(tm: Any, device: str, read: dict | None = None) -> dict:
    """The least time a 1-token forward can take: projection bytes streamed / read bandwidth. read: the
    bandwidth readings `verify_cost_curve` took in turn with the forwards (their median is used); without them,
    the best of 5 reads made now."""
    nbytes = tm.streamed_bytes()
    if read is None:
        bw, how, spread = read_bandwidth(device), "best of 5 sums over 512 MiB", None
    else:
        bw, how = read["median"], (f"median of {read['readings']} sums over {read['mib']} MiB taking turns with the "
                                   f"forwards")
        spread = [read["min"] / 1e9, read["max"] / 1e9]
    pages = None
    if device == "cpu":
        from drafthead.kernels import hugepages
        pages = hugepages.pages()
        how += f" on {pages}"
    # the weights as the kernel streams them: the fp32 kernel's storage (fp32, bf16, int8), else the model's dtype
    weights = tm.weights if tm.kernel == "fp32" else str(tm.dtype).removeprefix("torch.")
    return {"kernel": tm.kernel, "weights": weights, "weight_bytes": nbytes, "read_gb_per_s": bw / 1e9,
            "read_gb_per_s_range": spread, "read": how, "pages": pages,
            "bound_ms": 1000 * nbytes / bw}


def compute_rate(tm: Any, device: str) -> dict | None:
    """The compute side of the roofline: the decode kernel's multiply-add rate from registers on this machine's
    threads, and the multiply-adds a token takes. None where no CPU decode kernel runs (oneDNN, GPU)."""
    from drafthead.kernels import cpu_linear, extension
    if device != "cpu" or not tm.kernel:
        return None
    # AMX tiles multiply far faster than any rate measured here from registers: the bandwidth side alone bounds them
    amx = tm.kernel == "bf16" and extension.amx()
    rate = None if amx else cpu_linear.peak_macs(tm.kernel) / 1e9
    return {"kernel": tm.kernel, "macs_per_token": tm.multiply_adds(), "peak_gmacs_per_s": rate,
            "threads": torch.get_num_threads()}


def roofline(curve: list[dict], bound: dict, compute: dict | None) -> None:
    """Adds to each verify-cost row its roofline: max(bytes streamed / read bandwidth, n x multiply-adds a token /
    the kernel's measured rate), the ratio to it, and the kernel's tile path at n rows."""
    from drafthead.kernels import cpu_linear
    for row in curve:
        row["bandwidth_ms"] = bound["bound_ms"]
        if compute is None:
            continue
        n = row["num_tokens"]
        rate = compute["peak_gmacs_per_s"]
        row["compute_ms"] = 1000 * n * compute["macs_per_token"] / (rate * 1e9) if rate else None
        row["roofline_ms"] = max(row["bandwidth_ms"], row["compute_ms"] or 0.0)
        row["x_roofline"] = row["ms"] / row["roofline_ms"]
        row["tile_path"] = cpu_linear.tile_path(compute["kernel"], n)


# what each number of bench.json means (written into it, beside the numbers)
DEFINITIONS = {
    "tokens_per_s": "generated tokens / wall time of the per-prompt generate calls (prefill "
                    "included, one warm-up call excluded), batch size 1, greedy; the methods "
                    "take turns prompt by prompt",
    "acceptance_length": "tokens from verify rounds (all but the prefill's first) / verify rounds "
                         "(our runtime only; AR = 1)",
    "outputs_equal_our_ar": "prompts whose output equals our AR output token for token",
    "verify_cost": "median wall time of one target forward (our runtime's, as in a verify round) "
                   "of num_tokens new tokens appended to a cached prefix of verify_prefix tokens; "
                   "the sizes take turns, one forward of each per round",
    "verify_cost_hf": "the same through HF model(...) with a DynamicCache",
    "bandwidth_bound": "bytes of projection weights one generated token streams / measured read "
                       "bandwidth (the median of sums over a 512 MiB tensor, one in each round "
                       "of the verify_cost forwards): the least a 1-token forward can cost when "
                       "weights come from memory",
    "compute_rate": "multiply-adds a second that the decode kernel's multiply instruction sustains "
                    "from registers on every thread (measured here), and the multiply-adds one token "
                    "takes in the projections and head",
    "roofline_ms": "max(bandwidth bound, num_tokens x multiply-adds a token / that rate): the least "
                   "a forward of num_tokens can cost; x_roofline = ms / roofline_ms"}


def bench_methods(cfg: BenchConfig, target: Any, drafter: Any, generator: Any, device: str
                  ) -> dict[str, Callable | str]:
    """The rows bench times, name -> a generate function, or why the row is skipped: our AR, HF generate and its
    prompt lookup, our n-gram, and each mode the draft drafts (chain, chain + n-gram, tree, block at each count)."""
    from drafthead.runtime import SpecConfig

    given = {"num_speculative_tokens": cfg.num_speculative_tokens, "tree_nodes": cfg.tree_nodes, "topk": cfg.topk}
    base = dict(temperature=0.0, **runtime_settings("chain", given, cfg.draft)[0], ngram_n=cfg.ngram_n, batch_size=1)
    shape = runtime_settings("tree", given, cfg.draft)[0]  # the tree row: the shape the trainer chose, if it did
    k = base["num_speculative_tokens"]
    methods: dict[str, Callable | str] = {
        "ar (ours)": runtime_method(generator, SpecConfig(mode="ar", **base)),
        "hf generate greedy": hf_method(target.model, device),
        f"hf prompt lookup ({cfg.prompt_lookup_num_tokens})": hf_method(
            target.model, device, prompt_lookup_num_tokens=cfg.prompt_lookup_num_tokens),
        f"ngram n={cfg.ngram_n} k={k} (ours)": runtime_method(
            generator, SpecConfig(mode="ngram", **base)),
    }
    chain = f"draft chain k={k} (ours)"
    tree = f"draft tree depth={shape['num_speculative_tokens']} topk={shape['topk']} nodes={shape['tree_nodes']} (ours)"
    modes = drafter.draft_modes if drafter is not None else ()
    why = "skipped: draft=none" if drafter is None else f"skipped: a {drafter.family} draft drafts {', '.join(modes)}"
    methods[chain] = runtime_method(generator, SpecConfig(mode="chain", **base)) if "chain" in modes else why
    methods[chain + " + ngram"] = (runtime_method(generator, SpecConfig(mode="chain", ngram=True, **base))
                                   if "chain" in modes else why)
    methods[tree] = runtime_method(generator, SpecConfig(mode="tree", **{**base, **shape})) if "tree" in modes else why
    if "block" in modes:
        for n in block_sizes(cfg, drafter.config.num_draft_tokens):
            methods[f"draft block k={n} (ours)"] = runtime_method(
                generator, SpecConfig(mode="block", **{**base, "num_speculative_tokens": n}))
    return methods


def run_bench(cfg: BenchConfig, target: Any = None, drafter: Any = None, generator: Any = None) -> dict:
    from drafthead.runtime import SpeculativeGenerator, TargetModel

    validate(cfg)
    samples = load_eval_dataset(cfg.dataset, cfg.max_prompts, cfg.draft, cfg.heldout)
    device = resolve_device(cfg.device)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    target_check = "not checked: the caller passed the target object" if target is not None else None
    if target is None:
        target, drafter, target_check = load_models(cfg.draft, cfg.target, cfg.gguf_file, device, cfg.dtype,
                                                    cfg.allow_target_mismatch)
        target_check = target_check or ("same target as the draft's (fingerprint)" if drafter is not None else None)
    generator = generator or SpeculativeGenerator(target, drafter, device=device, weights=cfg.weights)
    tok = target.tokenizer
    prompts = [chat_prompt(tok, [{"role": "user", "content": s.turns[0]}]) for s in samples]

    methods = bench_methods(cfg, target, drafter, generator, device)

    timed = time_methods({n: r for n, r in methods.items() if not isinstance(r, str)}, prompts, cfg.max_new_tokens,
                         device, cfg.progress)
    rows = {n: timed[n] if n in timed else {"skipped": r} for n, r in methods.items()}
    ar = rows["ar (ours)"]
    hf = rows["hf generate greedy"]
    for name, r in rows.items():
        if "skipped" in r:
            continue
        r["vs_our_ar"] = r["tokens_per_s"] / ar["tokens_per_s"] if r["tokens_per_s"] and ar["tokens_per_s"] else None
        r["vs_hf_generate"] = (r["tokens_per_s"] / hf["tokens_per_s"]
                               if r["tokens_per_s"] and hf["tokens_per_s"] else None)
        r["outputs_equal_our_ar"] = sum(o == a for o, a in zip(r["outputs"], ar["outputs"]))
    prefix = [t for p in prompts for t in p]
    prefix = (prefix * (cfg.verify_prefix // max(1, len(prefix)) + 1))[: cfg.verify_prefix]
    sizes = list(cfg.verify_sizes)
    tm = generator.model if isinstance(generator.model, TargetModel) else TargetModel(target.model)
    curve, read = verify_cost_curve(tm, prefix, sizes, cfg.verify_repeats, device, read_mib=512)
    bound = bandwidth_bound(tm, device, read)
    compute = compute_rate(tm, device)
    roofline(curve, bound, compute)
    hf_curve = hf_verify_cost_curve(target.model, prefix, sizes, cfg.verify_repeats, device)
    from drafthead.kernels import probe

    result = {"settings": {**dataclasses.asdict(cfg), "target": getattr(target, "name_or_path", None),
                           "weights_dtype": str(target.model.dtype).removeprefix("torch."),
                           "num_prompts": len(prompts), "machine": machine_info(device),
                           "runtime_paths": tm.paths(),
                           "target_check": target_check},
              "methods": {n: {k: v for k, v in r.items() if k != "outputs"} for n, r in rows.items()},
              "verify_cost": curve,
              "bandwidth_bound": bound,
              "compute_rate": compute,
              "kernel_probe": (probe.report() if tm.kernel == "bf16" else
                               probe.fp32_report(tm.weights) if tm.kernel == "fp32" else None),
              "verify_cost_hf": hf_curve,
              "definitions": DEFINITIONS}
    print(format_table(result))
    if cfg.out:
        out = Path(cfg.out)
        out = out if out.suffix == ".json" else out / "bench.json"
        atomic_write_json(out, result)
        print(f"wrote {out}")
    return result


def format_table(result: dict) -> str:
    f = lambda x, nd=2: "n/a" if x is None else f"{x:.{nd}f}"  # noqa: E731
    n = result["settings"]["num_prompts"]
    lines = [f"decoding speed: {n} prompts of {result['settings']['dataset']}, max_new_tokens "
             f"{result['settings']['max_new_tokens']}, {result['settings']['machine']['device']}, "
             f"{result['settings']['machine']['torch_threads']} threads",
             f"{'method':<40} {'tok/s':>8} {'vs AR':>7} {'vs HF':>7} {'tau':>6} {'=AR':>6}"]
    for name, r in result["methods"].items():
        if "skipped" in r:
            lines.append(f"{name:<40} {r['skipped']}")
            continue
        lines.append(f"{name:<40} {f(r['tokens_per_s'], 1):>8} {f(r['vs_our_ar']):>7} {f(r['vs_hf_generate']):>7} "
                     f"{f(r['acceptance_length']):>6} {r['outputs_equal_our_ar']:>3}/{n:<2}")
    bd = result.get("bandwidth_bound")
    if bd:
        line = (f"CPU class {result['settings']['machine'].get('cpu_class')}, decode kernel "
                f"{bd['kernel'] or 'none (oneDNN)'}, weights {bd['weights']}: {bd['weight_bytes'] / 1e6:.0f} MB "
                f"streamed per token, read bandwidth {bd['read_gb_per_s']:.1f} GB/s"
                + (f" on {bd['pages']}" if bd.get("pages") else "")
                + (" (readings {:.1f}-{:.1f})".format(*bd["read_gb_per_s_range"]) if bd.get("read_gb_per_s_range")
                   else "")
                + f" -> bound {bd['bound_ms']:.1f} ms")
        one = next((c for c in result["verify_cost"] if c["num_tokens"] == 1), None)
        if one:
            line += f"; 1-token forward {one['ms']:.1f} ms = {one['ms'] / bd['bound_ms']:.2f}x the bound"
        lines.append(line)
    lines.append(f"target verify cost: one forward of n tokens on a cached prefix of "
                 f"{result['settings']['verify_prefix']} tokens")
    kp = result.get("kernel_probe")
    if kp:
        lines.append(f"kernel probe ({kp['cpu_class']}, {kp['threads']} threads, {kp['seconds']} s once): "
                     f"{kp['name']}; ms per pass by rows, chosen / fastest / built-in: "
                     + ", ".join(f"{r}: {v['chosen_ms']:.1f} / {v['fastest_ms']:.1f} ({v['fastest']}) / "
                                 f"{f(v['built_in_ms'], 1)}" for r, v in kp["rows"].items()))
    cr = result.get("compute_rate")
    if cr and cr["peak_gmacs_per_s"] is None:
        lines.append(f"compute: {cr['macs_per_token'] / 1e6:.0f}M multiply-adds a token on AMX tiles; roofline = "
                     f"bandwidth ms")
    elif cr:
        lines.append(f"compute: {cr['macs_per_token'] / 1e6:.0f}M multiply-adds a token, {cr['kernel']} kernel's "
                     f"instruction at {cr['peak_gmacs_per_s']:.0f} GMAC/s on {cr['threads']} threads; roofline = "
                     f"max(bandwidth ms, compute ms)")
    lines.append(f"{'n':>4} {'ours ms':>9} {'x n=1':>6} {'HF ms':>9} {'x n=1':>6} {'bw ms':>7} {'mac ms':>7} "
                 f"{'x roof':>6}  tile path")
    for c, h in zip(result["verify_cost"], result["verify_cost_hf"]):
        lines.append(f"{c['num_tokens']:>4} {c['ms']:>9.2f} {c['relative_to_first']:>6.2f} {h['ms']:>9.2f} "
                     f"{h['relative_to_first']:>6.2f} {f(c.get('bandwidth_ms')):>7} {f(c.get('compute_ms')):>7} "
                     f"{f(c.get('x_roofline')):>6}  {c.get('tile_path', '')}")
    return "\n".join(lines)


def help_text(argv: list[str]) -> str:
    return options.help_text("drafthead bench key=value ...", __doc__, BenchConfig())


def main(argv: list[str]) -> int:
    run_bench(options.parse(BenchConfig, argv))
    return 0

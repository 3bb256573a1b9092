"""Time the Triton verify kernels against their PyTorch references (and check they agree) on one GPU.

    python scripts/bench_kernels.py                 # full grid, ~1-2 min on an H200
    python scripts/bench_kernels.py --quick         # small grid (used by the gpu-marked test)
    python scripts/bench_kernels.py --out bench.json
    python scripts/bench_kernels.py --cpu           # references only, on CPU, small sizes
    TRITON_INTERPRET=1 python scripts/bench_kernels.py --cpu   # + kernels in the interpreter (slow; a dry run)

Each case first checks the kernel against the reference (exact for masks, greedy walks and K/V moves; for
rejection sampling the accept decisions must match exactly and next_token must be a valid inverse-CDF draw of
the reference's final distribution, since float32 cumsums over 150k entries round differently), then reports
the median time over repeated calls (CUDA events). Exit code 1 if any check fails.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from drafthead import hardware  # noqa: E402
from drafthead.kernels import reference as ref  # noqa: E402
from drafthead.kernels import verify  # noqa: E402


# ------------------------------------------------------------------------------------------------ timing
def median_ms(fn: Callable[[], object], device: torch.device, budget_s: float = 0.2, max_reps: int = 30) -> float:
    """Median wall time of fn in ms: a few warmup calls, then up to max_reps timed calls within ~budget_s."""
    for _ in range(2):
        fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_reps and (len(times) < 3 or time.perf_counter() - start < budget_s):
        if device.type == "cuda":
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record()
            fn()
            t1.record()
            t1.synchronize()
            times.append(t0.elapsed_time(t1))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


# ------------------------------------------------------------------------------------------------ inputs
def random_tree(B: int, N: int, V: int, device: torch.device, g: torch.Generator):
    """EAGLE-like trees: each node hangs below one of the 4 nodes before it (bushy near the root, deep later)."""
    idx = torch.arange(N, device=device)
    low = (idx - 4).clamp_min(0)
    parents = (low + (torch.rand(B, N, generator=g, device=device) * (idx - low)).long()).clamp_max(idx - 1)
    parents[:, 0] = -1
    tokens = torch.randint(0, V, (B, N), generator=g, device=device)
    num_nodes = torch.full((B,), N, dtype=torch.long, device=device)
    num_nodes[: B // 4] = max(1, N // 2)  # a quarter of the batch uses padding slots
    return tokens, parents, num_nodes


def peaked_probs(B: int, N: int, V: int, parents, tokens, device, g: torch.Generator) -> torch.Tensor:
    """softmax(noise) with a boost on each node's child tokens (a lone child gets p ~ 0.6), so both accepts
    and rejects happen at any vocab size."""
    logits = torch.randn(B, N, V, generator=g, device=device)
    rows = torch.arange(B, device=device)[:, None].expand(B, N - 1)
    boost = torch.tensor(math.log(V) + 1.0, device=device)
    logits.index_put_((rows, parents[:, 1:].clamp_min(0), tokens[:, 1:]), boost, accumulate=True)
    return torch.softmax(logits, dim=-1)


# ------------------------------------------------------------------------------------------------ checks
def same(got, want) -> str:
    for i, (a, b) in enumerate(zip(got, want)):
        if not torch.equal(a, b):
            return f"FAIL output {i}: {(a != b).sum().item()} entries differ"
    return "ok"


def check_sample(got, walk, bonus_uniforms) -> str:
    """got = kernel (accept_len, path, next_token); walk = reference (accept_len, path, final p)."""
    if not torch.equal(got[0], walk[0]) or not torch.equal(got[1], walk[1]):
        return f"FAIL accept decisions: {(got[0] != walk[0]).sum().item()} rows differ"
    p = walk[2].double()
    cdf = p.cumsum(-1)
    threshold = bonus_uniforms.double() * cdf[:, -1]
    t = got[2]
    rows = torch.arange(p.shape[0], device=p.device)
    if ((t < 0) | (t >= p.shape[1])).any():
        return "FAIL next_token out of range"
    tol = 5e-6 * cdf[:, -1]  # float32 scan rounding; a neighbouring token is ~1/V away
    above = cdf[rows, t] >= threshold - tol  # t's cdf reaches the threshold ...
    below = torch.where(t > 0, cdf[rows, (t - 1).clamp_min(0)], 0.0) <= threshold + tol  # ... its predecessor not
    if not (above & below & (p[rows, t] > 0)).all():
        return f"FAIL next_token not a draw of the final distribution in {(~(above & below)).sum().item()} rows"
    exact = (got[2] == ref.sample_inverse_cdf(walk[2], bonus_uniforms)).float().mean().item()
    return "ok" if exact == 1.0 else f"ok ({exact:.0%} same token)"


# ------------------------------------------------------------------------------------------------ cases
def cases(quick: bool, cpu: bool):
    """(kernel name, params) grid."""
    if cpu:
        batches, nodes, vocabs = (1, 4), (8,), (1000,)
    elif quick:
        batches, nodes, vocabs = (1, 8), (8, 32), (32000,)
    else:
        batches, nodes, vocabs = (1, 8, 64), (8, 64), (32000, 152064)
    for B in batches:
        for N in nodes:
            yield "tree_mask", dict(B=B, N=N)
            yield "greedy_tree", dict(B=B, N=N)
            for V in vocabs:
                yield "rejection_tree", dict(B=B, N=N, V=V, draft_probs=False)
        for V in vocabs:
            yield "rejection_tree", dict(B=B, N=nodes[0], V=V, draft_probs=True)
            for draft_probs in (False, True):
                yield "rejection_chain", dict(B=B, K=7, V=V, draft_probs=draft_probs)
        yield "greedy_chain", dict(B=B, K=7)
        for L in (8, 64) if not cpu else (8,):
            yield "kv_compact", dict(B=B, H=8, S=512 if cpu else 4096, D=128, L=L)
    if quick and not cpu:
        yield "rejection_tree", dict(B=8, N=16, V=152064, draft_probs=True)


def build(name: str, prm: dict, device: torch.device, g: torch.Generator):
    """(kernel call, reference call, check) for one case."""
    if name == "tree_mask":
        _, parents, num_nodes = random_tree(prm["B"], prm["N"], 2, device, g)
        kernel = lambda: verify.build_tree_mask(parents, num_nodes, backend="triton", check=False)  # noqa: E731
        reference = lambda: ref.build_tree_mask(parents, num_nodes)  # noqa: E731
        return kernel, reference, lambda: same(kernel(), reference())
    if name == "greedy_tree":
        B, N = prm["B"], prm["N"]
        tokens, parents, num_nodes = random_tree(B, N, 4, device, g)  # 4 tokens: many matches
        am = torch.randint(0, 4, (B, N), generator=g, device=device)
        kernel = lambda: verify.greedy_verify_tree(tokens, parents, num_nodes, am,  # noqa: E731
                                                   backend="triton", check=False)
        reference = lambda: ref.greedy_verify_tree(tokens, parents, num_nodes, am)  # noqa: E731
        return kernel, reference, lambda: same(kernel(), reference())
    if name == "greedy_chain":
        B, K = prm["B"], prm["K"]
        draft = torch.randint(0, 2, (B, K), generator=g, device=device)
        am = torch.randint(0, 2, (B, K + 1), generator=g, device=device)
        kernel = lambda: verify.greedy_verify_chain(draft, am, backend="triton", check=False)  # noqa: E731
        reference = lambda: ref.greedy_verify_chain(draft, am)  # noqa: E731
        return kernel, reference, lambda: same(kernel(), reference())
    if name == "rejection_tree":
        B, N, V = prm["B"], prm["N"], prm["V"]
        tokens, parents, num_nodes = random_tree(B, N, V, device, g)
        target = peaked_probs(B, N, V, parents, tokens, device, g)
        draft = torch.softmax(torch.randn(B, N, V, generator=g, device=device), -1) if prm["draft_probs"] else None
        u, bu = torch.rand(B, N, generator=g, device=device), torch.rand(B, generator=g, device=device)
        args = (tokens, parents, num_nodes, target, draft, u, bu)
        kernel = lambda: verify.rejection_sample_tree(*args, backend="triton", check=False)  # noqa: E731
        reference = lambda: ref.rejection_sample_tree(*args)  # noqa: E731
        return kernel, reference, lambda: check_sample(kernel(), ref.rejection_walk_tree(*args[:-1]), bu)
    if name == "rejection_chain":
        B, K, V = prm["B"], prm["K"], prm["V"]
        tokens, parents, _ = random_tree(B, K + 1, V, device, g)
        parents, num_nodes = verify.chain_tree(B, K, device)
        target = peaked_probs(B, K + 1, V, parents, tokens, device, g)
        draft = torch.softmax(torch.randn(B, K, V, generator=g, device=device), -1) if prm["draft_probs"] else None
        u, bu = torch.rand(B, K, generator=g, device=device), torch.rand(B, generator=g, device=device)
        args = (tokens[:, 1:], draft, target, u, bu)
        kernel = lambda: verify.rejection_sample_chain(*args, backend="triton", check=False)  # noqa: E731
        reference = lambda: ref.rejection_sample_chain(*args)  # noqa: E731

        def check() -> str:
            al, nt = kernel()
            pad = lambda t: torch.cat([torch.zeros_like(t[:, :1]), t], 1)  # noqa: E731 - root row
            walk = ref.rejection_walk_tree(tokens, parents, num_nodes, target,
                                           None if draft is None else pad(draft), pad(u))
            return check_sample((al, walk[1], nt), walk, bu)

        return kernel, reference, check
    if name == "kv_compact":
        B, H, S, D, L = prm["B"], prm["H"], prm["S"], prm["D"], prm["L"]
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        cache = torch.randn(B, H, S, D, generator=g, device=device).to(dtype)
        dst = torch.full((B,), S - 2 * L, dtype=torch.long, device=device)  # prefix, then a 2L-slot tree
        picked = torch.rand(B, 2 * L, generator=g, device=device).argsort(-1)[:, :L]  # the path's slots in the tree
        src = dst[:, None] + picked.sort(-1).values
        lengths = torch.randint(1, L + 1, (B,), generator=g, device=device)
        kernel = lambda: verify.kv_compact(cache, src, lengths, dst, backend="triton", check=False)  # noqa: E731
        reference = lambda: ref.kv_compact(cache, src, lengths, dst)  # noqa: E731

        def check() -> str:
            fresh = torch.randn(B, H, S, D, generator=g, device=device).to(dtype)
            want = ref.kv_compact(fresh.clone(), src, lengths, dst)
            return same([verify.kv_compact(fresh, src, lengths, dst, backend="triton")], [want])

        return kernel, reference, check
    raise KeyError(name)


# ------------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    ap.add_argument("--quick", action="store_true", help="small grid (a correctness smoke test)")
    ap.add_argument("--cpu", action="store_true",
                    help="run on CPU: references only (kernels too under TRITON_INTERPRET=1)")
    args = ap.parse_args(argv)

    if args.cpu:
        device = torch.device("cpu")
        torch.set_num_threads(1)
        with_kernels = os.environ.get("TRITON_INTERPRET") == "1"
    elif torch.cuda.is_available():
        device, with_kernels = torch.device("cuda"), True
    else:
        print("bench_kernels: a CUDA GPU is needed to time the Triton kernels (use --cpu to time the references).")
        return 0

    g = torch.Generator(device=device).manual_seed(0)  # inputs are made on the device (150k-vocab probs are GBs)
    rows, failed = [], 0
    header = f"{'kernel':<16} {'shape':<34} {'triton ms':>10} {'torch ms':>10} {'speedup':>8}  check"
    print(f"device: {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, "
          f"CPU class {hardware.cpu_class()} (capability {hardware.cpu_capability()})\n{header}\n{'-' * len(header)}")
    t_start = time.perf_counter()
    for name, prm in cases(args.quick, args.cpu):
        kernel, reference, check = build(name, prm, device, g)
        status, t_kernel = "-", None
        if with_kernels:
            status = check()
            failed += status.startswith("FAIL")
            t_kernel = median_ms(kernel, device)
        t_ref = median_ms(reference, device)
        shape = " ".join(f"{k}={v}" for k, v in prm.items())
        speed = f"{t_ref / t_kernel:7.1f}x" if t_kernel else "       -"
        kernel_col = f"{t_kernel:10.3f}" if t_kernel is not None else f"{'-':>10}"
        print(f"{name:<16} {shape:<34} {kernel_col} {t_ref:10.3f} {speed}  {status}", flush=True)
        rows.append(dict(kernel=name, **prm, triton_ms=t_kernel, torch_ms=t_ref, check=status))
        del kernel, reference, check
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"total {time.perf_counter() - t_start:.1f} s, {failed} check(s) failed")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = dict(device=str(device), gpu=torch.cuda.get_device_name() if device.type == "cuda" else None,
                    torch=torch.__version__)
        args.out.write_text(json.dumps(dict(meta=meta, results=rows), indent=1))
        print(f"wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

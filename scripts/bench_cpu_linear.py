"""The CPU decode kernels alone: one pass over a model's projections at 1..64 rows, against the roofline.

    python scripts/bench_cpu_linear.py                          # SmolLM2-135M's 30 layers of projections
    python scripts/bench_cpu_linear.py rows=[1,8] layers=30 repeats=7 threads=2
    python scripts/bench_cpu_linear.py only=bf16 prefetch=built_in     # the bf16 kernel before the probe

Why: `drafthead bench` times whole forwards, where attention and Python overhead hide what the projections
cost. Here random weights of SmolLM2's shapes (q, k, v, o, gate, up, down per layer; ~530 MB in fp32, far
past the caches) go through each kernel the runtime can pick (the fp32 AVX2 kernel with fp32 / bf16 / int8
weights, the bf16 kernel on each tile path the CPU has, AVX512-BF16 and AMX, with the prefetch setting
`kernels/probe.py` chose here) and through oneDNN (`F.linear`) for fp32, at each row
count. Prints ms per pass, the weight bytes streamed per ms (GB/s), the cost relative to 1 row, the bandwidth bound
(bytes / the measured read bandwidth) and the roofline: max(that bound, rows x weights / the multiply-add rate the
kernel's instruction sustains from registers here, `cpu_linear.peak_macs`); oneDNN gets the bandwidth side only.
"""
from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from drafthead import hardware, options
from drafthead.eval.bench import read_bandwidth
from drafthead.kernels import cpu_linear, extension, hugepages, probe

USAGE = "python scripts/bench_cpu_linear.py [key=value ...]"


@dataclass
class Config:
    rows: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 12, 16, 24, 32, 48, 64])  # rows of x per call
    layers: int = 30  # decoder layers of projections a pass streams
    hidden: int = 576  # the model's width (SmolLM2-135M's by default)
    kv: int = 192  # width of the k and v projections
    ffn: int = 1536  # width of the gate and up projections
    repeats: int = 7  # timed passes per method and row count (the median is kept)
    threads: int | None = None  # torch threads (null: torch's default)
    only: str = ""  # run only the methods whose name contains this text

    # how the bf16 kernel prefetches a target's weights: tuned (what kernels/probe.py chose on this machine, measured
    # now if not cached) or built_in (NTA 32 ahead)
    prefetch: str = "tuned"


def shapes(c) -> list[tuple[int, int]]:
    """(N, K) of one layer's projections, in the order a forward runs them."""
    H, KV, F_ = c.hidden, c.kv, c.ffn
    return [(H, H), (KV, H), (KV, H), (H, H), (F_, H), (F_, H), (H, F_)]


def timed(fn, repeats: int) -> float:
    fn()  # warm: pages touched, extension loaded
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def main(argv: list[str]) -> int:
    c = options.script_options(Config, argv, USAGE, __doc__)
    if c is None:
        return 0
    if c.prefetch not in ("tuned", "built_in"):
        raise SystemExit(f"bench_cpu_linear: prefetch is tuned or built_in, got {c.prefetch!r}")
    if c.threads:
        torch.set_num_threads(int(c.threads))
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=g) * k ** -0.5 for _ in range(c.layers) for n, k in shapes(c)]
    bw = read_bandwidth("cpu") / 1e9  # GB/s
    pages = hugepages.HugePages()  # packed weights on the pages the runtime gives them, and the bound reads
    print(f"CPU class {hardware.cpu_class()}, {torch.get_num_threads()} threads, read bandwidth {bw:.1f} GB/s on "
          f"{hugepages.pages()}, "
          f"{len(weights)} projections, {sum(w.numel() for w in weights) / 1e6:.1f}M weights")
    methods: dict[str, tuple[list, int]] = {}  # name -> (per-projection callables by rows, bytes per pass)
    peak = {k: cpu_linear.peak_macs(k) / 1e9 for k in extension.KINDS if extension.available(k)}  # GMAC/s
    print("multiply-add rate from registers: " + ", ".join(f"{k} kernel {r:.0f} GMAC/s" for k, r in peak.items()))
    if extension.available("fp32"):
        for storage in ("fp32", "bf16", "int8"):
            packed = []
            for w in weights:
                stored, scale, _ = cpu_linear.compress(w, storage)
                packed.append((pages.put(cpu_linear.pack_fp32(stored)), scale, w.shape[0]))
            nbytes = sum(p.numel() * p.element_size() + (0 if s is None else s.numel() * 4) for p, s, _ in packed)
            methods[f"fp32 kernel, {storage} weights"] = (
                lambda x, packed=packed: [cpu_linear.linear_fp32(xk(x, w), p, n, s)
                                          for (p, s, n), w in zip(packed, weights)], nbytes)
    else:
        print(f"fp32 kernel skipped: {extension.unavailable_reason('fp32')}")
    if extension.available("bf16"):  # bf16 activations too: what the runtime runs for a bf16 target
        tuned = probe.tuned() if c.prefetch == "tuned" else probe.BUILT_IN
        print(f"bf16 kernel: a target's weights prefetched {tuned.hint.upper()} {tuned.ahead} k-pairs ahead "
              f"({c.prefetch}); the probe's path: {tuned.name()}")
        packed16 = [(pages.put(cpu_linear.pack(w.bfloat16())), w.shape[0]) for w in weights]

        def bf16_pass(x, path):
            with probe.use(probe.Setting(path, tuned.hint, tuned.ahead)):
                return [cpu_linear.linear(xk(x, w).bfloat16(), p, n, stream=True)  # as the runtime runs a target's
                        for (p, n), w in zip(packed16, weights)]
        for path in probe.cpu_paths():
            methods[f"{'AMX' if path == 'amx' else 'AVX512-BF16'} kernel, bf16"] = (
                lambda x, path=path: bf16_pass(x, path), sum(w.numel() * 2 for w in weights))
    else:
        print(f"AVX512-BF16 kernel skipped: {extension.unavailable_reason('bf16')}")
    methods["oneDNN F.linear, fp32"] = (lambda x: [F.linear(xk(x, w), w) for w in weights],
                                        sum(w.numel() * 4 for w in weights))
    methods = {k: v for k, v in methods.items() if c.only in k}
    macs = sum(w.numel() for w in weights)  # a row's multiply-adds
    print("\n| method | rows | ms | GB/s | vs 1 row | vs bound | compute ms | vs roofline |\n"
          "|---|---|---|---|---|---|---|---|")
    for name, (run, nbytes) in methods.items():
        bound = nbytes / bw / 1e6
        # AMX tiles multiply faster than any rate measured from registers here: bandwidth side only, as oneDNN
        rate = peak.get("bf16" if name.startswith("AVX512-BF16") else "fp32" if name.startswith("fp32") else "")
        base = None
        for m in c.rows:
            x = torch.randn(m, c.hidden, generator=g)
            ms = timed(lambda: run(x), c.repeats)
            base = base or ms
            compute = m * macs / rate / 1e6 if rate else None
            roof = f"{compute:.1f} | {ms / max(bound, compute):.2f}x" if compute else "n/a | n/a"
            print(f"| {name} | {m} | {ms:.1f} | {nbytes / ms / 1e6:.1f} | {ms / base:.2f}x | {ms / bound:.2f}x | "
                  f"{roof} |", flush=True)
    return 0


_inputs: dict[tuple[int, int], torch.Tensor] = {}


def xk(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x, or (for the down projection, which reads the FFN width) an input of w's K, made once per row count."""
    key = (x.shape[0], w.shape[1])
    if w.shape[1] == x.shape[1]:
        return x
    if key not in _inputs:
        _inputs[key] = torch.randn(key)
    return _inputs[key]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Where a decode step and a verify block spend their time, by phase, in our runtime's target forward.

    python scripts/profile_step.py                                  # SmolLM2, the run's dtype, weights as loaded
    python scripts/profile_step.py dtype=float32 weights=int8 rows=[1,8] prefix=256 repeats=20 top=15
    python scripts/profile_step.py fused=true                      # the layers as the runtime runs them

Runs one forward of `rows` new tokens on a cached prefix under torch.profiler and groups the operators into
phases: projections (the decode kernel or oneDNN), attention (the extension's or SDPA), norms, RoPE and
elementwise math, KV writes and masks, and the rest of the wall time (Python and dispatch overhead). Prints the
CPU class, the kernel, the bandwidth bound (`drafthead bench`'s) and milliseconds per phase, so the next thing
to trim is the biggest row after the projections; `top=N` also lists the N operators with the most self time.
The runtime runs a generated token's decoder layers in one call each (`packing.decode_layer`), where no phase
inside a layer can be seen; by default this script runs them op by op with the same kernels and ops (the same
bits) so the phases show, and `fused=true` times them as the runtime does, as one "decoder layers" phase.
The labels the extension's calls get cost a few microseconds each under the profiler: wall times here run
above `drafthead bench`'s, which times forwards without it.
"""
from __future__ import annotations

import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from drafthead import hardware, options
from drafthead.kernels import cpu_linear, packing
from drafthead.runtime import TargetModel
from drafthead.target import load_target
from drafthead.eval.bench import bandwidth_bound

USAGE = "python scripts/profile_step.py [key=value ...]"


@dataclass
class Config:
    target: str = "smollm2-135m-instruct"  # the target: a built-in name or a path
    dtype: str = "auto"  # the target's dtype (auto: bf16 where native, else fp32)
    weights: str | None = None  # weight storage of the decode kernel (null: as the runtime loads them; int8, bf16)
    rows: list[int] = field(default_factory=lambda: [1, 8])  # new tokens per profiled forward
    prefix: int = 256  # cached tokens before them
    repeats: int = 20  # profiled forwards per row count
    threads: int | None = None  # torch threads (null: torch's default)
    top: int = 0  # also list the N operators with the most self time
    fused: bool = False  # time the decoder layers as the runtime runs them (one call each)

# operator name (substring) -> phase; the first match wins
PHASES = [
    ("drafthead_cpu_linear", "projections"), ("aten::linear", "projections"), ("aten::addmm", "projections"),
    ("aten::mm", "projections"), ("aten::matmul", "projections"),
    ("scaled_dot_product", "attention"), ("drafthead_attention", "attention"), ("_flash_attention", "attention"),
    ("aten::bmm", "attention"),
    ("drafthead_rope", "rope, elementwise"), ("drafthead_silu_mul", "rope, elementwise"), ("rms_norm", "norms"),
    ("aten::pow", "norms"), ("aten::rsqrt", "norms"),
    ("aten::index_put", "kv writes, masks"), ("aten::copy_", "kv writes, masks"), ("aten::slice", "kv writes, masks"),
    ("aten::lt", "kv writes, masks"), ("aten::le", "kv writes, masks"), ("aten::ge", "kv writes, masks"),
    ("aten::__or__", "kv writes, masks"), ("aten::__and__", "kv writes, masks"), ("aten::bitwise", "kv writes, masks"),
    ("aten::arange", "kv writes, masks"), ("aten::cat", "rope, elementwise"), ("aten::mul", "rope, elementwise"),
    ("aten::add", "rope, elementwise"), ("aten::neg", "rope, elementwise"), ("aten::silu", "rope, elementwise"),
    ("aten::embedding", "embedding"), ("drafthead_decode_layer", "decoder layers (one call each)"),
]


def phase_of(name: str) -> str:
    return next((p for key, p in PHASES if key in name), "other ops")


def main(argv: list[str]) -> int:
    cfg = options.script_options(Config, argv, USAGE, __doc__)
    if cfg is None:
        return 0
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    # the kernels are pybind calls, not torch operators, so the profiler would count them as Python time:
    # label each call (only here; the runtime pays nothing for it)
    def labelled(fn, label: str):
        def call(*args):
            with torch.profiler.record_function(label):
                return fn(*args)
        return call

    packing.PackedLinear.forward = labelled(packing.PackedLinear.forward, "drafthead_cpu_linear")
    for name, label in (("attention_fp32", "drafthead_attention"), ("rms_norm", "drafthead_rms_norm"),
                        ("rope", "drafthead_rope"), ("silu_mul", "drafthead_silu_mul")):
        setattr(cpu_linear, name, labelled(getattr(cpu_linear, name), label))
    target = load_target(cfg.target, dtype=cfg.dtype)
    tm = TargetModel(target.model, weights=cfg.weights)
    tm.fused = tm.fused and bool(cfg.fused)
    if tm.fused:  # a pybind object's method cannot be wrapped in place: wrap the layers the runtime asks for
        made = tm.fused_layer

        class Labelled:
            def __init__(self, step) -> None:
                self.step = step

            def forward(self, *args):
                with torch.profiler.record_function("drafthead_decode_layer"):
                    return self.step.forward(*args)

        tm.fused_layer = lambda i, layer: (lambda s: Labelled(s) if s is not None else None)(made(i, layer))
    bound = bandwidth_bound(tm, "cpu")
    print(f"CPU class {hardware.cpu_class()} (capability {hardware.cpu_capability()}), {torch.get_num_threads()} "
          f"threads, {str(tm.dtype).removeprefix('torch.')}, kernel {tm.kernel or 'none (oneDNN)'}, weights "
          f"{tm.weights}, layers {'one call each' if tm.fused else 'op by op'}: "
          f"{bound['weight_bytes'] / 1e6:.0f} MB a token at {bound['read_gb_per_s']:.1f} GB/s -> "
          f"bound {bound['bound_ms']:.1f} ms")
    prefix = torch.randint(100, 20000, (1, int(cfg.prefix)), generator=torch.Generator().manual_seed(0))
    cache = tm.new_cache(1, int(cfg.prefix) + max(cfg.rows))
    lens = torch.zeros(1, dtype=torch.long)
    tm.forward(cache, prefix, lens, prefill=True)
    lens = lens + int(cfg.prefix)
    for n in cfg.rows:
        new = prefix[:, :n]  # [1, n]
        for _ in range(3):
            tm.forward(cache, new, lens)  # warm-up: packs the weights, first-shape costs
        walls = []
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(int(cfg.repeats)):
                t0 = time.perf_counter()
                tm.forward(cache, new, lens)
                walls.append(time.perf_counter() - t0)
        by_phase: dict[str, float] = defaultdict(float)
        for ev in prof.key_averages():
            by_phase[phase_of(ev.key)] += ev.self_cpu_time_total / 1000 / int(cfg.repeats)  # ms per forward
        wall = 1000 * statistics.median(walls)
        ops = sum(by_phase.values())
        print(f"\n{n} new token(s): median {wall:.1f} ms a forward under the profiler "
              f"({wall / bound['bound_ms']:.2f}x the bound); operator time {ops:.1f} ms")
        for name, ms in sorted(by_phase.items(), key=lambda kv: -kv[1]):
            print(f"  {name:<22} {ms:8.2f} ms  {100 * ms / wall:5.1f} %")
        print(f"  {'python, dispatch':<22} {max(0.0, wall - ops):8.2f} ms  {100 * max(0.0, wall - ops) / wall:5.1f} %"
              f"  (wall minus operator self time; profiler overhead included)")
        for ev in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:int(cfg.top)]:
            print(f"    {ev.key:<34} {ev.self_cpu_time_total / 1000 / int(cfg.repeats):7.2f} ms  "
                  f"{ev.count // int(cfg.repeats):5d} calls  ({phase_of(ev.key)})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""One command that checks drafthead on a GPU: verify kernels, bf16 training, DeepSpeed, the runtime on CUDA.

GPU time often comes in short slices with no network, so this is one prepared run (105 s on one H200, plus
about 40 s to start the machine and install the wheels) that writes `gpu_check.json` and `gpu_check.md`
and exits 1 if any check fails:

  kernels   the Triton verify kernels (tree mask, greedy chain/tree, rejection sampling chain/tree, K/V compaction)
            against their PyTorch references at batch 1-64: equal (or a valid draw, for sampling) and speed ratio
  eagle3    bf16 EAGLE3 training on a random-weight target of Llama-3.1-8B geometry, online capture, TTT 7 as
            recipes/eagle3_qwen.yaml, 2048-token samples: tokens/s, peak GPU memory, MFU (FLOPs counted by
            torch's FlopCounterMode on one micro-step, against the GPU's dense bf16 peak and a measured matmul)
  zero2     the same with DeepSpeed ZeRO-2 on one rank
  dflash    DFlash training steps (recipes/dflash_qwen.yaml's shape) on the same target
  mtp       MTP training steps (recursive, K=3, as recipes/mtp_qwen35.yaml) on the same target
  runtime   greedy chain / tree / block speculative == our AR loop == HF greedy on a small random fp64 target,
            batch 1 and 3, eager and on the static path (CUDA graphs); on the 8B-geometry bf16 target, the
            verify-cost curve (T = 1..64 new tokens on a cached prefix) of the runtime's forward, eager and as CUDA
            graphs, beside HF's forward with a DynamicCache, against the bound (weight bytes / measured HBM read),
            and AR tokens/s (ours eager, ours graphed, HF `generate`)

Here, with network (the GPU image has torch 2.11, transformers 5.17, triton 3.6, peft, safetensors, tqdm,
numpy, pyyaml; the rest travels as wheels, about 6 MiB):

    python scripts/gpu_check.py --fetch-wheels      # -> .whl/: omegaconf 2.4.0, deepspeed 0.19.8 (built from
                                                    #    its sdist, DS_BUILD_OPS=0: pure Python), hjson 3.1.0,
                                                    #    pydantic 2.13.4, pydantic-core 2.46.4, annotated-types
                                                    #    0.7.0, typing-inspection 0.4.2, ijson 3.6.0, gguf 0.19.0,
                                                    #    datasets 5.2.0, dill 0.4.1, multiprocess 0.70.19

On the GPU machine, from the checkout (Python 3.12 there; no install of drafthead needed):

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \\
      PYTHONPATH=/tmp/site python3 scripts/gpu_check.py --out OUT_DIR
    # or install drafthead itself, resolving every dependency offline (keeps the image's torch):
    python3 -m pip install --no-index --find-links .whl --no-build-isolation -e '.[dev]'

On CPU, tiny models, every section (the test suite runs this, so the script cannot rot):

    python scripts/gpu_check.py --dry --out /tmp/gpu_check
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

if "--dry" in sys.argv:  # before triton is imported: the kernels run in Triton's interpreter on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

WHEELS = ["omegaconf==2.4.0", "hjson==3.1.0", "pydantic==2.13.4", "pydantic-core==2.46.4", "annotated-types==0.7.0",
          "typing-inspection==0.4.2", "ijson==3.6.0", "gguf==0.19.0",
          "datasets==5.2.0", "dill==0.4.1", "multiprocess==0.70.19"]  # the last three: `pip install -e .` offline
DEEPSPEED = "deepspeed==0.19.8"  # sdist only on PyPI: built into a pure-Python wheel here
# dense bf16 tensor-core peak (datasheet, no sparsity), FLOP/s
BF16_PEAK = {"H200": 989.4e12, "H100": 989.4e12, "H20": 148e12, "A100": 312e12, "L40S": 362e12, "B200": 2250e12}

LLAMA31_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
                  rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128009)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512, max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
SMALL = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=1024, max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


# ------------------------------------------------------------------------------------------------ setup
def fetch_wheels(dest: Path) -> None:
    """Download the wheels the GPU image lacks (Python 3.12, manylinux x86-64) and build DeepSpeed's."""
    dest.mkdir(parents=True, exist_ok=True)
    plats = [a for p in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
                         "manylinux2014_x86_64", "manylinux1_x86_64") for a in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *plats, "-d", str(dest), *WHEELS], check=True)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", DEEPSPEED,
                    "-w", str(dest)], check=True, env={**os.environ, "DS_BUILD_OPS": "0"})
    total = sum(f.stat().st_size for f in dest.glob("*.whl"))
    print(f"{len(list(dest.glob('*.whl')))} wheels in {dest}, {total / 2**20:.1f} MiB")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_target(geometry: dict, dtype: torch.dtype, device: torch.device, seed: int = 0, head_scale: float = 1.0):
    """A frozen random-weight Llama of the given geometry, built on the device (no download, no disk)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from drafthead.target import Target, freeze

    torch.manual_seed(seed)
    cfg = LlamaConfig(**geometry)
    with torch.device(device):
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = LlamaForCausalLM(cfg)
        finally:
            torch.set_default_dtype(prev)
    model.to(dtype)
    if head_scale != 1.0:  # sharper next-token distributions than the near-uniform random init
        with torch.no_grad():
            model.lm_head.weight.mul_(head_scale)
    name = "random-llama-3.1-8b" if geometry is LLAMA31_8B else f"random-llama-h{geometry['hidden_size']}"
    return freeze(Target(model.eval(), None, name))


def random_samples(n: int, length: int, vocab: int, seed: int) -> list[dict]:
    """Token samples with the first eighth masked out of the loss (a prompt), the rest supervised. Ids stay
    below vocab - 2 so the last rows are free for a DFlash mask token."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(3, vocab - 2, (length,), generator=g).tolist()
        mask = [0] * (length // 8) + [1] * (length - length // 8)
        out.append({"id": f"r{i}", "input_ids": ids, "loss_mask": mask})
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------------ sections
def section_env(device: torch.device, dry: bool) -> dict:
    import transformers

    from drafthead import hardware

    out = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "device": str(device), "cpu_class": hardware.cpu_class()}
    with contextlib.suppress(ImportError):
        import triton
        out["triton"] = triton.__version__
    with contextlib.suppress(ImportError):
        import deepspeed
        out["deepspeed"] = deepspeed.__version__
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        out.update(gpu=p.name, sm_count=p.multi_processor_count, gpu_memory_gib=round(p.total_memory / 2**30, 1),
                   cuda=torch.version.cuda)
        out["bf16_peak_tflops"] = next((v / 1e12 for k, v in BF16_PEAK.items() if k in p.name), None)
    n = 512 if dry else 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    sync(device)
    reps = 2 if dry else 10
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    # 4 significant digits: a small CPU matmul in --dry is well under 0.1 TFLOP/s, and the ratio below divides by it
    out["matmul_bf16_tflops"] = float(f"{2 * n**3 * reps / (time.perf_counter() - t0) / 1e12:.4g}")
    return out


class SectionSkipped(Exception):
    """A section that cannot run here, with the reason (reported as `skipped: reason`, not as a failure)."""


def section_kernels(device: torch.device, dry: bool) -> dict:
    import bench_kernels as bk

    from drafthead.kernels import triton_kernels as tk

    if tk.INTERPRETED and not tk.INTERPRETER_LOOPS_OVER_LOADS:
        raise SectionSkipped(f"triton {tk.triton.__version__}'s interpreter cannot loop over a loaded scalar; "
                             f"the compiled kernels run on a GPU")

    g = torch.Generator(device=device).manual_seed(0)
    rows, failed = [], 0
    for name, prm in bk.cases(quick=False, cpu=dry):
        kernel, reference, check = bk.build(name, prm, device, g)
        status = check()
        failed += status.startswith("FAIL")
        t_k = bk.median_ms(kernel, device, budget_s=0.05 if dry else 0.2, max_reps=3 if dry else 30)
        t_r = bk.median_ms(reference, device, budget_s=0.05 if dry else 0.2, max_reps=3 if dry else 30)
        rows.append(dict(kernel=name, shape=" ".join(f"{k}={v}" for k, v in prm.items()), triton_ms=round(t_k, 4),
                         torch_ms=round(t_r, 4), speedup=round(t_r / t_k, 2), check=status))
        del kernel, reference, check
    if failed:
        bad = [f"{r['kernel']} {r['shape']}: {r['check']}" for r in rows if r["check"].startswith("FAIL")]
        raise AssertionError(f"{failed} kernel check(s) failed: " + "; ".join(bad))
    return {"rows": rows, "cases": len(rows)}


def train_config(recipe: str, overrides: list[str], run_dir: Path):
    from drafthead.trainer.config import load_config

    return load_config([f"recipe={recipe}", f"output_dir={run_dir}", "logging.wandb=false", "budget.minutes=null",
                        "train.deepspeed=null", *overrides])


def measure_training(cfg, target, samples: list[dict], device: torch.device, d, warm: int, timed: int,
                     count_flops: bool) -> dict:
    """Micro-steps exactly as train.py runs them (online capture in the step); tokens/s over the timed ones."""
    from drafthead.trainer.engines import build_engine
    from drafthead.trainer.step import forward_backward, make_batch
    from drafthead.trainer.prepare import build_draft, feature_dtype
    from drafthead.registry import family

    fam = family(cfg.drafter.family)
    ds = build_draft(cfg, target, samples, device, log=lambda *a: None)
    drafter, head = ds.drafter, ds.head
    engine = build_engine(drafter, cfg, 1000, d)
    layer_ids = drafter.capture_layer_ids()
    fdt = feature_dtype(cfg.capture.dtype)

    def micro(i: int) -> dict:
        batch = make_batch([samples[i % len(samples)]], target, layer_ids, fdt, False, device,
                           fam.predicts_draft_vocab(getattr(cfg.drafter, fam.name)))
        out = forward_backward(engine, batch, head, cfg.train.dtype, device)
        engine.step()
        return out

    losses = []
    for i in range(warm):
        losses.append(float(micro(i)["loss"].detach()))
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    ntok = 0
    for i in range(warm, warm + timed):
        losses.append(float(micro(i)["loss"].detach()))
        ntok += len(samples[i % len(samples)]["input_ids"])
    sync(device)
    dt = time.perf_counter() - t0
    res = {"tokens_per_s": round(ntok / dt, 1), "step_ms": round(dt / timed * 1000, 1), "micro_steps": timed,
           "tokens_per_micro_step": ntok // timed, "losses": [round(x, 4) for x in losses],
           "trainable_params_m": round(sum(p.numel() for p in drafter.parameters() if p.requires_grad) / 1e6, 1),
           "engine": engine.kind}
    if device.type == "cuda":
        res["peak_gpu_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    if not all(map(lambda x: x == x and abs(x) < 1e6, losses)):
        raise AssertionError(f"non-finite or exploding loss: {losses}")
    if count_flops:
        from torch.utils.flop_counter import FlopCounterMode

        with FlopCounterMode(display=False) as fc, gqa_as_mha():
            micro(warm + timed)
        res["flops_per_micro_step"] = fc.get_total_flops()
    return res


@contextlib.contextmanager
def gqa_as_mha():
    """SDPA with grouped K/V heads repeated to the query heads: the same math and FLOPs, in the shapes torch's
    FlopCounterMode can count (its SDPA formulas assert equal head counts). Only for the one counted step."""
    import torch.nn.functional as F

    orig = F.scaled_dot_product_attention

    def sdpa(q, k, v, *args, enable_gqa: bool = False, **kw):
        if k.shape[-3] != q.shape[-3]:
            r = q.shape[-3] // k.shape[-3]
            k, v = k.repeat_interleave(r, dim=-3), v.repeat_interleave(r, dim=-3)
        return orig(q, k, v, *args, **kw)

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = orig


def add_mfu(res: dict, env: dict, flops_per_micro: int | None) -> None:
    if not flops_per_micro:
        return
    achieved = flops_per_micro / (res["step_ms"] / 1000)
    res["achieved_tflops"] = round(achieved / 1e12, 1)
    if env.get("bf16_peak_tflops"):
        res["mfu"] = round(achieved / (env["bf16_peak_tflops"] * 1e12), 3)
    if env.get("matmul_bf16_tflops"):
        res["of_measured_matmul"] = round(achieved / (env["matmul_bf16_tflops"] * 1e12), 3)


def section_train(name: str, recipe: str, overrides: list[str], ctx: dict, flops_of: str | None = None) -> dict:
    """Training micro-steps of a recipe on the big target; MFU from FLOPs counted here, or from the section
    `flops_of` whose model math this run shares (an engine the counter should not run inside)."""
    from drafthead.trainer.dist import Dist

    device, dry = ctx["device"], ctx["dry"]
    seq = 64 if dry else 2048
    target = ctx["big"]
    samples = random_samples(8, seq, target.config.vocab_size, seed=1)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = train_config(recipe, [f"data.max_length={seq}", *overrides], Path(tmp))
        res = measure_training(cfg, target, samples, device, Dist(device=device), warm=1 if dry else 3,
                               timed=2 if dry else 10, count_flops=flops_of is None)
    flops = res.get("flops_per_micro_step") if flops_of is None else ctx.get("flops", {}).get(flops_of)
    add_mfu(res, ctx["env"], flops)
    ctx.setdefault("flops", {})[name] = flops
    return res


def section_zero2(ctx: dict) -> dict:
    import torch.distributed as dist

    from drafthead.optional import require

    require("deepspeed", "the zero2 section (bring its wheel: --fetch-wheels)")  # named, before any setup
    if not dist.is_initialized():  # one rank, as torchrun would set it up (DeepSpeed reads these)
        for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                     ("MASTER_PORT", str(free_port()))):
            os.environ.setdefault(k, v)
        dist.init_process_group("nccl" if ctx["device"].type == "cuda" else "gloo", rank=0, world_size=1)
    return section_train("zero2", "eagle3_qwen", ["train.deepspeed=zero2", *ctx["eagle3_over"]], ctx,
                         flops_of="eagle3")  # the same model math as the plain EAGLE3 run


@torch.inference_mode()
def static_path(tm, dry: bool):
    """The static-cache path `runtime/graphs.py` gives a GPU run, for `tm`: CUDA graphs on a GPU, the same path
    run eagerly in a dry run on CPU."""
    from drafthead.runtime import graphs
    return graphs.StaticForward(tm, graphs=not dry)


def verify_curve(target, device: torch.device, prefix: int, sizes: list[int], reps: int, dry: bool) -> list[dict]:
    """ms of one forward over T new tokens on a cached prefix (a rejected verify round: the cache is not
    advanced): the runtime's TargetModel run eagerly and on its static path (CUDA graphs on a GPU) beside HF's
    forward with a DynamicCache (cropped back each time). Each row also says how far the static path's logits are
    from the eager forward's (the same math in other kernels' order: near, not equal, on a GPU)."""
    from transformers import DynamicCache

    from drafthead.runtime import TargetModel

    L = target.num_layers
    tm = TargetModel(target.model, aux_layer_ids=[min(2, L - 1), L // 2, max(L - 3, 0)])
    tm.static = static_path(tm, dry)
    V = target.config.vocab_size
    g = torch.Generator(device=device).manual_seed(0)
    cache = tm.new_cache(1, prefix + max(sizes) + 1)
    static, tm.static = tm.static, None
    lens = torch.zeros(1, dtype=torch.long, device=device)
    pre = torch.randint(0, V, (1, prefix), device=device, generator=g)
    tm.forward(cache, pre, lens, prefill=True)
    lens += prefix
    hf_cache = DynamicCache()
    target.model(input_ids=pre, past_key_values=hf_cache, use_cache=True)

    def timed(fn: Callable[[], object]) -> float:
        fn()
        sync(device)
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            sync(device)
            ts.append(time.perf_counter() - t0)
        return sorted(ts)[len(ts) // 2] * 1000

    def run(T_ids: torch.Tensor, on_static: bool):
        tm.static = static if on_static else None
        try:
            return tm.forward(cache, T_ids, lens, capture=True)
        finally:
            tm.static = None

    rows = []
    for T in sizes:  # a first pass warms clocks, allocator and kernel choices (and captures graphs); not recorded
        ids = torch.randint(0, V, (1, T), device=device, generator=g)
        run(ids, False)
        run(ids, True)
        target.model(input_ids=ids, past_key_values=hf_cache, use_cache=True)
        hf_cache.crop(-T)
    for T in sizes:
        ids = torch.randint(0, V, (1, T), device=device, generator=g)
        eager_logits, static_logits = run(ids, False)[0].float(), run(ids, True)[0].float()

        def hf() -> None:
            target.model(input_ids=ids, past_key_values=hf_cache, use_cache=True)
            hf_cache.crop(-T)  # back to the prefix (a negative count: the form every transformers 5.x takes)

        rows.append({"T": T, "runtime_ms": round(timed(lambda: run(ids, False)), 3),
                     "static_ms": round(timed(lambda: run(ids, True)), 3), "hf_ms": round(timed(hf), 3),
                     "static_max_abs_diff": float((static_logits - eager_logits).abs().max()),
                     "static_argmax_equal": bool(torch.equal(static_logits.argmax(-1), eager_logits.argmax(-1)))})
    one = rows[0]["runtime_ms"]
    for r in rows:
        r["runtime_x_T1"] = round(r["runtime_ms"] / one, 2)
        r["static_x_T1"] = round(r["static_ms"] / rows[0]["static_ms"], 2)
    return rows


def weight_bound(target, device: torch.device) -> dict:
    """The least time a 1-token forward can take on this device: its weight bytes / the measured read rate."""
    from drafthead.eval.bench import read_bandwidth
    nbytes = sum(p.numel() * p.element_size() for n, p in target.model.named_parameters() if "embed_tokens" not in n)
    bw = read_bandwidth(device.type, mib=64 if device.type == "cpu" else 2048)
    return {"weight_bytes": nbytes, "read_gb_per_s": round(bw / 1e9, 1), "bound_ms": round(1000 * nbytes / bw, 3)}


def ar_speed(target, device: torch.device, new: int, dry: bool) -> dict:
    """Tokens/s of greedy AR decoding of `new` tokens after a 32-token prompt: our runtime eager, on its static path
    (CUDA graphs on a GPU), and HF `generate`."""
    from drafthead.runtime import SpecConfig, SpeculativeGenerator
    V = target.config.vocab_size
    prompt = torch.randint(3, V - 2, (32,), generator=torch.Generator().manual_seed(7)).tolist()
    gen = SpeculativeGenerator(target, None, device=device)
    out = {}
    for name, on in (("ours_eager", False), ("ours_static", True)):
        gen.model.static = static_path(gen.model, dry) if on else None
        gen.generate([prompt], 4, SpecConfig(mode="ar"))  # warm (and capture)
        sync(device)
        t0 = time.perf_counter()
        r = gen.generate([prompt], new, SpecConfig(mode="ar"))[0]
        sync(device)
        out[name] = round(len(r.tokens) / (time.perf_counter() - t0), 2)
    ids = torch.tensor([prompt], device=device)
    with torch.no_grad():
        target.model.generate(ids, max_new_tokens=4, do_sample=False, min_new_tokens=4)
        sync(device)
        t0 = time.perf_counter()
        o = target.model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        sync(device)
    out["hf_generate"] = round((o.shape[1] - ids.shape[1]) / (time.perf_counter() - t0), 2)
    out["static_vs_hf"] = round(out["ours_static"] / out["hf_generate"], 2)
    return out


def reference_greedy(target, prompt: list[int], n: int, eos: int, device: torch.device) -> list[int]:
    """Plain greedy decoding with full HF forwards (no cache), stopping after EOS."""
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            t = int(target.model(torch.tensor([ids], device=device)).logits[0, -1].argmax())
            out.append(t)
            ids.append(t)
            if t == eos:
                break
    return out


def section_runtime(ctx: dict) -> dict:
    """Greedy speculative decoding is lossless on the device: every mode's tokens equal our AR loop's and HF's
    greedy tokens (fp64, so no near-tie argmax flips from summation order), then the verify-cost curve."""
    from drafthead.runtime import SpecConfig, SpeculativeGenerator
    from drafthead.trainer.prepare import build_draft

    device, dry = ctx["device"], ctx["dry"]
    small = random_target(TINY if dry else SMALL, torch.float64, device, seed=3, head_scale=8.0)
    V = small.config.vocab_size
    samples = random_samples(4, 32, V, seed=2)
    drafters = {}
    with tempfile.TemporaryDirectory() as tmp:
        for fam, recipe, over in (("eagle3", "eagle3_smollm2", ["drafter.eagle3.draft_vocab_size=256"]),
                                  ("dflash", "dflash_smollm2", [f"drafter.dflash.mask_token_id={V - 1}",
                                                                "drafter.dflash.block_size=4",
                                                                "drafter.dflash.num_layers=2"])):
            cfg = train_config(recipe, over, Path(tmp))
            drafters[fam] = build_draft(cfg, small, samples, device, log=lambda *a: None).drafter.double().eval()
    g = torch.Generator().manual_seed(5)
    lengths = torch.randint(4, 20, (3,), generator=g).tolist()
    prompts = [torch.randint(3, V - 2, (n,), generator=g).tolist() for n in lengths]
    n_new = 24
    eos = small.config.eos_token_id
    want = [reference_greedy(small, p, n_new, eos, device) for p in prompts]
    checks = []
    settings = [("eagle3", SpecConfig(mode="ar")), ("eagle3", SpecConfig(mode="chain", num_speculative_tokens=4)),
                ("eagle3", SpecConfig(mode="tree", num_speculative_tokens=4, tree_nodes=8, topk=2)),
                ("dflash", SpecConfig(mode="block", num_speculative_tokens=3))]
    for fam, spec in settings:
        gen = SpeculativeGenerator(small, drafters[fam], device=device)
        for path in ("eager", "static"):  # static: CUDA graphs on a GPU, the same path eagerly in a dry run
            gen.model.static = static_path(gen.model, dry) if path == "static" else None
            for bs in (1, 3):
                s = SpecConfig(**{**spec.__dict__, "batch_size": bs})
                got = [r.tokens for r in gen.generate(prompts, n_new, s)]
                checks.append({"mode": spec.mode, "drafter": fam, "path": path, "batch": bs,
                               "equal_to_hf_greedy": got == want})
    bad = [c for c in checks if not c["equal_to_hf_greedy"]]
    if bad:
        raise AssertionError(f"speculative != greedy: {bad}")
    out = {"lossless_fp64": checks, "small_target": f"hidden {small.config.hidden_size}, "
                                                   f"{small.config.num_hidden_layers} layers, vocab {V}, fp64"}
    del small, drafters
    big = ctx["big"]
    sizes = [1, 2, 4, 8] if dry else [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
    out["verify_curve"] = verify_curve(big, device, prefix=32 if dry else 512, sizes=sizes, reps=2 if dry else 10,
                                       dry=dry)
    out["verify_target"] = f"{big.name_or_path}, {str(big.model.dtype).removeprefix('torch.')}"
    out["bound"] = weight_bound(big, device)
    out["bound"]["static_T1_x_bound"] = round(out["verify_curve"][0]["static_ms"] / out["bound"]["bound_ms"], 2)
    out["ar_tokens_per_s"] = ar_speed(big, device, new=8 if dry else 128, dry=dry)
    bad = [r["T"] for r in out["verify_curve"] if not r["static_argmax_equal"]]
    if dry and bad:  # fp32 / bf16 on CPU: the static path runs the same kernels; on a GPU, said in the report
        raise AssertionError(f"static path's argmax != eager's at T = {bad}")
    return out


# ------------------------------------------------------------------------------------------------ report
def markdown(res: dict) -> str:
    env = res["sections"].get("env", {})
    lines = [f"# gpu_check ({'dry, CPU' if res['dry'] else env.get('gpu', 'GPU')})", "",
             f"torch {env.get('torch')}, transformers {env.get('transformers')}, triton {env.get('triton', '-')}, "
             f"deepspeed {env.get('deepspeed', '-')}; CPU class {env.get('cpu_class')}; "
             f"bf16 matmul {env.get('matmul_bf16_tflops')} TFLOP/s measured, "
             f"peak {env.get('bf16_peak_tflops', '-')}; {res['wall_s']} s in all", "",
             "| section | status | s | figures |", "| --- | --- | --- | --- |"]
    for name, st in res["status"].items():
        s = res["sections"].get(name, {})
        if name in ("eagle3", "zero2", "dflash", "mtp") and st == "ok":
            fig = (f"{s['tokens_per_s']} tok/s, {s['step_ms']} ms/micro-step, peak {s.get('peak_gpu_gib', '-')} GiB, "
                   f"MFU {s.get('mfu', '-')}, {s['trainable_params_m']}M trainable")
        elif name == "kernels" and st == "ok":
            sp = [r["speedup"] for r in s["rows"]]
            fig = f"{s['cases']} cases equal; Triton/torch speedup {min(sp)}-{max(sp)}x"
        elif name == "runtime" and st == "ok":
            c = s["verify_curve"]
            fig = (f"{len(s['lossless_fp64'])} mode x path x batch runs lossless; verify T=1 {c[0]['runtime_ms']} ms "
                   f"eager, {c[0]['static_ms']} static ({s['bound']['static_T1_x_bound']}x the bound), "
                   f"HF {c[0]['hf_ms']}; T={c[-1]['T']} {c[-1]['runtime_ms']} / {c[-1]['static_ms']} ms "
                   f"(HF {c[-1]['hf_ms']}); AR {s['ar_tokens_per_s']}")
        elif st != "ok":
            fig = res["errors"].get(name, "")[:200].replace("|", "/").replace("\n", " ")
        else:
            fig = ""
        lines.append(f"| {name} | {st} | {res['seconds'].get(name, '-')} | {fig} |")
    if res["status"].get("runtime") == "ok":
        lines += ["", "Verify cost (ms), " + res["sections"]["runtime"]["verify_target"], "",
                  "| T | runtime eager | static (CUDA graphs) | HF + DynamicCache | eager / T=1 | static / T=1 "
                  "| static vs eager: max abs diff, argmax equal |", "| --- | --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {r['T']} | {r['runtime_ms']} | {r['static_ms']} | {r['hf_ms']} | {r['runtime_x_T1']} | "
                  f"{r['static_x_T1']} | {r['static_max_abs_diff']:.3g}, {r['static_argmax_equal']} |"
                  for r in res["sections"]["runtime"]["verify_curve"]]
        b = res["sections"]["runtime"]["bound"]
        lines += ["", f"Bound: {b['weight_bytes'] / 1e9:.2f} GB of weights at {b['read_gb_per_s']} GB/s read = "
                      f"{b['bound_ms']} ms; static T=1 = {b['static_T1_x_bound']}x. AR tokens/s: "
                      f"{res['sections']['runtime']['ar_tokens_per_s']}"]
    if res["status"].get("kernels") == "ok":
        lines += ["", "| kernel | shape | Triton ms | torch ms | speedup | check |", "| --- " * 6 + "|"]
        lines += [f"| {r['kernel']} | {r['shape']} | {r['triton_ms']} | {r['torch_ms']} | {r['speedup']} "
                  f"| {r['check']} |" for r in res["sections"]["kernels"]["rows"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry", action="store_true", help="CPU, tiny models (Triton kernels in its interpreter)")
    ap.add_argument("--out", type=Path, default=Path("gpu_check_out"), help="folder for gpu_check.json / .md")
    ap.add_argument("--only", default="", help="comma-separated sections to run (default: all)")
    ap.add_argument("--fetch-wheels", type=Path, nargs="?", const=ROOT / ".whl", default=None,
                    help="download the wheels the GPU image lacks into this folder (default .whl) and exit")
    args = ap.parse_args(argv)
    if args.fetch_wheels is not None:
        fetch_wheels(args.fetch_wheels)
        return 0
    if not args.dry and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; use --dry for the CPU run of every section", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.dry else "cuda")
    if args.dry:
        torch.set_num_threads(min(2, torch.get_num_threads()))
    else:
        torch.backends.cuda.matmul.allow_tf32 = False  # fp64/fp32 parity checks stay exact-path
    t_all = time.perf_counter()
    ctx: dict = {"device": device, "dry": args.dry}
    res: dict = {"dry": args.dry, "sections": {}, "status": {}, "seconds": {}, "errors": {}}
    eagle3_over = ["drafter.eagle3.draft_vocab_size=" + ("256" if args.dry else "32000")]
    ctx["eagle3_over"] = eagle3_over
    big_layers = TINY["num_hidden_layers"] if args.dry else LLAMA31_8B["num_hidden_layers"]
    vocab = (TINY if args.dry else LLAMA31_8B)["vocab_size"]
    dflash_over = [f"drafter.dflash.mask_token_id={vocab - 1}", "drafter.dflash.init=random",
                   "drafter.dflash.target_layer_ids=" + ("[0,1,2]" if args.dry else "[1,8,15,22,29]")]
    if args.dry:
        dflash_over += ["drafter.dflash.num_layers=2", "drafter.dflash.block_size=4", "drafter.dflash.num_anchors=8"]
    mtp_over = ["drafter.mtp.init=target"]
    sections: list[tuple[str, Callable[[], dict]]] = [
        ("env", lambda: section_env(device, args.dry)),
        ("kernels", lambda: section_kernels(device, args.dry)),
        ("eagle3", lambda: section_train("eagle3", "eagle3_qwen", eagle3_over, ctx)),
        ("zero2", lambda: section_zero2(ctx)),
        ("dflash", lambda: section_train("dflash", "dflash_qwen", dflash_over, ctx)),
        ("mtp", lambda: section_train("mtp", "mtp_qwen35", mtp_over, ctx)),
        ("runtime", lambda: section_runtime(ctx)),
    ]
    only = {s for s in args.only.split(",") if s}
    unknown = only - {n for n, _ in sections}
    if unknown:
        ap.error(f"--only: unknown section(s) {sorted(unknown)}")
    args.out.mkdir(parents=True, exist_ok=True)
    for name, fn in sections:
        if only and name not in only and name != "env":
            continue
        if name not in ("env", "kernels") and "big" not in ctx:
            t0 = time.perf_counter()
            ctx["big"] = random_target(TINY if args.dry else LLAMA31_8B, torch.bfloat16, device)
            res["seconds"]["target_build"] = round(time.perf_counter() - t0, 1)
            print(f"target: {ctx['big'].name_or_path}, {big_layers} layers, built in "
                  f"{res['seconds']['target_build']} s", flush=True)
        t0 = time.perf_counter()
        try:
            res["sections"][name] = fn()
            res["status"][name] = "ok"
            if name == "env":
                ctx["env"] = res["sections"]["env"]
        except SectionSkipped as e:
            res["status"][name] = f"skipped: {e}"
        except Exception as e:  # one broken section must not hide the others' figures
            res["status"][name] = "fail"
            res["errors"][name] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        res["seconds"][name] = round(time.perf_counter() - t0, 1)
        print(f"[{name}] {res['status'][name]} in {res['seconds'][name]} s"
              + (f": {res['errors'][name]}" if name in res["errors"] else ""), flush=True)
        (args.out / "gpu_check.json").write_text(json.dumps(res, indent=1, default=str))  # partial results survive
    res["wall_s"] = round(time.perf_counter() - t_all, 1)
    (args.out / "gpu_check.json").write_text(json.dumps(res, indent=1, default=str))
    (args.out / "gpu_check.md").write_text(markdown(res))
    print(markdown(res))
    return 1 if any(s == "fail" for s in res["status"].values()) else 0  # a skipped section names its reason


if __name__ == "__main__":
    sys.exit(main())

"""Training throughput of a recipe on this machine.

    python scripts/bench_train.py [recipe=NAME] [bench.batches=6] [key=value ...]

Prints, on real samples of the recipe's data: target forward tokens/s (no hooks), capture tokens/s
(forward with the layer hooks, features copied out, the target's full-vocab argmax as offline capture stores
it), draft training tokens/s on captured features
(teacher + TTT forward + backward + optimizer step), online training tokens/s (capture + train in one
step, what `train.py` does with capture.mode=online), the ratio online-train / target-forward (goal
>= 0.5) and peak memory.
"""
from __future__ import annotations

import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from drafthead.hardware import cpu_capability, cpu_class, resolve_dtype_name  # noqa: E402
from drafthead.target import load_target  # noqa: E402
from drafthead.trainer.dist import Dist  # noqa: E402
from drafthead.trainer.engines import TorchEngine  # noqa: E402
from drafthead.trainer.memory import retain_freed_memory  # noqa: E402
from drafthead.trainer.step import forward_backward  # noqa: E402
from drafthead.trainer.capture import collate, features_for_batch  # noqa: E402
from drafthead.trainer.config import parse_or_exit  # noqa: E402
from drafthead.trainer.prepare import build_draft, feature_dtype, prepare_samples  # noqa: E402


def main(argv: list[str]) -> None:
    from drafthead.options import HELP_FLAGS, wants_help
    from drafthead.trainer.config import help_text

    if wants_help(argv):  # this script's own key, then the recipe's options as `drafthead train --help` lists them
        print(f"{__doc__.strip()}\n\nbench.batches=6  batches timed per measurement\n")
        print(help_text([a for a in argv if a not in HELP_FLAGS], entry="python scripts/bench_train.py"))
        return
    n_batches = 6
    rest = []
    for a in argv:
        if a.startswith("bench.batches="):
            n_batches = int(a.split("=", 1)[1])
        else:
            rest.append(a)
    cfg = parse_or_exit(rest + ["data.max_samples=" + str(max(400, 8 * n_batches * 4))])
    retain_freed_memory()  # as train.py does
    d = Dist()
    target = load_target(cfg.target.name_or_path, cfg.target.gguf_file, cfg.target.dtype)
    prep = prepare_samples(cfg, target, d, Path("/tmp"), log=lambda *a: None)
    ds = build_draft(cfg, target, prep.train, d.device, log=lambda *a: None)
    drafter, head, d2t = ds.drafter, ds.head, ds.d2t
    engine = TorchEngine(drafter, cfg, 1000, d)
    fdt = feature_dtype(cfg.capture.dtype)
    layer_ids = drafter.capture_layer_ids()
    bs = cfg.train.batch_size
    pad = target.tokenizer.pad_token_id
    batches = [collate(prep.train[i * bs:(i + 1) * bs], pad) for i in range(n_batches + 1)]

    def timed(fn) -> float:
        fn(batches[0])  # warm-up
        tok, t0 = 0, time.perf_counter()
        for b in batches[1:]:
            fn(b)
            tok += int(b["attention_mask"].sum())
        return tok / (time.perf_counter() - t0)

    def fwd(b):
        with torch.no_grad():
            target.model.model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False)

    feats = {}

    def cap(b):
        feats[id(b)] = features_for_batch(target, b, layer_ids, fdt, argmax=d2t is not None)  # what capture stores

    def train_step(fb):
        forward_backward(engine, fb, head, cfg.train.dtype, d.device)
        engine.step()

    # two rounds, best of each: the first thing timed on this CPU ran ~25% slow whatever it was (frequency /
    # allocator warm-up), which skewed one-shot ratios
    best = {"fwd": 0.0, "cap": 0.0, "train": 0.0, "online": 0.0}
    for _ in range(2):
        best["fwd"] = max(best["fwd"], timed(fwd))
        best["cap"] = max(best["cap"], timed(cap))
        best["train"] = max(best["train"], timed(lambda b: train_step(feats[id(b)])))
        best["online"] = max(best["online"], timed(
            lambda b: train_step(features_for_batch(target, b, layer_ids, fdt, argmax=d2t is not None))))
    fwd_tps, cap_tps, train_tps, online_tps = best["fwd"], best["cap"], best["train"], best["online"]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"recipe {cfg.recipe}: target {cfg.target.name_or_path} "
          f"({resolve_dtype_name(cfg.target.dtype, quiet=True)}), "
          f"draft vocab {d2t.numel() if d2t is not None else 'full'}, K {drafter.config.num_draft_tokens}, "
          f"batch {bs} x <= {cfg.data.max_length} tokens, "
          f"train dtype {resolve_dtype_name(cfg.train.dtype, quiet=True)}, threads {torch.get_num_threads()}, "
          f"CPU class {cpu_class()} (capability {cpu_capability()})")
    print(f"target forward      {fwd_tps:8.0f} tok/s")
    print(f"capture (3 layers)  {cap_tps:8.0f} tok/s")
    print(f"draft train step    {train_tps:8.0f} tok/s   (features given)")
    print(f"online train step   {online_tps:8.0f} tok/s   (capture + train)")
    print(f"online / forward    {online_tps / fwd_tps:8.2f}      (goal >= 0.5)")
    print(f"peak memory (RSS)   {peak:8.0f} MiB")
    if torch.cuda.is_available():
        print(f"peak CUDA memory    {torch.cuda.max_memory_allocated() / 2**20:8.0f} MiB")


if __name__ == "__main__":
    main(sys.argv[1:])

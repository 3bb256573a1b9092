"""Regeneration throughput per engine: which one should write the target's answers on this machine.

    python scripts/bench_regenerate.py [conversations=32] [max_new_tokens=256] [engines=[ours,vllm,hf]]
                                       [batch_sizes=[8,32]] [dtype=auto] [target=smollm2-135m-instruct]

The same first turns of ShareGPT conversations, greedy, through `drafthead.trainer.data.regenerate` with each
engine at each batch size, one after the other (vLLM spins its threads: nothing may run beside it). Prints new
tokens/s with each engine's start-up included (what a run pays) and the CPU class; answers of every engine are
checked against the first one's (greedy: the same text, or the first turn where they part, named).
"""
from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from drafthead.hardware import cpu_class  # noqa: E402
from drafthead.target import load_target  # noqa: E402
from drafthead.trainer import data as tdata  # noqa: E402
from drafthead.trainer import regenerate as tregen  # noqa: E402


USAGE = "python scripts/bench_regenerate.py [key=value ...]"


@dataclass
class Config:
    conversations: int = 32  # ShareGPT conversations whose first turn each engine answers
    max_new_tokens: int = 256  # answer tokens at most
    engines: list[str] = field(default_factory=lambda: ["ours", "vllm", "hf"])  # engines, in the order they run
    batch_sizes: list[int] = field(default_factory=lambda: [8, 32])  # each engine at each batch size
    target: str = "smollm2-135m-instruct"  # the target: a built-in name or a path
    dtype: str = "auto"  # the target's dtype (auto: bf16 where native, else fp32)


def main(argv: list[str]) -> None:
    from drafthead import options

    cfg = options.script_options(Config, argv, USAGE, __doc__)
    if cfg is None:
        return
    n, new, engines, batches = cfg.conversations, cfg.max_new_tokens, cfg.engines, cfg.batch_sizes
    target = load_target(cfg.target, dtype=cfg.dtype)
    convs, _ = tdata.load_conversations("sharegpt", max_samples=n)
    print(f"{len(convs)} conversations, first turn, {new} new tokens at most, greedy; CPU class {cpu_class()}, "
          f"dtype {str(target.model.dtype).removeprefix('torch.')}")
    print("| engine | batch | conversations | answer tokens | seconds | tokens/s | same answers as the first row |")
    print("|---|---|---|---|---|---|---|")
    first = None
    for engine in engines:
        for b in batches:
            opts = tregen.AnswerOptions(max_new_tokens=new, batch_size=b, engine=engine,
                                       max_prompt_tokens=1024 - 32)
            with tempfile.TemporaryDirectory() as tmp:
                t0 = time.perf_counter()
                got = tregen.regenerate(target, convs, str(Path(tmp) / "r.jsonl"), opts)
                took = time.perf_counter() - t0
            answers = [c.messages[-1]["content"] for c in got]
            tokens = sum(len(target.tokenizer(a, add_special_tokens=False).input_ids) for a in answers)
            first = first or answers
            same = sum(a == f for a, f in zip(answers, first))
            print(f"| {engine} | {b} | {len(got)} | {tokens} | {took:.1f} | {tokens / took:.1f} | "
                  f"{same}/{len(answers)} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

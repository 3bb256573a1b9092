"""HF transformers' own speculative path with our LoRA self-draft: `generate(assistant_model=<to=hf export>)`
against plain `generate`, greedy, on MT-Bench first turns (a baseline users know).

    python scripts/bench_hf_assisted.py draft=runs/lora_smollm2/final
    python scripts/bench_hf_assisted.py draft=... max_prompts=8 max_new_tokens=128 \\
        num_assistant_tokens=[2,4] dtype=float32

Prints tokens/s of both, the ratio, and whether every assisted output equals the plain one, with the CPU class.
"""
from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch

from drafthead import hardware, options
from drafthead.export import export
from drafthead.target import load_target
from drafthead.eval.datasets import load_mt_bench

USAGE = "python scripts/bench_hf_assisted.py draft=RUN/final [key=value ...]"


@dataclass
class Config:
    draft: str | None = None  # a LoRA self-draft's run folder (required; exported with to=hf here)
    target: str | None = None  # the target (null: the one the draft was trained on)
    max_prompts: int = 8  # MT-Bench first turns
    max_new_tokens: int = 128  # tokens each prompt decodes
    num_assistant_tokens: list[int] = field(default_factory=lambda: [2, 4])  # HF's drafts per round, each timed
    dtype: str = "float32"  # dtype of target and draft
    threads: int | None = None  # torch threads (null: torch's default)


def main(argv: list[str]) -> int:
    from transformers import AutoModelForCausalLM

    from drafthead.registry import read_draft_config

    cfg = options.script_options(Config, argv, USAGE, __doc__)
    if cfg is None:
        return 0
    if not cfg.draft:
        raise SystemExit(f"usage: {USAGE}: draft= is required (--help lists the options)")
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    meta = read_draft_config(cfg.draft)["target"]
    target = load_target(cfg.target or meta["name_or_path"], None if cfg.target else meta.get("gguf_file"),
                         dtype=cfg.dtype)
    tok = target.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": s.turns[0]}], add_generation_prompt=True,
                                       return_tensors="pt", return_dict=True)["input_ids"]
               for s in load_mt_bench()[: cfg.max_prompts]]
    with tempfile.TemporaryDirectory() as tmp:
        path = export(str(cfg.draft), "hf", f"{tmp}/hf", target=cfg.target)
        draft = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, cfg.dtype)).eval()
    kw = dict(max_new_tokens=cfg.max_new_tokens, do_sample=False, pad_token_id=tok.eos_token_id)

    def run(**extra) -> tuple[float, list[torch.Tensor]]:
        target.model.generate(prompts[0], max_new_tokens=8, do_sample=False, pad_token_id=tok.eos_token_id,
                              **extra)  # warm-up
        outs, new, t0 = [], 0, time.perf_counter()
        for p in prompts:
            with torch.no_grad():
                o = target.model.generate(p, **kw, **extra)
            outs.append(o)
            new += o.shape[1] - p.shape[1]
        return new / (time.perf_counter() - t0), outs

    plain_s, plain = run()
    print(f"CPU class {hardware.cpu_class()} (capability {hardware.cpu_capability()}), {torch.get_num_threads()} "
          f"threads, {cfg.dtype}; {len(prompts)} MT-Bench first turns, {cfg.max_new_tokens} new tokens, greedy")
    print(f"plain generate: {plain_s:.1f} tokens/s")
    for k in cfg.num_assistant_tokens:
        draft.generation_config.num_assistant_tokens = int(k)
        draft.generation_config.num_assistant_tokens_schedule = "constant"
        tok_s, outs = run(assistant_model=draft)
        same = sum(torch.equal(a, b) for a, b in zip(outs, plain))
        print(f"assistant_model, {k} tokens a round: {tok_s:.1f} tokens/s = {tok_s / plain_s:.2f}x plain; "
              f"identical outputs {same}/{len(prompts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

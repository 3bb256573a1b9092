"""Acceptance metrics and the generation loop they are measured on.

Vocabulary: a *round* is one target verify forward. It checks the drafted tokens, accepts a prefix of
`accept_len` of them and adds one token of its own (the bonus), so it emits `accept_len + 1` tokens.
AR decoding is the special case of 0 drafted tokens: one token per forward.

The runtime's `GenerationResult.tokens` starts with the token of the prefill forward, which verifies
nothing and is not a round (`num_rounds` counts verify forwards after prefill). tau leaves it out of
both counts, so AR decoding has tau = 1 exactly and an always-accepted chain of k has tau = k + 1.
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from tqdm.auto import tqdm

from drafthead.eval.datasets import EvalSample, chat_prompt


@dataclass
class Generation:
    """One generated assistant turn of one sample."""
    sample_id: str
    category: str
    turn: int  # 0-based
    prompt_len: int
    result: Any  # drafthead.runtime.GenerationResult
    wall_s: float  # this turn's share of its batch's wall time
    text: str = ""

    @property
    def num_tokens(self) -> int:
        return len(self.result.tokens)


# ---------------------------------------------------------------------------------------------- metrics

def verified_tokens(result: Any) -> int:
    """Tokens emitted by verify rounds: all generated tokens but the first (the prefill's)."""
    return max(0, len(result.tokens) - 1)


def acceptance_length(results: Iterable[Any]) -> float | None:
    """tau = tokens emitted by verify rounds / verify rounds (bonus token included). None without rounds."""
    results = list(results)
    rounds = sum(r.num_rounds for r in results)
    return sum(verified_tokens(r) for r in results) / rounds if rounds else None


def mean_accepted(results: Iterable[Any]) -> float | None:
    """Mean accepted draft tokens per round (bonus excluded)."""
    lens = [a for r in results for a in r.accept_lens]
    return sum(lens) / len(lens) if lens else None


def acceptance_rate_by_position(results: Iterable[Any], max_positions: int | None = None) -> list[float | None]:
    """rate[i] = P(draft token i accepted | the round drafted at least i+1 tokens), i 0-based.

    Draft token i is accepted when accept_len > i (acceptance is a prefix). A position no round reached
    is None (no data), not 0.
    """
    rounds = _rounds(results)
    longest = max((d for _, d in rounds), default=0)
    n = longest if max_positions is None else min(max_positions, longest)
    rates: list[float | None] = []
    for i in range(n):
        drafted = [a for a, d in rounds if d >= i + 1]
        rates.append(sum(a > i for a in drafted) / len(drafted) if drafted else None)
    return rates


def conditional_acceptance_by_position(results: Iterable[Any], max_positions: int | None = None
                                      ) -> list[float | None]:
    """rate[i] = P(draft token i accepted | tokens 0..i-1 accepted and the round drafted at least i+1).

    Where `acceptance_rate_by_position` falls geometrically for any drafter, this curve tells a drafter whose
    later tokens follow from the earlier ones (it stays high) from one whose tokens are independent guesses
    (it stays at about rate[0]): the sign of a block drafter starved of supervision. None: no round got there.
    """
    rounds = _rounds(results)
    longest = max((d for _, d in rounds), default=0)
    n = longest if max_positions is None else min(max_positions, longest)
    rates: list[float | None] = []
    for i in range(n):
        reached = [a for a, d in rounds if d >= i + 1 and a >= i]
        rates.append(sum(a > i for a in reached) / len(reached) if reached else None)
    return rates


def _rounds(results: Iterable[Any]) -> list[tuple[int, int]]:
    """(accept_len, num_drafted) of every round, checked."""
    rounds = [(a, d) for r in results for a, d in zip(r.accept_lens, r.num_drafted, strict=True)]
    for a, d in rounds:
        if not 0 <= a <= d:
            raise ValueError(f"a round accepted {a} of {d} drafted tokens: accept_len must be in 0..num_drafted")
    return rounds


def summarize(gens: Sequence[Generation]) -> dict:
    """tau, tokens/s and counts of a set of generated turns."""
    results = [g.result for g in gens]
    tokens = sum(g.num_tokens for g in gens)
    wall = sum(g.wall_s for g in gens)
    return {"acceptance_length": acceptance_length(results), "mean_accepted_per_round": mean_accepted(results),
            "tokens_per_s": tokens / wall if wall > 0 else None, "num_generations": len(gens),
            "generated_tokens": tokens, "verify_rounds": sum(r.num_rounds for r in results),
            "target_forwards": sum(r.num_rounds + 1 for r in results),  # + the prefill of each turn
            "time_s": wall}


def by_category(gens: Sequence[Generation]) -> dict[str, dict]:
    cats: dict[str, list[Generation]] = {}
    for g in gens:
        cats.setdefault(g.category, []).append(g)
    return {c: summarize(gs) for c, gs in cats.items()}


def compare_outputs(spec: Sequence[Generation], ar: Sequence[Generation]) -> list[dict]:
    """Turns where the speculative output differs from AR, with the first differing index."""
    ar_by_key = {(g.sample_id, g.turn): g for g in ar}
    diffs = []
    for g in spec:
        ref = ar_by_key.get((g.sample_id, g.turn))
        if ref is None:
            diffs.append({"sample_id": g.sample_id, "turn": g.turn, "first_diff": 0, "reason": "no AR output"})
            continue
        a, b = list(g.result.tokens), list(ref.result.tokens)
        if a != b:
            first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            diffs.append({"sample_id": g.sample_id, "turn": g.turn, "first_diff": first,
                          "spec_len": len(a), "ar_len": len(b)})
    return diffs


# ------------------------------------------------------------------------------------------ generation

def generate_samples(generator: Any, tokenizer: Any, samples: Sequence[EvalSample], max_new_tokens: int,
                     spec: Any, desc: str = "generate", progress: bool = True) -> list[Generation]:
    """Run every turn of every sample with one spec (`generate_runs` with one run)."""
    return generate_runs(generator, tokenizer, samples, max_new_tokens, {"run": spec}, desc, progress)["run"]


def generate_runs(generator: Any, tokenizer: Any, samples: Sequence[EvalSample], max_new_tokens: int,
                  specs: dict[str, Any], desc: str = "generate", progress: bool = True) -> dict[str, list[Generation]]:
    """Run every turn of every sample once per spec; turn i+1 sees that run's own answer to turn i.

    The runs take turns batch by batch, in an order that alternates, so a machine whose speed drifts between
    minutes (a shared VM's can) slows every run alike and their tokens/s ratio stays fair; one run
    after the other put the drift into the speedup. Batches (spec.batch_size, the same for every run) never mix
    categories, so the wall time of each batch belongs to one category and per-category tokens/s is exact.
    """
    sizes = {max(1, int(getattr(sc, "batch_size", 1))) for sc in specs.values()}
    if len(sizes) != 1:
        raise ValueError(f"runs that take turns need one batch size, got {sorted(sizes)}")
    batch_size = sizes.pop()
    names = list(specs)
    history = {n: {s.id: [] for s in samples} for n in names}
    out: dict[str, list[Generation]] = {n: [] for n in names}
    num_turns = max((len(s.turns) for s in samples), default=0)
    bar = tqdm(total=len(names) * sum(len(s.turns) for s in samples), desc=desc, unit="turn", disable=not progress,
               dynamic_ncols=True)
    flip = False
    try:
        for turn in range(num_turns):
            todo = [s for s in samples if len(s.turns) > turn]
            for batch in _category_batches(todo, batch_size):
                for n in (names[::-1] if flip else names):
                    prompts = []
                    for s in batch:
                        history[n][s.id].append({"role": "user", "content": s.turns[turn]})
                        prompts.append(chat_prompt(tokenizer, history[n][s.id]))
                    t0 = time.perf_counter()
                    results = generator.generate(prompts, max_new_tokens, specs[n])
                    wall = time.perf_counter() - t0
                    if len(results) != len(batch):
                        raise RuntimeError(f"generator returned {len(results)} results for {len(batch)} prompts")
                    for s, p, r in zip(batch, prompts, results):
                        text = tokenizer.decode(list(r.tokens), skip_special_tokens=True)
                        history[n][s.id].append({"role": "assistant", "content": text})
                        out[n].append(Generation(s.id, s.category, turn, len(p), r, wall / len(batch), text))
                    bar.update(len(batch))
                flip = not flip
                tau = acceptance_length(g.result for g in out[names[0]] if g.turn == turn)
                bar.set_postfix(tau=f"{tau:.2f}" if tau else "-", refresh=False)
    finally:
        bar.close()
    return out


def warmup(generator: Any, tokenizer: Any, sample: EvalSample, spec: Any, max_new_tokens: int = 8) -> None:
    """One short untimed generation: first-call costs (allocations, kernel selection) stay out of tokens/s."""
    generator.generate([chat_prompt(tokenizer, [{"role": "user", "content": sample.turns[0]}])],
                       max_new_tokens, spec)


def _category_batches(samples: Sequence[EvalSample], batch_size: int) -> list[list[EvalSample]]:
    cats: dict[str, list[EvalSample]] = {}
    for s in samples:
        cats.setdefault(s.category, []).append(s)
    return [group[i: i + batch_size] for group in cats.values() for i in range(0, len(group), batch_size)]

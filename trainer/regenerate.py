"""The target's own answers: a dataset's assistant turns rewritten by the target (draft heads learn the target's
distribution), batched through vLLM's offline engine, our runtime's AR loop or HF `generate`; resumable.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from drafthead.trainer.data import Conversation, conv_line, eot_tokens, read_done, render_chat


@dataclass
class AnswerOptions:
    """How the target answers when it rewrites a dataset's answers (`data.regenerate`'s knobs)."""
    max_new_tokens: int = 512
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    batch_size: int = 8
    seed: int = 0
    max_turns: int = 1  # user turns answered, in order, each with the regenerated history
    chat_template: str | None = None
    enable_thinking: bool | None = None
    # conversations whose first prompt is longer keep their original answers: a batch runs at the length of its
    # longest prompt, and an answer behind a prompt longer than the training window is cut anyway
    max_prompt_tokens: int | None = None
    engine: str = "auto"  # vllm | ours | hf | auto (ours where it runs the architecture, else vLLM, else hf)
    vllm_python: str | None = None


ANSWER_ENGINES = ("auto", "vllm", "ours", "hf")


def _ar_runtime(target, eot: list[int]):
    """drafthead's own batched decoding loop (finished rows leave the batch, where HF `generate` keeps decoding
    them: docs/experiment_log.md has the comparison) when the runtime implements the architecture; None -> HF
    `generate`."""
    from drafthead.runtime.generate import SpeculativeGenerator
    from drafthead.runtime.model import SUPPORTED_MODEL_TYPES

    if getattr(target.model.config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return None
    g = SpeculativeGenerator(target, None, device=next(target.model.parameters()).device)
    g.eos |= set(eot)
    return g


class _Answerer:
    """Answers a batch of tokenized prompts with the engine `opts.engine` names: vLLM's offline engine (one
    process kept for the whole run, batches of `batch_size`), our runtime's batched AR loop where it runs the
    architecture, or HF `generate`. Answers stop at the first end-of-turn token (kept)."""

    def __init__(self, target, opts: AnswerOptions) -> None:
        tok, model = target.tokenizer, target.model
        self.eot = list(eot_tokens(tok))
        gen_eos = model.generation_config.eos_token_id
        self.eot += [i for i in ([gen_eos] if isinstance(gen_eos, int) else gen_eos or []) if i not in self.eot]
        self.tok, self.model, self.opts = tok, model, opts
        pad = tok.pad_token_id if tok.pad_token_id is not None else self.eot[0]
        self.gen_kw = dict(max_new_tokens=opts.max_new_tokens, do_sample=opts.temperature > 0, pad_token_id=pad,
                           eos_token_id=self.eot)
        if opts.temperature > 0:  # top_k=0: only top_p filters, whatever the model's generation_config says
            self.gen_kw.update(temperature=opts.temperature, top_p=opts.top_p, top_k=0)
        else:  # greedy; unset the sampling knobs some generation_configs carry (avoids warnings)
            self.gen_kw.update(temperature=None, top_p=None, top_k=None)
        if opts.engine not in ANSWER_ENGINES:
            raise ValueError(f"regenerate engine={opts.engine!r}: choose from {', '.join(ANSWER_ENGINES)}")
        self.vllm, self.vllm_python, self.why = None, None, ""
        # auto: our loop where it runs the architecture (on a 2-core CPU it answered ~7x vLLM's CPU build's tokens/s
        # at batch 8: docs/benchmarks.md), else vLLM where its environment works, else HF generate
        self.runtime = None if opts.engine in ("vllm", "hf") else _ar_runtime(target, self.eot)
        if opts.engine == "vllm" or (opts.engine == "auto" and self.runtime is None):
            from drafthead.eval import vllm

            try:
                self.vllm_python = vllm.find_python(opts.vllm_python)
            except vllm.VllmError as e:
                if opts.engine == "vllm":
                    raise
                self.why = f" (vLLM not used: {e})"
        if opts.engine == "ours" and self.runtime is None:
            raise ValueError(f"regenerate engine=ours: our runtime does not run model type "
                             f"{getattr(model.config, 'model_type', None)!r}; use engine=vllm or engine=hf")
        self.target = target

    def __enter__(self) -> _Answerer:
        if self.vllm_python is not None:  # one engine for the whole run: it takes ~20 s to start
            from drafthead.eval import vllm

            limit = getattr(self.model.config, "max_position_embeddings", None) or 4096
            self.vllm = vllm.Session(self.vllm_python, vllm.target_dir(self.target),
                                     str(self.model.dtype).removeprefix("torch."), limit, self.opts.batch_size)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.vllm is not None:
            self.vllm.close()
            self.vllm = None

    def describe(self) -> str:
        if self.vllm_python is not None:
            return f"vLLM's offline engine ({self.vllm_python}, batches of {self.opts.batch_size})"
        if self.runtime is None:
            return (f"HF generate (batches of {self.opts.batch_size}"
                    + ("" if self.opts.engine == "hf" else "; the runtime does not run this architecture") + ")"
                    + self.why)
        return f"our runtime's batched loop (batches of {self.opts.batch_size}); {self.runtime.model.paths()}{self.why}"

    def __call__(self, prompts: list[list[int]], seed: int) -> list[list[int]]:
        import torch

        from drafthead.runtime.generate import SpecConfig

        o = self.opts
        if self.vllm is not None:
            answers, _ = self.vllm.generate(prompts, o.max_new_tokens, o.temperature, o.top_p, seed, self.eot)
        elif self.runtime is not None:  # our batched loop: finished rows leave the batch
            spec = SpecConfig(mode="ar", temperature=o.temperature, top_p=o.top_p, seed=seed, batch_size=len(prompts))
            answers = [r.tokens for r in self.runtime.generate(prompts, o.max_new_tokens, spec)]
        else:
            enc = self.tok.pad({"input_ids": prompts}, padding=True, return_tensors="pt").to(self.model.device)
            with torch.no_grad():
                gen = self.model.generate(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                                          **self.gen_kw)
            answers = gen[:, enc["input_ids"].shape[1]:].tolist()  # [B, new]
        cut = [next((k for k, t in enumerate(ids) if t in self.eot), None) for ids in answers]
        return [ids if k is None else ids[:k + 1] for ids, k in zip(answers, cut)]


def _prompts_to_answer(tok, convs: list[Conversation], done: dict, opts: AnswerOptions) -> tuple[list, int]:
    """(id, leading system message, first max_turns user turns) of the conversations still to answer, longest
    first prompt first (similar lengths per batch: less padding), and how many were left out for a first
    prompt longer than max_prompt_tokens."""
    todo = []
    for c in convs:
        if c.id in done:
            continue
        system = [m for m in c.messages[:1] if m["role"] == "system"]
        users = [m for m in c.messages if m["role"] == "user"][:opts.max_turns]
        if users:
            todo.append((c.id, system, users))
    long_prompts = 0
    if opts.max_prompt_tokens is not None:
        def fits(item) -> bool:
            prompt = render_chat(tok, item[1] + item[2][:1], opts.chat_template, opts.enable_thinking,
                             add_generation_prompt=True)
            return len(tok(prompt, add_special_tokens=False)["input_ids"]) <= opts.max_prompt_tokens
        kept = [item for item in todo if fits(item)]
        long_prompts, todo = len(todo) - len(kept), kept
    todo.sort(key=lambda t: -len(t[2][0]["content"]))
    return todo, long_prompts


def _answer_batch(batch: list, tok, answer: _Answerer, opts: AnswerOptions, limit: int | None, seed: int
                  ) -> tuple[list[list[dict]], int]:
    """Each conversation's history with the target's answers, turn by turn (a conversation with no room left
    in the target's positions stops at its previous turn), and the new tokens generated."""
    hist = [list(sys_msg) for _, sys_msg, _ in batch]
    alive = list(range(len(batch)))
    new_tokens = 0
    for turn in range(opts.max_turns):
        rows = [i for i in alive if turn < len(batch[i][2])]
        for i in rows:
            hist[i].append(batch[i][2][turn])
        if not rows:
            break
        prompts = tok([render_chat(tok, hist[i], opts.chat_template, opts.enable_thinking, add_generation_prompt=True)
                       for i in rows], add_special_tokens=False)["input_ids"]
        if limit is not None:  # no room to answer: stop this conversation at the previous turn
            over = [i for i, p in zip(rows, prompts) if len(p) + opts.max_new_tokens > limit]
            for i in over:
                hist[i].pop()
                alive.remove(i)
            prompts = [p for i, p in zip(rows, prompts) if i not in over]
            rows = [i for i in rows if i not in over]
            if not rows:
                break
        for i, ids in zip(rows, answer(prompts, seed)):
            new_tokens += len(ids)
            hist[i].append({"role": "assistant", "content": tok.decode(ids, skip_special_tokens=True).strip()})
    return hist, new_tokens


def regenerate(target, convs: list[Conversation], out_path: str, opts: AnswerOptions | None = None
               ) -> list[Conversation]:
    """Replace assistant turns with the target's own answers (draft heads learn the target's distribution).

    Keeps the leading system message and the first `max_turns` user turns, answering each in order with
    the regenerated history. Resumable: finished conversations are appended to `out_path` (flushed per
    batch) and ids already there are skipped. Returns the regenerated conversations of `convs` (input order).
    """
    import torch

    opts = opts or AnswerOptions()
    if opts.max_turns < 1 or opts.batch_size < 1 or opts.max_new_tokens < 1:
        raise ValueError("max_turns, batch_size and max_new_tokens must be >= 1")
    tok = target.tokenizer
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = read_done(out)
    todo, long_prompts = _prompts_to_answer(tok, convs, done, opts)
    if long_prompts:
        print(f"regenerate: {long_prompts} conversations keep their original answers: first prompt longer than "
              f"max_prompt_tokens={opts.max_prompt_tokens}", flush=True)
    answer = _Answerer(target, opts)
    print(f"regenerate: {answer.describe()}", flush=True)
    limit = getattr(target.model.config, "max_position_embeddings", None)
    side, tok.padding_side = tok.padding_side, "left"
    too_long, new_tokens, t0 = 0, 0, time.time()
    try:
        with answer, open(out, "ab") as f, tqdm(total=len(todo), desc="regenerate", unit="conv",
                                                 dynamic_ncols=True) as bar:
            for b in range(0, len(todo), opts.batch_size):
                batch = todo[b:b + opts.batch_size]
                torch.manual_seed(opts.seed + b)
                hist, n = _answer_batch(batch, tok, answer, opts, limit, opts.seed + b)
                new_tokens += n
                lines = []
                for (cid, _, _), h in zip(batch, hist):
                    if any(m["role"] == "assistant" for m in h):
                        done[cid] = Conversation(cid, h)
                        lines.append(conv_line(done[cid]))
                    else:
                        too_long += 1
                f.write(b"".join(lines))
                f.flush()
                os.fsync(f.fileno())
                bar.update(len(batch))
                bar.set_postfix(tok_s=f"{new_tokens / max(time.time() - t0, 1e-9):.1f}")
    finally:
        tok.padding_side = side
    if too_long:
        print(f"regenerate: {too_long} conversations not written: the first prompt + max_new_tokens exceeds "
              f"the target's {limit} positions", flush=True)
    if todo:
        took = time.time() - t0
        print(f"regenerate: {len(todo)} conversations, {new_tokens} new tokens in {took:.1f} s "
              f"({new_tokens / max(took, 1e-9):.1f} tok/s, engine start included)", flush=True)
    return [done[c.id] for c in convs if c.id in done]


PROBE_NEW_TOKENS = 32  # new tokens a probe batch decodes: enough for the loop's steady rate, a few seconds


def measure(target, convs: list[Conversation], opts: AnswerOptions) -> dict[str, float]:
    """What the time budget needs to plan regeneration (trainer/budget.py `Rates`): the engine's new tokens/s at
    `opts.batch_size` (one warm-up batch, then one timed batch of PROBE_NEW_TOKENS each), the new tokens an answer
    is expected to take (the data's first answers, capped at `max_new_tokens`: the target's own are often shorter,
    which the run's re-fit after capture takes back), and the share of conversations whose first prompt fits."""
    import dataclasses

    tok = target.tokenizer
    todo, long_prompts = _prompts_to_answer(tok, convs, {}, opts)
    if not todo:
        return {"regen_tok_s": 0.0, "answer_tokens": 0.0, "answerable_frac": 0.0}
    lengths = []
    for c in convs:
        first = next((m["content"] for m in c.messages if m["role"] == "assistant"), "")
        lengths.append(min(opts.max_new_tokens, len(tok(first, add_special_tokens=False)["input_ids"])))
    short = dataclasses.replace(opts, max_new_tokens=PROBE_NEW_TOKENS, max_turns=1)
    answer = _Answerer(target, short)
    side, tok.padding_side = tok.padding_side, "left"
    try:
        with answer:
            batches = [todo[i * opts.batch_size:(i + 1) * opts.batch_size] for i in range(2)]
            _answer_batch(batches[0], tok, answer, short, None, opts.seed)  # warm-up: kernels, caches
            t = time.perf_counter()
            _, n = _answer_batch(batches[1] or batches[0], tok, answer, short, None, opts.seed)
            took = time.perf_counter() - t
    finally:
        tok.padding_side = side
    return {"regen_tok_s": n / max(took, 1e-9), "answer_tokens": sum(lengths) / len(lengths),
            "answerable_frac": len(todo) / (len(todo) + long_prompts)}

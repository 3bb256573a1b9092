"""One vLLM run, inside vLLM's own environment (scripts/make_vllm_env.sh): never imported by drafthead.

    VLLM_PYTHON eval/vllm_worker.py JOB.json OUT.json     # one configuration over the job's prompts
    VLLM_PYTHON eval/vllm_worker.py --serve JOB.json      # one engine answering batches from stdin (regeneration)

vLLM pins transformers below drafthead's, so it lives in a venv of its own and this file is its only contact with
drafthead: it imports nothing of ours. The job names the target directory, the prompts (token ids, so both
runtimes see exactly the same prompt; or conversations of user turns, templated as drafthead eval templates them),
the sampling and one engine configuration (with or without a draft). The result holds each turn's generated ids
and decode time, and the spec-decode counters vLLM keeps (drafts, drafted and accepted tokens, accepted by
position) as differences over the timed turns alone. One process per configuration: vLLM's engine keeps its
threads and memory for the life of the process.
"""
from __future__ import annotations

import json
import os
import sys
import time

# run as a file, Python puts this folder first on sys.path, where drafthead's own eval/vllm.py would shadow vLLM
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]


def counters(llm) -> dict:
    """vLLM's spec-decode counters now (cumulative since the engine started)."""
    out = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_pos": []}
    for m in llm.get_metrics():
        key = m.name.removeprefix("vllm:spec_decode_")
        if m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            out["accepted_per_pos"] = list(m.values)
        elif key in out and hasattr(m, "value"):
            out[key] = int(m.value)
    return out


def difference(after: dict, before: dict) -> dict:
    pos = [a - (before["accepted_per_pos"][i] if i < len(before["accepted_per_pos"]) else 0)
           for i, a in enumerate(after["accepted_per_pos"])]
    return {**{k: after[k] - before[k] for k in after if k != "accepted_per_pos"}, "accepted_per_pos": pos}


def chat_ids(tok, messages: list[dict]) -> list[int]:
    """A conversation through the target's chat template, as drafthead's eval builds it (text, then ids)."""
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tok.encode(text, add_special_tokens=False))


def engine(job: dict):
    """vLLM's offline engine for the job's target (and draft), with its stats on (the spec-decode counters)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(job.get("kv_cache_gib", 2)))
    from vllm import LLM

    return LLM(model=job["model"], tokenizer=job["model"], dtype=job["dtype"], max_model_len=job["max_model_len"],
               enforce_eager=job.get("enforce_eager", True), seed=job.get("seed", 0), disable_log_stats=False,
               speculative_config=job.get("speculative_config"),
               max_num_seqs=job.get("max_num_seqs", job.get("batch_size", 1)))


def serve(job_path: str) -> None:
    """Keep one engine and answer batches read from stdin, one JSON line each ({"prompts": [[ids]], "max_tokens",
    "temperature", "top_p", "seed", "stop_token_ids"}), with one line each on stdout ({"outputs": [[ids]], "s"}):
    regeneration sends thousands of prompts, and a process per batch would spend most of its time starting."""
    answer = os.fdopen(os.dup(1), "w")  # the answers' channel: stdout as it was given
    os.dup2(2, 1)  # everything else written to stdout (vLLM's logs, prints) goes to stderr from here on
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = engine(json.loads(open(job_path).read()))
    print(json.dumps({"ready": True}), file=answer, flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        params = SamplingParams(temperature=req.get("temperature", 0.0), top_p=req.get("top_p", 1.0),
                                max_tokens=req["max_tokens"], seed=req.get("seed", 0),
                                stop_token_ids=req.get("stop_token_ids") or None)
        t = time.perf_counter()
        res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in req["prompts"]], params, use_tqdm=False)
        print(json.dumps({"outputs": [list(r.outputs[0].token_ids) for r in res], "s": time.perf_counter() - t}),
              file=answer, flush=True)


def main(job_path: str, out_path: str) -> None:
    job = json.loads(open(job_path).read())
    import torch
    import vllm
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = engine(job)
    startup = time.perf_counter() - t0
    params = SamplingParams(temperature=job.get("temperature", 0.0), top_p=job.get("top_p", 1.0),
                            max_tokens=job["max_tokens"], ignore_eos=job.get("ignore_eos", False),
                            seed=job.get("seed", 0))
    tok = llm.get_tokenizer()
    first = job["prompts"][0] if job.get("prompts") else chat_ids(tok, [{"role": "user",
                                                                         "content": job["conversations"][0][0]}])
    llm.generate([TokensPrompt(prompt_token_ids=first)], SamplingParams(temperature=0.0, max_tokens=8),
                 use_tqdm=False)  # warm-up
    before = counters(llm)
    records = []

    def decode(prompts: list[list[int]]) -> list[list[int]]:
        """Batch 1 by default, as drafthead eval decodes; each call's wall time shared by its prompts."""
        out, batch = [], job.get("batch_size", 1)
        for i in range(0, len(prompts), batch):
            t = time.perf_counter()
            res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts[i: i + batch]], params,
                               use_tqdm=False)
            wall = time.perf_counter() - t
            out += [(list(r.outputs[0].token_ids), wall / len(res)) for r in res]
        return out

    if job.get("prompts"):  # token ids as given
        for i, (ids, wall) in enumerate(decode(job["prompts"])):
            records.append({"sample": i, "turn": 0, "prompt_len": len(job["prompts"][i]), "tokens": ids, "s": wall})
    else:  # conversations: turn t+1 sees this run's own answer to turn t, as drafthead eval's runs do
        convs = job["conversations"]
        history: list[list[dict]] = [[] for _ in convs]
        for turn in range(max(len(c) for c in convs)):
            todo = [i for i, c in enumerate(convs) if len(c) > turn]
            prompts = []
            for i in todo:
                history[i].append({"role": "user", "content": convs[i][turn]})
                prompts.append(chat_ids(tok, history[i]))
            for i, p, (ids, wall) in zip(todo, prompts, decode(prompts)):
                history[i].append({"role": "assistant", "content": tok.decode(ids, skip_special_tokens=True)})
                records.append({"sample": i, "turn": turn, "prompt_len": len(p), "tokens": ids, "s": wall})
    result = {"name": job.get("name", ""), "records": records, "startup_s": startup,
              "spec": difference(counters(llm), before), "vllm_version": vllm.__version__,
              "torch_version": torch.__version__,
              "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")}
    tmp = out_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, out_path)


if __name__ == "__main__":
    serve(sys.argv[2]) if sys.argv[1] == "--serve" else main(*sys.argv[1:3])

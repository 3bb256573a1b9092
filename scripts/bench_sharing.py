"""Two decoding processes on one machine: each one's time beside the other over its time alone.

    python scripts/bench_sharing.py                         # AR decode of SmolLM2, settings off,on
    python scripts/bench_sharing.py settings=off,on,passive,one_thread new=128 reps=2

Each setting runs the same decode (our runtime, greedy, `new` tokens from a fixed chat prompt) once alone and
once as two processes started together, after both have loaded the target and warmed up; the two wait on
one signal, so their decodes overlap. Settings:
  off         `DRAFTHEAD_SHARE_CORES=0`: torch's threads as set, whoever else runs
  on          the default: `drafthead.cores` drops to the cores other processes leave free
  passive     off, and `OMP_WAIT_POLICY=PASSIVE`: libgomp's threads sleep at barriers instead of spinning
  one_thread  off, and one torch thread per process
Alone-vs-pair is the figure; settings run in turn within one call, so their ratios compare.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

SETTINGS = {"off": ({"DRAFTHEAD_SHARE_CORES": "0"}, 0),
            "on": ({}, 0),
            "passive": ({"DRAFTHEAD_SHARE_CORES": "0", "OMP_WAIT_POLICY": "PASSIVE"}, 0),
            "one_thread": ({"DRAFTHEAD_SHARE_CORES": "0"}, 1)}
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


@dataclass
class Config:
    settings: str = "off,on"  # comma-separated names from SETTINGS
    new: int = 128  # tokens each decode generates
    reps: int = 1  # alone/pair measurements per setting
    target: str = "smollm2-135m-instruct"  # the target: a built-in name or a path
    child: bool = False  # internal: be one decoding process
    threads: int = 0  # internal: torch threads of a child (0: torch's default)


def child(cfg: Config) -> None:
    import torch

    from drafthead import cores
    from drafthead.runtime import SpecConfig, SpeculativeGenerator
    from drafthead.target import load_target

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    target = load_target(cfg.target)
    prompt = list(target.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}],
                                                        add_generation_prompt=True, tokenize=True, return_dict=False))
    gen = SpeculativeGenerator(target)
    gen.generate([prompt], 8, SpecConfig(mode="ar"))  # warm-up: kernels built and paged in
    print("ready", flush=True)
    sys.stdin.readline()
    t = time.perf_counter()
    (r,) = gen.generate([prompt], cfg.new, SpecConfig(mode="ar"))
    dt = time.perf_counter() - t
    print(json.dumps({"s": dt, "tokens": len(r.tokens), "threads_changes": cores.watcher().changes}), flush=True)


def run_group(cfg: Config, name: str, n: int) -> list[dict]:
    env_add, threads = SETTINGS[name]
    env = {**os.environ, **env_add}
    argv = [sys.executable, __file__, "child=true", f"new={cfg.new}", f"target={cfg.target}", f"threads={threads}"]
    logs = [tempfile.TemporaryFile("w+") for _ in range(n)]  # a pipe could fill while the parent waits
    procs = [subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
             for log in logs]
    for p in procs:
        while (line := p.stdout.readline()) and line.strip() != "ready":
            pass
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    out = []
    for p, log in zip(procs, logs):
        text, _ = p.communicate()
        if p.returncode:
            log.seek(0)
            raise SystemExit(f"bench_sharing: a child failed (rc {p.returncode}):\n{log.read()[-3000:]}")
        out.append(json.loads(text.strip().splitlines()[-1]))
    return out


def main() -> None:
    from drafthead import hardware, options

    cfg = options.script_options(Config, sys.argv[1:], "python scripts/bench_sharing.py [key=value ...]", __doc__)
    if cfg is None:
        return
    if cfg.child:
        return child(cfg)
    names = [s for s in cfg.settings.split(",") if s]
    bad = [s for s in names if s not in SETTINGS]
    if bad:
        raise SystemExit(f"unknown settings {bad}; known: {', '.join(SETTINGS)}")
    print(f"CPU class {hardware.cpu_class()}, {os.cpu_count()} CPUs, {cfg.new} tokens AR per process")
    rows = {s: {"alone": [], "pair": [], "changes": []} for s in names}
    for _ in range(cfg.reps):
        for s in names:
            (a,) = run_group(cfg, s, 1)
            pair = run_group(cfg, s, 2)
            rows[s]["alone"].append(a["s"])
            rows[s]["pair"] += [p["s"] for p in pair]
            rows[s]["changes"] += [p["threads_changes"] for p in pair]
    print("| setting | alone s | beside another s (each) | ratio | thread changes in the pair |")
    print("|---|---|---|---|---|")
    for s, r in rows.items():
        alone, pair = statistics.median(r["alone"]), statistics.mean(r["pair"])
        print(f"| {s} | {alone:.2f} | {' / '.join(f'{x:.2f}' for x in r['pair'])} | {pair / alone:.2f}x "
              f"| {r['changes']} |")


if __name__ == "__main__":
    main()

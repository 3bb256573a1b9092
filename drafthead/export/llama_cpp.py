"""Run llama.cpp's tools on our GGUF drafts: build/find the binaries, run target-alone and speculative
generation, read their numbers. Used by tests/test_llama_cpp.py and scripts/bench_llama_cpp.py.

Binaries come from scripts/build_llama_cpp.sh (llama.cpp vendored in the llama-cpp-python 0.3.36 sdist,
built once into ${DRAFTHEAD_CACHE:-~/.cache/drafthead}/llama.cpp/build/bin).
"""
from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from drafthead.assets import cache_dir

TOOLS = ("llama-speculative-simple", "llama-completion", "llama-bench")


def default_threads() -> int:
    """-t for llama.cpp: DRAFTHEAD_LLAMA_THREADS, else 2 on an idle machine and 1 on a busy one (ggml's
    spinning thread pool slows down a hundredfold when its 2 threads share 2 busy cores)."""
    import os

    if os.environ.get("DRAFTHEAD_LLAMA_THREADS"):
        return int(os.environ["DRAFTHEAD_LLAMA_THREADS"])
    n = min(2, os.cpu_count() or 1)
    return n if os.getloadavg()[0] < max(1.0, (os.cpu_count() or 1) - n + 0.5) else 1


def llama_cpp_source() -> Path:
    """The vendored llama.cpp tree the build script unpacked (for convert_hf_to_gguf.py cross-checks)."""
    return cache_dir() / "llama.cpp" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"


def build_script() -> Path:
    return Path(__file__).resolve().parents[2] / "scripts" / "build_llama_cpp.sh"


def llama_cpp_bin(build: bool = True) -> Path:
    """Directory with the llama.cpp tools. With `build`, runs scripts/build_llama_cpp.sh, which returns at
    once when its cached build is current and otherwise builds (~15 min on 2 cores)."""
    bin_dir = cache_dir() / "llama.cpp" / "build" / "bin"
    script = build_script()
    if build and script.is_file():
        res = subprocess.run(["bash", str(script)], capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"building llama.cpp failed:\n{res.stderr[-3000:]}")
        return Path(res.stdout.strip().splitlines()[-1])
    if all((bin_dir / t).is_file() for t in TOOLS):
        return bin_dir
    raise FileNotFoundError(f"llama.cpp tools not built in {bin_dir}: run scripts/build_llama_cpp.sh "
                            f"(from a drafthead source checkout)")


def chat_prompt(tokenizer, user: str) -> str:
    """The target's chat template around one user turn, ready for generation (text, special tokens inline)."""
    return tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                         add_generation_prompt=True)


@dataclass
class Run:
    text: str  # generated text only (prompt stripped)
    log: str  # stderr (llama.cpp's log)
    n_drafted: int = 0
    n_accept: int = 0
    decode_tok_s: float | None = None  # llama.cpp's own "decoded N tokens ... speed"
    n_decoded: int = 0
    decode_s: float | None = None
    accept_by_pos: list[float] | None = None  # share of verify rounds that accepted draft position i (-lv 4)

    @property
    def accept_rate(self) -> float | None:
        return self.n_accept / self.n_drafted if self.n_drafted else None


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        raise RuntimeError(f"{Path(cmd[0]).name} failed ({res.returncode}):\n{res.stderr[-3000:]}")
    return res


# the prompt goes in with -p: `-f FILE` drops a final newline (common/arg.cpp), which changes the
# tokens of a chat prompt ending in "assistant\n"
COMMON = ["--temp", "0", "--seed", "0", "-c", "2048"]


def _poll(poll: int | None) -> list[str]:
    """--poll 0 makes ggml's worker threads sleep instead of spin (the draft context follows --poll):
    ~10% slower on an idle machine, but no collapse when the cores are shared. Tests use it;
    benchmarks keep llama.cpp's default."""
    return [] if poll is None else ["--poll", str(poll)]


def run_target(bins: Path, model: Path, prompt: str, n_predict: int, threads: int = 2,
               timeout: float = 600, poll: int | None = None) -> Run:
    """Greedy generation by the target alone (llama-completion, no conversation mode)."""
    res = _run([str(bins / "llama-completion"), "-m", str(model), "-p", prompt, "-n", str(n_predict),
                "-t", str(threads), "-no-cnv", "--no-display-prompt", *COMMON, *_poll(poll)], timeout)
    # stdout: generated pieces + (" [end of text]\n" at EOS) + "\n\n"
    text = res.stdout.removesuffix("\n\n").removesuffix(" [end of text]\n")
    m = re.search(r"eval time =\s*([\d.]+) ms /\s*(\d+) runs", res.stderr)
    run = Run(text=text, log=res.stderr)
    if m:
        run.decode_s, run.n_decoded = float(m.group(1)) / 1e3, int(m.group(2))
        run.decode_tok_s = run.n_decoded / run.decode_s if run.decode_s else None
    return run


def run_speculative(bins: Path, target: Path, draft: Path, prompt: str, n_predict: int, n_draft: int = 3,
                    threads: int = 2, timeout: float = 600, verbose: bool = False, poll: int | None = None,
                    spec_type: str = "draft-eagle3", extra: list[str] | tuple[str, ...] = ()) -> Run:
    """llama-speculative-simple with our draft (`spec_type` draft-eagle3 | draft-dflash | draft-simple);
    returns text and llama.cpp's own counters. `verbose` keeps the model-loading log and the per-position
    statistics (-lv 4), e.g. `load_arch_hparams: EAGLE3 extract_layers = [..]`; `extra` more arguments."""
    res = _run([str(bins / "llama-speculative-simple"), "-m", str(target), "-md", str(draft),
                "--spec-type", spec_type, "--spec-draft-n-max", str(n_draft), "-p", prompt,
                "-n", str(n_predict), "-t", str(threads), "-td", str(threads), *COMMON, *_poll(poll),
                *(["-lv", "4"] if verbose else []), *extra], timeout)
    # stdout: "\n\n" + prompt pieces + generated pieces + "\n\n" + "\n\n"
    body = res.stdout.removeprefix("\n\n").removesuffix("\n\n\n\n")
    if not body.startswith(prompt):
        raise RuntimeError(f"llama-speculative-simple did not echo the prompt as expected:\n{res.stdout[:500]!r}")
    text = body[len(prompt):]
    log = res.stderr

    def grab(pattern: str, cast=int):
        m = re.search(pattern, log)
        return cast(m.group(1)) if m else None

    run = Run(text=text, log=log, n_drafted=grab(r"n_drafted\s*=\s*(\d+)") or 0,
              n_accept=grab(r"n_accept\s*=\s*(\d+)") or 0)
    m = re.search(r"#acc rate/pos = \(([\d., ]+)\)", log)  # with -lv 4: share of rounds accepting position i
    if m:
        run.accept_by_pos = [float(x) for x in m.group(1).split(",")]
    m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s", log)
    if m:
        run.n_decoded, run.decode_s, run.decode_tok_s = int(m.group(1)), float(m.group(2)), float(m.group(3))
    return run


def verify_cost(bins: Path, model: Path, sizes: list[int], depth: int = 256, threads: int = 2,
                repetitions: int = 5, timeout: float = 900) -> dict[int, float]:
    """Seconds for the target to evaluate a batch of n tokens after `depth` tokens of context
    (llama-bench -p n -n 0 -d depth): the cost of one verify round with n-1 drafted tokens."""
    res = _run([str(bins / "llama-bench"), "-m", str(model), "-p", ",".join(map(str, sizes)), "-n", "0",
                "-d", str(depth), "-t", str(threads), "-r", str(repetitions), "-o", "json"], timeout)
    rows = json.loads(res.stdout)
    return {int(r["n_prompt"]): float(r["avg_ns"]) / 1e9 for r in rows if int(r.get("n_gen", 0)) == 0}

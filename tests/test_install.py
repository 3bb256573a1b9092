"""Install range and optional dependencies: drafthead installs beside an engine's own torch (2.11-2.14), every
module imports without DeepSpeed, wandb and Triton, and a run that asks for a missing one gets a named error."""
from __future__ import annotations

import subprocess
import sys
import tomllib
import warnings
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.version import Version

from drafthead import optional
from drafthead.kernels import verify
from trainer.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
OPTIONAL = ("deepspeed", "wandb", "triton")


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_torch_range_admits_the_engines_torch_and_the_cpu_default() -> None:
    reqs = {Requirement(r).name: Requirement(r) for r in project()["dependencies"]}
    torch_spec = reqs["torch"].specifier
    for v in ("2.11.0", "2.12.1", "2.13.0", "2.14.1"):  # 2.11: SGLang 0.5.14 / SpecForge and the GPU image
        assert torch_spec.contains(v), v
    assert not torch_spec.contains("2.10.0") and not torch_spec.contains("2.15.0")  # untested: outside
    assert torch_spec.contains(Version(torch.__version__).base_version)
    pinned = [Requirement(line) for line in (ROOT / "constraints" / "cpu.txt").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    assert [str(r) for r in pinned] == ["torch==2.13.0"] and torch_spec.contains("2.13.0")
    assert not set(OPTIONAL) & set(reqs)  # heavy parts are extras
    extras = project()["optional-dependencies"]
    assert {Requirement(r).name for r in extras["deepspeed"]} == {"deepspeed"}
    assert {Requirement(r).name for r in extras["wandb"]} == {"wandb"}


def test_readme_and_ci_install_with_the_cpu_constraints() -> None:
    readme = (ROOT / "README.md").read_text().splitlines()
    assert readme[3] == "pip install -c constraints/cpu.txt -e . && python train.py"
    ci = (ROOT / ".ci" / "run").read_text().splitlines()[-1]
    assert readme[4] == ci == "pip install -q -c constraints/cpu.txt -e '.[dev]' && python -m pytest -q -ra"


def test_every_module_imports_without_the_optional_parts() -> None:
    mods = sorted({".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
                   for pkg in ("drafthead", "trainer", "eval") for p in (ROOT / pkg).rglob("*.py")}
                  - {"drafthead.kernels.triton_kernels"})  # the Triton kernels themselves
    code = ("import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in OPTIONAL) +
            "import importlib\n" + "".join(f"importlib.import_module({m!r})\n" for m in mods) +
            "from drafthead.kernels import verify\nimport torch\n"
            "assert verify._resolve('auto', torch.device('cpu')) == 'torch'\nprint('ok', len(sys.modules))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 0 and p.stdout.startswith("ok"), p.stderr[-3000:]


def test_missing_deepspeed_is_named_at_parse(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    assert not optional.installed("deepspeed")
    with pytest.raises(ConfigError, match=r"train.deepspeed=zero2 needs DeepSpeed, which is not installed here: "
                                          r"pip install 'drafthead\[deepspeed\]', or train.deepspeed=null"):
        load_config(["recipe=eagle3_qwen", f"output_dir={tmp_path}"])
    with pytest.raises(optional.MissingDependency, match=r"zero3 needs deepspeed.*drafthead\[deepspeed\]"):
        optional.require("deepspeed", "train.deepspeed=zero3")
    assert load_config(["recipe=eagle3_qwen", f"output_dir={tmp_path}", "train.deepspeed=null"]).train.deepspeed is None


def test_missing_wandb_says_so_and_keeps_metrics(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys) -> None:
    from trainer.dist import Dist
    from trainer.engine import Logger

    monkeypatch.setitem(sys.modules, "wandb", None)
    cfg = load_config([f"output_dir={tmp_path}", "logging.wandb=true"])
    log = Logger(tmp_path, cfg, Dist(), {})
    log.log({"step": 1, "loss": 2.0})
    log.close()
    out = capsys.readouterr().out
    assert "wandb disabled (metrics go to" in out and "pip install 'drafthead[wandb]'" in out
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1


def test_cuda_without_triton_warns_once_and_uses_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken():
        raise RuntimeError("backend='triton' needs a working triton install (No module named 'triton')")

    monkeypatch.setattr(verify, "_triton_kernels", broken)
    verify._say_no_triton.cache_clear()
    cuda = torch.device("cuda")  # only its type is read: no GPU needed
    with pytest.warns(UserWarning, match="CUDA tensors use the PyTorch reference"):
        assert verify._resolve("auto", cuda) == "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert verify._resolve("auto", cuda) == "torch"  # once a process
    with pytest.raises(RuntimeError, match="needs a working triton install"):
        verify._resolve("triton", cuda)


def test_version_is_the_package_version(capsys) -> None:
    import drafthead
    from drafthead.cli import main

    assert drafthead.__version__ == project()["version"]
    assert main(["--version"]) == 0 and capsys.readouterr().out == f"drafthead {project()['version']}\n"
    assert main(["--help"]) == 0 and "drafthead --version" in capsys.readouterr().out

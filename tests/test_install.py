"""Install range and optional dependencies: drafthead installs beside an engine's own torch (2.11-2.14), every
module imports without DeepSpeed, wandb and Triton, and a run that asks for a missing one gets a named error."""
from __future__ import annotations

import os
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
from drafthead.trainer.config import ConfigError, load_config

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
    script = (ROOT / ".ci" / "run").read_text().splitlines()
    ci = script[-1]
    assert readme[4] == ci == "pip install -q -c constraints/cpu.txt -e '.[dev]' && python -m pytest -q -ra"
    # ... inside a virtual environment of its own, so the machine's own packages cannot hide a missing install
    made = next(i for i, line in enumerate(script) if '-m venv "$tmp/venv"' in line)
    entered = next(i for i, line in enumerate(script) if line.strip() == 'source "$tmp/venv/bin/activate"')
    assert made < entered < len(script) - 1


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
    from drafthead.trainer.dist import Dist
    from drafthead.trainer.metrics import Logger

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


def test_the_package_list_covers_the_tree() -> None:
    """pyproject.toml names every package: each folder with an __init__.py under drafthead/, trainer/ and eval/
    (installed as drafthead.*), and recipes/ as package data, so a non-editable install misses nothing."""
    st = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    where = {"drafthead": "drafthead", "trainer": "drafthead.trainer", "eval": "drafthead.eval"}
    found = {".".join([where[p.relative_to(ROOT).parts[0]], *p.parent.relative_to(ROOT).parts[1:]])
             for top in where for p in (ROOT / top).rglob("__init__.py")}
    assert found <= set(st["packages"]), found - set(st["packages"])
    assert st["package-dir"] == {"drafthead.trainer": "trainer", "drafthead.eval": "eval",
                                 "drafthead.recipes": "recipes"}
    assert {"drafthead.recipes", "drafthead.recipes.deepspeed"} <= set(st["packages"])


@pytest.mark.slow
def test_a_wheel_trains_from_any_directory(tmp_path: Path, tiny_llama_dir, tiny_sharegpt) -> None:
    """The built wheel alone (no checkout on the path) holds trainer, eval, recipes and kernels: `drafthead train`
    run from an empty folder with it trains and saves, and `drafthead --version` answers."""
    import zipfile

    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(wheels), str(ROOT)], check=True, capture_output=True)
    (wheel,) = wheels.glob("drafthead-*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        z.extractall(site)
    for f in ("drafthead/trainer/run.py", "drafthead/eval/bench.py", "drafthead/recipes/eagle3_smollm2.yaml",
              "drafthead/recipes/deepspeed/zero2.json", "drafthead/kernels/cpu_linear.cpp"):
        assert f in names, f
    assert not any(n.startswith(("trainer/", "eval/", "recipes/")) for n in names)  # nothing at the top level
    work = tmp_path / "elsewhere"
    work.mkdir()
    kv = {"recipe": "eagle3_smollm2", "budget.minutes": "null", "target.name_or_path": tiny_llama_dir,
          "target.dtype": "float32", "data.dataset": tiny_sharegpt, "data.max_samples": 16, "data.num_holdout": 4,
          "data.max_length": 96, "drafter.eagle3.draft_vocab_size": 128, "capture.layer_ids": "[1,2,3]",
          "train.max_steps": 4, "train.batch_size": 2, "train.dtype": "float32", "logging.progress": "false",
          "output_dir": "run"}
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import drafthead.cli as c; "
            "assert c.__file__.startswith(sys.argv[1]), c.__file__; sys.exit(c.main(sys.argv[2:]))")
    # the installed copy's kernels build from its own sources, here rather than beside the checkout's build
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "DRAFTHEAD_KERNEL_CACHE": str(tmp_path / "k")}
    r = subprocess.run([sys.executable, "-c", code, str(site), "train", *[f"{k}={v}" for k, v in kv.items()]],
                       cwd=work, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (work / "run" / "final" / "model.safetensors").is_file()
    r = subprocess.run([sys.executable, "-c", code, str(site), "--version"], cwd=work, capture_output=True,
                       text=True, env=env, check=True)
    assert r.stdout.startswith("drafthead ")

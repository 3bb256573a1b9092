"""Optional heavy dependencies (DeepSpeed, wandb, Triton): imported only where a run uses them, so drafthead
installs beside SGLang / vLLM environments without them; a run that asks for a missing one gets a named error
that says which extra brings it."""
from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

EXTRAS = {"deepspeed": "deepspeed", "wandb": "wandb", "triton": "triton"}  # module -> drafthead extra


class MissingDependency(ImportError):
    """An optional package a requested feature needs is not installed (or does not import)."""


def installed(module: str) -> bool:
    """Whether `module` can be found, without importing it (importing DeepSpeed takes seconds)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: sys.modules[module] is None (blocked)
        return False


def hint(module: str) -> str:
    extra = EXTRAS.get(module)
    return f"pip install 'drafthead[{extra}]'" if extra else f"pip install {module}"


def require(module: str, what: str) -> ModuleType:
    """Import `module` for `what` (e.g. "train.deepspeed=zero2"), or raise MissingDependency naming both."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingDependency(f"{what} needs {module}, which does not import here ({e}); {hint(module)}") from e

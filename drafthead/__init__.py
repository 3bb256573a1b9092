"""drafthead: train, measure and export speculative-decoding draft heads for a frozen target LLM."""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("drafthead")  # the installed distribution's (pyproject.toml)
except PackageNotFoundError:  # a checkout on sys.path, not installed
    __version__ = "0.1.0+checkout"

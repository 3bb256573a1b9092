"""`drafthead <command> key=value ...`: thin entry points into the library, trainer and eval.

Commands are "module:function" strings imported only when run, so the library's own modules do not import
`drafthead.eval` or `drafthead.trainer` (and a command's heavy imports do not slow down the others).
"""
from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass
from typing import Any

from drafthead.options import HELP_FLAGS, wants_help


@dataclass(frozen=True)
class Command:
    run: str  # "module:function" taking the arguments, returning the exit code
    help: str  # "module:function" taking the arguments, returning the --help text
    summary: str


COMMANDS: dict[str, Command] = {
    "train": Command("drafthead.trainer.run:cli", "drafthead.trainer.config:help_text",
                     "train a draft for a target (recipe=NAME key.sub=value ...; torchrun for several ranks)"),
    "capture": Command("drafthead.trainer.commands:capture", "drafthead.trainer.commands:help_text",
                       "capture a recipe's target features offline, resumable, for capture.mode=offline"),
    "eval": Command("drafthead.eval.command:main", "drafthead.eval.command:help_text",
                    "tau, acceptance by position, speedup and losslessness of a draft, in our runtime and vLLM"),
    "bench": Command("drafthead.eval.bench:main", "drafthead.eval.bench:help_text",
                     "decoding speed of every method (ours, HF, n-gram, prompt lookup, the draft) and verify cost"),
    "export": Command("drafthead.export:main", "drafthead.export:help_text",
                      "write a draft in a format an engine serves (vLLM, SGLang, speculators, llama.cpp, peft)"),
}


def _load(spec: str) -> Any:
    module, func = spec.split(":")
    return getattr(importlib.import_module(module), func)


def usage() -> str:
    width = max(map(len, COMMANDS))
    rows = "\n".join(f"  {name:<{width}}  {c.summary}" for name, c in COMMANDS.items())
    return (f"usage: drafthead <command> key=value ... | drafthead <command> --help | drafthead --version\n\n"
            f"commands:\n{rows}\n\n`drafthead <command> --help` lists every option with its default and doc.")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-V", "--version"):
        from drafthead import __version__

        print(f"drafthead {__version__}")
        return 0
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"drafthead: unknown command {cmd!r}; commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    try:
        if wants_help(rest):
            print(_load(COMMANDS[cmd].help)([a for a in rest if a not in HELP_FLAGS]))
            return 0
        return int(_load(COMMANDS[cmd].run)(rest) or 0)
    except (ValueError, OSError) as e:  # bad input, a folder in use, a read-only or full disk: one clear line
        if os.environ.get("DRAFTHEAD_TRACEBACK"):
            raise
        print(f"drafthead {cmd}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # commands without a checkpoint to write: everything they write is atomic
        print(f"drafthead {cmd}: stopped by SIGINT", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""`drafthead <command> key=value ...`: thin entry points into the library, trainer and eval.

Commands are "module:function" strings imported only when run, so `drafthead/` does not import
`eval/` or `trainer/` (and a command's heavy imports do not slow down the others).
"""
from __future__ import annotations

import importlib
import os
import sys

COMMANDS: dict[str, str] = {
    "capture": "trainer.commands:capture",
    "eval": "eval:main",
    "bench": "eval.bench:main",
    "export": "drafthead.export:main",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-V", "--version"):
        from drafthead import __version__

        print(f"drafthead {__version__}")
        return 0
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(f"usage: drafthead <command> key=value ... | drafthead --version\n"
              f"commands: {', '.join(sorted(COMMANDS))}")
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"drafthead: unknown command {cmd!r}; commands: {', '.join(sorted(COMMANDS))}", file=sys.stderr)
        return 2
    module, func = COMMANDS[cmd].split(":")
    try:
        return int(getattr(importlib.import_module(module), func)(rest) or 0)
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

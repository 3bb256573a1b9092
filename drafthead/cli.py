"""`drafthead <command> key=value ...`: thin entry points into the library, trainer and eval.

Commands are "module:function" strings imported only when run, so the library's own modules do not import
`drafthead.eval` or `drafthead.trainer` (and a command's heavy imports do not slow down the others).
"""
from __future__ import annotations

import importlib
import os
import sys

COMMANDS: dict[str, str] = {
    "train": "drafthead.trainer.run:cli",
    "capture": "drafthead.trainer.commands:capture",
    "eval": "drafthead.eval:main",
    "bench": "drafthead.eval.bench:main",
    "export": "drafthead.export:main",
}


def key_values(argv: list[str], error: type[Exception] = ValueError) -> dict[str, str]:
    """`key=value` arguments, in order (a key given twice: the last wins, as in OmegaConf's dotlist). The one
    parser of every command's arguments (train, capture, eval, bench, export); an argument without a key and
    '=' is an `error` naming it."""
    bad = [a for a in argv if "=" not in a or a.startswith("=")]
    if bad:
        raise error(f"arguments must be key=value, got {bad}")
    return dict(a.split("=", 1) for a in argv)


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

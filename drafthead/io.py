"""Atomic writes: a reader never sees a half-written checkpoint, capture shard or export."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import errno
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class WriteError(OSError):
    """A write that failed for a reason outside drafthead (read-only folder, full disk, no permission), with
    the destination named: the CLIs print it as one line. Nothing half-written is left at the destination."""

    def __str__(self) -> str:
        return str(self.strerror)  # without OSError's "[Errno N]" prefix: the cause is in the text


def _cause(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        return e.strerror  # its filename is a temp name beside the destination, which the message names
    # safetensors wraps the OS error in its own text ('... I/O error: No space left on device (os error 28)')
    m = re.search(r'message: "([^"]+)"', str(e)) or re.search(r"I/O error: (.+?) \(os error \d+\)", str(e))
    return m.group(1) if m else str(e).splitlines()[0]


def _is_write_failure(e: BaseException) -> bool:
    if isinstance(e, WriteError):
        return False
    if isinstance(e, OSError):
        return e.errno in (errno.EROFS, errno.ENOSPC, errno.EACCES, errno.EPERM, errno.EDQUOT, errno.EIO,
                           errno.ENOTDIR, errno.EEXIST, errno.EFBIG)
    return type(e).__name__ == "SafetensorError"  # its I/O failures (e.g. disk full while serializing)


@contextlib.contextmanager
def writing(path: str | os.PathLike) -> Iterator[None]:
    """Turn an OS-level write failure inside the block into a WriteError that names `path` and the cause."""
    try:
        yield
    except Exception as e:
        if _is_write_failure(e):
            raise WriteError(e.errno if isinstance(e, OSError) else errno.EIO,
                             f"cannot write {path}: {_cause(e)}") from e
        raise


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling directory; on success it replaces `path` in one rename.

    On an exception the temporary directory is removed and `path` is left as it was.
    """
    path = Path(path)
    with writing(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        with writing(path):
            yield tmp
            if path.exists():
                old = path.parent / f".{path.name}.old-{os.getpid()}"
                os.replace(path, old)
                os.replace(tmp, path)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    path = Path(path)
    with writing(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with writing(path), os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        with writing(path):
            os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


def clean_stale_tmp(folder: str | os.PathLike) -> list[Path]:
    """Remove leftovers of writes killed mid-way (`.NAME.tmp-*`); returns what was removed."""
    removed = []
    folder = Path(folder)
    if folder.is_dir():
        for p in folder.glob(".*.tmp-*"):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
            removed.append(p)
    return removed

"""A GGUF file's metadata (key/values) read without llama.cpp: what target discovery, the GGUF writer (the target's
tokenizer, copied) and the tests that read our GGUF exports back need."""
from __future__ import annotations

import os
from typing import Any

import numpy as np

from drafthead.export.common import ExportError

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
STRING, ARRAY = 8, 9


def read_gguf_metadata(path: str | os.PathLike) -> dict[str, tuple[int, int | None, Any]]:
    """All key/values of a GGUF file: {key: (value type, array item type or None, value)}.

    Our own reader of the KV section (little-endian GGUF v2/v3): `gguf.GGUFReader` builds a numpy
    view per string and needs ~1 min for a 49k-token vocabulary on a busy 2-core machine; this ~0.1 s.
    """
    import mmap
    import struct

    with open(path, "rb") as f:
        head = f.read(24)
        if len(head) < 24 or head[:4] != b"GGUF":
            raise ExportError(f"{path}: not a GGUF file")
        version, _, n_kv = struct.unpack("<IQQ", head[4:])
        if version not in (2, 3):
            raise ExportError(f"{path}: unsupported GGUF version {version} (or big-endian file)")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # only the metadata pages are read
    try:
        return _parse_kv(buf, 24, n_kv, str(path))
    finally:
        buf.close()


def _parse_kv(buf, pos: int, n_kv: int, path: str) -> dict[str, tuple[int, int | None, Any]]:
    import struct

    def take(fmt: str):
        nonlocal pos
        v = struct.unpack_from(fmt, buf, pos)[0]
        pos += struct.calcsize(fmt)
        return v

    def string() -> str:
        nonlocal pos
        n = take("<Q")
        pos += n
        return bytes(buf[pos - n: pos]).decode("utf-8")

    def value(t: int):
        if t == STRING:
            return string()
        if t in _SCALARS:
            return take(_SCALARS[t])
        raise ExportError(f"{path}: unexpected GGUF value type {t}")

    out: dict[str, tuple[int, int | None, Any]] = {}
    for _ in range(n_kv):
        key = string()
        t = take("<I")
        if t != ARRAY:
            out[key] = (t, None, value(t))
            continue
        sub, n = take("<I"), take("<Q")
        if sub in _NUMPY:
            arr = np.frombuffer(buf, dtype=_NUMPY[sub], count=n, offset=pos)
            pos += arr.nbytes
            items = arr.tolist()
            del arr  # release the mmap export before close
        else:
            items = [value(sub) for _ in range(n)]
        out[key] = (t, sub, items)
    return out

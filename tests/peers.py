"""Peer sites: other projects' Python code that the parity tests import (speculators' model classes, z-lab's
DFlash reference), assembled from PyPI wheels into the asset cache and put on sys.path, never pip-installed.

A peer pins versions of libraries we also use (speculators pins transformers below ours), so installing it would
downgrade the environment the rest of the suite tests. Instead its wheel is unpacked into a folder of its own
together with every distribution its metadata requires that this environment lacks, resolved transitively from
each wheel's `Requires-Dist` (markers evaluated here, extras followed). Naming only the packages one run happened
to miss is how a site came to work on a machine whose Python had `sniffio` and fail in a fresh venv: the closure
is computed against the venv's own site-packages (`sysconfig`), so a package that only some machines have cannot
hide a gap. tests/test_peers.py imports every entry point in a subprocess that sees only the venv and the site.
"""
from __future__ import annotations

import hashlib
import importlib.metadata as md
import os
import shutil
import sys
import sysconfig
import zipfile
from dataclasses import dataclass, field
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from drafthead.assets import cache_dir, pip_download


@dataclass(frozen=True)
class PeerSite:
    """A peer's code and the part of its dependency closure this environment lacks."""

    name: str
    roots: tuple[tuple[str, str], ...]  # (distribution, version): always unpacked into the site
    entry_points: tuple[str, ...]  # the modules the tests import from it
    # versions of the distributions the closure may have to fetch (a fresh venv lacks most of them); a needed
    # one missing here is an error naming it, so the site never floats to whatever PyPI serves that day
    pins: dict[str, str] = field(default_factory=dict)
    # distributions left out on purpose, each with why the entry points do not need it
    leave_out: dict[str, str] = field(default_factory=dict)
    prepend: bool = False  # put the site before the environment on sys.path (only for names nobody else has)


SPECULATORS = PeerSite(
    name="speculators-0.9.0",
    roots=(("speculators", "0.9.0"),),
    entry_points=("speculators", "speculators.models", "speculators.models.eagle3", "speculators.models.dspark",
                  "speculators.models.peagle"),
    pins={
        "aiohappyeyeballs": "2.7.1", "aiohttp": "3.14.5", "aiosignal": "1.4.0", "attrs": "26.1.0",
        "frozenlist": "1.8.0", "hs-connectors": "0.9.0", "httpcore": "1.0.9", "httpx": "0.29.0",
        "jiter": "0.19.0", "loguru": "0.7.3", "multidict": "7.2.1", "openai": "3.63.0", "propcache": "0.5.4",
        "protobuf": "7.36.2", "pydantic-settings": "2.16.3", "python-dotenv": "1.2.4", "sniffio": "1.3.1",
        "yarl": "1.25.1",
    },
    leave_out={
        "torchaudio": "audio only; speculators' model code never imports it, and its wheels pull another torch",
        "torchvision": "vision only; speculators' model code never imports it, and its wheels pull another torch",
    },
)

DFLASH = PeerSite(
    name="dflash-0.1.0",
    roots=(("dflash", "0.1.0"),),
    entry_points=("dflash.model",),
    leave_out={},
    prepend=True,
)

SPECFORGE = PeerSite(
    name="specforge-0.2.0",
    roots=(("specforge", "0.2.0"),),
    entry_points=("specforge.modeling.draft.domino",),
    leave_out={
        "sglang": "its serving engine (CUDA); the draft model modules never import it",
        "yunchang": "sequence parallelism for training; the draft model modules never import it",
        "openai-harmony": "chat formats of its data pipeline; the draft model modules never import it",
        "tensorboard": "training logs; the draft model modules never import it",
        "wandb": "training logs; the draft model modules never import it",
    },
)

PEERS = (SPECULATORS, DFLASH, SPECFORGE)


def environment_paths() -> list[str]:
    """The site-packages of the running interpreter's environment (the venv's, in CI), without any peer site."""
    paths = sysconfig.get_paths()
    return list(dict.fromkeys(p for p in (paths["purelib"], paths["platlib"]) if p and os.path.isdir(p)))


def installed() -> dict[str, str]:
    """{canonical distribution name: version} of what the environment itself holds."""
    return {canonicalize_name(d.metadata["Name"]): d.version
            for d in md.distributions(path=environment_paths()) if d.metadata["Name"]}


def wheel_requirements(wheel: Path) -> list[Requirement]:
    """`Requires-Dist` of a wheel's METADATA."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        msg = Parser().parsestr(z.read(meta).decode())
    return [Requirement(r) for r in msg.get_all("Requires-Dist") or []]


def wanted(req: Requirement, extras: set[str]) -> bool:
    """Whether a requirement applies on this interpreter when the parent was asked for with `extras`."""
    if req.marker is None:
        return True
    return any(req.marker.evaluate({"extra": e}) for e in (extras | {""}))


@dataclass
class Closure:
    fetch: dict[str, tuple[str, Path]]  # canonical name -> (version, wheel)
    from_environment: dict[str, str]  # canonical name -> installed version the peer uses
    left_out: list[str]


def resolve(peer: PeerSite, have: dict[str, str] | None = None) -> Closure:
    """Walk the roots' requirements: what the environment has is used as it is (its own dependencies are its
    installer's business), what it lacks is fetched at its pin and walked in turn."""
    have = installed() if have is None else have
    pypi = cache_dir() / "pypi"
    closure = Closure({}, {}, [])
    todo: list[tuple[Requirement, set[str], str]] = []
    for name, version in peer.roots:
        wheel = pip_download(name, version, pypi)
        closure.fetch[canonicalize_name(name)] = (version, wheel)
        todo += [(r, set(), name) for r in wheel_requirements(wheel)]
    while todo:
        req, parent_extras, parent = todo.pop(0)
        name = canonicalize_name(req.name)
        if not wanted(req, parent_extras) or name in closure.fetch or name in closure.from_environment:
            continue
        if name in peer.leave_out:
            if name not in closure.left_out:
                closure.left_out.append(name)
            continue
        if name in have:
            closure.from_environment[name] = have[name]
            continue
        version = peer.pins.get(name)
        if version is None:
            raise RuntimeError(f"peer site {peer.name}: {parent} requires {req}, which this environment lacks and "
                               f"tests/peers.py pins no version of; add it to {peer.name}'s pins")
        if req.specifier and not req.specifier.contains(version, prereleases=True):
            raise RuntimeError(f"peer site {peer.name}: {parent} requires {req}, but tests/peers.py pins {version}")
        wheel = pip_download(name, version, pypi)
        closure.fetch[name] = (version, wheel)
        todo += [(r, set(req.extras), name) for r in wheel_requirements(wheel)]
    return closure


def assemble(peer: PeerSite) -> Path:
    """The site folder for this environment (built once per fetched set, written atomically)."""
    closure = resolve(peer)
    key = hashlib.sha256(" ".join(f"{n}=={v}" for n, (v, _) in sorted(closure.fetch.items())).encode())
    root = cache_dir() / "assets" / f"{peer.name}-site-{key.hexdigest()[:12]}"
    if (root / ".complete").is_file():
        return root
    tmp = root.with_name(root.name + f".part{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    for _, wheel in closure.fetch.values():
        with zipfile.ZipFile(wheel) as z:
            z.extractall(tmp)
    (tmp / ".complete").write_text("\n".join(f"{n}=={v}" for n, (v, _) in sorted(closure.fetch.items())) + "\n")
    try:
        os.replace(tmp, root)
    except OSError:  # another process built the same site first
        shutil.rmtree(tmp, ignore_errors=True)
    return root


def add_to_path(peer: PeerSite) -> Path:
    """Assemble the site and put it on sys.path (first or last as the peer says)."""
    root = assemble(peer)
    if str(root) not in sys.path:
        sys.path.insert(0, str(root)) if peer.prepend else sys.path.append(str(root))
    return root

"""Peer sites (tests/peers.py) carry their whole dependency closure: every entry point the parity tests import
loads in a fresh interpreter that sees only this environment's site-packages and the peer's site."""
from __future__ import annotations

import os
import subprocess
import sys
import zipfile

import pytest

from tests.peers import PEERS, SPECULATORS, PeerSite, add_to_path, environment_paths, installed, resolve

# Run with -I -S: no user site, no PYTHON* variables, no site-packages but the ones named on the command line
# (their .pth files processed, so an editable install of drafthead still resolves).
ISOLATED_IMPORT = r"""
import os, site, sys
root, prepend, paths, modules = sys.argv[1], sys.argv[2] == "1", sys.argv[3].split(os.pathsep), sys.argv[4:]
for p in paths:
    site.addsitedir(p)
strays = [p for p in sys.path if "-packages" in p and p not in paths and not p.startswith(tuple(paths))]
assert not strays, f"site-packages outside this environment on sys.path: {strays}"
sys.path.insert(0, root) if prepend else sys.path.append(root)
import importlib
for m in modules:
    importlib.import_module(m)
top = {m.split(".")[0] for m in modules}
print(" ".join(sorted(os.path.dirname(sys.modules[t].__file__) for t in top)))
"""


@pytest.mark.parametrize("peer", PEERS, ids=[p.name for p in PEERS])
def test_every_entry_point_imports_with_only_the_environment_and_the_site(peer: PeerSite):
    try:
        root = add_to_path(peer)
    except RuntimeError as e:  # no package index here
        pytest.skip(f"{peer.name} could not be fetched: {e}")
    r = subprocess.run([sys.executable, "-I", "-S", "-c", ISOLATED_IMPORT, str(root), str(int(peer.prepend)),
                        os.pathsep.join(environment_paths()), *peer.entry_points],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    for where in r.stdout.split():  # the peer's own packages came from its site, not from anything installed
        assert where.startswith(str(root)), (where, root)


def test_a_package_the_environment_lacks_is_fetched_into_the_site():
    """The failure this module exists for: openai imports sniffio, which some machines' Python has and a fresh
    venv lacks. Without it in the environment, the closure fetches it at its pin."""
    have = {n: v for n, v in installed().items() if n not in ("sniffio", "loguru")}
    closure = resolve(SPECULATORS, have)
    assert closure.fetch["sniffio"][0] == SPECULATORS.pins["sniffio"]
    assert closure.fetch["openai"][0] == SPECULATORS.pins["openai"]
    assert closure.fetch["loguru"][0] == SPECULATORS.pins["loguru"]
    assert "transformers" in closure.from_environment  # ours, whatever speculators pins
    assert set(closure.left_out) == {"torchaudio", "torchvision"}
    for _, wheel in closure.fetch.values():
        assert zipfile.is_zipfile(wheel)


def test_a_needed_package_without_a_pin_is_named():
    peer = PeerSite(name="speculators-unpinned", roots=SPECULATORS.roots, entry_points=(),
                    pins={n: v for n, v in SPECULATORS.pins.items() if n != "loguru"})
    have = {n: v for n, v in installed().items() if n != "loguru"}
    with pytest.raises(RuntimeError, match=r"speculators requires loguru.* pins no version of"):
        resolve(peer, have)


def test_a_pin_outside_the_requirement_is_named():
    peer = PeerSite(name="speculators-badpin", roots=SPECULATORS.roots, entry_points=(),
                    pins={**SPECULATORS.pins, "loguru": "0.6.0"})
    have = {n: v for n, v in installed().items() if n != "loguru"}
    with pytest.raises(RuntimeError, match=r"requires loguru<=0.7.3,>=0.7.2, but tests/peers.py pins 0.6.0"):
        resolve(peer, have)

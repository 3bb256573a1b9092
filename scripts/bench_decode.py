"""Decoding-speed benchmark, same as `drafthead bench` (see eval/bench.py for the keys).

    python scripts/bench_decode.py draft=runs/eagle3/final max_prompts=8 max_new_tokens=128 out=bench.json
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from drafthead.eval.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

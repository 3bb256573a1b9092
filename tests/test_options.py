"""One command line: every command's options parsed by `drafthead.options` from its typed config, `--help` listing
each option with its default and doc, unknown keys named with the nearest known one."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from drafthead import options
from drafthead.cli import COMMANDS, main


@dataclass
class Layouts:
    a: int = 1  # a's doc
    # which continues here
    b: int = 2  # b's doc

    # b2's doc, above it
    b2: str | None = None
    c: int = 3  # c's doc
    d: int = 4  # d's doc
    e: float = field(default=0.5, metadata={"help": "e's doc, declared"})


@dataclass
class Ambiguous:
    a: int = 1  # a's doc
    # a's, or b's?
    b: int = 2


@dataclass
class Derived(Layouts):
    c: int = 30  # c's own doc here
    f: bool = False  # f's doc


def test_a_subclass_keeps_its_bases_docs_and_declares_its_own():
    docs = options.field_docs(Derived)
    assert docs["a"] == "a's doc which continues here" and docs["e"] == "e's doc, declared"
    assert docs["c"] == "c's own doc here" and docs["f"] == "f's doc"


def test_docs_come_from_the_comments_beside_or_above_each_option():
    docs = options.field_docs(Layouts)
    assert docs == {"a": "a's doc which continues here", "b": "b's doc", "b2": "b2's doc, above it", "c": "c's doc",
                    "d": "d's doc", "e": "e's doc, declared"}
    with pytest.raises(options.DocLayoutError, match=r"the comment above 'b' .* may be 'a''s continued"):
        options.field_docs(Ambiguous)


def test_parse_types_values_unsets_optionals_and_names_the_nearest_key():
    cfg = options.parse(Layouts, ["a=7", "b2=none", "e=0.25"])
    assert (cfg.a, cfg.b2, cfg.e) == (7, None, 0.25)
    with pytest.raises(ValueError, match=r"unknown config key 'cc' \(did you mean 'c'\?\)"):
        options.parse(Layouts, ["cc=1"])
    with pytest.raises(ValueError, match=r"bad value for 'a'"):
        options.parse(Layouts, ["a=seven"])
    with pytest.raises(ValueError, match=r"arguments must be key=value \(or --help\), got \['a'\]"):
        options.parse(Layouts, ["a"])


def test_every_option_of_every_command_has_a_doc():
    from drafthead.eval import EvalConfig
    from drafthead.eval.bench import BenchConfig
    from drafthead.export import ExportConfig
    from drafthead.trainer.config import RunConfig

    for cls in (RunConfig, EvalConfig, BenchConfig, ExportConfig):
        undocumented = [o.key for o in options.options(cls) if not o.doc]
        assert not undocumented, f"{cls.__name__}: options without a doc: {undocumented}"


@pytest.mark.parametrize("cmd", sorted(COMMANDS))
def test_every_command_has_help_listing_its_options(cmd, capsys):
    from drafthead.eval import EvalConfig
    from drafthead.eval.bench import BenchConfig
    from drafthead.export import ExportConfig
    from drafthead.trainer.config import load_config

    assert main([cmd, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: drafthead {cmd} ")
    cfg = {"train": load_config([]), "capture": load_config([]), "eval": EvalConfig(), "bench": BenchConfig(),
           "export": ExportConfig()}[cmd]
    lines = out.splitlines()
    for o in options.options(cfg):
        head = f"  {o.key}={options.shown(o.value)}"
        row = next((i for i, line in enumerate(lines) if line == head or line.startswith(head + " ")), None)
        assert row is not None, f"{cmd} --help does not list {head.strip()}"
        doc = " ".join(lines[row][len(head):].split()) or " ".join(lines[row + 1].split())  # a long key: doc below
        assert doc == o.doc, (o.key, doc)


def test_help_shows_the_recipes_values_and_the_top_level_lists_commands(capsys):
    assert main(["train", "recipe=mtp_smollm2", "--help"]) == 0
    out = capsys.readouterr().out
    assert "drafter.family=mtp " in out and "values shown: recipe=mtp_smollm2" in out
    assert main(["export", "-h"]) == 0
    assert "eagle3: to=sglang [outtype], to=speculators [outtype num_speculative_tokens verifier store_embedding]" in \
        capsys.readouterr().out
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name, c in COMMANDS.items():
        assert f"  {name}" in out and c.summary and c.summary in out


@pytest.mark.parametrize("argv, said", [
    (["eval", "max_new_token=5"], "unknown config key 'max_new_token' (did you mean 'max_new_tokens'?)"),
    (["bench", "verify_size=[1]"], "unknown config key 'verify_size' (did you mean 'verify_sizes'?)"),
    (["export", "outype=f16"], "unknown config key 'outype' (did you mean 'outtype'?)"),
    (["capture", "capture.shard_sample=3"], "unknown config key 'capture.shard_sample' (did you mean "
                                             "'capture.shard_samples'?)"),
    # the runtime's draft length has its own name; the old one is named as renamed, for every command that reads it
    (["eval", "num_draft_tokens=2"], "'num_draft_tokens' is now 'num_speculative_tokens' here"),
    (["bench", "num_draft_tokens=2"], "'num_draft_tokens' is now 'num_speculative_tokens' here"),
    (["export", "num_draft_tokens=2"], "'num_draft_tokens' is now 'num_speculative_tokens' here"),
])
def test_unknown_keys_name_the_nearest_known_one(argv, said, capsys):
    assert main(argv) == 2
    assert said in capsys.readouterr().err


def test_every_exporter_option_is_a_documented_export_option():
    from drafthead.export import FORMAT_OPTIONS
    from drafthead.export import options as exporter_options
    from drafthead.registry import FAMILIES

    for fam in FAMILIES.values():
        for fmt, spec in fam.exporters.items():
            assert set(exporter_options(spec)) <= set(FORMAT_OPTIONS), (fam.name, fmt, exporter_options(spec))


def test_the_checkouts_train_py_answers_help_too():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "train.py", "recipe=dflash_smollm2", "--help"], cwd=root, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: python train.py [recipe=NAME]") and "drafter.family=dflash " in r.stdout


KEY_VALUE_SCRIPTS = ("bench_cpu_linear", "bench_hf_assisted", "bench_llama_cpp", "bench_regenerate", "bench_sharing",
                     "profile_step")


def _run_script(path, argv: list[str], capsys) -> tuple[int, str, str]:
    """A script run as `python scripts/X.py ARGV` would run it, in this process (one torch import for all)."""
    import runpy
    import sys

    saved = sys.argv
    sys.argv = [str(path), *argv]
    try:
        runpy.run_path(str(path), run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        said = "" if isinstance(e.code, int) or e.code is None else str(e.code)  # what Python prints on exit
    else:
        said = ""
    finally:
        sys.argv = saved
    out = capsys.readouterr()
    return code, out.out, out.err + said


def test_every_script_answers_help_and_names_a_mistyped_key(capsys):
    """The scripts read `key=value` through the commands' parser: `--help` lists each option with its doc and runs
    nothing (a bench that ran on --help took minutes), and a mistyped key stops it before anything loads."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    scripts = sorted((root / "scripts").glob("*.py"))
    assert set(KEY_VALUE_SCRIPTS) <= {p.stem for p in scripts}
    for path in scripts:
        code, out, err = _run_script(path, ["--help"], capsys)
        assert code == 0 and "usage" in out.lower(), (path.stem, code, err[-2000:])
        if path.stem in KEY_VALUE_SCRIPTS:
            assert "options (key=default):" in out, path.stem
            assert all(not line.startswith("  ") or len(line.split(None, 1)) == 2 for line in
                       out.split("options (key=default):")[1].splitlines()), (path.stem, "an option without a doc")
    for name in KEY_VALUE_SCRIPTS:
        code, _, err = _run_script(root / "scripts" / f"{name}.py", ["repeatz=3"], capsys)
        assert code == 2 and "unknown config key 'repeatz'" in err, (name, code, err[-2000:])
    code, _, err = _run_script(root / "scripts" / "bench_cpu_linear.py", ["prefetch=fast"], capsys)
    assert code == 1 and "prefetch is tuned or built_in, got 'fast'" in err

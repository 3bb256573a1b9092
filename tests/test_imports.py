"""The house drawn from imports: no circles (function-level imports count too), the library never imports
`drafthead.trainer` or `drafthead.eval` (trainer/ and eval/ in the repository), and the shared code (trainer,
runtime, eval, export dispatch) never imports a drafter family's module: it asks the registry. Also: no module
is imported under a one-letter alias, the pure budget planner imports no torch."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# repository folder -> the import name it installs as (pyproject.toml's package-dir)
PACKAGES = {"drafthead": "drafthead", "trainer": "drafthead.trainer", "eval": "drafthead.eval"}
LIBRARY_ONLY = ("drafthead.trainer", "drafthead.eval")  # what the library itself never imports


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    if parts[0] in PACKAGES:
        parts[0] = PACKAGES[parts[0]]
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")] + [ROOT / "train.py"]
    mods = {module_name(p): p for p in files}
    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        deps: set[str] = set()
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative import
                    anchor = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = ".".join(anchor[: len(anchor) - node.level + 1] + ([base] if base else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for n in names:
                # importing a.b.c runs a/__init__ and a/b/__init__ too
                parts = n.split(".")
                for i in range(1, len(parts) + 1):
                    m = ".".join(parts[:i])
                    # a module's own parent packages are initialised before it, whatever it imports
                    if m in mods and m != mod and not mod.startswith(m + "."):
                        deps.add(m)
        graph[mod] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (c := visit(m)):
                return c
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (c := visit(n)):
            return c
    return None


def test_no_import_circles():
    graph = import_graph()
    assert "drafthead.runtime.generate" in graph and "drafthead.trainer.run" in graph  # the walk found the house
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_library_does_not_import_trainer_or_eval():
    graph = import_graph()
    assert "drafthead.eval.bench" in graph  # the repository's eval/ walked under its installed name
    bad = {m: sorted(d for d in deps if d.startswith(LIBRARY_ONLY))
           for m, deps in graph.items() if not m.startswith(LIBRARY_ONLY) and m != "train"}
    assert not {m: d for m, d in bad.items() if d}


def test_no_module_is_imported_under_a_one_letter_alias() -> None:
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    files += [ROOT / "train.py", *(ROOT / "scripts").glob("*.py"), *(ROOT / "tests").glob("*.py")]
    hits = [f"{p.relative_to(ROOT)}:{n.lineno}" for p in files for n in ast.walk(ast.parse(p.read_text()))
            if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names
            if a.asname and len(a.asname) == 1 and a.name != "torch.nn.functional"]  # F: the universal one
    assert not hits, hits


def test_the_budget_planner_is_pure() -> None:
    """trainer/budget.py plans from rates alone (its tests need no model): it imports no torch and no other part
    of drafthead; the probe that measures lives in trainer/probe.py."""
    deps = {n.names[0].name if isinstance(n, ast.Import) else n.module
            for n in ast.walk(ast.parse((ROOT / "trainer" / "budget.py").read_text()))
            if isinstance(n, (ast.Import, ast.ImportFrom))}
    assert not {d for d in deps if d and d.split(".")[0] in ("torch", "drafthead", "transformers")}, deps


def test_shared_code_imports_no_family_module():
    from drafthead.registry import FAMILIES

    family_modules = {f.model.__module__ for f in FAMILIES.values()}
    shared = ("train", "drafthead.trainer", "drafthead.eval", "drafthead.runtime", "drafthead.export")
    graph = import_graph()
    bad = {m: sorted(deps & family_modules) for m, deps in graph.items()
           if (m == "train" or m.startswith(shared)) and m != "drafthead.export"}
    # family-specific exporter modules are the family's own (drafthead/export/<family>.py and the formats
    # only that family writes); the dispatcher and every shared module stay clear
    allowed = {m for m in graph if m.startswith("drafthead.export.") and m != "drafthead.export.common"}
    assert not {m: d for m, d in bad.items() if d and m not in allowed}
    assert not graph["drafthead.export"] & family_modules


SHARED = ["train.py", "trainer", "drafthead/runtime", "eval", "drafthead/export/__init__.py", "drafthead/registry.py"]


def test_shared_code_never_probes_a_drafter_or_family() -> None:
    """The `Drafter` protocol (drafthead/family.py) declares every hook: shared code calls them, never
    hasattr/getattr on a drafter, its draft state or a family record."""
    import re

    probe = re.compile(r"\b(?:hasattr|getattr)\(\s*(?:self\.)?(?:drafter|draft|draft_model|fam|family|d\.drafter)\b")
    files = [p for s in SHARED for p in ([ROOT / s] if (ROOT / s).is_file() else sorted((ROOT / s).rglob("*.py")))]
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in files
            for i, line in enumerate(p.read_text().splitlines(), 1) if probe.search(line)]
    assert not hits, hits


def test_no_python_line_over_120_characters() -> None:
    import subprocess

    files = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    long = [f"{f}:{i}: {len(line)}" for f in files if (ROOT / f).exists()
            for i, line in enumerate((ROOT / f).read_text().splitlines(), 1) if len(line) > 120]
    assert not long, long


def runtime_private_fields() -> set[str]:
    """Every `self._name` a runtime module sets: the runtime's private state."""
    names = set()
    for p in (ROOT / "drafthead/runtime").glob("*.py"):
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self" \
                    and n.attr.startswith("_") and not n.attr.startswith("__"):
                names.add(n.attr)
    return names


def test_no_module_reads_the_runtimes_private_state() -> None:
    """Outside drafthead/runtime, no code reads a private field of a runtime object, and no module imports another
    module's private name: a draft state reads the session and the target through `runtime.contract` only."""
    private = runtime_private_fields()
    assert {"_s", "_m"} <= private  # the views' own handles are what a family must not reach through
    files = [p for d in ("drafthead", "trainer", "eval", "scripts") for p in sorted((ROOT / d).rglob("*.py"))
             if "runtime" not in p.relative_to(ROOT).parts] + [ROOT / "train.py"]
    hits = []
    for p in files:
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.Attribute) and n.attr in private and not (
                    isinstance(n.value, ast.Name) and n.value.id in ("self", "cls")):
                hits.append(f"{p.relative_to(ROOT)}:{n.lineno}: .{n.attr}")
            if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("drafthead"):
                hits += [f"{p.relative_to(ROOT)}:{n.lineno}: import {a.name}" for a in n.names
                         if a.name.startswith("_") and not a.name.startswith("__")]
    assert not hits, hits


def test_family_files_see_the_runtime_through_its_contract() -> None:
    """A family file imports the runtime's contract, its shared runners and sampling: never the session
    (runtime.generate) or the target model (runtime.model)."""
    from drafthead.registry import FAMILIES

    allowed = {"drafthead.runtime.contract", "drafthead.runtime.draft", "drafthead.runtime.sampling"}
    graph = import_graph()
    bad = {}
    for fam in FAMILIES.values():
        mod = fam.model.__module__
        runtime = {d for d in graph[mod] if d.startswith("drafthead.runtime.")}
        if runtime - allowed:
            bad[mod] = sorted(runtime - allowed)
    assert not bad, bad


def test_mypy_passes_on_the_runtime_and_the_family_files() -> None:
    """The protocols are checked, not only written: mypy over drafthead/runtime and every family file
    (pyproject.toml [tool.mypy] says what it follows)."""
    import subprocess
    import sys

    from drafthead.registry import FAMILIES

    families = sorted({str(Path(str(sys.modules[f.model.__module__].__file__)).relative_to(ROOT))
                       for f in FAMILIES.values()})
    out = subprocess.run([sys.executable, "-m", "mypy", "drafthead/runtime", *families], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]

"""One command line for every command: `key.sub=value` arguments into a typed dataclass, and `--help` from the same
declarations (each option's default and the comment written beside it, or `field(metadata={"help": ...})`).

    cfg = parse(EvalConfig, ["draft=runs/x/final", "max_prompts=8"])      # an EvalConfig
    print(help_text("drafthead eval", __doc__, EvalConfig()))             # every option, default, one line of doc

An option's doc is the comment on its line, continued by comment lines right below it; a field without one takes
the comment block right above it. A block between a commented field and an uncommented one could belong to either,
so `field_docs` refuses that layout (a blank line or a comment on the second field's line settles it).
"""
from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import io
import textwrap
import tokenize
import types
import typing
from typing import Any

NONE_WORDS = ("none", "None", "null", "")  # an optional option given as one of these is unset (draft=none)
HELP_FLAGS = ("-h", "--help")


def key_values(argv: list[str], error: type[Exception] = ValueError) -> dict[str, str]:
    """`key=value` arguments, in order (a key given twice: the last wins, as in OmegaConf's dotlist); an argument
    without a key and '=' is an `error` naming it."""
    bad = [a for a in argv if "=" not in a or a.startswith("=")]
    if bad:
        raise error(f"arguments must be key=value (or --help), got {bad}")
    return dict(a.split("=", 1) for a in argv)


def wants_help(argv: list[str]) -> bool:
    return any(a in HELP_FLAGS for a in argv)


# ---------------------------------------------------------------------------------------------
# docs from the declarations


class DocLayoutError(ValueError):
    """A comment block whose field cannot be told from the layout."""


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """{field: its doc on one line} for the dataclass `cls` (fields without any doc are absent); a field a dataclass
    base declares keeps the base's doc unless `cls` declares it again."""
    inherited: dict[str, str] = {}
    for base in reversed(cls.__mro__[1:]):
        if dataclasses.is_dataclass(base):
            inherited.update(field_docs(base))
    docs = {f.name: " ".join(str(f.metadata["help"]).split()) for f in dataclasses.fields(cls) if "help" in f.metadata}
    try:
        src = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # made at run time (make_dataclass): metadata only
        return {**inherited, **docs}
    tree = ast.parse(src).body[0]
    assert isinstance(tree, ast.ClassDef)
    trailing: dict[int, str] = {}  # line -> comment after code on it
    alone: dict[int, str] = {}  # line -> a comment-only line
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            (alone if not tok.line[: tok.start[1]].strip() else trailing)[tok.start[0]] = text
    decls = [(n.target.id, n.lineno, n.end_lineno or n.lineno) for n in tree.body
             if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
    own = {name: [trailing[i] for i in range(a, b + 1) if i in trailing] for name, a, b in decls}
    for k, (name, a, b) in enumerate(decls):
        nxt = decls[k + 1] if k + 1 < len(decls) else None
        below = _block(alone, b + 1, 1)  # comment lines right below the field
        above = _block(alone, a - 1, -1)  # comment lines right above it
        prev = decls[k - 1] if k else None
        if prev and above and above[0][0] == prev[2] + 1 and own[prev[0]]:  # touches a commented field above
            if not own[name]:
                raise DocLayoutError(f"{cls.__qualname__}: the comment above {name!r} (line {above[0][0]}) may be "
                                     f"{prev[0]!r}'s continued; put {name!r}'s doc on its line or leave a blank "
                                     f"line between")
            above = []
        text = [t for _, t in above] + own[name]
        if own[name] and below and (nxt is None or below[-1][0] < nxt[1] - 1 or own[nxt[0]]):
            text += [t for _, t in below]
        if text and name not in docs:
            docs[name] = " ".join(" ".join(text).split())
    return {**inherited, **docs}


def _block(alone: dict[int, str], start: int, step: int) -> list[tuple[int, str]]:
    """The contiguous comment-only lines from `start` on, in `step` direction, in line order."""
    out, i = [], start
    while i in alone:
        out.append((i, alone[i]))
        i += step
    return sorted(out)


# ---------------------------------------------------------------------------------------------
# options of a (nested) dataclass


@dataclasses.dataclass
class Option:
    key: str  # dotted: train.max_steps
    value: Any  # the default shown (the dataclass's, or a recipe's)
    doc: str
    optional: bool  # None is a value (`key=none` unsets it)


def _is_optional(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp)


def options(obj: Any, prefix: str = "") -> list[Option]:
    """Every leaf option of the dataclass instance (or class) `obj`, depth first, with its value there."""
    cls = obj if isinstance(obj, type) else type(obj)
    inst = obj if not isinstance(obj, type) else cls()
    docs, hints = field_docs(cls), typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        value = getattr(inst, f.name)
        if dataclasses.is_dataclass(value):
            out += options(value, f"{prefix}{f.name}.")
        else:
            out.append(Option(prefix + f.name, value, docs.get(f.name, ""), _is_optional(hints[f.name])))
    return out


def shared(source: Any, base: type) -> dict[str, Any]:
    """`base`'s fields as `source` holds them: what a family's `build` carries from its options into its config, both
    of which extend `base` (so each choice a draft keeps is declared, documented and defaulted once)."""
    return {f.name: getattr(source, f.name) for f in dataclasses.fields(base)}


# command keys renamed since a release: old -> (new, why); a command that has the new key names it for the old
RENAMED = {"num_draft_tokens": ("num_speculative_tokens", "the runtime's drafts a round, vLLM's name; num_draft_tokens "
                                "is the depth a draft was trained to, drafter.<family>.num_draft_tokens")}


def closest(key: str, keys: list[str]) -> str:
    """' (did you mean 'K'?)' for the known key nearest `key`, or ''."""
    leaf = key.rsplit(".", 1)[-1]
    # the same leaf one level down first: 'drafter.init' -> 'drafter.<family>.init'
    hit = [k for k in keys if k.startswith(key.rsplit(".", 1)[0] + ".") and k.rsplit(".", 1)[-1] == leaf][:1]
    hit = hit or difflib.get_close_matches(key, keys, n=1, cutoff=0.4)
    if not hit:  # the leaf name alone: 'max_step' -> 'train.max_steps'
        leaves = {k.rsplit(".", 1)[-1]: k for k in keys}
        m = difflib.get_close_matches(leaf, list(leaves), n=1, cutoff=0.6)
        hit = [leaves[m[0]]] if m else []
    return f" (did you mean '{hit[0]}'?)" if hit else ""


def all_keys(opts: list[Option]) -> list[str]:
    """Every dotted key of these options, sections included (drafter, drafter.eagle3, drafter.eagle3.init...)."""
    keys = []
    for o in opts:
        parts = o.key.split(".")
        keys += [".".join(parts[: i + 1]) for i in range(len(parts))]
    return list(dict.fromkeys(keys))


def parse(cls: type, argv: list[str] | dict[str, str], error: type[Exception] = ValueError,
          layers: tuple[Any, ...] = ()) -> Any:
    """`key=value` arguments (or their pairs) into `cls`, over its defaults and then `layers` (OmegaConf configs,
    a recipe file say). An unknown key is an `error` naming the nearest known one; a bad value names its key; an
    optional option given as none/null/'' is unset."""
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

    pairs = key_values(argv, error) if isinstance(argv, list) else dict(argv)
    listed = options(cls)
    opts = {o.key: o for o in listed}
    keys = all_keys(listed)
    for k in pairs:
        if k in RENAMED and RENAMED[k][0] in opts:
            raise error(f"'{k}' is now '{RENAMED[k][0]}' here ({RENAMED[k][1]})")
        if k not in opts:
            raise error(f"unknown config key '{k}'{closest(k, keys)}")
    dotlist = [f"{k}=null" if v in NONE_WORDS and opts[k].optional else f"{k}={v}" for k, v in pairs.items()]
    schema = OmegaConf.structured(cls)
    OmegaConf.set_struct(schema, True)
    try:
        merged = OmegaConf.merge(schema, *layers, OmegaConf.from_dotlist(dotlist))
    except (ConfigKeyError, ValidationError) as e:  # a layer's key, or a value of the wrong type
        key = str(getattr(e, "full_key", None) or e)
        if isinstance(e, ConfigKeyError):
            raise error(f"unknown config key '{key}'{closest(key, keys)}") from None
        raise error(f"bad value for '{key}': {str(e).splitlines()[0]}") from None
    except OmegaConfBaseException as e:
        raise error(f"bad value: {str(e).splitlines()[0]}") from None
    return OmegaConf.to_object(merged)


# ---------------------------------------------------------------------------------------------
# --help


def shown(value: Any) -> str:
    """A value as it would be typed on the command line (null, true, [1,2,4])."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(shown(v) for v in value) + "]"
    return str(value)


def help_text(usage: str, about: str | None, obj: Any, notes: str = "") -> str:
    """`usage`, the first paragraph of `about`, then one line per option: key=default and its doc."""
    lines = [f"usage: {usage}", ""]
    if about:
        lines += [textwrap.dedent(about).strip().split("\n\n")[0].replace("\n", " "), ""]
    rows = [(f"{o.key}={shown(o.value)}", o.doc) for o in options(obj)]
    width = min(max(len(k) for k, _ in rows), 40)
    lines.append("options (key=default):")
    for k, doc in rows:
        lines.append(f"  {k:<{width}}  {doc}".rstrip() if len(k) <= width else f"  {k}\n  {'':<{width}}  {doc}")
    if notes:
        lines += ["", notes.strip()]
    return "\n".join(lines)


def script_options(cls: type, argv: list[str], usage: str, about: str | None) -> Any | None:
    """A script's arguments into `cls`, the commands' way: None after printing `--help` (the caller returns), and a
    bad key or value ends the script with exit code 2 and a line naming it, before anything loads."""
    import sys

    if wants_help(argv):
        print(help_text(usage, about, cls()))
        return None
    try:
        return parse(cls, argv)
    except ValueError as e:
        print(f"{usage.split()[1] if ' ' in usage else usage}: {e}", file=sys.stderr)
        raise SystemExit(2) from None

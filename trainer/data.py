"""Conversation data: load, clean, split, render + loss-mask, cache (the target's own answers: trainer/regenerate.py).

Sources: "sharegpt" (the built-in ShareGPT V3 split from PyPI) or a `.json` (a list of records) / `.jsonl`
file. Rows are ShareGPT `{"id", "conversations": [{"from", "value"}]}` or OpenAI `{"messages": [{"role",
"content"}]}`, detected per row. Every bad row is counted by reason in `SkipStats` (nothing is dropped
silently) and one summary line per stage is meant to be printed by the caller.

Cleaning rules (applied in this order, per conversation):
  - roles: human/user -> user, gpt/chatgpt/bard/assistant -> assistant, system -> system; any other role
    (bing, tool, function, ...) skips the whole conversation ("unknown role").
  - contents are stripped; empty messages are dropped.
  - assistant turns before the first user turn are dropped (ShareGPT splits long chats, so ~1/3 of its
    rows start with a "gpt" continuation whose question is missing).
  - consecutive messages of the same role are merged, joined by a blank line (many templates require
    strict user/assistant alternation).
  - a repeated id gets a suffix "#1", "#2", ... (the ShareGPT split reuses 123 ids for different chats).

Loss mask: 1 on the tokens of each assistant message's content and on the end-of-turn token that closes
it (what the target generates), 0 elsewhere. `loss_mask[t]` refers to token `input_ids[t]` itself
(the trainer shifts as it needs).
"""
from __future__ import annotations

import bisect
import hashlib
import io
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from drafthead.assets import asset_path, cache_dir
from drafthead.io import atomic_write_bytes

Message = dict  # {"role": "system"|"user"|"assistant", "content": str}

SKIP_REASONS = ("malformed json", "empty conversation", "no assistant turn", "unknown role",
                "all tokens masked", "longer than max_length", "assistant content not found in template")
ROLE_MAP = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant",
            "assistant": "assistant", "system": "system"}
# tokens that close an assistant turn in common templates (the tokenizer's eos is always added)
EOT_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
              "<|end_of_text|>", "</s>")
TOKENIZED_CACHE_VERSION = 1  # bump when the mask rules change: old cache entries stop matching


@dataclass
class Conversation:
    id: str
    messages: list[dict]


@dataclass
class SkipStats:
    """Counted bad rows of one stage (load or tokenize)."""
    counts: dict[str, int] = field(default_factory=dict)  # reason -> n
    total_in: int = 0
    kept: int = 0
    truncated: int = 0  # kept, but cut to max_length

    def add(self, reason: str) -> None:
        if reason not in SKIP_REASONS:
            raise ValueError(f"unknown skip reason {reason!r}; known: {', '.join(SKIP_REASONS)}")
        self.counts[reason] = self.counts.get(reason, 0) + 1

    @property
    def skipped(self) -> int:
        return sum(self.counts.values())

    def summary(self, what: str) -> str:
        """One line: '<what>: kept K of N conversations; skipped: 3 unknown role, 1 malformed json'."""
        order = sorted(self.counts.items(), key=lambda kv: (-kv[1], SKIP_REASONS.index(kv[0])))
        skipped = ", ".join(f"{n} {r}" for r, n in order) or "none"
        line = f"{what}: kept {self.kept} of {self.total_in} conversations; skipped: {skipped}"
        if self.truncated:
            line += f"; truncated to max_length: {self.truncated}"
        return line

    def to_dict(self) -> dict:
        return {"counts": dict(self.counts), "total_in": self.total_in, "kept": self.kept,
                "truncated": self.truncated}


class ContentNotFoundError(ValueError):
    """An assistant message's content does not appear in the rendered chat template."""


# ----------------------------------------------------------------------------- loading

def load_conversations(source: str, max_samples: int | None = None) -> tuple[list[Conversation], SkipStats]:
    """Read, clean and count a conversation source; the first `max_samples` usable ones (file order)."""
    if max_samples is not None and max_samples < 1:
        raise ValueError(f"max_samples must be >= 1 or None, got {max_samples}")
    what, stem, rows = _open_source(source)
    stats, convs, seen = SkipStats(), [], {}
    for index, row in enumerate(rows):
        if max_samples is not None and len(convs) >= max_samples:
            break
        stats.total_in += 1
        messages, reason = _clean_row(row)
        if reason is not None:
            stats.add(reason)
            continue
        cid = row.get("id")
        cid = f"{stem}-{index}" if cid is None or cid == "" else str(cid)
        if cid in seen:  # same id, different chat: keep both under distinct ids
            base = cid
            while cid in seen:
                seen[base] = seen.get(base, 0) + 1
                cid = f"{base}#{seen[base]}"
        seen.setdefault(cid, 0)
        convs.append(Conversation(cid, messages))
    stats.kept = len(convs)
    if not convs:
        raise ValueError(f"data source {what!r} has no usable conversations ({stats.summary(what)})")
    return convs, stats


def _open_source(source: str) -> tuple[str, str, Iterable[Any]]:
    """-> (name for messages, stem for generated ids, iterable of raw rows; None for an unparsable line)."""
    if source == "sharegpt":
        path, what = asset_path("sharegpt"), "sharegpt"
    else:
        path, what = Path(source), str(source)
        if not path.is_file():
            raise FileNotFoundError(f"data source {source!r}: no such file (use 'sharegpt' or a .json/.jsonl path)")
        if path.suffix not in (".json", ".jsonl"):
            raise ValueError(f"data source {source!r}: expected a .json (list of records) or .jsonl file")
    if path.suffix == ".json" and _is_cut_off_array(path):
        clean, fresh = _recovered_copy(path)
        ds = _load_with_datasets(clean)
        rows = _dataset_rows(ds) if ds is not None else _jsonl_rows(clean)
        if ds is not None:
            n = len(ds)
        else:
            with open(clean, "rb") as f:
                n = sum(1 for line in f if line.strip())
        print(f"{what}: {path.name} is truncated (cut off mid-record); recovered {n} complete conversations "
              f"({'wrote' if fresh else 'using'} clean copy {clean})", flush=True)
        return what, path.stem, rows
    ds = _load_with_datasets(path)
    if ds is not None:
        return what, path.stem, _dataset_rows(ds)
    # datasets refused it (a malformed line, mixed value types): parse it ourselves, counting bad lines
    return what, path.stem, _json_array_rows(path, what) if _first_byte(path) == b"[" else _jsonl_rows(path)


def _first_byte(path: Path) -> bytes:
    with open(path, "rb") as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    return head[:1]


def _is_cut_off_array(path: Path) -> bool:
    """A JSON list whose text does not end with ']' (a download or copy cut short)."""
    if _first_byte(path) != b"[":
        return False
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - 4096))
        tail = f.read().rstrip()
    return not tail.endswith(b"]")


def _recovered_copy(path: Path) -> tuple[Path, bool]:
    """Stream-parse the complete records of a cut-off JSON list into a cached JSONL (once). -> (path, fresh)."""
    import ijson

    st = path.stat()
    key = hashlib.sha1(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_dir() / "recovered" / f"{path.stem}-{key}.jsonl"
    if out.exists():
        return out, False
    buf = io.BytesIO()
    with open(path, "rb") as f:
        try:
            for rec in ijson.items(f, "item", use_float=True):
                buf.write(json.dumps(rec, ensure_ascii=False).encode() + b"\n")
        except ijson.JSONError:
            pass  # the cut-off record at the end
    atomic_write_bytes(out, buf.getvalue())
    return out, True


def _load_with_datasets(path: Path):
    """`datasets` JSON loader (Arrow-cached under the drafthead cache), or None if it cannot read the file."""
    import datasets

    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        return datasets.load_dataset("json", data_files=str(path), split="train",
                                     cache_dir=str(cache_dir() / "datasets"))
    except Exception:  # noqa: BLE001 - any failure means: parse it ourselves and count the bad rows
        return None
    finally:
        if bars:
            datasets.enable_progress_bars()


def _dataset_rows(ds, chunk: int = 2048) -> Iterator[dict]:
    for s in range(0, len(ds), chunk):
        yield from ds.select(range(s, min(s + chunk, len(ds)))).to_list()


def _jsonl_rows(path: Path) -> Iterator[Any]:
    with open(path, "rb") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except ValueError:
                yield None  # counted as "malformed json"


def _json_array_rows(path: Path, what: str) -> Iterator[Any]:
    import ijson

    with open(path, "rb") as f:
        try:
            yield from ijson.items(f, "item", use_float=True)
        except ijson.JSONError as e:
            raise ValueError(f"data source {what!r}: {path} is not valid JSON ({e}); "
                             "fix it or convert it to JSONL (bad lines are then counted and skipped)") from e


def _text(content: Any) -> str | None:
    """Message content as text: str, None (-> ''), or OpenAI content parts [{"type": "text", "text"}]."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        return "".join(p.get("text") or "" for p in content)
    return None


def _clean_row(row: Any) -> tuple[list[dict] | None, str | None]:
    """Raw row -> (clean messages, None) or (None, skip reason). See the module docstring for the rules."""
    if not isinstance(row, dict):
        return None, "malformed json"
    raw = row.get("conversations") if row.get("conversations") is not None else row.get("messages")
    if not isinstance(raw, list):
        return None, "malformed json"
    msgs = []
    for m in raw:
        if not isinstance(m, dict):
            return None, "malformed json"
        role = m.get("from") if m.get("from") is not None else m.get("role")
        content = _text(m.get("value") if m.get("value") is not None else m.get("content"))
        if not isinstance(role, str) or content is None:
            return None, "malformed json"
        role = ROLE_MAP.get(role.strip().lower())
        if role is None:
            return None, "unknown role"
        if content.strip():
            msgs.append({"role": role, "content": content.strip()})
    if not msgs:
        return None, "empty conversation"
    first_user = next((i for i, m in enumerate(msgs) if m["role"] == "user"), len(msgs))
    msgs = [m for i, m in enumerate(msgs) if i >= first_user or m["role"] != "assistant"]
    merged: list[dict] = []
    for m in msgs:
        if merged and merged[-1]["role"] == m["role"]:
            merged[-1] = {"role": m["role"], "content": merged[-1]["content"] + "\n\n" + m["content"]}
        else:
            merged.append(m)
    if not any(m["role"] == "assistant" for m in merged):
        return None, "no assistant turn"
    return merged, None


# ----------------------------------------------------------------------------- split

def split_holdout(convs: list[Conversation], num_holdout: int,
                  seed: int) -> tuple[list[Conversation], list[Conversation]]:
    """(train, holdout). Holdout = the `num_holdout` conversations with the smallest sha1(seed:id).

    Ranking by a hash of the id (not a shuffle of positions) keeps a conversation on the same side when
    the source grows or `max_samples` changes. Both lists keep the input order.
    """
    if not 0 <= num_holdout < len(convs):
        raise ValueError(f"num_holdout={num_holdout} must be in 0..{len(convs) - 1} "
                         f"(there are {len(convs)} conversations and training needs at least one)")
    ids = [c.id for c in convs]
    if len(set(ids)) != len(ids):
        raise ValueError("split_holdout: conversation ids are not unique; load them with load_conversations")
    rank = sorted(range(len(convs)), key=lambda i: hashlib.sha1(f"{seed}:{ids[i]}".encode()).digest())
    hold = set(rank[:num_holdout])
    return ([c for i, c in enumerate(convs) if i not in hold], [c for i, c in enumerate(convs) if i in hold])


# ----------------------------------------------------------------------------- render + mask

def render_and_mask(tokenizer, messages: list[dict], chat_template: str | None = None,
                    enable_thinking: bool | None = None) -> tuple[list[int], list[int]]:
    """Render with the chat template and mark assistant tokens. -> (input_ids, loss_mask), same length.

    Raises ContentNotFoundError when an assistant content cannot be located in the rendered text.
    """
    text = render_chat(tokenizer, messages, chat_template, enable_thinking)
    enc = _encode(tokenizer, [text])
    ids, offsets = enc["input_ids"][0], enc["offset_mapping"][0]
    return list(ids), _assistant_mask(text, messages, ids, offsets, eot_tokens(tokenizer))


def render_chat(tokenizer, messages: list[dict], chat_template: str | None, enable_thinking: bool | None,
            add_generation_prompt: bool = False) -> str:
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; "
                         "pass chat_template=<jinja string>")
    kw = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    return tokenizer.apply_chat_template(messages, tokenize=False, chat_template=chat_template,
                                         add_generation_prompt=add_generation_prompt, **kw)


def _encode(tokenizer, texts: list[str]):
    try:
        return tokenizer(texts, return_offsets_mapping=True, add_special_tokens=False)
    except NotImplementedError as e:
        raise TypeError(f"{type(tokenizer).__name__} cannot return offsets; a fast (Rust) tokenizer is needed "
                        "for the loss mask") from e


def eot_tokens(tokenizer) -> dict[int, str]:
    """id -> text of the end-of-turn tokens this tokenizer has (plus its eos)."""
    out = {}
    for t in (*EOT_TOKENS, getattr(tokenizer, "eos_token", None)):
        if not t:
            continue
        i = tokenizer.convert_tokens_to_ids(t)
        if isinstance(i, int) and i >= 0 and tokenizer.convert_ids_to_tokens(i) == t:
            out[i] = t
    return out


def _find_closed(text: str, sub: str, start: int, eot_texts: tuple[str, ...], end: int | None = None
                 ) -> tuple[int, int] | None:
    """First occurrence of `sub` at/after `start` that is followed by an end-of-turn (or the text end).

    Preferring a closed occurrence skips look-alikes in headers (content 'assistant' vs the role name).
    Falls back to the first occurrence.
    """
    end = len(text) if end is None else end
    first = pos = text.find(sub, start, end)
    while pos >= 0:
        rest = text[pos + len(sub): pos + len(sub) + 256].lstrip()
        if not rest or rest.startswith(eot_texts):
            return pos, pos + len(sub)
        pos = text.find(sub, pos + 1, end)
    return (first, first + len(sub)) if first >= 0 else None


def _assistant_mask(text: str, messages: list[dict], ids: list[int], offsets: list[tuple[int, int]],
                    eot: dict[int, str]) -> list[int]:
    """Mask from char spans: walk the messages in order with a cursor, so an assistant content is only
    searched after everything that precedes it (a user turn that quotes it cannot capture it)."""
    eot_texts = tuple(sorted(set(eot.values())))
    ends = [b for _, b in offsets]
    mask = [0] * len(ids)
    cursor = 0
    for m in messages:
        content = (m.get("content") or "").strip()
        if not content:
            continue
        span = _find_closed(text, content, cursor, eot_texts)
        if m.get("role") != "assistant":
            cursor = span[1] if span else cursor
            continue
        if span is None and "</think>" in content:
            # reasoning templates (Qwen3) re-format '<think>..</think>' and drop it from earlier turns
            answer = content.split("</think>")[-1].strip()
            reasoning = content.split("</think>")[0].split("<think>")[-1].strip()
            a = _find_closed(text, answer, cursor, eot_texts) if answer else None
            if a is not None:
                start = a[0]
                r = text.find(reasoning, cursor, a[0]) if reasoning else -1
                if r >= 0:
                    head = text[cursor:r].rstrip()
                    start = cursor + len(head) - len("<think>") if head.endswith("<think>") else r
                span = (start, a[1])
        if span is None:
            raise ContentNotFoundError(f"assistant content {content[:60]!r} not found in the rendered template")
        s, e = span
        k = bisect.bisect_right(ends, s)  # first token ending after s
        last = -1
        while k < len(ids) and offsets[k][0] < e:
            if offsets[k][1] > offsets[k][0]:
                mask[k] = 1
                last = k
            k += 1
        if last >= 0:  # the end-of-turn token that closes it (whitespace in between is part of the turn)
            j = last + 1
            while j < len(ids) and ids[j] not in eot and not text[offsets[j][0]:offsets[j][1]].strip():
                j += 1
            if j < len(ids) and ids[j] in eot:
                for q in range(last + 1, j + 1):
                    mask[q] = 1
        cursor = e
    return mask


# ----------------------------------------------------------------------------- tokenize (+ cache)

def tokenize_conversations(tokenizer, convs: list[Conversation], max_length: int, overlong: str = "truncate",
                           chat_template: str | None = None, enable_thinking: bool | None = None,
                           cache_key: str | None = None) -> tuple[list[dict], SkipStats]:
    """-> samples [{"id", "input_ids", "loss_mask"}] and counted skips.

    overlong="truncate" cuts to max_length (a sample left with no assistant token is skipped as
    "all tokens masked"); "skip" drops it ("longer than max_length"). ValueError when conversations were
    given but none is usable (an empty input gives an empty result). With `cache_key` the result is
    cached under cache_dir()/tokenized/, keyed on everything that changes it (conversation contents too).
    """
    if overlong not in ("truncate", "skip"):
        raise ValueError(f"overlong must be 'truncate' or 'skip', got {overlong!r}")
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    path = None
    if cache_key is not None:
        path = _tokenized_cache_path(tokenizer, convs, max_length, overlong, chat_template, enable_thinking, cache_key)
        if path.exists():
            return _load_tokenized(path)
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        render_chat(tokenizer, [], None, None)  # raises the 'no chat template' error
    eot = eot_tokens(tokenizer)
    stats, samples = SkipStats(total_in=len(convs)), []
    with tqdm(total=len(convs), desc="tokenize", unit="conv", dynamic_ncols=True) as bar:
        for s in range(0, len(convs), 64):
            chunk = convs[s:s + 64]
            texts = []
            for c in chunk:
                try:
                    texts.append(render_chat(tokenizer, c.messages, chat_template, enable_thinking))
                except Exception as e:  # e.g. jinja 'roles must alternate': name the conversation
                    raise ValueError(f"conversation {c.id!r}: the chat template failed: {e}") from e
            enc = _encode(tokenizer, texts)
            for c, text, ids, offs in zip(chunk, texts, enc["input_ids"], enc["offset_mapping"]):
                try:
                    mask = _assistant_mask(text, c.messages, ids, offs, eot)
                except ContentNotFoundError:
                    stats.add("assistant content not found in template")
                    continue
                cut = len(ids) > max_length
                if cut and overlong == "skip":
                    stats.add("longer than max_length")
                    continue
                ids, mask = list(ids[:max_length]), mask[:max_length]
                if not any(mask):
                    stats.add("all tokens masked")
                    continue
                stats.truncated += cut
                samples.append({"id": c.id, "input_ids": ids, "loss_mask": mask})
            bar.update(len(chunk))
    stats.kept = len(samples)
    if convs and not samples:
        raise ValueError(f"no usable conversations after tokenizing ({stats.summary('tokenize')})")
    if path is not None and samples:
        _save_tokenized(path, samples, stats)
    return samples, stats


def _tokenized_cache_path(tokenizer, convs, max_length, overlong, chat_template, enable_thinking, cache_key) -> Path:
    h = hashlib.sha256()
    head = {"v": TOKENIZED_CACHE_VERSION, "key": cache_key, "max_length": max_length, "overlong": overlong,
            "template": chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None),
            "enable_thinking": enable_thinking, "tokenizer": getattr(tokenizer, "name_or_path", ""),
            "vocab": len(tokenizer)}
    h.update(json.dumps(head, sort_keys=True).encode())
    for c in convs:  # ids and contents: regenerated data keeps the ids of its source
        h.update(json.dumps([c.id, c.messages], ensure_ascii=False).encode())
    return cache_dir() / "tokenized" / f"{h.hexdigest()[:32]}.npz"


def _save_tokenized(path: Path, samples: list[dict], stats: SkipStats) -> None:
    import numpy as np

    meta = {"ids": [s["id"] for s in samples], "stats": stats.to_dict()}
    buf = io.BytesIO()
    np.savez(buf, input_ids=np.fromiter((t for s in samples for t in s["input_ids"]), dtype=np.int32),
             loss_mask=np.fromiter((t for s in samples for t in s["loss_mask"]), dtype=np.uint8),
             lengths=np.array([len(s["input_ids"]) for s in samples], dtype=np.int64),
             meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8))
    atomic_write_bytes(path, buf.getvalue())


def _load_tokenized(path: Path) -> tuple[list[dict], SkipStats]:
    import numpy as np

    with np.load(path) as z:
        meta = json.loads(z["meta"].tobytes())
        bounds = np.cumsum(z["lengths"])[:-1]
        ids = np.split(z["input_ids"], bounds)
        masks = np.split(z["loss_mask"], bounds)
    samples = [{"id": i, "input_ids": a.tolist(), "loss_mask": m.tolist()} for i, a, m in zip(meta["ids"], ids, masks)]
    return samples, SkipStats(**meta["stats"])


# ----------------------------------------------------------------------------- JSONL of conversations

def conv_line(c: Conversation) -> bytes:
    return json.dumps({"id": c.id, "messages": c.messages}, ensure_ascii=False).encode() + b"\n"


def write_jsonl(convs: Iterable[Conversation], path: str | os.PathLike) -> None:
    """{"id", "messages"} per line, written atomically."""
    atomic_write_bytes(path, b"".join(conv_line(c) for c in convs))


def _parse_conv_line(line: bytes) -> Conversation:
    obj = json.loads(line)
    if not isinstance(obj, dict) or not isinstance(obj.get("messages"), list) or "id" not in obj:
        raise ValueError("not an {'id', 'messages'} record")
    return Conversation(str(obj["id"]), obj["messages"])


def read_jsonl(path: str | os.PathLike) -> list[Conversation]:
    out = []
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(_parse_conv_line(line))
            except ValueError as e:
                raise ValueError(f"{path}: line {n} is not a conversation record ({e})") from e
    return out


def read_done(path: Path) -> dict[str, Conversation]:
    """Conversations already in a regenerate output. A partial last line (a killed run) is dropped and
    the file rewritten; a bad line elsewhere is an error."""
    if not path.exists():
        return {}
    data = path.read_bytes()
    lines = data.split(b"\n")
    done, good, partial = {}, [], False
    for n, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            c = _parse_conv_line(line)
        except ValueError as e:
            if n == len(lines) - 1:
                partial = True
                break
            raise ValueError(f"{path}: line {n + 1} is not a conversation record ({e}); fix or remove it") from e
        done[c.id] = c
        good.append(line)
    if partial or (data and not data.endswith(b"\n")):
        atomic_write_bytes(path, b"".join(line + b"\n" for line in good))
    if partial:
        print(f"regenerate: dropped a partial last line in {path} (interrupted run); {len(done)} conversations kept",
              flush=True)
    return done

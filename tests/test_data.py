"""trainer/data.py: loading + counted skips, holdout split, loss masks on real chat templates, tokenize
cache, truncated-JSON recovery and resumable regeneration. Tiny in-process tokenizer and target; the
real SmolLM2 tokenizer and the real ShareGPT file only in the few `slow` tests."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from drafthead.runtime.generate import SpeculativeGenerator

from drafthead.trainer import data as tdata
from drafthead.trainer import regenerate as tregen
from drafthead.trainer.data import Conversation

TEMPLATES = Path(__file__).parent / "assets" / "chat_templates"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>"]


def template(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text().rstrip("\n")


@pytest.fixture(autouse=True)
def _tmp_cache(request, tmp_path, monkeypatch):
    """Fast tests write caches into tmp; slow tests use the real cache (the assets live there)."""
    if request.node.get_closest_marker("slow") is None:
        monkeypatch.setenv("DRAFTHEAD_CACHE", str(tmp_path / "cache"))


def tiny_tokenizer(chat_template: str = "smollm2_chatml"):
    """Byte-level BPE trained in-process, with the special tokens of ChatML, Llama-3 and Qwen3."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = ["Hello there, how are you? The answer is 4. Let me think about it. What is the capital of France? "
              "Paris is the capital. Write a poem about the sea. assistant user system"] * 4
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_tokens(["<think>", "</think>"])  # Qwen3: added, not special
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|begin_of_text|>",
                                 pad_token="<|endoftext|>")
    hf.chat_template = template(chat_template)
    return hf


def masked_text(tok, ids, mask) -> str:
    assert len(ids) == len(mask)
    return tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)


SINGLE = [{"role": "user", "content": "What is the capital of France?"},
          {"role": "assistant", "content": "Paris is the capital."}]
MULTI = [{"role": "system", "content": "Be brief."},
         {"role": "user", "content": "Hello there"},
         {"role": "assistant", "content": "Hello, how are you?"},
         {"role": "user", "content": "Write a poem about the sea."},
         {"role": "assistant", "content": "The sea,\nthe sea.\n\nIt is blue."}]
EOT = {"smollm2_chatml": "<|im_end|>", "llama3": "<|eot_id|>", "llama3_1": "<|eot_id|>", "qwen3": "<|im_end|>"}


# ----------------------------------------------------------------------------- loss masks

@pytest.mark.parametrize("name", list(EOT))
@pytest.mark.parametrize("messages", [SINGLE, MULTI], ids=["single", "multi"])
def test_mask_is_exactly_assistant_content_plus_eot(name, messages):
    tok = tiny_tokenizer(name)
    ids, mask = tdata.render_and_mask(tok, messages)
    want = "".join(m["content"] + EOT[name] for m in messages if m["role"] == "assistant")
    assert masked_text(tok, ids, mask) == want
    assert ids == tok(tok.apply_chat_template(messages, tokenize=False), add_special_tokens=False)["input_ids"]


def test_mask_chat_template_argument_overrides_tokenizer():
    tok = tiny_tokenizer("smollm2_chatml")
    ids, mask = tdata.render_and_mask(tok, MULTI, chat_template=template("llama3"))
    assert masked_text(tok, ids, mask) == "Hello, how are you?<|eot_id|>The sea,\nthe sea.\n\nIt is blue.<|eot_id|>"
    assert tok.decode(ids[:1]) == "<|begin_of_text|>"


@pytest.mark.parametrize("enable_thinking", [None, True, False])
def test_mask_qwen3_thinking(enable_thinking):
    """Qwen3 drops reasoning from turns before the last user query and re-formats the last one."""
    tok = tiny_tokenizer("qwen3")
    msgs = [{"role": "user", "content": "Hello there"},
            {"role": "assistant", "content": "<think>\nearlier reasoning\n</think>\n\nHello, how are you?"},
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "<think>Let me think.</think>The answer is 4."}]
    ids, mask = tdata.render_and_mask(tok, msgs, enable_thinking=enable_thinking)
    text = tok.decode(ids)
    assert "earlier reasoning" not in text  # the template stripped it, so it cannot be masked
    assert masked_text(tok, ids, mask) == ("Hello, how are you?<|im_end|>"
                                           "<think>\nLet me think.\n</think>\n\nThe answer is 4.<|im_end|>")
    # no reasoning: the final turn still renders an empty think block, which is not the model's answer
    ids, mask = tdata.render_and_mask(tok, SINGLE, enable_thinking=enable_thinking)
    assert "<think>\n\n</think>\n\nParis is the capital.<|im_end|>" in tok.decode(ids)
    assert masked_text(tok, ids, mask) == "Paris is the capital.<|im_end|>"


def test_mask_ignores_look_alikes_before_the_answer():
    """An answer quoted by the user, or equal to the role name, must be masked where the answer is."""
    tok = tiny_tokenizer("smollm2_chatml")
    msgs = [{"role": "user", "content": "Say 'Paris' or 'assistant'"}, {"role": "assistant", "content": "assistant"},
            {"role": "user", "content": "Paris"}, {"role": "assistant", "content": "Paris"}]
    ids, mask = tdata.render_and_mask(tok, msgs)
    assert masked_text(tok, ids, mask) == "assistant<|im_end|>Paris<|im_end|>"
    text = tok.apply_chat_template(msgs, tokenize=False)
    first = mask.index(1)
    assert tok.decode(ids[:first]) == text[: text.rindex("assistant\nassistant<|im_end|>") + len("assistant\n")]


# ----------------------------------------------------------------------------- loading

def write_jsonl_rows(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_load_sharegpt_and_openai_formats(tmp_path):
    sharegpt = [{"id": "a", "conversations": [{"from": "human", "value": " Hi "}, {"from": "gpt", "value": "Hello"}]},
                {"id": "b", "conversations": [{"from": "system", "value": "Sys"}, {"from": "user", "value": "Q"},
                                              {"from": "chatgpt", "value": "A1"}, {"from": "bard", "value": "A2"}]}]
    openai = [{"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]},
              {"id": "x", "messages": [{"role": "user", "content": [{"type": "text", "text": "parts"}]},
                                       {"role": "assistant", "content": "ok"}]}]
    p_json = tmp_path / "sg.json"
    p_json.write_text(json.dumps(sharegpt))
    convs, stats = tdata.load_conversations(str(p_json))
    assert [c.id for c in convs] == ["a", "b"]
    assert convs[0].messages == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    # consecutive assistant messages are merged with a blank line
    assert convs[1].messages == [{"role": "system", "content": "Sys"}, {"role": "user", "content": "Q"},
                                 {"role": "assistant", "content": "A1\n\nA2"}]
    assert stats.summary("sg") == "sg: kept 2 of 2 conversations; skipped: none"

    convs, _ = tdata.load_conversations(str(write_jsonl_rows(tmp_path / "oa.jsonl", openai)))
    assert [c.id for c in convs] == ["oa-0", "x"]  # missing id -> <file stem>-<row>
    assert convs[1].messages[0] == {"role": "user", "content": "parts"}

    # both formats in one file, detected per row
    convs, stats = tdata.load_conversations(str(write_jsonl_rows(tmp_path / "mixed.jsonl", sharegpt + openai)))
    assert [c.id for c in convs] == ["a", "b", "mixed-2", "x"] and stats.kept == 4


def test_load_drops_leading_assistant_and_dedups_ids(tmp_path):
    rows = [{"id": "d", "conversations": [{"from": "gpt", "value": "orphan answer"}, {"from": "human", "value": "Q"},
                                          {"from": "gpt", "value": "A"}]},
            {"id": "d", "conversations": [{"from": "human", "value": "Q2"}, {"from": "gpt", "value": "A2"}]},
            {"id": "d", "conversations": [{"from": "human", "value": "Q3"}, {"from": "gpt", "value": "A3"}]}]
    convs, _ = tdata.load_conversations(str(write_jsonl_rows(tmp_path / "d.jsonl", rows)))
    assert convs[0].messages == [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    assert [c.id for c in convs] == ["d", "d#1", "d#2"]
    convs, stats = tdata.load_conversations(str(tmp_path / "d.jsonl"), max_samples=2)
    assert [c.id for c in convs] == ["d", "d#1"] and stats.total_in == 2


def test_every_bad_row_kind_is_counted(tmp_path):
    good = {"id": "ok", "conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}]}
    rows = [good,
            '{"id": "broken", "conversations": [',  # malformed json line
            {"id": "e1", "conversations": []},  # empty conversation
            {"id": "e2", "messages": [{"role": "user", "content": "  "}]},  # empty after stripping
            {"id": "n1", "conversations": [{"from": "human", "value": "only a question"}]},  # no assistant turn
            {"id": "n2", "conversations": [{"from": "gpt", "value": "orphan"}]},  # leading assistant dropped -> none
            {"id": "u1", "conversations": [{"from": "human", "value": "Q"}, {"from": "bing", "value": "A"}]},
            {"id": "m1", "messages": "not a list"},  # malformed record
            [1, 2]]  # not an object
    convs, stats = tdata.load_conversations(str(write_jsonl_rows(tmp_path / "bad.jsonl", rows)))
    assert [c.id for c in convs] == ["ok"]
    assert stats.counts == {"malformed json": 3, "empty conversation": 2, "no assistant turn": 2, "unknown role": 1}
    assert stats.summary("bad.jsonl") == ("bad.jsonl: kept 1 of 9 conversations; skipped: 3 malformed json, "
                                          "2 empty conversation, 2 no assistant turn, 1 unknown role")
    with pytest.raises(ValueError, match="unknown skip reason"):
        stats.add("typo")


def test_nothing_usable_raises_with_summary(tmp_path):
    p = write_jsonl_rows(tmp_path / "none.jsonl", ['{"oops', {"conversations": [{"from": "human", "value": "Q"}]}])
    with pytest.raises(ValueError, match=r"none\.jsonl' has no usable conversations \(.*kept 0 of 2 conversations; "
                                         r"skipped: 1 malformed json, 1 no assistant turn\)"):
        tdata.load_conversations(str(p))
    with pytest.raises(FileNotFoundError, match="no such file"):
        tdata.load_conversations(str(tmp_path / "missing.jsonl"))
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(ValueError, match=r"expected a \.json"):
        tdata.load_conversations(str(tmp_path / "x.csv"))


def test_cut_off_json_is_stream_parsed_and_cached(tmp_path, capsys):
    rows = [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"Q{i} \u00e9"},
                                               {"from": "gpt", "value": f"A{i}", "score": 0.5}]} for i in range(5)]
    text = json.dumps(rows, indent=2, ensure_ascii=False)
    cut = text.index('"A3"') + 2  # mid-record, inside a string
    p = tmp_path / "cut.json"
    p.write_text(text[:cut])
    convs, stats = tdata.load_conversations(str(p))
    assert [c.id for c in convs] == ["c0", "c1", "c2"] and convs[2].messages[0]["content"] == "Q2 \u00e9"
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "cut.json is truncated" in out[0] and "recovered 3 complete conversations" in out[0]
    assert "wrote clean copy" in out[0]
    clean = list((tmp_path / "cache" / "recovered").glob("cut-*.jsonl"))
    assert len(clean) == 1 and len(clean[0].read_text().splitlines()) == 3
    # second call: the cached clean JSONL (fast path), same result, same single line
    convs2, stats2 = tdata.load_conversations(str(p))
    assert convs2 == convs and stats2 == stats
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "recovered 3 complete conversations (using clean copy" in out[0]


def test_invalid_json_array_is_an_error(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text('[{"id": "a", "conversations": []}, {"id": oops}]')
    with pytest.raises(ValueError, match=r"bad\.json is not valid JSON"):
        tdata.load_conversations(str(p))


# ----------------------------------------------------------------------------- split

def test_split_holdout_deterministic_and_disjoint():
    convs = [Conversation(f"id{i}", [{"role": "user", "content": str(i)}]) for i in range(50)]
    train, hold = tdata.split_holdout(convs, 10, seed=0)
    assert len(train) == 40 and len(hold) == 10
    assert {c.id for c in train}.isdisjoint({c.id for c in hold})
    assert {c.id for c in train} | {c.id for c in hold} == {c.id for c in convs}
    assert [c.id for c in train] == sorted((c.id for c in train), key=lambda s: int(s[2:]))  # input order kept
    train2, hold2 = tdata.split_holdout(list(convs), 10, seed=0)
    assert [c.id for c in hold2] == [c.id for c in hold] and [c.id for c in train2] == [c.id for c in train]
    assert [c.id for c in tdata.split_holdout(convs, 10, seed=1)[1]] != [c.id for c in hold]
    # chosen by id, not by position: the same set when the input order changes
    assert {c.id for c in tdata.split_holdout(convs[::-1], 10, seed=0)[1]} == {c.id for c in hold}
    assert tdata.split_holdout(convs, 0, seed=0) == (convs, [])
    with pytest.raises(ValueError, match="num_holdout=50 must be in 0..49"):
        tdata.split_holdout(convs, 50, seed=0)


# ----------------------------------------------------------------------------- tokenize

def convs_for_tokenize() -> list[Conversation]:
    return [Conversation("single", SINGLE), Conversation("multi", MULTI)]


def test_tokenize_samples_match_render_and_mask():
    tok = tiny_tokenizer("llama3")
    samples, stats = tdata.tokenize_conversations(tok, convs_for_tokenize(), max_length=4096)
    assert [s["id"] for s in samples] == ["single", "multi"]
    for s, c in zip(samples, convs_for_tokenize()):
        assert (s["input_ids"], s["loss_mask"]) == tdata.render_and_mask(tok, c.messages)
    assert stats.summary("tokenize") == "tokenize: kept 2 of 2 conversations; skipped: none"


def test_tokenize_truncate_skip_and_bad_rows():
    tok = tiny_tokenizer("smollm2_chatml")
    full, _ = tdata.tokenize_conversations(tok, [Conversation("multi", MULTI)], max_length=4096)
    n = len(full[0]["input_ids"])
    first_masked = full[0]["loss_mask"].index(1)
    # truncate: a prefix, counted
    samples, stats = tdata.tokenize_conversations(tok, [Conversation("multi", MULTI)], max_length=n - 3)
    assert samples[0]["input_ids"] == full[0]["input_ids"][: n - 3]
    assert samples[0]["loss_mask"] == full[0]["loss_mask"][: n - 3]
    assert stats.truncated == 1
    assert stats.summary("t") == "t: kept 1 of 1 conversations; skipped: none; truncated to max_length: 1"
    # skip mode
    convs = [Conversation("multi", MULTI), Conversation("single", SINGLE)]
    lens = {c.id: len(tdata.render_and_mask(tok, c.messages)[0]) for c in convs}
    shorter = min(lens, key=lens.get)
    samples, stats = tdata.tokenize_conversations(tok, convs, max_length=lens[shorter], overlong="skip")
    assert [s["id"] for s in samples] == [shorter] and stats.counts == {"longer than max_length": 1}
    # truncation that leaves no assistant token, and a template that never shows the answer
    hides = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] | upper + '<|im_end|>' }}"
             "{% endfor %}")
    early = Conversation("early", [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
                                   {"role": "assistant", "content": "Paris"}])
    assert tdata.render_and_mask(tok, early.messages)[1].index(1) < first_masked
    samples, stats = tdata.tokenize_conversations(tok, [convs[0], early], max_length=first_masked)
    assert stats.counts == {"all tokens masked": 1} and [s["id"] for s in samples] == ["early"]
    assert stats.truncated == 0  # a skipped sample is not also counted as truncated
    with pytest.raises(ValueError, match=r"no usable conversations after tokenizing \(tokenize: kept 0 of 2 "
                                         r"conversations; skipped: 2 assistant content not found in template\)"):
        tdata.tokenize_conversations(tok, convs, max_length=4096, chat_template=hides)
    # num_holdout=0
    assert tdata.tokenize_conversations(tok, [], max_length=64, cache_key="k") == ([], tdata.SkipStats())
    with pytest.raises(ValueError, match="overlong must be"):
        tdata.tokenize_conversations(tok, convs, max_length=10, overlong="drop")


def test_tokenize_skip_summary_line():
    tok = tiny_tokenizer("smollm2_chatml")
    upper_q = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + (m['content'] | upper "
               "if m['content'] == 'hidden' else m['content']) + '<|im_end|>' }}{% endfor %}")
    long_answer = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "Paris is the capital. " * 20}]
    late_answer = [{"role": "user", "content": "Write a poem about the sea. " * 20},
                   {"role": "assistant", "content": "A"}]
    convs = [Conversation("ok", SINGLE), Conversation("hidden", [{"role": "user", "content": "Q"},
                                                                 {"role": "assistant", "content": "hidden"}]),
             Conversation("late", late_answer), Conversation("long", long_answer)]
    samples, stats = tdata.tokenize_conversations(tok, convs, max_length=40, chat_template=upper_q)
    assert [s["id"] for s in samples] == ["ok", "long"] and all(len(s["input_ids"]) <= 40 for s in samples)
    assert stats.summary("tokenize") == ("tokenize: kept 2 of 4 conversations; skipped: 1 all tokens masked, "
                                         "1 assistant content not found in template; truncated to max_length: 1")


def test_tokenize_cache_roundtrip(tmp_path, monkeypatch):
    tok = tiny_tokenizer("qwen3")
    convs = convs_for_tokenize()
    samples, stats = tdata.tokenize_conversations(tok, convs, max_length=30, cache_key="tiny")
    files = list((tmp_path / "cache" / "tokenized").glob("*.npz"))
    assert len(files) == 1 and not list((tmp_path / "cache" / "tokenized").glob(".*tmp*"))

    def no_render(*a, **k):
        raise AssertionError("cache hit expected")

    with monkeypatch.context() as m:
        m.setattr(tdata, "render_chat", no_render)
        again, stats2 = tdata.tokenize_conversations(tok, convs, max_length=30, cache_key="tiny")
    assert again == samples and stats2 == stats
    # a change of content under the same ids (regenerated data) or of max_length is a new entry
    changed = [Conversation("single", [SINGLE[0], {"role": "assistant", "content": "Lyon"}]), convs[1]]
    new, _ = tdata.tokenize_conversations(tok, changed, max_length=30, cache_key="tiny")
    assert masked_text(tok, new[0]["input_ids"], new[0]["loss_mask"]) == "Lyon<|im_end|>"
    tdata.tokenize_conversations(tok, convs, max_length=31, cache_key="tiny")
    assert len(list((tmp_path / "cache" / "tokenized").glob("*.npz"))) == 3


# ----------------------------------------------------------------------------- JSONL + regenerate

def test_write_read_jsonl_roundtrip(tmp_path):
    convs = [Conversation("a", SINGLE), Conversation("b\u00e9", MULTI)]
    tdata.write_jsonl(convs, tmp_path / "c.jsonl")
    assert tdata.read_jsonl(tmp_path / "c.jsonl") == convs
    assert tdata.load_conversations(str(tmp_path / "c.jsonl"))[0] == convs  # our output is a valid source
    (tmp_path / "c.jsonl").write_text('{"id": "a", "messages": []}\n{"id": \n')
    with pytest.raises(ValueError, match="line 2 is not a conversation record"):
        tdata.read_jsonl(tmp_path / "c.jsonl")


def tiny_target():
    from transformers import LlamaConfig, LlamaForCausalLM

    from drafthead.target import Target, freeze

    tok = tiny_tokenizer("smollm2_chatml")
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    return freeze(Target(LlamaForCausalLM(cfg).eval(), tok, "tiny"))


def two_turns(batch_size: int) -> "tregen.AnswerOptions":
    """Six new tokens a turn, two turns: short answers to compare batchings and paths."""
    return tregen.AnswerOptions(max_new_tokens=6, batch_size=batch_size, max_turns=2, engine="ours")


def regen_convs() -> list[Conversation]:
    out = []
    for i in range(7):
        msgs = [{"role": "system", "content": "Be brief."}] if i % 3 == 0 else []
        for t in range(1 + i % 3):  # 1..3 user turns of different lengths
            msgs += [{"role": "user", "content": "Hello there " * (1 + (i * 2 + t) % 5) + f"#{i}.{t}"},
                     {"role": "assistant", "content": "old answer"}]
        out.append(Conversation(f"r{i}", msgs))
    return out


def test_regenerate_left_padding_matches_unbatched(tmp_path):
    target, convs = tiny_target(), regen_convs()
    a = tregen.regenerate(target, convs, str(tmp_path / "a.jsonl"), two_turns(4))
    b = tregen.regenerate(target, convs, str(tmp_path / "b.jsonl"), two_turns(1))
    assert a == b and [c.id for c in a] == [c.id for c in convs]
    for src, new in zip(convs, a):
        users = [m for m in src.messages if m["role"] == "user"][:2]
        assert [m for m in new.messages if m["role"] == "user"] == users
        assert [m["role"] for m in new.messages if m["role"] != "system"] == ["user", "assistant"] * len(users)
        assert all(m["content"] != "old answer" for m in new.messages)
    assert target.tokenizer.padding_side == "right"  # restored


def test_regenerate_resume_loses_and_duplicates_nothing(tmp_path, monkeypatch, capsys):
    target, convs = tiny_target(), regen_convs()
    ref = tregen.regenerate(target, convs, str(tmp_path / "ref.jsonl"), two_turns(2))
    ref_by_id = {c.id: c for c in ref}

    # kill 1: the run dies inside the third generate call (2nd batch): only batch 1 is on disk
    out = tmp_path / "out.jsonl"
    real_generate, calls = SpeculativeGenerator.generate, []

    def dying_generate(self, prompts, *a, **k):
        calls.append(len(prompts))
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_generate(self, prompts, *a, **k)

    monkeypatch.setattr(SpeculativeGenerator, "generate", dying_generate)
    with pytest.raises(KeyboardInterrupt):
        tregen.regenerate(target, convs, str(out), two_turns(2))
    first = tdata.read_jsonl(out)
    assert len(first) == 2

    # kill 2: a half-written line at the end
    with open(out, "ab") as f:
        f.write(json.dumps({"id": convs[-1].id, "messages": ref_by_id[convs[-1].id].messages}).encode()[:25])
    monkeypatch.setattr(SpeculativeGenerator, "generate", real_generate)
    capsys.readouterr()
    got = tregen.regenerate(target, convs, str(out), two_turns(2))
    assert "dropped a partial last line" in capsys.readouterr().out
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["id"] for r in lines) == sorted(c.id for c in convs)  # nothing lost, nothing twice
    assert lines[:2] == [{"id": c.id, "messages": c.messages} for c in first]  # finished work kept as is
    assert got == ref  # same answers as the uninterrupted run, in input order

    # a finished file: nothing left to generate
    monkeypatch.setattr(SpeculativeGenerator, "generate", lambda *a, **k: pytest.fail("nothing should be generated"))
    assert tregen.regenerate(target, convs, str(out), two_turns(2)) == ref


def test_regenerate_runtime_matches_hf_generate(tmp_path, monkeypatch, capsys):
    """Regeneration runs on drafthead's batched loop when the architecture allows; greedy answers are the
    ones HF `generate` gives (the fallback for other architectures, and what engine=auto takes when neither vLLM
    nor our runtime can answer)."""
    target, convs = tiny_target(), regen_convs()
    ours = tregen.regenerate(target, convs, str(tmp_path / "ours.jsonl"), two_turns(3))
    monkeypatch.setattr(SpeculativeGenerator, "generate", lambda *a, **k: pytest.fail("HF path expected"))
    hf = tregen.regenerate(target, convs, str(tmp_path / "hf.jsonl"), replace(two_turns(3), engine="hf"))
    assert ours == hf and len(ours) == len(convs)
    monkeypatch.setattr(tregen, "_ar_runtime", lambda *a: None)
    auto = replace(two_turns(3), engine="auto", vllm_python=str(tmp_path / "no-vllm" / "python"))
    capsys.readouterr()
    assert tregen.regenerate(target, convs, str(tmp_path / "auto.jsonl"), auto) == hf
    said = capsys.readouterr().out
    assert "HF generate" in said and "vLLM not used: no vLLM environment at" in said


def test_regenerate_engine_ours_on_an_architecture_it_cannot_run_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(tregen, "_ar_runtime", lambda *a: None)
    with pytest.raises(ValueError, match=r"engine=ours: our runtime does not run model type 'llama'; use "
                                         r"engine=vllm or engine=hf"):
        tregen.regenerate(tiny_target(), regen_convs(), str(tmp_path / "r.jsonl"), two_turns(2))


def test_regenerate_engine_vllm_without_vllm_is_named(tmp_path):
    opts = replace(two_turns(2), engine="vllm", vllm_python=str(tmp_path / "none"))
    with pytest.raises(ValueError, match=r"no vLLM environment at .*none.*make_vllm_env\.sh"):
        tregen.regenerate(tiny_target(), regen_convs(), str(tmp_path / "r.jsonl"), opts)


# ----------------------------------------------------------------------------- real assets (slow)

@pytest.mark.slow
def test_real_sharegpt_recovered(capsys):
    convs, stats = tdata.load_conversations("sharegpt")
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "is truncated" in out[0] and "recovered" in out[0]
    recovered = int(out[0].split("recovered ")[1].split()[0])
    assert 17_000 <= recovered <= 18_500 and stats.total_in == recovered
    assert 17_000 <= stats.kept <= recovered and stats.kept + sum(stats.counts.values()) == stats.total_in
    assert len({c.id for c in convs}) == len(convs)
    assert all(c.messages[0]["role"] in ("user", "system") for c in convs)
    print(stats.summary("sharegpt"))


def test_tokenize_template_errors_are_named():
    tok = tiny_tokenizer()
    tok.chat_template = None
    with pytest.raises(ValueError, match="has no chat template; pass chat_template="):
        tdata.tokenize_conversations(tok, convs_for_tokenize(), max_length=64)
    strict = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}"
              "{% endif %}{% endfor %}")
    with pytest.raises(ValueError, match="conversation 'multi': the chat template failed: no system role"):
        tdata.tokenize_conversations(tok, convs_for_tokenize(), max_length=64, chat_template=strict)


@pytest.mark.slow
def test_real_smollm2_weights_load_from_the_cache_as_from_the_gguf():
    """The de-quantized folder `load_target` reads holds transformers' own de-quantization of the GGUF: equal in
    fp32, and equal after the cast to bf16 (which is what loading the GGUF in bf16 does)."""
    import torch
    from transformers import AutoModelForCausalLM

    from drafthead.target import dequantized_dir, load_target, resolve_target

    from drafthead.assets import cache_dir

    path, gguf = resolve_target("smollm2-135m-instruct")
    ref = AutoModelForCausalLM.from_pretrained(path, gguf_file=gguf, dtype=torch.float32).state_dict()
    folder = dequantized_dir(path, gguf)  # written by whichever load came first
    assert folder.parent == cache_dir() / "gguf-models" and (folder / "model.safetensors").is_file()
    for dtype in ("float32", "bfloat16"):
        got = load_target("smollm2-135m-instruct", dtype=dtype).model
        assert got.model.embed_tokens.weight.data_ptr() == got.lm_head.weight.data_ptr()  # still tied
        sd = got.state_dict()
        assert sd.keys() == ref.keys()
        assert all(torch.equal(sd[k], ref[k].to(getattr(torch, dtype))) for k in ref), dtype


@pytest.mark.slow
def test_real_smollm2_tokenizer_masks():
    from transformers import AutoTokenizer

    from drafthead.assets import asset_path

    from drafthead.target import load_tokenizer, resolve_target

    tok = load_tokenizer(*resolve_target("smollm2-135m-instruct", None))  # the cached HF copy of the GGUF vocab
    gguf = asset_path("smollm2-135m-instruct")  # the cached copy must tokenize exactly like the GGUF vocab
    ref = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    text = ref.apply_chat_template(MULTI, tokenize=False) + " déjà vu 123 \n\t  code()"
    assert tok(text, return_offsets_mapping=True) == ref(text, return_offsets_mapping=True)
    assert (tok.chat_template, tok.eos_token, tok.pad_token, len(tok)) == (ref.chat_template, ref.eos_token,
                                                                          ref.pad_token, len(ref))
    for messages in (SINGLE, MULTI):
        ids, mask = tdata.render_and_mask(tok, messages)
        assert masked_text(tok, ids, mask) == "".join(m["content"] + "<|im_end|>"
                                                      for m in messages if m["role"] == "assistant")
    # the same real vocab under the Llama-3 and Qwen3 templates (their special tokens added)
    tok.add_special_tokens({"additional_special_tokens": ["<|begin_of_text|>", "<|start_header_id|>",
                                                          "<|end_header_id|>", "<|eot_id|>"]})
    tok.add_tokens(["<think>", "</think>"])
    tok.bos_token = "<|begin_of_text|>"
    for name in ("llama3", "llama3_1", "qwen3"):
        for messages in (SINGLE, MULTI):
            ids, mask = tdata.render_and_mask(tok, messages, chat_template=template(name))
            assert masked_text(tok, ids, mask) == "".join(m["content"] + EOT[name]
                                                          for m in messages if m["role"] == "assistant")


def test_regenerate_skips_and_counts_long_prompts(tmp_path, capsys):
    """A first prompt longer than max_prompt_tokens is not answered (a batch runs at its longest prompt);
    the conversation keeps its original answers in training and the skip is counted in one line."""
    target, convs = tiny_target(), regen_convs()
    tok = target.tokenizer
    first = [[m for m in c.messages[:1] if m["role"] == "system"] + [m for m in c.messages if m["role"] == "user"][:1]
             for c in convs]
    lens = [len(tok(tdata.render_chat(tok, msgs, None, None,
                              add_generation_prompt=True), add_special_tokens=False)["input_ids"]) for msgs in first]
    limit = sorted(lens)[len(lens) // 2]
    capsys.readouterr()
    got = tregen.regenerate(target, convs, str(tmp_path / "r.jsonl"),
                           tregen.AnswerOptions(max_new_tokens=4, batch_size=2, max_prompt_tokens=limit,
                                               engine="ours"))
    kept = [c.id for c, n in zip(convs, lens) if n <= limit]
    assert [c.id for c in got] == kept and 0 < len(kept) < len(convs)
    assert f"{len(convs) - len(kept)} conversations keep their original answers" in capsys.readouterr().out

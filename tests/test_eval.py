"""eval/: real dataset files, acceptance math on hand-made results, report files, bad inputs, CLI.

The slow tests run `drafthead eval` / the bench on the real SmolLM2 target with a tiny untrained draft.
"""
from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from drafthead import hardware
from drafthead import options
from drafthead.eval import EvalConfig, validate
from drafthead.eval.acceptance import (Generation, acceptance_length, acceptance_rate_by_position, compare_outputs,
                                      conditional_acceptance_by_position,
                             generate_runs, generate_samples, mean_accepted)
from drafthead.eval.datasets import (HUMANEVAL_INSTRUCTION, EvalSample, chat_prompt, heldout_path, load_eval_dataset,
                           load_humaneval, load_mt_bench, load_sharegpt)
from drafthead.eval.report import build_report, write_report

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Result:  # the fields of drafthead.runtime.GenerationResult that eval reads
    tokens: list[int]
    num_rounds: int
    accept_lens: list[int]
    num_drafted: list[int]
    time_s: float = 0.0
    stopped_eos: bool = False


def stub_result(k: int, rounds: int, accept: str) -> Result:
    """A drafter whose k proposals are always ("all") or never ("none") accepted.

    Like the runtime: the first token comes from prefill, then each round emits accept_len + 1.
    """
    a = k if accept == "all" else 0
    return Result(list(range(1 + rounds * (a + 1))), rounds, [a] * rounds, [k] * rounds)


# ------------------------------------------------------------------------------------------ datasets

def test_mt_bench_real_file_has_80_questions_8_categories_2_turns():
    qs = load_mt_bench()
    assert len(qs) == 80
    counts = Counter(q.category for q in qs)
    assert len(counts) == 8 and set(counts.values()) == {10}
    assert {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"} == set(counts)
    assert all(len(q.turns) == 2 and all(t.strip() for t in q.turns) for q in qs)
    assert len({q.id for q in qs}) == 80
    # interleaved: any 8 consecutive questions from the start cover all 8 categories
    assert len({q.category for q in qs[:8]}) == 8
    assert len({q.category for q in load_eval_dataset("mt_bench", max_prompts=16)}) == 8


def test_humaneval_real_file_has_164_prompts_asked_as_user_messages():
    tasks = load_humaneval()
    assert len(tasks) == 164
    assert tasks[0].id == "HumanEval/0" and tasks[-1].id == "HumanEval/163"
    assert all(len(t.turns) == 1 and "def " in t.turns[0] for t in tasks)
    assert tasks[0].turns[0].startswith(HUMANEVAL_INSTRUCTION.split("{")[0])
    assert "def has_close_elements(numbers: List[float], threshold: float) -> bool:" in tasks[0].turns[0]
    assert len(load_eval_dataset("humaneval", max_prompts=5)) == 5


def test_sharegpt_reads_the_heldout_split_next_to_the_draft(tmp_path):
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    rows = [{"id": "a", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                                     {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]},
            {"id": "b", "messages": [{"role": "assistant", "content": "no user turn"}]},
            {"id": "c", "messages": [{"role": "user", "content": "second"}]}]
    (run / "heldout.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert heldout_path(run / "final") == (run / "heldout.jsonl").resolve()
    got = load_eval_dataset("sharegpt", draft_dir=str(run / "final") + "/")
    assert [(s.id, s.turns) for s in got] == [("sharegpt/a", ("hi",)), ("sharegpt/c", ("second",))]
    assert load_sharegpt(run / "heldout.jsonl") == got


def test_sharegpt_without_heldout_file_is_a_clear_error(tmp_path):
    (tmp_path / "run" / "final").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="heldout.jsonl"):
        load_eval_dataset("sharegpt", draft_dir=tmp_path / "run" / "final")
    with pytest.raises(ValueError, match="held out by training"):
        load_eval_dataset("sharegpt")


def test_bad_dataset_and_sizes_are_errors_naming_the_problem(tmp_path):
    with pytest.raises(ValueError, match="unknown dataset 'gsm8k'; valid: mt_bench, humaneval, sharegpt"):
        load_eval_dataset("gsm8k")
    with pytest.raises(ValueError, match="max_prompts must be > 0"):
        load_eval_dataset("mt_bench", max_prompts=0)
    base = dict(draft=None, target="smollm2-135m-instruct", mode="ngram")
    with pytest.raises(ValueError, match="unknown dataset 'gsm8k'"):
        validate(EvalConfig(**base, dataset="gsm8k"))
    with pytest.raises(ValueError, match="max_new_tokens must be > 0, got 0"):
        validate(EvalConfig(**base, max_new_tokens=0))
    with pytest.raises(ValueError, match="max_new_tokens must be > 0, got -3"):
        validate(EvalConfig(**base, max_new_tokens=-3))
    with pytest.raises(ValueError, match="max_prompts must be > 0"):
        validate(EvalConfig(**base, max_prompts=-1))
    with pytest.raises(ValueError, match="unknown dtype 'fp8'; valid: auto, float32, bfloat16"):
        validate(EvalConfig(**base, dtype="fp8"))
    from drafthead.eval.bench import BenchConfig, validate as validate_bench
    with pytest.raises(ValueError, match="unknown dtype 'half'"):
        validate_bench(BenchConfig(target="t", dtype="half"))
    with pytest.raises(ValueError, match="tree_nodes must be > 0, got 0"):
        validate_bench(BenchConfig(target="t", tree_nodes=0))
    with pytest.raises(ValueError, match="mode=chain needs a trained draft"):
        validate(EvalConfig(draft=None, target="x", mode="chain"))
    with pytest.raises(ValueError, match="draft=none needs target="):
        validate(EvalConfig(draft=None))
    with pytest.raises(FileNotFoundError, match="not a draft directory"):
        validate(EvalConfig(draft=str(tmp_path)))
    with pytest.raises(ValueError, match=r"unknown config key 'max_new_token' \(did you mean 'max_new_tokens'\?\)"):
        options.parse(EvalConfig, ["draft=none", "max_new_token=5"])
    cfg = options.parse(EvalConfig, ["draft=none", "target=t", "max_prompts=2", "temperature=0.7"])
    assert cfg.draft is None and cfg.max_prompts == 2 and cfg.temperature == 0.7


def test_cli_reports_bad_input_in_one_line(capsys):
    from drafthead.cli import COMMANDS, main
    assert {"eval", "bench"} <= set(COMMANDS)
    assert main(["eval", "draft=none", "target=x", "dataset=nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown dataset 'nope'" in err and "mt_bench" in err
    assert main(["eval", "draft=none", "target=x", "max_new_tokens=0"]) == 2
    assert "max_new_tokens must be > 0" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------- metrics

@pytest.mark.parametrize("k", [1, 4, 7])
def test_always_and_never_accept_stubs(k):
    always = [stub_result(k, 10, "all"), stub_result(k, 3, "all")]
    never = [stub_result(k, 10, "none"), stub_result(k, 5, "none")]
    assert acceptance_length(always) == k + 1
    assert acceptance_length(never) == 1
    assert mean_accepted(always) == k and mean_accepted(never) == 0
    assert acceptance_rate_by_position(always) == [1.0] * k
    assert acceptance_rate_by_position(never) == [0.0] * k


def test_position_rates_count_only_rounds_that_drafted_that_far():
    # accept 0 of 4, 2 of 4, 4 of 4, 1 of 2
    r = Result(tokens=list(range(1 + 1 + 3 + 5 + 2)), num_rounds=4, accept_lens=[0, 2, 4, 1], num_drafted=[4, 4, 4, 2])
    assert acceptance_rate_by_position([r]) == [3 / 4, 2 / 4, 1 / 3, 1 / 3]
    assert acceptance_rate_by_position([r], max_positions=2) == [3 / 4, 2 / 4]
    assert acceptance_length([r]) == 11 / 4
    # given tokens 0..i-1 accepted: position 1 among rounds with a >= 1 (2 of 4, 4 of 4, 1 of 2): 2 of 3
    assert conditional_acceptance_by_position([r]) == [3 / 4, 2 / 3, 1 / 2, 1 / 1]
    assert conditional_acceptance_by_position([r], max_positions=1) == [3 / 4]
    assert conditional_acceptance_by_position([Result([5], 1, [0], [3])]) == [0.0, None, None]  # nobody got there
    assert acceptance_rate_by_position([Result([], 0, [], [])]) == []
    assert acceptance_length([Result([], 0, [], [])]) is None
    with pytest.raises(ValueError, match="accept_len must be in 0..num_drafted"):
        acceptance_rate_by_position([Result([1], 1, [3], [2])])
    with pytest.raises(ValueError, match="accept_len must be in 0..num_drafted"):
        conditional_acceptance_by_position([Result([1], 1, [3], [2])])


def test_independent_slots_show_as_a_flat_conditional_curve():
    """Slots right with probability p each, independently: the rates fall as p^(i+1), the conditional curve
    stays at p; a drafter whose slot i+1 is right whenever slot i is keeps the conditional curve at 1."""
    g = torch.Generator().manual_seed(0)
    p, k, n = 0.3, 4, 20000
    right = torch.rand(n, k, generator=g) < p
    accept = right.int().cumprod(1).sum(1).tolist()  # a prefix is accepted
    r = Result(tokens=[0] * (1 + sum(accept) + n), num_rounds=n, accept_lens=accept, num_drafted=[k] * n)
    rates, cond = acceptance_rate_by_position([r]), conditional_acceptance_by_position([r])
    for i in range(k):
        assert rates[i] == pytest.approx(p ** (i + 1), abs=0.02) and cond[i] == pytest.approx(p, abs=0.05)
    chained = Result(tokens=[0] * (1 + n + k * n // 2), num_rounds=n, accept_lens=[0, k] * (n // 2),
                     num_drafted=[k] * n)
    assert conditional_acceptance_by_position([chained]) == [0.5, 1.0, 1.0, 1.0]


def gen(sample_id: str, category: str, result: Result, wall: float, turn: int = 0) -> Generation:
    return Generation(sample_id, category, turn, 10, result, wall, "text")


def test_report_files_and_fields(tmp_path):
    k = 4
    spec = [gen("q1", "math", stub_result(k, 4, "all"), 0.5), gen("q2", "coding", stub_result(k, 20, "none"), 1.0)]
    # AR: the same tokens, one per forward
    ar = [gen(g.sample_id, g.category, Result(list(g.result.tokens), len(g.result.tokens) - 1,
                                              [0] * 20, [0] * 20), 1.0) for g in spec]
    settings = {"dataset": "mt_bench", "draft": "/d", "target": "t", "max_new_tokens": 20,
                "machine": {"device": "cpu", "torch_threads": 1}}
    r = build_report(spec, ar, {"mode": "chain", "num_speculative_tokens": k, "temperature": 0.0}, settings,
                     num_prompts=2)
    assert r["acceptance_length"] == 40 / 24  # 20 + 20 tokens over 4 + 20 forwards
    assert r["by_category"]["math"]["acceptance_length"] == k + 1
    assert r["by_category"]["coding"]["acceptance_length"] == 1
    assert r["by_category"]["math"]["tokens_per_s"] == 42 and r["by_category"]["math"]["speedup"] == 2
    assert r["tokens_per_s"] == 42 / 1.5 and r["baseline_tokens_per_s"] == 21
    assert r["target_forwards"] == 26 and r["baseline_target_forwards"] == 42
    assert r["speedup"] == pytest.approx(4 / 3) and r["pays_off"] is True
    assert r["acceptance_rate_by_position"] == [4 / 24] * k
    assert r["conditional_acceptance_by_position"] == [4 / 24] + [1.0] * (k - 1)
    assert r["lossless"] is True and r["num_prompts"] == 2
    assert "bonus" in r["definitions"]["acceptance_length"]
    assert r["settings"]["spec"]["mode"] == "chain" and r["settings"]["machine"]["torch_threads"] == 1

    paths = write_report(r, tmp_path / "out", spec)
    on_disk = json.loads(paths["report.json"].read_text())
    for key in ("acceptance_length", "acceptance_rate_by_position", "conditional_acceptance_by_position",
                "by_category", "tokens_per_s",
                "baseline_tokens_per_s", "speedup", "lossless", "num_prompts", "pays_off", "settings", "definitions"):
        assert on_disk[key] == r[key]
    for png in ("acceptance_by_position.png", "tau_by_category.png"):
        assert paths[png].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = paths["report.md"].read_text()
    assert "| math | 5.000 |" in md and "| speedup | 1.333 |" in md
    assert len(paths["generations.jsonl"].read_text().splitlines()) == 2
    assert not list((tmp_path / "out").glob(".*tmp*"))  # atomic writes leave no temp files

    # slower than AR: said in the report; one differing output: not lossless
    slow = [gen(g.sample_id, g.category, g.result, 10.0) for g in spec]
    slow[1].result = Result([9] + list(spec[1].result.tokens[1:]), 20, [0] * 20, [k] * 20)
    r2 = build_report(slow, ar, {"mode": "chain", "temperature": 0.0}, settings, num_prompts=2)
    assert r2["pays_off"] is False and "does not pay for itself" in r2["verdict"]
    assert r2["lossless"] is False and r2["mismatches"] == [
        {"sample_id": "q2", "turn": 0, "first_diff": 0, "spec_len": 21, "ar_len": 21}]
    r3 = build_report(spec, ar, {"mode": "chain", "temperature": 0.8}, settings, num_prompts=2)
    assert r3["lossless"] is None and "temperature" in r3["lossless_note"]


def test_compare_outputs_finds_first_difference():
    a = [gen("x", "c", Result([1, 2, 3], 1, [2], [2]), 1)]
    b = [gen("x", "c", Result([1, 2], 2, [0, 0], [0, 0]), 1)]
    assert compare_outputs(a, b)[0]["first_diff"] == 2
    assert compare_outputs(a, a) == []


# --------------------------------------------------------------------- the generation loop (fake runtime)

class CharTokenizer:
    """Bytes as tokens (vocab 256) and a tiny chat template: enough to drive eval without a real model."""
    eos_token_id = pad_token_id = 0
    eos_token = pad_token = "\x00"

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        text = "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def encode(self, text, add_special_tokens=False):
        return list(text.encode())

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i for i in ids if i or not skip_special_tokens).decode(errors="replace")


@dataclass
class FakeGenerator:
    """Answers each prompt with its last 5 bytes reversed; records what it was asked."""
    calls: list = field(default_factory=list)

    def generate(self, prompts, max_new_tokens, spec, stream=None):
        self.calls.append((len(prompts), [bytes(p).decode() for p in prompts]))
        out = []
        for p in prompts:
            toks = list(reversed(p[-16:-11]))[:max_new_tokens]
            out.append(Result(toks, max(1, len(toks) // 2), [1] * (len(toks) // 2), [2] * (len(toks) // 2)))
        return out


def test_second_turn_sees_the_models_own_first_answer_and_batches_stay_in_one_category():
    samples = [EvalSample("w1", "writing", ("first question", "second question")),
               EvalSample("m1", "math", ("2+2?", "times 3?")),
               EvalSample("w2", "writing", ("another one", "and again"))]
    g = FakeGenerator()
    tok = CharTokenizer()
    gens = generate_samples(g, tok, samples, 64, SimpleNamespace(batch_size=2, mode="chain"), progress=False)
    assert [(x.sample_id, x.turn) for x in gens] == [("w1", 0), ("w2", 0), ("m1", 0), ("w1", 1), ("w2", 1), ("m1", 1)]
    assert [n for n, _ in g.calls] == [2, 1, 2, 1]  # writing x2, math x1, per turn
    answer = gens[0].text
    assert answer == ">resu"  # the fake's reply: the 5 bytes before "<assistant>", reversed
    second_prompt = g.calls[2][1][0]
    assert second_prompt == tok.apply_chat_template([
        {"role": "user", "content": "first question"}, {"role": "assistant", "content": answer},
        {"role": "user", "content": "second question"}])
    assert gens[3].prompt_len == len(chat_prompt(tok, [{"role": "user", "content": "first question"},
                                                       {"role": "assistant", "content": answer},
                                                       {"role": "user", "content": "second question"}]))
    assert sum(x.wall_s for x in gens) > 0


def test_runs_take_turns_in_alternating_order_each_with_its_own_history():
    """Two specs over the same batches: a call of each per batch, the order flipping every batch; each run's
    second turn sees its own first answer (here the fake answers differently per spec)."""
    samples = [EvalSample("w1", "writing", ("first question", "second question")),
               EvalSample("m1", "math", ("2+2?", "times 3?"))]

    class PerSpec(FakeGenerator):
        def generate(self, prompts, max_new_tokens, spec, stream=None):
            self.calls.append(spec.mode)
            out = super().generate(prompts, max_new_tokens, spec)
            if spec.mode == "ar":  # a different answer, so the histories differ
                out = [Result(r.tokens[::-1], r.num_rounds, r.accept_lens, r.num_drafted) for r in out]
            return out

    g, tok = PerSpec(), CharTokenizer()
    specs = {"speculative": SimpleNamespace(batch_size=1, mode="chain"), "autoregressive": SimpleNamespace(
        batch_size=1, mode="ar")}
    runs = generate_runs(g, tok, samples, 64, specs, progress=False)
    assert [c for c in g.calls if isinstance(c, str)] == ["chain", "ar", "ar", "chain"] * 2  # 4 batches
    for name in specs:
        gens = runs[name]
        assert [(x.sample_id, x.turn) for x in gens] == [("w1", 0), ("m1", 0), ("w1", 1), ("m1", 1)]
    spec_first, ar_first = runs["speculative"][0].text, runs["autoregressive"][0].text
    assert spec_first != ar_first
    with pytest.raises(ValueError, match="one batch size"):
        generate_runs(g, tok, samples, 64, {"a": SimpleNamespace(batch_size=1, mode="chain"),
                                            "b": SimpleNamespace(batch_size=2, mode="ar")}, progress=False)


# ------------------------------------------------------------------- end to end with the real runtime

def tiny_target_and_draft():
    from transformers import LlamaConfig, LlamaForCausalLM

    from drafthead.eagle3 import Eagle3Config, Eagle3Drafter
    from drafthead.target import Target, freeze
    from drafthead.vocab import build_vocab_mapping

    tcfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                       bos_token_id=1, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    target = freeze(Target(LlamaForCausalLM(tcfg).eval(), CharTokenizer(), "tiny"))
    dcfg = Eagle3Config.from_target(tcfg, draft_vocab_size=128, aux_layer_ids=[1, 2, 3])
    drafter = Eagle3Drafter(dcfg)
    drafter.embed_tokens.weight.data.copy_(target.model.get_input_embeddings().weight)
    d2t, t2d = build_vocab_mapping(torch.arange(256).flip(0).clone(), 128)
    drafter.d2t.copy_(d2t)
    drafter.t2d.copy_(t2d)
    return target, drafter.eval()


@pytest.mark.parametrize("mode", ["chain", "tree", "ngram"])
def test_run_eval_tiny_model_is_lossless_and_writes_the_report(tmp_path, mode):
    from drafthead.eval import run_eval

    torch.set_num_threads(1)
    target, drafter = tiny_target_and_draft()
    cfg = EvalConfig(draft=None, target="tiny", dataset="mt_bench", max_prompts=2, max_new_tokens=12, mode=mode,
                     num_speculative_tokens=3, tree_nodes=3, topk=2, out=str(tmp_path / "out"), progress=False,
                     device="cpu")
    r = run_eval(cfg, target=target, drafter=drafter if mode != "ngram" else None)
    assert r["lossless"] is True, r["mismatches"]
    assert r["num_prompts"] == 2 and r["num_generations"] == 4  # 2 MT-Bench questions x 2 turns
    assert set(r["by_category"]) == {"writing", "roleplay"}
    assert r["settings"]["spec"]["mode"] == mode and r["settings"]["dataset"] == "mt_bench"
    assert r["baseline_target_forwards"] == r["baseline_generated_tokens"]  # AR: one token per forward
    assert 1.0 <= r["acceptance_length"] <= (3 if mode == "tree" else cfg.num_speculative_tokens) + 1
    assert all(x is None or 0 <= x <= 1 for x in r["acceptance_rate_by_position"])
    on_disk = json.loads((tmp_path / "out" / "report.json").read_text())
    assert on_disk["speedup"] == r["speedup"] and on_disk["pays_off"] == (r["speedup"] > 1)
    # the machine and dtype every figure is reported with
    assert on_disk["settings"]["machine"]["cpu_class"] == hardware.cpu_class()
    assert on_disk["settings"]["machine"]["cpu_capability"] == hardware.cpu_capability()
    assert on_disk["settings"]["dtype"] == "float32"
    md = (tmp_path / "out" / "report.md").read_text()
    assert f"(CPU class {hardware.cpu_class()})" in md and "dtype float32" in md


def test_bench_tiny_model_all_methods_agree_with_our_ar(tmp_path):
    from drafthead.eval.bench import BenchConfig, run_bench

    torch.set_num_threads(1)
    target, drafter = tiny_target_and_draft()
    cfg = BenchConfig(draft=None, target="tiny", dataset="humaneval", max_prompts=2, max_new_tokens=10,
                      num_speculative_tokens=3, tree_nodes=3, topk=2, verify_sizes=[1, 2, 8], verify_prefix=64,
                      verify_repeats=2, out=str(tmp_path / "bench.json"), progress=False, device="cpu")
    r = run_bench(cfg, target=target, drafter=drafter)
    on_disk = json.loads((tmp_path / "bench.json").read_text())
    assert on_disk["settings"]["machine"]["cpu_class"] == hardware.cpu_class()
    assert on_disk["settings"]["weights_dtype"] == "float32"
    assert on_disk["methods"].keys() == r["methods"].keys() and len(r["methods"]) == 7
    for name, m in r["methods"].items():
        assert m["outputs_equal_our_ar"] == 2, name  # greedy everywhere: same tokens as our AR, HF included
        assert m["generated_tokens"] > 0 and m["tokens_per_s"] > 0
    assert r["methods"]["ar (ours)"]["acceptance_length"] == 1
    for curve in (r["verify_cost"], r["verify_cost_hf"]):
        assert [c["num_tokens"] for c in curve] == [1, 2, 8] and curve[0]["relative_to_first"] == 1
        assert all(c["ms"] > 0 for c in curve)
    from drafthead.kernels import cpu_linear, extension, hugepages

    bound = on_disk["bandwidth_bound"]  # fp32 tiny target: the fp32 kernel where the CPU has AVX2 + FMA
    assert bound["kernel"] == ("fp32" if extension.available("fp32") else None) and bound["weights"] == "fp32"
    c = target.config
    per_layer = 2 * c.hidden_size * c.hidden_size + 2 * c.hidden_size * c.num_key_value_heads * (
        c.hidden_size // c.num_attention_heads) + 3 * c.hidden_size * c.intermediate_size
    assert bound["weight_bytes"] >= 4 * (c.num_hidden_layers * per_layer + c.vocab_size * c.hidden_size)
    assert bound["read_gb_per_s"] > 0 and bound["bound_ms"] > 0
    lo, hi = bound["read_gb_per_s_range"]  # one reading a round of the verify forwards, the median between
    assert lo <= bound["read_gb_per_s"] <= hi and "taking turns with the forwards" in bound["read"]
    from drafthead.eval.bench import bandwidth_bound
    from drafthead.runtime import TargetModel

    pages = hugepages.pages()
    assert bound["pages"] == pages and bound["read"].endswith(f" on {pages}")
    alone = bandwidth_bound(TargetModel(target.model), "cpu")  # no readings given: it reads now (profile_step.py)
    assert alone["read_gb_per_s_range"] is None and alone["read"] == f"best of 5 sums over 512 MiB on {pages}"
    compute = on_disk["compute_rate"]  # the roofline's compute side: the kernel's rate, the token's multiply-adds
    if bound["kernel"] is None:
        assert compute is None and "compute_ms" not in on_disk["verify_cost"][0]
    else:
        assert compute["kernel"] == "fp32" and compute["peak_gmacs_per_s"] > 0 and compute["threads"] == 1
        assert compute["macs_per_token"] == c.num_hidden_layers * per_layer + c.vocab_size * c.hidden_size
        for row in on_disk["verify_cost"]:
            n = row["num_tokens"]
            assert row["compute_ms"] == pytest.approx(1000 * n * compute["macs_per_token"]
                                                      / (compute["peak_gmacs_per_s"] * 1e9))
            assert row["roofline_ms"] == max(row["bandwidth_ms"], row["compute_ms"])
            assert row["x_roofline"] == pytest.approx(row["ms"] / row["roofline_ms"])
            assert row["tile_path"] == cpu_linear.tile_path("fp32", n) and row["tile_path"].startswith("fp32")
        from drafthead.eval.bench import format_table
        table = format_table(on_disk)
        assert "x roof" in table and on_disk["verify_cost"][-1]["tile_path"] in table


def test_cli_eval_loads_target_from_the_draft_config_and_reads_the_heldout_split(tiny_llama_dir, tmp_path):
    """The whole command path on a tiny HF target directory: draft config -> target -> drafter -> report."""
    from drafthead.cli import main
    from drafthead.eagle3 import Eagle3Config, Eagle3Drafter
    from drafthead.registry import save_draft
    from drafthead.target import load_target
    from drafthead.vocab import build_vocab_mapping

    torch.set_num_threads(1)
    target = load_target(str(tiny_llama_dir), dtype="float32")
    torch.manual_seed(0)
    drafter = Eagle3Drafter(Eagle3Config.from_target(target.config, draft_vocab_size=64, aux_layer_ids=[1, 2, 3]))
    d2t, t2d = build_vocab_mapping(torch.zeros(target.config.vocab_size, dtype=torch.long), 64)
    drafter.d2t.copy_(d2t)
    drafter.t2d.copy_(t2d)
    final = save_draft(drafter, tmp_path / "run" / "final", target.info())
    convs = [{"id": f"h{i}", "messages": [{"role": "user", "content": f"tell me about the {w} river"},
                                          {"role": "assistant", "content": "it is big"}]}
             for i, w in enumerate(["red", "blue", "green"])]
    (tmp_path / "run" / "heldout.jsonl").write_text("".join(json.dumps(c) + "\n" for c in convs))
    out = tmp_path / "eval"
    assert main(["eval", f"draft={final}", "dataset=sharegpt", "max_prompts=2", "max_new_tokens=8", f"out={out}",
                 "mode=chain", "num_speculative_tokens=2", "progress=false", "device=cpu"]) == 0
    r = json.loads((out / "report.json").read_text())
    assert r["settings"]["target"] == str(tiny_llama_dir) and r["settings"]["draft"] == str(final.resolve())
    assert r["settings"]["drafter_family"] == "eagle3" and r["settings"]["spec"]["num_speculative_tokens"] == 2
    assert r["num_prompts"] == 2 and list(r["by_category"]) == ["sharegpt"] and r["lossless"] is True
    gens = [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()]
    assert [g["sample_id"] for g in gens] == ["sharegpt/h0", "sharegpt/h1"]


# ---------------------------------------------------------------------------- real SmolLM2 (slow)

@pytest.fixture(scope="module")
def smollm2_draft(tmp_path_factory):
    """The real target and a tiny random (untrained) EAGLE3 draft of it saved as <run>/final."""
    from drafthead.eagle3 import Eagle3Config, Eagle3Drafter
    from drafthead.registry import save_draft
    from drafthead.target import load_target
    from drafthead.vocab import build_vocab_mapping

    torch.set_num_threads(1)
    target = load_target("smollm2-135m-instruct")
    torch.manual_seed(0)
    dcfg = Eagle3Config.from_target(target.config, draft_vocab_size=2048)
    drafter = Eagle3Drafter(dcfg)
    d2t, t2d = build_vocab_mapping(torch.zeros(target.config.vocab_size, dtype=torch.long), 2048)
    drafter.d2t.copy_(d2t)
    drafter.t2d.copy_(t2d)
    final = tmp_path_factory.mktemp("run") / "final"
    save_draft(drafter, final, target.info())
    return target, final


@pytest.mark.slow
def test_drafthead_eval_on_smollm2_with_a_random_draft(smollm2_draft, tmp_path):
    _, final = smollm2_draft
    out = tmp_path / "eval"
    cmd = [sys.executable, "-m", "drafthead.cli", "eval", f"draft={final}", "dataset=mt_bench", "max_prompts=2",
           "max_new_tokens=16", "temperature=0", f"out={out}", "mode=chain", "num_speculative_tokens=3", "threads=1"]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    r = json.loads((out / "report.json").read_text())
    assert r["lossless"] is True, r["mismatches"]
    assert r["num_prompts"] == 2 and r["num_generations"] == 4
    assert r["settings"]["target"] == "smollm2-135m-instruct" and r["settings"]["spec"]["num_speculative_tokens"] == 3
    assert r["settings"]["machine"]["torch_threads"] == 1 and r["settings"]["machine"]["device"] == "cpu"
    assert 1.0 <= r["acceptance_length"] <= 4.0 and len(r["acceptance_rate_by_position"]) <= 3
    assert r["baseline_tokens_per_s"] > 0 and r["speedup"] == pytest.approx(
        r["tokens_per_s"] / r["baseline_tokens_per_s"])
    assert set(r["by_category"]) == {"writing", "roleplay"}
    for f in ("report.md", "acceptance_by_position.png", "tau_by_category.png", "generations.jsonl"):
        assert (out / f).stat().st_size > 0
    if not r["pays_off"]:  # an untrained draft should not pay: the console must say so
        assert "does not pay for itself" in res.stdout


@pytest.mark.slow
def test_bench_on_smollm2_matches_hf_generate(smollm2_draft, tmp_path):
    from drafthead.eval.bench import BenchConfig, run_bench
    from drafthead.registry import load_draft
    from drafthead.target import load_target

    _, final = smollm2_draft
    target = load_target("smollm2-135m-instruct", dtype="float32")  # parity with HF generate: fp32 on every CPU
    drafter = load_draft(final, embed_weight=target.model.get_input_embeddings().weight)
    cfg = BenchConfig(draft=str(final), dataset="mt_bench", max_prompts=2, max_new_tokens=16, verify_sizes=[1, 4, 16],
                      verify_repeats=2, out=str(tmp_path), progress=False, device="cpu")
    r = run_bench(cfg, target=target, drafter=drafter)
    assert (tmp_path / "bench.json").is_file()
    for name, m in r["methods"].items():
        assert m["outputs_equal_our_ar"] == 2, name
    assert r["verify_cost"][-1]["ms"] > 0


@pytest.mark.slow
def test_bench_speedup_script_runs_interleaved_and_checks_losslessness(smollm2_draft):
    """scripts/bench_speedup.py on the real target with a random draft: both MT-Bench turns, every method
    timed, and the speculative outputs equal our AR outputs."""
    _, final = smollm2_draft
    cmd = [sys.executable, "scripts/bench_speedup.py", "--draft", str(final), "--questions", "1", "--new", "6",
           "--threads", "1"]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    auto = "bfloat16" if hardware.native_bf16() else "float32"  # the script's --dtype auto
    for name in ("our AR", f"HF generate ({auto})", "chain k=2 + n-gram"):
        assert name in out
    assert f"CPU class {hardware.cpu_class()} (capability {hardware.cpu_capability()})" in out
    assert "outputs equal to our AR 2/2" in out


def test_verify_cost_curve_settles_the_caches_after_each_bandwidth_read():
    """The sum that reads the bandwidth evicts what a forward leaves cached; the forward timed after it would pay
    for that. An untimed forward of the first size must follow every sum, and the sums' readings come back."""
    from drafthead.eval.bench import verify_cost_curve

    class Recorder:
        def __init__(self):
            self.calls = []

        def new_cache(self, batch, capacity):
            return torch.zeros(batch, capacity)

        def forward(self, cache, input_ids, lens, logits_at=None, prefill=False):
            self.calls.append("prefill" if prefill else input_ids.shape[1])

    rec = Recorder()
    curve, read = verify_cost_curve(rec, list(range(10)), [1, 4], repeats=3, device="cpu", read_mib=1)
    assert [c["num_tokens"] for c in curve] == [1, 4]
    assert rec.calls == ["prefill"] + [1, 4, 1] * 4  # each round: the timed 1 and 4, then the settling 1
    assert read["readings"] == 3 and read["mib"] == 1 and read["min"] <= read["median"] <= read["max"]

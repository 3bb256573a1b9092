"""vLLM runs our exports (slow: makes vLLM's CPU environment once, ~2 min on 2 cores, then a vLLM process per
configuration, ~17-30 s each with the engine in that process: vLLM keeps its engine for the life of a process).

Flow: an EAGLE3 draft is half-trained in-process on our runtime's fp32 greedy continuations of a few chat prompts
with the SmolLM2 target (accepted at some draft positions and not at others, so a misread export shows at some
position), and `drafthead eval engine=ours,vllm` runs it in both engines (vLLM's CPU build from
scripts/make_vllm_env.sh, its own venv, a subprocess: vLLM alone, the draft exported on the fly, vLLM's own n-gram
drafter). Checked: vLLM alone decodes exactly our fp32 greedy tokens, vLLM's tokens with each drafter equal its own
target-alone tokens on every turn, vLLM's tau and acceptance by position are
within 0.03 of our runtime's, which decodes the same tokens, and every layout vLLM reads an EAGLE3 draft from
(to=sglang, to=speculators) gives exactly the same counts. What vLLM's CPU build refuses is
named by its own message. vLLM spins its threads: these runs never overlap anything else CPU-heavy in this module.
"""
from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from drafthead.eval import vllm
from drafthead.dspark import DsparkDrafter, DsparkOptions
from drafthead.dspark import build as build_dspark
from drafthead.export import export
from drafthead.export import llama_cpp as lc
from drafthead.registry import FAMILIES, save_draft
from drafthead.runtime import SpecConfig, SpeculativeGenerator
from drafthead.target import load_target
from tests.overfit import batch, overfit_eagle3

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = [
    "What is the capital of France? Answer in two sentences.",
    "Write a short poem about the sea.",
    "Give three tips for staying healthy.",
    "Explain what a binary search does.",
]
MAX_TOKENS = 48
K = 3  # draft tokens a round, in vLLM and in our runtime
DRAFT_VOCAB = 2048
TRAIN_STEPS = 8  # half-trained: partly accepted (see `world`)
TTT_STEPS = 3
PEAGLE_STEPS = 16
EAGLE31_STEPS = 24  # fc_norm starts the draft further from the target: 8 steps accepted ~7% at the first position
MTP_STEPS = 30


@pytest.fixture(scope="module", autouse=True)
def _engine_in_process():
    """vLLM's engine core in its worker process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, vLLM's own switch): the same
    tokens and spec-decode counters, and two fewer processes importing vLLM at each start (~35 -> ~17 s a run on
    2 AVX2 cores). Only here: `drafthead eval engine=vllm` times vLLM as it runs by default."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        yield


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    r = subprocess.run(["bash", str(ROOT / "scripts" / "make_vllm_env.sh")], capture_output=True, text=True,
                       timeout=3600)
    assert r.returncode == 0, r.stderr[-3000:]
    return vllm.find_python(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def world(vllm_python, tmp_path_factory) -> dict:
    """The target (ours, fp32) and as an HF directory for vLLM, the prompts, vLLM's target-alone run, and a draft
    half-trained on it: accepted at some positions and not at others, so acceptance by position has something to
    compare (a misread export would show at some position)."""
    torch.manual_seed(0)
    torch.set_num_threads(2)
    root = tmp_path_factory.mktemp("vllm")
    target = load_target("smollm2-135m-instruct", dtype="float32")
    tok = target.tokenizer
    prompts = [tok(lc.chat_prompt(tok, q), add_special_tokens=False).input_ids for q in QUESTIONS]
    model = vllm.target_dir(target)
    # K tokens more for training: the draft proposes past the last token it will be checked on. fp32 greedy is the
    # same in both engines (checked against vLLM alone in the eval below), so vLLM need not decode these itself.
    longer = [r.tokens for r in SpeculativeGenerator(target).generate(prompts, MAX_TOKENS + K, SpecConfig(mode="ar"))]
    alone = [o[:MAX_TOKENS] for o in longer]
    fit = overfit_eagle3(target, batch([p + o for p, o in zip(prompts, longer, strict=True)],
                                       [len(p) for p in prompts]), DRAFT_VOCAB, TRAIN_STEPS, TTT_STEPS,
                         intermediate_size=2 * target.config.intermediate_size)
    draft = save_draft(fit.trained, root / "draft", target.info())
    ours = SpeculativeGenerator(target, fit.trained).generate(prompts, MAX_TOKENS,
                                                              SpecConfig(mode="chain", num_speculative_tokens=K))
    return dict(target=target, model=model, prompts=prompts, alone=alone, longer=longer, draft=draft, ours=ours,
                root=root)


@pytest.fixture(scope="module")
def eval_report(world, vllm_python) -> dict:
    """`drafthead eval engine=ours,vllm` of the draft on the same questions (its default vLLM layout, exported on
    the fly): vLLM alone, the draft and vLLM's n-gram drafter, beside our runtime."""
    from drafthead.eval import EvalConfig, run_eval

    heldout = world["root"] / "heldout.jsonl"
    heldout.write_text("".join(json.dumps({"id": i, "messages": [{"role": "user", "content": q}]}) + "\n"
                               for i, q in enumerate(QUESTIONS)))
    return run_eval(EvalConfig(draft=str(world["draft"]), dataset="sharegpt", heldout=str(heldout),
                               max_new_tokens=MAX_TOKENS, num_speculative_tokens=K, dtype="float32", engine="ours,vllm",
                               vllm_python=str(vllm_python), out=str(world["root"] / "eval"), progress=False))


@pytest.mark.slow
def test_drafthead_eval_with_engine_vllm_beside_ours(world, eval_report):
    """vLLM serves the export losslessly (every turn equals vLLM alone), at our acceptance: tau and each position
    within 0.03 of our runtime's, which decodes the same tokens; the report shows vLLM's n-gram drafter beside it."""
    report = eval_report
    v = report["vllm"]["runs"]
    assert [r["tokens"] for r in report["vllm"]["outputs"]["autoregressive"]] == world["alone"], \
        "vLLM alone and our runtime decode different fp32 greedy tokens"
    assert [r.tokens for r in world["ours"]] == world["alone"]
    assert report["lossless"] is True
    assert v["draft"]["lossless"] is True and v["ngram"]["lossless"] is True, (v["draft"], v["ngram"])
    pos, ours = v["draft"]["acceptance_rate_by_position"], report["acceptance_rate_by_position"]
    print(f"\nvLLM tau {v['draft']['acceptance_length']:.3f} by position {[round(p, 3) for p in pos]}, ours "
          f"{report['vllm']['ours_accept_length']:.3f} {[round(p, 3) for p in ours]}; n-gram tau "
          f"{v['ngram']['acceptance_length']}; tok/s {({k: round(r['tokens_per_s'], 1) for k, r in v.items()})}")
    assert 0.1 < pos[0] < 0.95, f"not a partly accepted draft: {pos}"
    assert max(abs(a - b) for a, b in zip(pos, ours, strict=True)) <= 0.03, (pos, ours)
    assert abs(v["draft"]["acceptance_length"] - report["vllm"]["ours_accept_length"]) <= 0.05
    assert report["vllm"]["draft_export"] == next(iter(FAMILIES["eagle3"].vllm))
    md = (world["root"] / "eval" / "report.md").read_text()
    assert "## In vLLM 0.32.0" in md and "| ngram |" in md and "vLLM's free n-gram drafter" in md


@pytest.mark.slow
def test_every_eagle3_layout_vllm_reads_is_the_same_draft_to_it(world, eval_report, vllm_python, tmp_path):
    """The other layouts (to=speculators) served by vLLM on the same questions: the same tokens and exactly the
    same spec-decode counters as the layout the eval exported."""
    alone = [r["tokens"] for r in eval_report["vllm"]["outputs"]["autoregressive"]]
    fmt0, *others = FAMILIES["eagle3"].vllm
    first = eval_report["vllm"]["runs"]["draft"]
    assert others, "EAGLE3 declares one vLLM layout only"
    for fmt in others:
        out = export(world["draft"], fmt, tmp_path / fmt, outtype="f32",  # as the fp32 eval exported the first
                     **({"verifier": str(world["model"])} if fmt == "speculators" else {}))
        run = vllm.run(vllm_python, world["model"], world["prompts"], MAX_TOKENS, f"eagle3 {fmt}",
                       spec=vllm.speculative_config(FAMILIES["eagle3"].vllm[fmt], out, K))
        assert run.outputs == alone, f"{fmt}: differs from vLLM without speculation"
        assert run.spec == first["spec_counters"], (fmt, run.spec, fmt0, first["spec_counters"])


def by_position(res: list) -> list[float]:
    """Our runtime's acceptance by draft position: the share of verify rounds that accepted position i."""
    rounds = [a for r in res for a in r.accept_lens]
    return [sum(a > i for a in rounds) / len(rounds) for i in range(K)]


def ours_in_chain(world: dict, drafter: Any, tmp_path: Path) -> tuple[Path, list[float]]:
    """The draft saved, and our runtime's chain of K drafts with it: the target alone's ids on every prompt (checked)
    and acceptance by position."""
    target = world["target"]
    draft = save_draft(drafter, tmp_path / "draft", target.info())
    res = SpeculativeGenerator(target, drafter).generate(world["prompts"], MAX_TOKENS,
                                                         SpecConfig(mode="chain", num_speculative_tokens=K))
    assert [r.tokens for r in res] == world["alone"]
    return draft, by_position(res)


def served_as_ours(world: dict, vllm_python: Path, draft: Path, family: str, ours: list[float], tmp_path: Path) -> None:
    """Each layout vLLM reads a `family` draft from (with the keys the family adds to vLLM's speculative config):
    greedy ids equal vLLM alone on every prompt, acceptance by position within 0.03 of `ours`."""
    fam = FAMILIES[family]
    for fmt, method in fam.vllm.items():
        out = export(draft, fmt, tmp_path / fmt, outtype="f32",
                     **({"verifier": str(world["model"])} if fmt == "speculators" else {}))
        run = vllm.run(vllm_python, world["model"], world["prompts"], MAX_TOKENS, f"{family} {fmt}",
                       spec=vllm.speculative_config(method, out, K, **fam.vllm_config))
        assert run.outputs == world["alone"], f"{fmt}: differs from vLLM without speculation"
        pos = run.acceptance_by_position(K)
        print(f"\nvLLM {family} {fmt}: by position {[round(p, 3) for p in pos]}, ours {[round(p, 3) for p in ours]}")
        assert max(abs(a - b) for a, b in zip(pos, ours, strict=True)) <= 0.03, (fmt, pos, ours)


@pytest.mark.slow
def test_dflash_layouts_vllm_serves_losslessly_at_our_acceptance(world, vllm_python, tmp_path):
    """A DFlash draft (blocks of K + 1, 150 steps on the target's own continuations: partly accepted at every position;
    12 steps had accepted nothing past the first) in each layout vLLM reads
    (`to=dflash`, `to=speculators`; vLLM's DFlash proposer, eager on CPU): greedy ids equal vLLM alone on every
    prompt, and acceptance by position within 0.03 of our runtime's block mode with the same K drafts."""
    from types import SimpleNamespace

    from drafthead.dflash import DflashDrafter, DflashOptions
    from drafthead.dflash import build as build_dflash
    from tests.llama_cpp_data import one_hot_batch, overfit_block_drafts

    target = world["target"]
    seqs = [torch.tensor(p + o) for p, o in zip(world["prompts"], world["longer"], strict=True)]
    data = SimpleNamespace(target=target, **dict(zip(("input_ids", "attn", "loss_mask", "argmax", "teacher"),
                                                      one_hot_batch(target, seqs, [len(p) for p in world["prompts"]]))))
    opts = DflashOptions(num_layers=1, block_size=K + 1, mask_token_id=16, target_layer_ids=[1, 14, 27],
                         num_anchors=16)  # 16: <empty_output>, as recipes/dflash_smollm2.yaml
    drafters, _ = overfit_block_drafts(DflashDrafter, build_dflash(target.config, opts, None, None), data,
                                       {"half": 150}, tmp_path, gguf=False)
    draft = save_draft(drafters["half"], tmp_path / "draft", target.info())
    res = SpeculativeGenerator(target, drafters["half"]).generate(world["prompts"], MAX_TOKENS,
                                                                  SpecConfig(mode="block", num_speculative_tokens=K))
    assert [r.tokens for r in res] == world["alone"]
    ours = by_position(res)
    assert 0.05 < min(ours) and max(ours) < 0.95, f"not a partly accepted draft at every position: {ours}"
    served_as_ours(world, vllm_python, draft, "dflash", ours, tmp_path)


@pytest.mark.slow
def test_peagle_layouts_vllm_serves_with_parallel_drafting_at_our_acceptance(world, vllm_python, tmp_path):
    """A P-EAGLE draft (K drafts from one forward, 16 steps on the target's own continuations: its first mask position
    partly accepted) in each layout vLLM reads, with the `parallel_drafting` key the family declares: greedy ids
    equal vLLM alone on every prompt, and acceptance by position within 0.03 of our runtime's chain of the same K
    drafts."""
    from drafthead.peagle import PeagleConfig, PeagleDrafter

    target, prompts = world["target"], world["prompts"]
    fit = overfit_eagle3(target, batch([p + o for p, o in zip(prompts, world["longer"], strict=True)],
                                       [len(p) for p in prompts]), DRAFT_VOCAB, PEAGLE_STEPS, K,
                         intermediate_size=2 * target.config.intermediate_size, drafter_cls=PeagleDrafter,
                         config_cls=PeagleConfig, mask_token_id=16, num_draft_tokens=K)  # 16: <empty_output>
    draft, ours = ours_in_chain(world, fit.trained, tmp_path)
    assert ours[0] > 0.05 and any(0.05 < p < 0.95 for p in ours), f"no partly accepted position: {ours}"
    served_as_ours(world, vllm_python, draft, "peagle", ours, tmp_path)


@pytest.mark.slow
def test_eagle31_layouts_vllm_serves_at_our_acceptance(world, vllm_python, tmp_path):
    """An EAGLE 3.1 draft (`fc_norm`: a norm on each captured layer's state before `fc`; `norm_output`: the draft's
    hidden normed once), EAGLE31_STEPS steps on the same continuations, in each layout vLLM reads (its llama_eagle3
    takes both fields from the draft's config): greedy ids equal vLLM alone on every prompt, acceptance by position
    within 0.03 of our runtime's chain."""
    target, prompts = world["target"], world["prompts"]
    fit = overfit_eagle3(target, batch([p + o for p, o in zip(prompts, world["longer"], strict=True)],
                                       [len(p) for p in prompts]), DRAFT_VOCAB, EAGLE31_STEPS, TTT_STEPS,
                         intermediate_size=2 * target.config.intermediate_size, fc_norm=True, norm_output=True)
    assert fit.trained.fc_norm is not None and fit.trained.config.norm_output
    draft, ours = ours_in_chain(world, fit.trained, tmp_path)
    assert ours[0] > 0.05 and any(0.05 < p < 0.95 for p in ours), f"no partly accepted position: {ours}"
    served_as_ours(world, vllm_python, draft, "eagle3", ours, tmp_path)


@pytest.mark.slow
def test_mtp_layers_vllm_serves_in_the_target_written_as_mimo(world, vllm_python, tmp_path):
    """An MTP draft (one recursive layer started from the target's last layer, MTP_STEPS steps on the target's own
    continuations) exported `to=hf` as `engine=vllm` exports it (`layout=served`: the llama target written as MiMo,
    the one dense MTP model type vLLM serves) and run by vLLM as the model itself with `method=mtp`: greedy ids
    equal vLLM alone on every prompt, and acceptance by position within 0.03 of our runtime's chain of K drafts
    (MiMo zeroes the embedding at position 0 and drafthead's layer does not: one cached key of the prompt differs)."""
    from drafthead.mtp import MtpConfig, MtpDrafter, init_from_target
    from drafthead.target import capture
    from tests.llama_cpp_data import one_hot_batch

    target, prompts = world["target"], world["prompts"]
    seqs = [torch.tensor(p + o) for p, o in zip(prompts, world["longer"], strict=True)]
    input_ids, attn, loss_mask, argmax, teacher = one_hot_batch(target, seqs, [len(p) for p in prompts])
    with torch.no_grad():
        _, last = capture(target.model, input_ids, attn, [])  # [B, T, H] the target's final-norm output
    torch.manual_seed(0)
    d = MtpDrafter(MtpConfig.from_target(target.config, num_draft_tokens=K, recursive=True, attention="chain"))
    init_from_target(d, target.model)  # the block is a copy of the target's last layer, the head its lm_head
    opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=1e-3)
    for _ in range(MTP_STEPS):
        out = d(input_ids, last, teacher, argmax, loss_mask)
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
    draft, ours = ours_in_chain(world, d.eval(), tmp_path)
    assert ours[0] > 0.05 and any(0.05 < p < 0.95 for p in ours), f"no partly accepted position: {ours}"
    fam = FAMILIES["mtp"]
    assert fam.vllm_in_target and fam.vllm == {"hf": "mtp"}
    served = export(draft, "hf", tmp_path / "hf", outtype="f32", target=str(world["model"]), **fam.vllm_export)
    assert json.loads((served / "config.json").read_text())["architectures"] == ["MiMoForCausalLM"]
    run = vllm.run(vllm_python, served, prompts, MAX_TOKENS, "mtp", spec=vllm.speculative_config("mtp", None, K))
    assert run.outputs == world["alone"], "differs from vLLM without speculation"
    pos = run.acceptance_by_position(K)
    print(f"\nvLLM MTP (MiMo layout): by position {[round(p, 3) for p in pos]}, ours {[round(p, 3) for p in ours]}")
    assert max(abs(a - b) for a, b in zip(pos, ours, strict=True)) <= 0.03, (pos, ours)


@pytest.mark.slow
def test_regeneration_through_vllm_writes_vllms_own_greedy_answers(world, eval_report, vllm_python, tmp_path,
                                                                   capsys):
    """`data.regenerate.engine=vllm`: one vLLM engine answers every conversation; each answer is vLLM's own greedy
    continuation of that prompt (what vLLM alone decoded in the eval), cut at the target's end of turn."""
    from drafthead.trainer import data as tdata
    from drafthead.trainer import regenerate as tregen

    target, n = world["target"], 32
    convs = [tdata.Conversation(f"q{i}", [{"role": "user", "content": q}, {"role": "assistant", "content": "old"}])
             for i, q in enumerate(QUESTIONS)]
    opts = tregen.AnswerOptions(max_new_tokens=n, batch_size=4, engine="vllm", vllm_python=str(vllm_python))
    got = tregen.regenerate(target, convs, str(tmp_path / "regen.jsonl"), opts)
    said = capsys.readouterr().out
    assert "vLLM's offline engine" in said and "tok/s, engine start included" in said
    tok = target.tokenizer
    for c, alone in zip(got, [r["tokens"] for r in eval_report["vllm"]["outputs"]["autoregressive"]], strict=True):
        assert c.messages[-1]["content"] == tok.decode(alone[:n], skip_special_tokens=True).strip(), c.id


@pytest.mark.slow
def test_what_vllms_cpu_build_refuses_is_named_in_its_own_words(world, vllm_python, tmp_path):
    """A DSpark draft in the speculators layout: vLLM's CPU build (its V1 model runner) refuses it with the message
    the family records, and `drafthead eval engine=vllm` names that before loading anything."""
    target = world["target"]
    opts = DsparkOptions(num_layers=1, block_size=4, mask_token_id=16, target_layer_ids=[1, 14, 27], markov_rank=32)
    torch.manual_seed(0)
    ddir = save_draft(DsparkDrafter(build_dspark(target.config, opts, None, None)), tmp_path / "dspark",
                      target.info())
    fam = FAMILIES["dspark"]
    for fmt, method in fam.vllm.items():
        out = export(ddir, fmt, tmp_path / fmt, verifier=str(world["model"]))
        with pytest.raises(vllm.VllmError, match=re.escape(fam.vllm_refused[fmt])):
            vllm.run(vllm_python, world["model"], world["prompts"][:1], 8, "dspark",
                     spec=vllm.speculative_config(method, out, K))
    with pytest.raises(vllm.VllmError, match=r"CPU build serves no layout of a dspark draft \(to=speculators: "
                                             r"Model Runner V1 does not support"):
        vllm.check_family(fam)


# ---------------------------------------------------------------------------------------------
# bad input, named (no vLLM run needed)

def fake_python(tmp_path: Path, version: str | None) -> Path:
    """An interpreter whose `import vllm` finds a stub of `version` (None: no vllm at all)."""
    site = tmp_path / "site"
    if version is not None:
        (site / "vllm").mkdir(parents=True)
        (site / "vllm" / "__init__.py").write_text(f"__version__ = {version!r}\n")
    script = tmp_path / "python"
    script.write_text(f"#!/bin/sh\nPYTHONPATH={site} PYTHONNOUSERSITE=1 exec {sys.executable} -S \"$@\"\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def test_missing_vllm_environment_is_named(tmp_path, monkeypatch):
    monkeypatch.delenv("DRAFTHEAD_VLLM_PYTHON", raising=False)
    with pytest.raises(vllm.VllmError, match=r"no vLLM environment at .*nowhere.*bash scripts/make_vllm_env.sh"):
        vllm.find_python(tmp_path / "nowhere" / "python")


def test_an_interpreter_without_vllm_is_named(tmp_path):
    with pytest.raises(vllm.VllmError, match=r"cannot import vllm \(ModuleNotFoundError: No module named 'vllm'\)"):
        vllm.find_python(fake_python(tmp_path, None))


def test_the_wrong_vllm_version_is_named(tmp_path):
    with pytest.raises(vllm.VllmError, match=r"has vLLM 0\.31\.0; drafthead runs its exports in vLLM 0\.32\.0"):
        vllm.find_python(fake_python(tmp_path, "0.31.0"))


def test_the_environment_variable_names_the_interpreter(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTHEAD_VLLM_PYTHON", str(fake_python(tmp_path, vllm.VLLM_VERSION)))
    assert vllm.find_python() == Path(os.environ["DRAFTHEAD_VLLM_PYTHON"])


def test_eval_names_an_unknown_engine():
    from drafthead.eval import EvalConfig, validate

    with pytest.raises(ValueError, match=r"engine=ours,tpu: unknown engine 'tpu'; each must be one of ours, vllm"):
        validate(EvalConfig(target="smollm2-135m-instruct", engine="ours,tpu"))


def test_eval_with_engine_vllm_names_a_missing_vllm_before_loading_anything(tmp_path, capsys):
    from drafthead import cli

    code = cli.main(["eval", "target=no-such-target", "engine=ours,vllm", f"vllm_python={tmp_path / 'none'}",
                     f"out={tmp_path / 'out'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("drafthead eval: error: no vLLM environment at") and "make_vllm_env.sh" in err[0]


def test_eval_serves_an_in_target_family_from_its_export(tmp_path, monkeypatch):
    """`engine=vllm` with an MTP draft: the layers go into the very target vLLM runs alone (`target=` that
    directory, the family's `vllm_export` options), and vLLM serves the export itself as the model with `method=mtp`
    and no draft model; an EAGLE3 draft keeps the target as the model and the export as the draft (no vLLM run:
    the runs are recorded)."""
    from types import SimpleNamespace

    import drafthead.export as export_mod

    model = tmp_path / "target_hf"
    calls: list[tuple[Path, dict | None]] = []
    exported: list[tuple[str, dict]] = []

    def fake_run(python, served, prompts, max_tokens, name, spec=None, **job):
        calls.append((served, spec))
        return vllm.Run(name, [{"sample": 0, "turn": 0, "prompt_len": 3, "tokens": [1, 2], "s": 0.1}], 1.0,
                        {"num_drafts": 1, "num_accepted_tokens": 1, "accepted_per_pos": [1]} if spec else {})

    def fake_export(draft, fmt, out, **options):
        exported.append((fmt, options))
        return Path(out)
    monkeypatch.setattr(vllm, "run", fake_run)
    monkeypatch.setattr(vllm, "target_dir", lambda target: model)
    monkeypatch.setattr(export_mod, "export", fake_export)
    target = SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(max_position_embeddings=2048)))
    convs = [["hi"]]
    vllm.evaluate(Path("py"), target, convs, "d", FAMILIES["mtp"], tmp_path / "o", 2, 8, "float32")
    assert exported == [("hf", {"outtype": "f32", "target": str(model), "layout": "served"})]
    (alone, _), (served, spec), (ngram_model, _) = calls
    assert alone == model == ngram_model and served == tmp_path / "o" / "vllm_draft" / "hf"
    assert spec == {"method": "mtp", "num_speculative_tokens": 2}
    calls.clear()
    vllm.evaluate(Path("py"), target, convs, "d", FAMILIES["eagle3"], tmp_path / "o3", 2, 8, "float32")
    assert calls[1][0] == model and calls[1][1]["model"] == str(tmp_path / "o3" / "vllm_draft" / "sglang")

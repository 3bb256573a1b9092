"""Domino: its training view against its inference path, the GRU making each draft follow the ones before it, the
curriculum, greedy rollout lossless at fp32 and bf16, the warm start from a DFlash draft, bad input, and the
`to=dflash` layout checked field by field against what SGLang's reader requires and against SpecForge 0.2.0's
`DominoDraftModel` (its tensors load strictly, its rollout drafts ours)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from drafthead.dflash import sample_anchors
from drafthead.domino import DominoDrafter, DominoOptions, build, init
from drafthead.export import ExportError, export
from drafthead.export.domino import config_from_domino_hf, read_exported
from drafthead.registry import load_draft, save_draft
from drafthead.runtime import SpecConfig, SpeculativeGenerator
from drafthead.target import capture, lm_head_weight, load_target
from drafthead.trainer.config import ConfigError, load_config
from test_dspark import batch, saved_dflash  # the same random conversation and teacher, a DFlash draft to start from


@pytest.fixture(scope="module")
def qwen3(tiny_qwen3_dir):
    return load_target(str(tiny_qwen3_dir), dtype="float32")


def make_drafter(target, seed: int = 0, **kw) -> DominoDrafter:
    opts = DominoOptions(**{"num_layers": 2, "block_size": 5, "mask_token_id": 2, "target_layer_ids": [0, 2],
                            "gru_hidden_dim": 16, "emb_dim": 8, **kw})
    torch.manual_seed(seed)
    d = DominoDrafter(build(target.config, opts, None, None))
    with torch.no_grad():
        for p in d.parameters():  # every weight away from its init, W2 included: the correction matters
            p.add_(0.2 * torch.randn_like(p))
        d.embed_proj[2].weight.normal_(std=3.0)  # a correction as large as the base logits' spread
        d.embed_tokens.weight.copy_(target.model.get_input_embeddings().weight)
        d.target_lm_head.weight.copy_(lm_head_weight(target.model))
    return d.eval()


def context(d, target, ids):
    """A runner holding the context of `ids` [1, T]."""
    feats = capture(target.model, ids, None, d.capture_layer_ids())[0]
    runner = d.draft_state(1, 64, torch.device("cpu"))
    runner.extend(ids, feats, torch.tensor([ids.shape[1]]))
    return runner, feats


def rollout(d, z: torch.Tensor, root: int) -> list[int]:
    """Greedy drafts from slot outputs z [k, H], written out step by step from the paper's equations: draft j =
    argmax(U_j + W2 SiLU(W1 [z_j ; g_j])) with g_j the GRU state after the root and drafts 0..j-1 (j >= s)."""
    out, read = [], [root]
    for j in range(z.shape[0]):
        logits = d.target_lm_head(z[j])
        if j >= d.config.pure_draft_prefix_len:
            g = d.prefix_gru(d.embed_tokens(torch.tensor([read])))[0][0, -1]  # from zeros over every token so far
            logits = logits + d.embed_proj(torch.cat([z[j], g]))
        out.append(int(logits.argmax()))
        read.append(out[-1])
    return out


@pytest.mark.parametrize("prefix", [0, 1])
def test_training_drafts_equal_inference_drafts(qwen3, prefix):
    """Every supervised draft of a training block (the GRU teacher-forced on the data's tokens) has the slot output
    and correction that the runtime computes for that anchor's block with the same tokens before it."""
    d = make_drafter(qwen3, pure_draft_prefix_len=prefix)
    d.config.num_anchors = 1  # one block a step: the supervised rows come out in draft order
    ids, mask, teacher, argmax = batch(qwen3)
    feats = capture(qwen3.model, ids, None, d.capture_layer_ids())[0]
    rows: dict[str, list] = {"z": [], "corr": []}
    hooks = [d.target_lm_head.register_forward_hook(lambda m, a, o: rows["z"].append(a[0].detach())),
             d.embed_proj[2].register_forward_hook(lambda m, a, o: rows["corr"].append(o.detach()))]
    d.train()  # training draws its anchors from torch's generator: the same seed gives the same anchor here
    torch.manual_seed(5)
    anchors, _ = sample_anchors(mask, d.config.block_size, 1)
    torch.manual_seed(5)
    with torch.no_grad():
        out = d(ids, feats, teacher, argmax, mask)
    for h in hooks:
        h.remove()
    d.eval()
    p = int(anchors[0, 0])
    n = min(d.config.num_draft_tokens, 24 - 1 - p)  # drafts whose predicted token lies inside the sequence
    assert int(out["count"].sum()) == n and rows["z"][0].shape[0] == n
    runner = d.draft_state(1, 64, torch.device("cpu"))
    runner.extend(ids[:, :p], feats[:, :p], torch.tensor([p]))
    z = runner.block_out(ids[:, p])[0, :n]  # [n, H] anchor-first: slot j is draft j
    torch.testing.assert_close(rows["z"][0], z, rtol=1e-4, atol=1e-4)
    g = d.read(ids[:, p: p + n])[0]  # [n, G] after the root and the data's tokens before each draft
    torch.testing.assert_close(rows["corr"][0], d.correction(z, g), rtol=1e-4, atol=1e-4)
    # what training counts as right is the argmax the runtime takes given the same tokens before it
    logits = d.target_lm_head(z) + d.correction(z, g) * (torch.arange(n) >= prefix)[:, None]
    assert int(out["correct"].sum()) == int((logits.argmax(-1) == argmax[0, p: p + n]).sum())


@pytest.mark.parametrize("prefix", [0, 1])
def test_greedy_block_is_the_papers_rollout_and_follows_its_own_drafts(qwen3, prefix):
    d = make_drafter(qwen3, pure_draft_prefix_len=prefix)
    ids, _, _, _ = batch(qwen3, T=10)
    runner, _ = context(d, qwen3, ids)
    got = runner.block(torch.tensor([7]), 4, 0.0, 1.0, None).drafts[0].tolist()
    z = runner.block_out(torch.tensor([7]))[0, :4]
    assert got == rollout(d, z, 7)
    # the correction reads the drafts: with W2 = 0 the block is DFlash's independent argmax per slot
    with torch.no_grad():
        d.embed_proj[2].weight.zero_()
    plain = runner.block(torch.tensor([7]), 4, 0.0, 1.0, None).drafts[0].tolist()
    assert plain == d.target_lm_head(z).argmax(-1).tolist()
    assert plain != got  # with these weights the correction changes some draft (a weak head would not)


def test_candidate_pool_drafts_as_sglangs_pool(qwen3):
    """With a pool of K < V tokens a corrected draft is the argmax, among the block's top K of the backbone's logits
    over the corrected slots (max over those slots), of base + correction: SGLang's candidate-pool rollout, written
    out here; the first draft keeps the whole vocabulary's argmax. Greedy output stays the target's."""
    d = make_drafter(qwen3, candidate_pool_size=16)
    ids, _, _, _ = batch(qwen3, T=10)
    runner, _ = context(d, qwen3, ids)
    got = runner.block(torch.tensor([7]), 4, 0.0, 1.0, None).drafts[0].tolist()
    z = runner.block_out(torch.tensor([7]))[0, :4]
    base = d.target_lm_head(z)  # [4, V]
    pool = base[1:].amax(0).topk(16).indices
    want, read = [int(base[0].argmax())], [7]
    for j in range(1, 4):
        read.append(want[-1])
        g = d.prefix_gru(d.embed_tokens(torch.tensor([read])))[0][0, -1]
        scores = base[j, pool] + d.embed_proj[2].weight[pool] @ d.embed_proj[1](d.embed_proj[0](torch.cat([z[j], g])))
        want.append(int(pool[scores.argmax()]))
    assert got == want


def test_curriculum_lambda_by_hand(qwen3):
    d = make_drafter(qwen3, lambda_base_start=0.8, lambda_base_decay_ratio=0.5)
    for step, total, want in ((0, 100, 0.8), (25, 100, 0.4), (50, 100, 0.0), (90, 100, 0.0), (10, 40, 0.4)):
        d.schedule(step, total)
        assert d.lambda_base == pytest.approx(want)
    ids, mask, teacher, argmax = batch(qwen3)
    feats = capture(qwen3.model, ids, None, d.capture_layer_ids())[0]
    losses = []
    for lam_step in (0, 50):  # lambda 0.8, then 0: the loss moves from the base's CE towards the corrected one
        d.schedule(lam_step, 100)
        torch.manual_seed(5)
        losses.append(d.train()(ids, feats, teacher, argmax, mask))
    assert not torch.isclose(losses[0]["loss"], losses[1]["loss"])
    for out in losses:
        assert 0 <= float(out["ratios"]["base_acc"][0]) <= float(out["ratios"]["base_acc"][1])


def test_training_reaches_the_correction_and_dpace_weighs_it(qwen3):
    """With the base's share at 0 the GRU and both projections get gradients; `loss_weighting=dpace` gives another
    finite loss over the same drafts."""
    ids, mask, teacher, argmax = batch(qwen3)
    outs = []
    for weighting in ("decay", "dpace"):
        d = make_drafter(qwen3, loss_weighting=weighting).train()
        d.schedule(10, 10)
        torch.manual_seed(5)
        out = d(ids, capture(qwen3.model, ids, None, d.capture_layer_ids())[0], teacher, argmax, mask)
        out["loss"].backward()
        assert torch.isfinite(out["loss"])
        for p in (d.prefix_gru.weight_ih_l0, d.prefix_gru.weight_hh_l0, d.embed_proj[0].weight,
                  d.embed_proj[2].weight, d.fc.weight):
            assert p.grad is not None and bool(p.grad.abs().sum() > 0)
        outs.append(out)
    assert not torch.isclose(outs[0]["loss"], outs[1]["loss"])
    assert torch.equal(outs[0]["correct"], outs[1]["correct"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_greedy_block_equals_ar(dtype):
    """Greedy speculative output equals greedy AR output token for token with a bf16 or fp32 target and draft,
    batched requests, several draft lengths, the corrected drafts chosen from a pool of 24 of the 128 tokens."""
    from test_runtime import random_prompts, tiny_target

    target = tiny_target("qwen3", dtype=dtype, seed=4, head_scale=4.0, hidden_size=64, intermediate_size=128)
    d = make_drafter(target, block_size=8, num_layers=1, target_layer_ids=[0], candidate_pool_size=24).to(dtype)
    gen = SpeculativeGenerator(target, d)
    prompts = random_prompts(4, 128, seed=23)
    want = [r.tokens for r in gen.generate(prompts, 24, SpecConfig(mode="ar"))]
    for k, bs in ((7, 4), (3, 1), (1, 2)):
        got = gen.generate(prompts, 24, SpecConfig(mode="block", num_speculative_tokens=k, batch_size=bs))
        assert [r.tokens for r in got] == want, (k, bs)
    with pytest.raises(ValueError, match="a block of this draft has 7 draft slots"):
        gen.generate(prompts[:1], 4, SpecConfig(mode="block", num_speculative_tokens=8))


def test_warm_start_from_dflash_takes_its_backbone(qwen3, tiny_qwen3_dir, tmp_path):
    dflash, src, info = saved_dflash(qwen3, tiny_qwen3_dir, tmp_path, 5)
    opts = DominoOptions(num_layers=2, block_size=5, mask_token_id=2, target_layer_ids=[0, 2], gru_hidden_dim=16,
                         emb_dim=8, warm_start=str(src))
    d = DominoDrafter(build(qwen3.config, opts, None, None))
    assert "backbone from the DFlash draft" in init(d, qwen3, opts)
    for name, v in dflash.state_dict().items():
        if name not in ("embed_tokens.weight", "target_lm_head.weight"):
            assert torch.equal(d.state_dict()[name], v), name
    assert not d.embed_proj[2].weight.any()  # the correction starts at zero: the backbone's drafts stand
    other = DominoOptions(**{**opts.__dict__, "block_size": 8})
    with pytest.raises(ValueError, match=r"drafter\.domino\.warm_start: .* has block_size=5, this draft 8"):
        init(DominoDrafter(build(qwen3.config, other, None, None)), qwen3, other)
    mine = save_draft(d, tmp_path / "domino", info)
    with pytest.raises(ValueError, match="holds a 'domino' draft, not a DFlash one"):
        init(d, qwen3, DominoOptions(**{**opts.__dict__, "warm_start": str(mine)}))


def test_bad_options_are_named(qwen3):
    base = ["drafter.family=domino", "drafter.domino.mask_token_id=2"]
    for key, value, words in (("gru_hidden_dim", 0, r"gru_hidden_dim': 0 \(must be >= 1\)"),
                              ("pure_draft_prefix_len", 7, r"pure_draft_prefix_len': 7 \(must be in \[0, block_size"),
                              ("lambda_base_start", 1.5, r"lambda_base_start': 1.5 \(must be in \[0, 1\]\)"),
                              ("lambda_base_decay_ratio", 0, r"lambda_base_decay_ratio': 0.0 \(must be > 0\)"),
                              ("dpace_alpha", 0, r"dpace_alpha': 0.0 \(must be in \(0, 1\]\)"),
                              ("candidate_pool_size", -1, r"candidate_pool_size': -1 \(must be >= 0")):
        with pytest.raises(ConfigError, match=r"drafter\.domino\." + words):
            load_config([*base, f"drafter.domino.{key}={value}"])
    with pytest.raises(ConfigError, match=r"unknown config key 'drafter\.dflash\.gru_hidden_dim'"):  # Domino's option
        load_config(["drafter.dflash.gru_hidden_dim=64"])
    with pytest.raises(ConfigError, match=r"unknown config key 'drafter\.eagle3\.lambda_base_start'"):
        load_config(["drafter.eagle3.lambda_base_start=0.5"])
    with pytest.raises(ConfigError, match=r"'train\.loss': 'tv' \(drafter\.family=domino trains its own loss"):
        load_config([*base, "train.loss=tv"])
    with pytest.raises(ValueError, match=r"drafter\.domino\.mask_token_id: 99999 is not a row"):
        build(qwen3.config, DominoOptions(mask_token_id=99999, num_layers=1), None, None)
    d = make_drafter(qwen3)
    problems = d.check_data([{"id": "b", "input_ids": [5, 2, 7]}])
    assert len(problems) == 1 and problems[0].startswith("drafter.domino.mask_token_id=2 occurs in 1")


def test_dflash_export_is_sglangs_domino_layout(qwen3, tiny_qwen3_dir, tmp_path):
    """`to=dflash` field by field as SGLang's `parse_dflash_draft_config` and `DFlashDraftModel.load_weights` read a
    Domino draft, bf16 by default (SGLang serves Domino in bf16 only), and read back to the same config and
    logits."""
    d = make_drafter(qwen3)
    src = save_draft(d, tmp_path / "final", {**qwen3.info(), "name_or_path": str(tiny_qwen3_dir)})
    out = export(src, "dflash", tmp_path / "sglang")
    cfg = json.loads((out / "config.json").read_text())
    dc = cfg["dflash_config"]
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 5 > 1
    assert dc["projector_type"] == "domino" and dc["shift_label"] is True
    assert dc["pure_draft_prefix_len"] == 1  # SGLang: "currently requires pure_draft_prefix_len=1"
    assert dc["gru_hidden_dim"] == 16 and dc["emb_dim"] == cfg["emb_dim"] == 8
    assert dc["mask_token_id"] == 2 and dc["target_layer_ids"] == [0, 2] and cfg["num_target_layers"] == 4
    from safetensors.torch import load_file
    sd = load_file(str(out / "model.safetensors"))
    H, V = qwen3.config.hidden_size, qwen3.config.vocab_size
    shapes = {k: tuple(v.shape) for k, v in sd.items() if k.startswith(("prefix_gru", "embed_proj"))}
    assert shapes == {"prefix_gru.weight_ih_l0": (48, H), "prefix_gru.weight_hh_l0": (48, 16),
                      "embed_proj.0.weight": (8, H + 16), "embed_proj.2.weight": (V, 8)}
    assert all(v.dtype == torch.bfloat16 for v in sd.values())
    assert "lm_head.weight" not in sd and "embed_tokens.weight" not in sd
    back, tensors = read_exported(export(src, "dflash", tmp_path / "f32", outtype="f32"))
    for f in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "vocab_size", "num_hidden_layers", "block_size", "mask_token_id", "target_layer_ids", "rms_norm_eps",
              "rope_theta", "gru_hidden_dim", "emb_dim", "pure_draft_prefix_len"):
        assert getattr(back, f) == getattr(d.config, f), f
    twin = DominoDrafter(back)
    twin.load_state_dict({**load_draft(src, target=qwen3.model).state_dict(), **tensors})
    ids, _, _, _ = batch(qwen3, T=10)
    drafts = [context(m.eval(), qwen3, ids)[0].block(torch.tensor([7]), 4, 0.0, 1.0, None).drafts
              for m in (d, twin)]
    assert torch.equal(drafts[0], drafts[1])
    for bad, words in (({"projector_type": "dspark"}, "not a Domino draft"), ({"shift_label": False}, "shift_label"),
                       ({"gru_hidden_dim": None}, "no gru_hidden_dim")):
        with pytest.raises(ExportError, match=words):
            config_from_domino_hf({**cfg, "dflash_config": {**dc, **bad}})
    with pytest.raises(ExportError, match="emb_dim differs"):
        config_from_domino_hf({**cfg, "emb_dim": 9})
    assert config_from_domino_hf({**cfg, "dflash_config": {**dc, "projector_type": "causal_v5"}}).emb_dim == 8
    zero = save_draft(make_drafter(qwen3, pure_draft_prefix_len=0), tmp_path / "zero",
                      {**qwen3.info(), "name_or_path": str(tiny_qwen3_dir)})
    with pytest.raises(ExportError, match="SGLang's Domino reader requires pure_draft_prefix_len=1"):
        export(zero, "dflash", tmp_path / "zero_out")


def test_specforge_domino_model_loads_our_export_and_drafts_ours(qwen3, tiny_qwen3_dir, tmp_path, specforge_domino):
    """SpecForge 0.2.0's `DominoDraftModel`, built from our config.json, takes our tensors with a strict load (same
    names and shapes), and its own rollout (`_sample_draft_tokens`, greedy) over our block's hidden states drafts
    what our runtime drafts."""
    from safetensors.torch import load_file
    from transformers import Qwen3Config

    d = make_drafter(qwen3, candidate_pool_size=0)  # SpecForge's rollout scores the whole vocabulary
    src = save_draft(d, tmp_path / "final", {**qwen3.info(), "name_or_path": str(tiny_qwen3_dir)})
    out = export(src, "dflash", tmp_path / "sglang", outtype="f32")
    cfg = json.loads((out / "config.json").read_text())
    theirs = specforge_domino.DominoDraftModel(Qwen3Config(**{k: v for k, v in cfg.items() if k != "auto_map"}))
    missing, unexpected = theirs.load_state_dict(load_file(str(out / "model.safetensors")), strict=False)
    assert not unexpected and not [k for k in missing if "rotary" not in k], (missing, unexpected)
    ids, _, _, _ = batch(qwen3, T=10)
    runner, _ = context(d, qwen3, ids)
    root = torch.tensor([7])
    z = runner.block_out(root)  # [1, B, H]
    block = torch.full((1, d.config.block_size), d.config.mask_token_id)
    block[0, 0] = 7
    target = SimpleNamespace(lm_head=d.target_lm_head, model=SimpleNamespace(embed_tokens=d.embed_tokens))
    with torch.no_grad():
        want = theirs.eval()._sample_draft_tokens(target, z, block)  # [1, B-1]
    got = runner.block(root, d.config.num_draft_tokens, 0.0, 1.0, None).drafts
    assert torch.equal(got, want)


def test_engine_vllm_names_the_family_it_cannot_serve():
    """vLLM 0.32 has no Domino head: `drafthead eval engine=vllm` says so before exporting or loading anything."""
    from drafthead.eval import vllm
    from drafthead.registry import FAMILIES

    with pytest.raises(vllm.VllmError, match=r"serves no layout of a domino draft; use engine=ours"):
        vllm.check_family(FAMILIES["domino"])


def test_a_draft_vocabulary_scores_its_rows_in_the_head_and_the_correction(qwen3, tiny_qwen3_dir, tmp_path):
    """`drafter.domino.draft_vocab_size`: the backbone's head and W2 both score the draft vocabulary's rows (training
    and drafting alike, the candidate pool drawn from those rows), drafts are target ids the GRU reads, greedy
    output stays the target's, sampled q is zero outside the vocabulary, and `to=dflash` writes what SGLang reads:
    no d2t / t2d, W2 widened to the target's V rows with zeros outside the vocabulary."""
    from test_dflash import nudged_block_equals_ar
    from test_families import samples

    from drafthead.registry import draft_state_dict
    from drafthead.trainer.prepare import build_draft
    from drafthead.trainer.step import drafter_inputs, make_batch

    cfg = load_config(["drafter.family=domino", f"target.name_or_path={tiny_qwen3_dir}", "target.dtype=float32",
                       "train.dtype=float32", "drafter.domino.mask_token_id=2", "drafter.domino.block_size=5",
                       "drafter.domino.num_layers=2", "drafter.domino.target_layer_ids=[0,2]",
                       "drafter.domino.gru_hidden_dim=16", "drafter.domino.emb_dim=8",
                       "drafter.domino.candidate_pool_size=16", "drafter.domino.draft_vocab_size=64"])
    V, E = qwen3.config.vocab_size, 8
    train = samples(V)
    torch.manual_seed(0)
    ds = build_draft(cfg, qwen3, train, torch.device("cpu"), log=lambda *a: None)
    d = ds.drafter
    rows = d.head_rows()
    assert rows.numel() == 64 and torch.equal(d.target_lm_head.weight, lm_head_weight(qwen3.model)[rows])
    assert tuple(d.embed_proj[2].weight.shape) == (64, E)
    batch_ = make_batch(train[:2], qwen3, d.capture_layer_ids(), torch.float32, False, torch.device("cpu"), True)
    d.train()
    d.lambda_base = 0.5
    out = d(**drafter_inputs(batch_, ds.head))
    out["loss"].backward()
    assert torch.isfinite(out["loss"]) and int(out["count"].sum()) > 0
    assert d.prefix_gru.weight_hh_l0.grad is not None and d.embed_proj[0].weight.grad.abs().sum() == 0  # W2 = 0
    assert d.embed_proj[2].weight.grad.abs().sum() > 0

    prompts = nudged_block_equals_ar(qwen3, d, 0.2, 4)
    ids = torch.tensor([prompts[0]])
    runner, _ = context(d, qwen3, ids)
    greedy = runner.block(torch.tensor([7]), 4, 0.0, 1.0, None).drafts[0]
    z = runner.block_out(torch.tensor([7]))[0, :4]
    base = d.target_lm_head(z)  # [4, 64] the pool's rows, SGLang's rollout over the draft vocabulary
    pool = base[1:].amax(0).topk(16).indices
    want, read = [int(rows[base[0].argmax()])], [7]
    for j in range(1, 4):
        read.append(want[-1])
        g = d.prefix_gru(d.embed_tokens(torch.tensor([read])))[0][0, -1]
        scores = base[j, pool] + d.embed_proj[2].weight[pool] @ d.embed_proj[1](d.embed_proj[0](torch.cat([z[j], g])))
        want.append(int(rows[pool[scores.argmax()]]))
    assert greedy.tolist() == want
    drawn = runner.block(torch.tensor([7]), 4, 1.0, 1.0, torch.Generator().manual_seed(0))
    assert bool(d.t2d[drawn.drafts].all()) and tuple(drawn.q.shape) == (1, 4, V)
    assert float(drawn.q[..., ~d.t2d].abs().sum()) == 0 and torch.allclose(drawn.q.sum(-1), torch.ones(1, 4))

    src = save_draft(d, tmp_path / "final", {**qwen3.info(), "name_or_path": str(tiny_qwen3_dir)})
    back = load_draft(src, target=qwen3.model)
    assert torch.equal(back.d2t, d.d2t) and torch.equal(back.embed_proj[2].weight, d.embed_proj[2].weight)
    zcfg, tensors = read_exported(export(src, "dflash", tmp_path / "sglang", outtype="f32"))
    assert zcfg.draft_vocab_size is None and set(tensors) == set(draft_state_dict(d)) - {"d2t", "t2d"}
    w2 = tensors["embed_proj.2.weight"]  # [V, E]
    assert tuple(w2.shape) == (V, E) and torch.equal(w2[rows], d.embed_proj[2].weight)
    assert not w2[~d.t2d].any()
    with pytest.raises(ConfigError, match=r"drafter\.domino\.draft_vocab_size': 0 \(must be >= 1"):
        load_config(["drafter.family=domino", "drafter.domino.mask_token_id=2", "drafter.domino.draft_vocab_size=0"])

"""DSpark: its training view against its inference path (both block layouts), the Markov head making slots depend
on the token drafted before them, the confidence stop, the warm start from a DFlash draft, bad input, and the
speculators layout checked against speculators 0.9.0's own config and model classes when they import."""
from __future__ import annotations

import json

import pytest
import torch

from drafthead.dflash import DflashDrafter, DflashOptions, sample_anchors
from drafthead.dflash import build as dflash_build
from drafthead.dspark import DsparkDrafter, DsparkOptions, build, init, warm_start
from drafthead.export import ExportError, export
from drafthead.registry import save_draft
from drafthead.runtime import SpecConfig, SpeculativeGenerator
from drafthead.target import capture, lm_head_weight, load_target
from drafthead.trainer.config import ConfigError, load_config


@pytest.fixture(scope="module")
def qwen3(tiny_qwen3_dir):
    return load_target(str(tiny_qwen3_dir), dtype="float32")


def make_drafter(target, sample_from_anchor: bool = True, seed: int = 0, **kw) -> DsparkDrafter:
    opts = DsparkOptions(num_layers=2, block_size=4, mask_token_id=2, target_layer_ids=[0, 2], markov_rank=8,
                         sample_from_anchor=sample_from_anchor, **kw)
    torch.manual_seed(seed)
    d = DsparkDrafter(build(target.config, opts, None, None))
    with torch.no_grad():
        for p in d.parameters():  # every weight away from its init, W2 included: the Markov term matters
            p.add_(0.05 * torch.randn_like(p))
        d.embed_tokens.weight.copy_(target.model.get_input_embeddings().weight)
        d.target_lm_head.weight.copy_(lm_head_weight(target.model))
    return d.eval()


def batch(target, T: int = 24, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, target.config.vocab_size, (1, T), generator=g)
    mask = torch.ones(1, T, dtype=torch.long)
    mask[:, :5] = 0
    V = target.config.vocab_size
    teacher = torch.randn(1, T, V, generator=g).softmax(-1)
    return ids, mask, teacher, teacher.argmax(-1)


@pytest.mark.parametrize("sample_from_anchor", [True, False])
def test_training_drafts_equal_inference_drafts(qwen3, sample_from_anchor):
    """Draft j of every training block (prev teacher-forced to the data token before the predicted one) has the
    logits a fresh runner gives for that anchor's block with the same prev: the slot layout, positions and
    Markov inputs of training are the runtime's."""
    d = make_drafter(qwen3, sample_from_anchor)
    d.config.num_anchors = 1  # one block a step: the supervised rows come out in draft order
    ids, mask, teacher, argmax = batch(qwen3)
    feats = capture(qwen3.model, ids, None, d.capture_layer_ids())[0]
    rows: dict[str, list] = {"h": [], "prev": []}
    hooks = [d.target_lm_head.register_forward_hook(lambda m, a, o: rows["h"].append(a[0].detach())),
             d.markov_head.markov_w1.register_forward_hook(lambda m, a, o: rows["prev"].append(a[0].detach()))]
    d.train()  # training draws its anchors from torch's generator: the same seed gives the same anchor here
    torch.manual_seed(5)
    anchors, _ = sample_anchors(mask, 4, 1)
    torch.manual_seed(5)
    with torch.no_grad():
        out = d(ids, feats, teacher, argmax, mask)
    for h in hooks:
        h.remove()
    p = int(anchors[0, 0])
    K = d.config.num_draft_tokens
    n = min(K, 24 - 1 - p)  # drafts whose predicted token lies inside the sequence
    assert int(out["count"].sum()) == n and rows["h"][0].shape[0] == n
    assert torch.equal(rows["prev"][0], ids[0, p: p + n])  # draft j's prev: the token at p + j
    runner = d.draft_state(1, 64, torch.device("cpu"))
    runner.extend(ids[:, :p], feats[:, :p], torch.tensor([p]))
    slots = runner.block_out(ids[:, p])[0, d.config.first_slot: d.config.first_slot + n]  # [n, H]
    torch.testing.assert_close(rows["h"][0], slots, rtol=1e-4, atol=1e-4)
    want, _ = d.slot_logits(slots, ids[0, p: p + n])
    got, _ = d.slot_logits(rows["h"][0], rows["prev"][0])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_markov_head_makes_drafts_follow_the_one_before(qwen3):
    """With W2 != 0 a draft's logits depend on the token before it; a fresh head (W2 = 0) adds nothing."""
    d = make_drafter(qwen3)
    h = torch.randn(3, d.config.hidden_size)
    a, _ = d.slot_logits(h, torch.tensor([5, 6, 7]))
    b, _ = d.slot_logits(h, torch.tensor([8, 6, 9]))
    assert not torch.allclose(a[0], b[0]) and torch.equal(a[1], b[1])
    with torch.no_grad():
        d.markov_head.markov_w2.weight.zero_()
    a, _ = d.slot_logits(h, torch.tensor([5, 6, 7]))
    torch.testing.assert_close(a, d.target_lm_head(h), rtol=0, atol=0)


def test_greedy_block_chains_its_own_drafts(qwen3):
    """Greedy drafting goes left to right: draft j is the argmax of slot j given draft j-1 as prev."""
    d = make_drafter(qwen3)
    ids, _, _, _ = batch(qwen3, T=10)
    feats = capture(qwen3.model, ids, None, d.capture_layer_ids())[0]
    runner = d.draft_state(1, 64, torch.device("cpu"))
    runner.extend(ids, feats, torch.tensor([10]))
    root = torch.tensor([7])
    got = runner.block(root, 4, 0.0, 1.0, None)
    out = runner.block_out(root)[0]
    prev = 7
    for j in range(4):
        logits, _ = d.slot_logits(out[j], torch.tensor(prev))
        assert int(got.drafts[0, j]) == int(logits.argmax())
        prev = int(got.drafts[0, j])
    assert int(got.lengths[0]) == 4


def test_confidence_stop_cuts_drafts_and_stays_lossless(qwen3):
    d = make_drafter(qwen3)
    ids, _, _, _ = batch(qwen3, T=10)
    feats = capture(qwen3.model, ids, None, d.capture_layer_ids())[0]
    runner = d.draft_state(1, 64, torch.device("cpu"))
    runner.extend(ids, feats, torch.tensor([10]))
    with torch.no_grad():
        d.confidence_head.proj.bias.fill_(-30.0)  # confidence ~0 everywhere: nothing is drafted
    assert int(runner.block(torch.tensor([7]), 4, 0.0, 1.0, None, stop_prob=0.5).lengths[0]) == 0
    with torch.no_grad():
        d.confidence_head.proj.bias.fill_(30.0)
    assert int(runner.block(torch.tensor([7]), 4, 0.0, 1.0, None, stop_prob=0.5).lengths[0]) == 4
    with torch.no_grad():
        d.confidence_head.proj.bias.fill_(0.0)
        d.confidence_head.proj.weight.normal_(std=2.0)  # a mixed stop: some rounds short, some long
    gen = SpeculativeGenerator(qwen3, d)
    prompts = [ids[0, :6].tolist(), ids[0, 2:9].tolist()]
    ar = gen.generate(prompts, 12, SpecConfig(mode="ar"))
    spec = gen.generate(prompts, 12, SpecConfig(mode="block", num_speculative_tokens=4, draft_stop_prob=0.5))
    assert [r.tokens for r in spec] == [r.tokens for r in ar]
    assert any(n < 4 for r in spec for n in r.num_drafted)  # the stop cut some rounds


def saved_dflash(qwen3, tiny_qwen3_dir, tmp_path, block_size: int):
    """A random DFlash draft of 2 layers saved as a draft directory (a warm start's source): (drafter, path, info)."""
    torch.manual_seed(0)
    dflash = DflashDrafter(dflash_build(qwen3.config, DflashOptions(num_layers=2, block_size=block_size,
                                                                      mask_token_id=2, target_layer_ids=[0, 2]),
                                        None, None))
    with torch.no_grad():
        for p in dflash.parameters():
            p.add_(0.05 * torch.randn_like(p))
    info = {**qwen3.info(), "name_or_path": str(tiny_qwen3_dir)}
    return dflash, save_draft(dflash, tmp_path / "dflash", info), info


def test_warm_start_from_dflash_computes_the_dflash_draft(qwen3, tiny_qwen3_dir, tmp_path):
    """A DSpark warm-started from a DFlash draft in DFlash's layout (sample_from_anchor false) drafts exactly what
    that DFlash draft drafts (W2 starts at zero); names that do not fit are a named error."""
    dflash, src, info = saved_dflash(qwen3, tiny_qwen3_dir, tmp_path, 4)
    opts = DsparkOptions(num_layers=2, block_size=4, mask_token_id=2, target_layer_ids=[0, 2], markov_rank=8,
                         sample_from_anchor=False, warm_start=str(src))
    d = DsparkDrafter(build(qwen3.config, opts, None, None))
    assert "backbone from the DFlash draft" in init(d, qwen3, opts)
    dflash.embed_tokens.weight.data.copy_(d.embed_tokens.weight)
    dflash.target_lm_head.weight.data.copy_(d.target_lm_head.weight)
    ids, _, _, _ = batch(qwen3, T=10)
    feats = capture(qwen3.model, ids, None, d.capture_layer_ids())[0]
    runs = []
    for m in (dflash.eval(), d.eval()):
        runner = m.draft_state(1, 64, torch.device("cpu"))
        runner.extend(ids, feats, torch.tensor([10]))
        runs.append(runner.block(torch.tensor([7]), 3, 0.0, 1.0, None).drafts)
    assert torch.equal(runs[0], runs[1])

    other = DsparkDrafter(build(qwen3.config, DsparkOptions(num_layers=1, block_size=4, mask_token_id=2,
                                                            target_layer_ids=[1], markov_rank=8), None, None))
    with pytest.raises(ValueError, match="does not fit this draft's backbone"):
        warm_start(other, str(src))
    eight = DsparkDrafter(build(qwen3.config, DsparkOptions(num_layers=2, block_size=8, mask_token_id=2,
                                                            target_layer_ids=[0, 2], markov_rank=8), None, None))
    with pytest.raises(ValueError, match="block_size=4, this draft 8"):
        warm_start(eight, str(src))
    spark = save_draft(d, tmp_path / "spark", info)
    with pytest.raises(ValueError, match="holds a 'dspark' draft, not a DFlash one"):
        warm_start(d, str(spark))


def test_dpace_weighting_trains_dspark_too(qwen3):
    """`loss_weighting=dpace` reaches DSpark (its drafts include the anchor's slot): a finite loss unlike the
    decay's, gradients on the backbone and heads, the same metrics."""
    ids, mask, teacher, argmax = batch(qwen3)
    outs = []
    for weighting in ("decay", "dpace"):
        d = make_drafter(qwen3, loss_weighting=weighting).train()
        torch.manual_seed(5)
        out = d(ids, capture(qwen3.model, ids, None, d.capture_layer_ids())[0], teacher, argmax, mask)
        out["loss"].backward()
        assert torch.isfinite(out["loss"]) and d.markov_head.markov_w1.weight.grad is not None
        outs.append(out)
    assert not torch.isclose(outs[0]["loss"], outs[1]["loss"])
    assert torch.equal(outs[0]["correct"], outs[1]["correct"]) and torch.equal(outs[0]["count"], outs[1]["count"])


def test_bad_options_are_named(qwen3):
    with pytest.raises(ConfigError, match=r"drafter\.dspark\.markov_rank': 0 \(must be >= 1\)"):
        load_config(["drafter.family=dspark", "drafter.dspark.mask_token_id=2", "drafter.dspark.markov_rank=0"])
    with pytest.raises(ConfigError, match=r"drafter\.dspark\.mask_token_id': required"):
        load_config(["drafter.family=dspark"])
    with pytest.raises(ConfigError, match=r"unknown config key 'drafter\.eagle3\.markov_rank'"):  # DSpark's option
        load_config(["drafter.eagle3.markov_rank=64"])
    with pytest.raises(ValueError, match=r"drafter\.dspark\.mask_token_id: 99999 is not a row"):
        build(qwen3.config, DsparkOptions(mask_token_id=99999, num_layers=1), None, None)
    d = make_drafter(qwen3)
    problems = d.check_data([{"id": "b", "input_ids": [5, 2, 7]}])
    assert len(problems) == 1 and problems[0].startswith("drafter.dspark.mask_token_id=2 occurs in 1")
    spec = SpecConfig(mode="block", num_speculative_tokens=5)
    assert "a block of this draft has 4 drafts" in d.draft_modes["block"].check(spec, d)
    plain = make_drafter(qwen3, confidence_head=False)
    assert "has none" in plain.draft_modes["block"].check(SpecConfig(mode="block", num_speculative_tokens=2,
                                                                     draft_stop_prob=0.3), plain)


def test_speculators_layout(qwen3, tiny_qwen3_dir, tmp_path):
    """The export's fields and tensors are speculators 0.9.0's DSpark layout (models/dspark/config.py)."""
    d = make_drafter(qwen3)
    src = save_draft(d, tmp_path / "final", {**qwen3.info(), "name_or_path": str(tiny_qwen3_dir)})
    out = export(src, "speculators", tmp_path / "spec")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dspark" and cfg["architectures"] == ["DSparkSpeculator"]
    assert (cfg["sample_from_anchor"], cfg["markov_rank"], cfg["markov_head_type"], cfg["enable_confidence_head"],
            cfg["confidence_head_with_markov"]) == (True, 8, "vanilla", True, True)
    assert cfg["aux_hidden_state_layer_ids"] == [1, 3] and cfg["block_size"] == 4 and cfg["mask_token_id"] == 2
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    from safetensors.torch import load_file
    sd = load_file(str(out / "model.safetensors"))
    V, H = qwen3.config.vocab_size, qwen3.config.hidden_size
    assert tuple(sd["markov_head.markov_w1.weight"].shape) == (V, 8)
    assert tuple(sd["markov_head.markov_w2.weight"].shape) == (V, 8)
    assert tuple(sd["confidence_head.proj.weight"].shape) == (1, H + 8)
    assert "lm_head.weight" not in sd and "embed_tokens.weight" not in sd



def test_speculators_classes_take_our_export(qwen3, tiny_qwen3_dir, tmp_path, speculators_models):
    """speculators 0.9.0's `DSparkSpeculatorConfig` validates our config.json; a `DSparkDraftModel` built from it has
    exactly our tensor names and shapes and, loaded with our tensors, computes our Markov term."""
    import importlib

    from safetensors.torch import load_file

    spec = importlib.import_module("speculators.models.dspark")
    d = make_drafter(qwen3)
    src = save_draft(d, tmp_path / "final", {**qwen3.info(), "name_or_path": str(tiny_qwen3_dir)})
    out = export(src, "speculators", tmp_path / "spec", outtype="f32")  # fp32: their Markov head equals ours
    cfg = json.loads((out / "config.json").read_text())
    sd = load_file(str(out / "model.safetensors"))
    theirs_cfg = spec.DSparkSpeculatorConfig(**{k: v for k, v in cfg.items() if k != "drafthead"})
    assert theirs_cfg.markov_rank == 8 and theirs_cfg.sample_from_anchor is True
    model = spec.DSparkDraftModel(theirs_cfg)
    theirs = {k: tuple(v.shape) for k, v in model.state_dict().items()
              if not k.startswith(("verifier_", "embed_tokens", "lm_head"))}
    assert theirs == {k: tuple(v.shape) for k, v in sd.items()}
    model.load_state_dict(sd, strict=False)
    prev = torch.tensor([[5, 9, 11]])
    with torch.no_grad():
        bias = model.markov_head.markov_w2(model.markov_head.markov_w1(prev))
        ours = d.markov_head.markov_w2(d.markov_head.markov_w1(prev))
    torch.testing.assert_close(bias, ours, rtol=0, atol=1e-6)


def test_gguf_carries_the_heads_and_keys(qwen3, tiny_qwen3_dir, tmp_path):
    import gguf

    d = make_drafter(qwen3)
    src = save_draft(d, tmp_path / "final", {**qwen3.info(), "name_or_path": str(tiny_qwen3_dir)})
    target_gguf = tmp_path / "t.gguf"
    from tests.test_export import write_target_gguf
    write_target_gguf(target_gguf, vocab=qwen3.config.vocab_size, hidden=qwen3.config.hidden_size,
                      layers=qwen3.config.num_hidden_layers)
    out = export(src, "gguf", tmp_path / "d.gguf", target=str(target_gguf))
    r = gguf.GGUFReader(str(out))
    kv = {f.name: f.contents() for f in r.fields.values()}
    assert kv["general.architecture"] == "dflash" and kv["dflash.sample_from_anchor"] is True
    assert kv["dflash.has_confidence_head"] is True and kv["dflash.block_size"] == 4
    names = {t.name for t in r.tensors}
    assert {"markov_w1.weight", "markov_w2.weight", "conf_proj.weight", "conf_proj.bias"} <= names
    with pytest.raises(ExportError, match="not a DSpark one"):
        from drafthead.export.dspark import read_back_gguf
        dflash = DflashDrafter(dflash_build(qwen3.config, DflashOptions(num_layers=2, block_size=4, mask_token_id=2,
                                                                          target_layer_ids=[0, 2]), None, None))
        plain = export(save_draft(dflash, tmp_path / "df", {**qwen3.info(), "name_or_path": str(tiny_qwen3_dir)}),
                       "gguf", tmp_path / "df.gguf", target=str(target_gguf))
        read_back_gguf(plain)

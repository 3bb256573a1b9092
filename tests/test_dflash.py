"""DFlash: the block drafter against z-lab's reference model code (PyPI `dflash==0.1.0`), its training
mask against its inference path, the layer-id conventions of each engine, anchors, the mask-token check,
and sampled block drafting staying lossless."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from drafthead.dflash import BlockRunner, DflashDrafter, DflashOptions, build, sample_anchors
from drafthead.export import export
from drafthead.export.dflash import gguf_target_layer_ids, read_back_gguf, read_exported
from drafthead.registry import save_draft
from drafthead.runtime import SpecConfig, SpeculativeGenerator
from drafthead.target import capture, lm_head_weight, load_target

def reference_module():
    """`dflash.model`, z-lab's reference model code (PyPI `dflash==0.1.0`), from its peer site (tests/peers.py):
    never pip-installed, its CLI dependencies are not ours."""
    from tests.peers import DFLASH, add_to_path

    add_to_path(DFLASH)
    import dflash.model

    return dflash.model


def make_drafter(target, block_size: int = 4, num_layers: int = 2, ids=(0, 2), seed: int = 0) -> DflashDrafter:
    opts = DflashOptions(num_layers=num_layers, block_size=block_size, mask_token_id=2, target_layer_ids=list(ids))
    torch.manual_seed(seed)
    d = DflashDrafter(build(target.config, opts, None, None))
    with torch.no_grad():
        for p in d.parameters():  # random, not the all-ones norms: every weight matters in the comparison
            p.add_(0.05 * torch.randn_like(p))
        d.embed_tokens.weight.copy_(target.model.get_input_embeddings().weight)
        d.target_lm_head.weight.copy_(lm_head_weight(target.model))
    return d.eval()


@pytest.fixture(scope="module")
def qwen3(tiny_qwen3_dir):
    return load_target(str(tiny_qwen3_dir), dtype="float32")


def test_reference_dflash_loads_our_export_and_gives_the_same_logits(qwen3, tiny_qwen3_dir, tmp_path):
    """z-lab's `DFlashDraftModel.from_pretrained(our to=dflash export)` on the same context features and
    block: its draft logits equal ours (fp32, max abs diff < 1e-4) and the argmax is identical. The
    features come from the reference's own `extract_context_feature` over the target's HF hidden states,
    and equal what our capture of `capture_layer_ids()` returns (the layer-id convention)."""
    ref = reference_module()
    drafter = make_drafter(qwen3, block_size=4)
    src = save_draft(drafter, tmp_path / "final", {**qwen3.info(), "name_or_path": str(tiny_qwen3_dir)})
    out = export(src, "dflash", tmp_path / "zlab", outtype="f32")  # fp32: the reference's logits to 1e-5
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dflash_config"]["target_layer_ids"] == [0, 2] and cfg["block_size"] == 4
    theirs = ref.DFlashDraftModel.from_pretrained(str(out), torch_dtype=torch.float32).eval()
    assert theirs.target_layer_ids == [0, 2] and theirs.mask_token_id == 2 and theirs.block_size == 4

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, qwen3.config.vocab_size, (2, 10), generator=g)  # 2 requests, 10 context tokens
    with torch.no_grad():
        hs = qwen3.model(ids, output_hidden_states=True).hidden_states
    feats = ref.extract_context_feature(hs, theirs.target_layer_ids)  # [2, 10, 2H]
    ours_feats = capture(qwen3.model, ids, None, drafter.capture_layer_ids())[0]
    torch.testing.assert_close(ours_feats, feats, rtol=0, atol=1e-6)

    roots = torch.tensor([5, 7])
    block = torch.full((2, 4), theirs.mask_token_id)
    block[:, 0] = roots
    with torch.no_grad():
        hidden = theirs(target_hidden=feats, noise_embedding=qwen3.model.get_input_embeddings()(block),
                        position_ids=torch.arange(14)[None].expand(2, 14), use_cache=False)
        want = theirs.compute_logits(hidden[:, 1:], qwen3.model.lm_head)  # [2, 3, V]
    runner = drafter.draft_state(2, 32, torch.device("cpu"))
    runner.extend(ids, feats, torch.tensor([10, 10]))
    got = runner.block_logits(roots)
    assert (got - want).abs().max().item() < 1e-4
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_training_blocks_equal_inference_blocks(qwen3):
    """The training mask is the inference view: every anchor's block in the training forward gives the
    logits of a fresh runner holding exactly the context before that anchor (nothing at or after it), with
    dense anchors whose blocks overlap."""
    drafter = make_drafter(qwen3, block_size=4)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, qwen3.config.vocab_size, (2, 24), generator=g)
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[:, :5] = 0
    feats = capture(qwen3.model, ids, None, drafter.capture_layer_ids())[0]
    anchors, valid = sample_anchors(mask, 4, 64, torch.Generator().manual_seed(0))
    assert (anchors[0, 1:] - anchors[0, :-1]).min() < 4  # blocks overlap
    with torch.no_grad():
        train = drafter.target_lm_head(drafter.anchor_blocks(ids, feats, anchors, valid)[:, :, 1:])  # [2, A, 3, V]
    checked = 0
    for b in range(2):
        for j in range(anchors.shape[1]):
            if not valid[b, j]:
                continue
            a = int(anchors[b, j])
            runner = drafter.draft_state(1, 32, torch.device("cpu"))
            if a:
                runner.extend(ids[b: b + 1, :a], feats[b: b + 1, :a], torch.tensor([a]))
            want = runner.block_logits(ids[b: b + 1, a])[0]
            torch.testing.assert_close(train[b, j], want, rtol=1e-4, atol=1e-4)
            checked += 1
    assert checked >= 6


@pytest.mark.parametrize("overlap", [True, False])
def test_anchors_are_supervised_distinct_and_capped(overlap):
    """Dense: every supervised start up to num_anchors (blocks overlap); spaced: no two within a block."""
    g = torch.Generator().manual_seed(0)
    mask = (torch.rand(3, 200, generator=g) > 0.2).long()
    mask[2] = 0  # a row with nothing to supervise gets no anchor
    anchors, valid = sample_anchors(mask, 8, 512, g, overlap)
    for b in range(3):
        a = anchors[b][valid[b]].tolist()
        gap = 1 if overlap else 8
        assert a == sorted(a) and all(y - x >= gap for x, y in zip(a, a[1:]))
        assert all(mask[b, t] and mask[b, t + 1] for t in a)
    starts = int((mask[0, :-1].bool() & mask[0, 1:].bool()).sum())
    assert valid[2].sum() == 0 and (valid[0].sum() == starts if overlap else 10 <= valid[0].sum() <= 200 // 8 + 1)
    few, v = sample_anchors(mask, 8, 3, g, overlap)
    assert v.sum(1).tolist()[:2] == [3, 3]  # num_anchors caps them


@pytest.mark.parametrize("labels, weighting", [("soft", "decay"), ("hard", "decay"), ("soft", "dpace")])
def test_anchor_pieces_give_the_loss_and_gradients_of_one_forward(qwen3, labels, weighting):
    """anchor_chunk only bounds memory: pieces of 3 anchors (recomputed in the backward) give the loss, the
    metrics and the gradients of every anchor in one piece (D-PACE's weights are per block, and a block is never
    split between pieces)."""
    from dataclasses import replace

    from drafthead.target import TargetHead
    from drafthead.trainer.step import teacher_targets

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, qwen3.config.vocab_size, (2, 40), generator=g)
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[:, :6] = 0
    mask[1, 30:] = 0
    base = make_drafter(qwen3, block_size=4)
    with torch.no_grad():
        feats, last = capture(qwen3.model, ids, None, base.capture_layer_ids())
        probs, argmax = teacher_targets(TargetHead(lm_head_weight(qwen3.model), None), last, mask)
    runs = []
    for chunk in (64, 3):
        d = make_drafter(qwen3, block_size=4)
        d.config = replace(d.config, anchor_chunk=chunk, labels=labels, loss_weighting=weighting)
        d.train()
        torch.manual_seed(7)  # the same anchors
        out = d(ids, feats, probs, argmax, mask)
        out["loss"].backward()
        runs.append((out, {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}))
    (one, g1), (pieces, g3) = runs
    assert int(one["ratios"]["block_accept_len"][1]) > 40 // 4  # dense: more blocks than fit side by side
    torch.testing.assert_close(pieces["loss"], one["loss"], rtol=1e-5, atol=1e-6)
    for k in ("correct", "count"):
        assert torch.equal(pieces[k], one[k]), k
    assert one["ratios"].keys() == pieces["ratios"].keys() == {"block_accept_len", "cond_acc"}
    for k, (num, den) in one["ratios"].items():
        assert torch.equal(pieces["ratios"][k][0], num) and torch.equal(pieces["ratios"][k][1], den), k
    assert g1.keys() == g3.keys() and len(g1) > 5
    for n in g1:
        torch.testing.assert_close(g3[n], g1[n], rtol=1e-4, atol=1e-6)
    # the health counts: slot 1 is conditioned on nothing; a later slot on the run before it
    cond_correct, cond_count = one["ratios"]["cond_acc"]
    assert torch.equal(cond_count[0], one["count"][0]) and torch.equal(cond_correct[0], one["correct"][0])
    assert bool((cond_count <= one["count"]).all()) and bool((cond_correct <= cond_count).all())


def test_layer_id_conventions_per_engine(qwen3, tiny_qwen3_dir, tmp_path):
    """Stored: z-lab's (outputs of layers). Capture: inputs = +1. to=dflash: as stored. to=gguf
    (`dflash.target_layers`, llama.cpp extracts layer inputs) and to=speculators (vLLM's capture ids): +1.
    Read back: the stored ids."""
    from test_families import weightless_gguf

    drafter = make_drafter(qwen3, ids=(0, 2))
    assert drafter.config.target_layer_ids == [0, 2] and drafter.capture_layer_ids() == [1, 3]
    tdir = tmp_path / "target"
    tdir.mkdir()
    for f in tiny_qwen3_dir.iterdir():
        (tdir / f.name).write_bytes(f.read_bytes())
    weightless_gguf(tdir / "target.gguf", qwen3)
    src = save_draft(drafter, tmp_path / "final", {**qwen3.info(), "name_or_path": str(tdir)})
    gg = export(src, "gguf", tmp_path / "d.gguf", target=str(tdir / "target.gguf"),
                allow_target_mismatch=True)  # a weightless stand-in GGUF, for its tokenizer
    import gguf

    r = gguf.GGUFReader(str(gg))
    assert r.fields["general.architecture"].contents() == "dflash"
    assert list(r.fields["dflash.target_layers"].contents()) == [1, 3]
    assert int(r.fields["dflash.block_size"].contents()) == 4
    assert int(r.fields["tokenizer.ggml.mask_token_id"].contents()) == 2
    assert gguf_target_layer_ids(gg) == [0, 2]
    back = read_back_gguf(gg)
    assert torch.equal(back["layers.1.self_attn.k_norm.weight"], drafter.layers[1].self_attn.k_norm.weight)
    zl = export(src, "dflash", tmp_path / "zlab")
    assert json.loads((zl / "config.json").read_text())["dflash_config"]["target_layer_ids"] == [0, 2]
    sp = export(src, "speculators", tmp_path / "spec")
    sc = json.loads((sp / "config.json").read_text())
    assert sc["speculators_model_type"] == "dflash" and sc["aux_hidden_state_layer_ids"] == [1, 3]
    assert sc["mask_token_id"] == 2 and sc["block_size"] == 4 and sc["sample_from_anchor"] is False
    assert sc["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert read_exported(sp)[0] == read_exported(zl)[0] == replace(drafter.config, num_anchors=512,
                                                                   loss_decay_gamma=4.0, labels="soft")
    # capture.layer_ids (inputs) wins over the options and is stored as outputs
    c = build(qwen3.config, DflashOptions(mask_token_id=2, num_layers=2), [1, 3], None)
    assert c.target_layer_ids == [0, 2]


def test_dpace_weights_by_hand():
    """D-PACE's Eq. 7-8 on one block of three slots, alpha 0.5: p = 0.6 / 0.2 / 0.5 gives q = 0.8 / 0.6 / 0.75,
    C = 0.8 / 0.48 / 0.36 and w = 1.64 / 0.84 / 0.36; with slot 1 unsupervised it counts as 1 in the product and is
    left out of the sum: C = 0.8 / - / 0.6, w = 1.4 / - / 0.6."""
    import math

    from drafthead.dflash import dpace_weights

    logp = torch.tensor([0.6, 0.2, 0.5]).log()
    zero, slots = torch.zeros(3, dtype=torch.long), torch.arange(3)
    torch.testing.assert_close(dpace_weights(logp, zero, zero, slots, (1, 1, 3), 0.5), torch.tensor([1.64, 0.84, 0.36]))
    two = torch.tensor([0, 2])
    got = dpace_weights(logp[two], zero[:2], zero[:2], two, (1, 1, 3), 0.5)
    torch.testing.assert_close(got, torch.tensor([1.4, 0.6]))
    # alpha 1: the draft's probabilities drop out; slot j weighs the supervised slots from j on
    torch.testing.assert_close(dpace_weights(logp, zero, zero, slots, (1, 1, 3), 1.0), torch.tensor([3.0, 2.0, 1.0]))
    assert math.isclose(float(dpace_weights(torch.zeros(1), zero[:1], zero[:1], slots[:1], (1, 1, 3), 0.3)), 1.0)


def test_bad_mask_token_and_layers_are_named_errors(qwen3):
    with pytest.raises(ValueError, match="mask_token_id: required"):
        DflashOptions().validate()
    for alpha in (0.0, 1.5):
        with pytest.raises(ValueError, match=rf"dpace_alpha: {alpha} \(must be in \(0, 1\]\)"):
            DflashOptions(mask_token_id=2, loss_weighting="dpace", dpace_alpha=alpha).validate()
    with pytest.raises(ValueError, match=r"loss_weighting: 'dpac' \(choose from decay, dpace\)"):
        DflashOptions(mask_token_id=2, loss_weighting="dpac").validate()
    with pytest.raises(ValueError, match=r"num_anchors: 0 \(must be >= 1\)"):
        DflashOptions(mask_token_id=2, num_anchors=0).validate()
    with pytest.raises(ValueError, match=r"anchor_chunk: 0 \(must be >= 1\)"):
        DflashOptions(mask_token_id=2, anchor_chunk=0).validate()
    with pytest.raises(ValueError, match="mask_token_id: 9999 is not a row"):
        build(qwen3.config, DflashOptions(mask_token_id=9999), None, None)
    with pytest.raises(ValueError, match=r"target_layer_ids: \[3\] out of range"):
        build(qwen3.config, DflashOptions(mask_token_id=2, target_layer_ids=[3]), None, None)
    drafter = make_drafter(qwen3)
    problems = drafter.check_data([{"id": "a", "input_ids": [5, 6]}, {"id": "b", "input_ids": [5, 2, 6]}])
    assert len(problems) == 1 and "mask_token_id=2 occurs in 1 training sample(s) (first: b)" in problems[0]


def test_verify_fewer_drafts_than_the_block_and_reject_more(qwen3):
    drafter = make_drafter(qwen3, block_size=4)
    gen = SpeculativeGenerator(qwen3, drafter)
    prompt = [[5, 6, 7, 8, 9]]
    ar = gen.generate(prompt, 12, SpecConfig(mode="ar"))[0].tokens
    for k in (1, 2, 3):
        res = gen.generate(prompt, 12, SpecConfig(mode="block", num_speculative_tokens=k))[0]
        assert res.tokens == ar and max(res.num_drafted) <= k
    with pytest.raises(ValueError, match="a block of this draft has 3 draft slots"):
        gen.generate(prompt, 4, SpecConfig(mode="block", num_speculative_tokens=4))
    with pytest.raises(ValueError, match="spec mode 'chain': this dflash draft drafts block only"):
        gen.generate(prompt, 4, SpecConfig(mode="chain"))


class OracleBlockRunner(BlockRunner):
    """Block slots that are the target's own greedy continuation (`truth[i]`: prompt i, then its AR tokens), one
    slot wrong every third round, so verify blocks of up to 16 tokens a row both accept and reject."""

    truth: list[list[int]] = []
    started = 0  # requests given a runner so far: batches are taken in prompt order

    def __init__(self, *args) -> None:
        super().__init__(*args)
        B = self.lens.shape[0]
        self.ids, self.rounds = list(range(self.started, self.started + B)), 0  # request index per row
        OracleBlockRunner.started += B

    def select(self, rows: torch.Tensor) -> None:
        super().select(rows)
        self.ids = [self.ids[int(r)] for r in rows]

    def block_logits(self, roots: torch.Tensor) -> torch.Tensor:
        c = self.drafter.config
        slots = c.block_size - 1
        self.rounds += 1
        logits = torch.zeros(len(roots), slots, c.vocab_size)  # [B, Bk-1, V]
        for r, (i, L) in enumerate(zip(self.ids, self.lens.tolist())):
            seq = self.truth[i]
            assert seq[L] == int(roots[r]), f"request {i} left the AR tokens at position {L}"
            nxt = (seq[L + 1: L + 1 + slots] + [0] * slots)[:slots]
            if self.rounds % 3 == 0:
                nxt[1] = (nxt[1] + 1) % c.vocab_size
            logits[r, torch.arange(slots), torch.tensor(nxt)] = 1.0
        return logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_block_verify_of_up_to_64_rows_is_lossless_through_the_decode_kernels(dtype, monkeypatch):
    """Greedy block mode equals AR token for token with the target on the CPU decode kernels, where a round
    verifies up to 16 tokens for each of 4 requests (64 rows a projection: every multi-row tile path), with an
    oracle block so that long drafts are accepted as well as cut."""
    from drafthead.kernels import extension
    from test_runtime import random_prompts, tiny_target

    if not extension.available("bf16" if dtype == torch.bfloat16 else "fp32"):
        pytest.skip("no decode kernel of this kind on this CPU")
    target = tiny_target("qwen3", dtype=dtype, seed=4, head_scale=4.0, hidden_size=64, intermediate_size=128)
    drafter = make_drafter(target, block_size=16, ids=(0,)).to(dtype)
    monkeypatch.setattr(DflashDrafter, "draft_state", lambda self, *args: OracleBlockRunner(self, *args))
    gen = SpeculativeGenerator(target, drafter)
    assert gen.model.decode_kernel and gen.model.kernel == ("bf16" if dtype == torch.bfloat16 else "fp32")
    prompts = random_prompts(4, 128, seed=23)
    want = [r.tokens for r in gen.generate(prompts, 40, SpecConfig(mode="ar"))]
    OracleBlockRunner.truth = [p + w for p, w in zip(prompts, want)]
    for k, batch in ((15, 4), (7, 4), (15, 1), (3, 2)):
        OracleBlockRunner.started = 0
        got = gen.generate(prompts, 40, SpecConfig(mode="block", num_speculative_tokens=k, batch_size=batch))
        assert [r.tokens for r in got] == want, (k, batch)
        accepted = [a for r in got for a in r.accept_lens]
        assert max(accepted) == k and min(accepted) < k, (k, batch)  # whole blocks taken and blocks cut


def test_sampled_block_drafting_matches_the_target():
    """Slots are drafted independently from their own distributions; rejection sampling over them keeps the
    target's joint distribution (the same total-variation check as the chain and tree modes)."""
    from test_runtime import V_SMALL, empirical_joint, exact_joint, tiny_target

    target = tiny_target("qwen3", vocab=V_SMALL, seed=2, dtype=torch.float32, head_scale=20.0)
    target.model.config.eos_token_id = target.model.generation_config.eos_token_id = None
    opts = DflashOptions(num_layers=1, block_size=4, mask_token_id=0, target_layer_ids=[0])
    torch.manual_seed(4)
    drafter = DflashDrafter(build(target.config, opts, None, None))
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.3 * torch.randn_like(p))
        drafter.embed_tokens.weight.copy_(target.model.get_input_embeddings().weight)
        drafter.target_lm_head.weight.copy_(lm_head_weight(target.model))
    prompt = [3, 5, 1, 6]
    spec = SpecConfig(mode="block", num_speculative_tokens=3, temperature=1.0, batch_size=1000)
    res = SpeculativeGenerator(target, drafter.eval()).generate([prompt] * 8000, 3, spec)
    assert sum(r.accept_lens[0] for r in res if r.accept_lens) > 500  # the drafts do get accepted
    exact = exact_joint(target, prompt, 3, 1.0, 1.0)
    tv = 0.5 * float((empirical_joint(res, 3) - exact).abs().sum())
    assert tv < 0.07, tv
    spec_p = replace(spec, temperature=0.7, top_p=0.8)
    res = SpeculativeGenerator(target, drafter).generate([prompt] * 8000, 3, spec_p)
    tv = 0.5 * float((empirical_joint(res, 3) - exact_joint(target, prompt, 3, 0.7, 0.8)).abs().sum())
    assert tv < 0.07, tv


def nudged_block_equals_ar(target, d, scale: float, k: int) -> list[list[int]]:
    """Every trainable weight of block draft `d` moved by `scale` noise, then greedy block drafting of k drafts
    (batch 1 and 3) equal to greedy AR on three random prompts of 12 tokens; returns the prompts."""
    from test_families import samples

    d.eval()
    with torch.no_grad():
        for p in d.parameters():
            if p.requires_grad:
                p.add_(scale * torch.randn_like(p))
    gen = SpeculativeGenerator(target, d)
    prompts = [s["input_ids"][:12] for s in samples(target.config.vocab_size, n=3, seed=5)]
    ar = [r.tokens for r in gen.generate(prompts, 16, SpecConfig(mode="ar"))]
    for bs in (1, 3):
        got = gen.generate(prompts, 16, SpecConfig(mode="block", num_speculative_tokens=k, batch_size=bs))
        assert [r.tokens for r in got] == ar
    return prompts


def test_a_draft_vocabulary_trains_and_drafts_over_its_rows_and_exports_the_backbone(qwen3, tiny_qwen3_dir, tmp_path):
    """`draft_vocab_size`: the block's head is the target head's rows of the draft vocabulary (training, teacher and
    drafting alike), drafts are target ids and greedy output stays the target's, sampled drafts carry q zero
    outside the vocabulary, the draft saves and loads with its d2t / t2d, and the exports hold the backbone only
    (engines draft through the target's whole head)."""
    from test_families import samples

    from drafthead.registry import draft_state_dict, load_draft
    from drafthead.trainer.config import ConfigError, load_config
    from drafthead.trainer.prepare import build_draft
    from drafthead.trainer.step import drafter_inputs, make_batch

    cfg = load_config(["drafter.family=dflash", f"target.name_or_path={tiny_qwen3_dir}", "target.dtype=float32",
                       "train.dtype=float32", "drafter.dflash.mask_token_id=2", "drafter.dflash.block_size=4",
                       "drafter.dflash.num_layers=2", "drafter.dflash.target_layer_ids=[0,2]",
                       "drafter.dflash.draft_vocab_size=64"])
    V, H = qwen3.config.vocab_size, qwen3.config.hidden_size
    train = samples(V)
    torch.manual_seed(0)
    ds = build_draft(cfg, qwen3, train, torch.device("cpu"), log=lambda *a: None)
    d = ds.drafter
    rows = d.head_rows()
    assert rows.numel() == 64 and int(d.t2d.sum()) == 64 and bool(d.t2d[rows].all())
    assert torch.equal(d.target_lm_head.weight, lm_head_weight(qwen3.model)[rows])
    assert tuple(ds.head.draft_weight.shape) == (64, H)  # the teacher scores the same rows
    batch = make_batch(train[:2], qwen3, d.capture_layer_ids(), torch.float32, False, torch.device("cpu"), True)
    out = d.train()(**drafter_inputs(batch, ds.head))
    out["loss"].backward()
    assert torch.isfinite(out["loss"]) and d.fc.weight.grad is not None and int(out["count"].sum()) > 0

    prompts = nudged_block_equals_ar(qwen3, d, 0.05, 3)
    runner = d.draft_state(1, 32, torch.device("cpu"))
    ids = torch.tensor([prompts[0]])
    runner.extend(ids, capture(qwen3.model, ids, None, d.capture_layer_ids())[0], torch.tensor([12]))
    drawn = runner.block(torch.tensor([7]), 3, 1.0, 1.0, torch.Generator().manual_seed(0))
    assert bool(d.t2d[drawn.drafts].all()) and tuple(drawn.q.shape) == (1, 3, V)
    assert float(drawn.q[..., ~d.t2d].abs().sum()) == 0 and torch.allclose(drawn.q.sum(-1), torch.ones(1, 3))

    src = save_draft(d, tmp_path / "final", {**qwen3.info(), "name_or_path": str(tiny_qwen3_dir)})
    back = load_draft(src, target=qwen3.model)
    assert torch.equal(back.d2t, d.d2t) and torch.equal(back.target_lm_head.weight, d.target_lm_head.weight)
    zcfg, tensors = read_exported(export(src, "dflash", tmp_path / "zlab", outtype="f32"))
    assert zcfg.draft_vocab_size is None and set(tensors) == set(draft_state_dict(d)) - {"d2t", "t2d"}

    with pytest.raises(ConfigError, match=r"drafter\.dflash\.draft_vocab_size': 0 \(must be >= 1"):
        load_config(["drafter.family=dflash", "drafter.dflash.mask_token_id=2", "drafter.dflash.draft_vocab_size=0"])
    with pytest.raises(ConfigError, match=r"unknown config key 'drafter\.dspark\.draft_vocab_size'"):
        load_config(["drafter.dspark.draft_vocab_size=64"])

"""P-EAGLE: one draft forward a round, the runtime's mask entries equal the training forward's, lossless at fp32 and
bf16, named errors, and our speculators export run by speculators 0.9.0's own `PEagleDraftModel` with our logits.
(The family contract, tests/test_families.py, covers build, training, save/load, greedy == AR and export round
trips.)"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from drafthead.export import ExportError, export
from drafthead.peagle import ParallelRunner, PeagleConfig, PeagleDrafter, PeagleOptions
from drafthead.registry import save_draft
from drafthead.runtime import SpecConfig, SpeculativeGenerator
from drafthead.target import load_target
from drafthead.vocab import build_vocab_mapping

AUX = [1, 2, 3]
K = 3
MASK = 2  # never drawn by `ids` below (ids from 3 up)


def make_draft(tdir, seed: int = 0) -> PeagleDrafter:
    torch.manual_seed(seed)
    tcfg = AutoConfig.from_pretrained(tdir)
    n = tcfg.vocab_size // 2
    base = PeagleConfig.from_target(tcfg, draft_vocab_size=n, aux_layer_ids=AUX, num_draft_tokens=K)
    drafter = PeagleDrafter(PeagleConfig(**{**base.to_dict(), "mask_token_id": MASK}))
    drafter.embed_tokens.weight.data.copy_(load_file(str(tdir / "model.safetensors"))["model.embed_tokens.weight"])
    d2t, t2d = build_vocab_mapping(torch.randint(0, 1000, (tcfg.vocab_size,)), n)
    drafter.d2t.copy_(d2t)
    drafter.t2d.copy_(t2d)
    return drafter.eval()


def ids(vocab: int, T: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, vocab, (1, T), generator=torch.Generator().manual_seed(seed))


def test_runtime_mask_entries_equal_the_training_forward(tiny_llama_dir):
    """The training forward's step i at row t (mask entries at every row, TTT attention) and the runtime's extend
    (prefix 0..t, then K-1 mask entries in the same forward) give the same logits for drafts 1..K."""
    drafter = make_draft(tiny_llama_dir)
    c = drafter.config
    T = 7
    x = ids(c.vocab_size, T)
    aux = torch.randn(1, T, len(AUX) * c.target_hidden_size, generator=torch.Generator().manual_seed(2))
    seen = []
    hook = drafter.lm_head.register_forward_hook(lambda m, i, o: seen.append(o.detach()))
    teacher = torch.softmax(torch.randn(1, T, c.draft_vocab_size), -1)
    with torch.no_grad():
        drafter(input_ids=x, aux_hidden=aux, teacher_probs=teacher, target_argmax=torch.zeros(1, T, dtype=torch.long),
                loss_mask=torch.ones(1, T, dtype=torch.long))
    hook.remove()
    assert len(seen) == K  # step i scores rows t < T - 2 - i, in order
    for t in range(T - 2 - (K - 1)):
        state = drafter.draft_state(1, 64, torch.device("cpu"))
        state.extend(x[:, 1: t + 2], aux[:, : t + 1], torch.tensor([t + 1]))
        for i in range(K):
            torch.testing.assert_close(state.all_logits[0, i], seen[i][t], rtol=1e-4, atol=1e-5)


class Counter:
    def __init__(self) -> None:
        self.calls = 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_draft_forward_a_round_and_lossless(tiny_llama_dir, dtype, monkeypatch):
    """Greedy speculative output equals greedy AR output, and every round's K drafts cost one draft forward:
    decode calls == extend calls (EAGLE3's chain pays one more per draft after the first)."""
    target = load_target(str(tiny_llama_dir), dtype=dtype)
    drafter = make_draft(tiny_llama_dir).to(getattr(torch, dtype))
    gen = SpeculativeGenerator(target, drafter)
    prompts = [ids(target.config.vocab_size, 12, seed=s)[0].tolist() for s in range(3)]
    ar = [r.tokens for r in gen.generate(prompts, 20, SpecConfig(mode="ar"))]
    decodes, extends = Counter(), Counter()
    real_decode, real_extend = PeagleDrafter.decode, ParallelRunner.extend

    def decode(self, *a, **kw):
        decodes.calls += 1
        return real_decode(self, *a, **kw)

    def extend(self, *a, **kw):
        extends.calls += 1
        return real_extend(self, *a, **kw)

    monkeypatch.setattr(PeagleDrafter, "decode", decode)
    monkeypatch.setattr(ParallelRunner, "extend", extend)
    for batch_size in (1, 3):
        got = [r.tokens for r in gen.generate(prompts, 20, SpecConfig(mode="chain", num_speculative_tokens=K,
                                                                      batch_size=batch_size))]
        assert got == ar, batch_size
    assert extends.calls > len(prompts) and decodes.calls == extends.calls


def test_sampling_matches_the_target_exactly():
    """At temperature 1 (and 0.7 with top-p) the joint of the first three tokens equals the target's exact joint,
    in total variation as tests/test_runtime.py measures EAGLE3's chain (each draft is sampled from its own
    distribution and rejection sampling uses that one), with a confident draft that often disagrees."""
    from tests.test_runtime import V_SMALL, exact_joint, empirical_joint, tiny_target

    target = tiny_target("llama", vocab=V_SMALL, seed=2, dtype=torch.float32, head_scale=20.0)
    target.model.config.eos_token_id = target.model.generation_config.eos_token_id = None  # no early stop
    torch.manual_seed(9)
    base = PeagleConfig.from_target(target.config, draft_vocab_size=6, aux_layer_ids=[0, 1, 1], num_draft_tokens=K)
    drafter = PeagleDrafter(PeagleConfig(**{**base.to_dict(), "mask_token_id": V_SMALL - 1}))
    drafter.embed_tokens.weight.data.copy_(target.model.get_input_embeddings().weight)
    d2t, t2d = build_vocab_mapping(torch.arange(V_SMALL).flip(0), 6)
    drafter.d2t.copy_(d2t)
    drafter.t2d.copy_(t2d)
    with torch.no_grad():
        drafter.lm_head.weight.mul_(5.0)
    gen = SpeculativeGenerator(target, drafter)
    prompt = [3, 5, 1, 6]
    for spec in (SpecConfig(mode="chain", num_speculative_tokens=K, temperature=1.0),
                 SpecConfig(mode="chain", num_speculative_tokens=2, temperature=0.7, top_p=0.8)):
        res = gen.generate([prompt] * 8000, 3, SpecConfig(**{**spec.__dict__, "batch_size": 1000}))
        exact = exact_joint(target, prompt, 3, spec.temperature, spec.top_p)
        tv = 0.5 * float((empirical_joint(res, 3) - exact).abs().sum())
        assert tv < 0.07, (spec, tv)  # an exact sampler lands at ~0.035; biased ones at 0.2 and more
        assert sum(sum(r.accept_lens) for r in res) > 0  # drafts were accepted, not only corrected


def test_serving_more_than_trained_and_mask_token_in_data_are_named(tiny_llama_dir):
    target = load_target(str(tiny_llama_dir), dtype="float32")
    drafter = make_draft(tiny_llama_dir)
    gen = SpeculativeGenerator(target, drafter)
    with pytest.raises(ValueError, match=r"num_speculative_tokens=4: this P-EAGLE draft proposes at most 3"):
        gen.generate([[5, 6, 7]], 4, SpecConfig(mode="chain", num_speculative_tokens=K + 1))
    assert "mask_token_id=2 occurs in 1" in drafter.check_data([{"id": "a", "input_ids": [5, MASK, 6]}])[0]
    with pytest.raises(ValueError, match="mask_token_id: required"):
        PeagleOptions().validate()


@pytest.fixture(scope="module")
def saved(tiny_llama_dir, tmp_path_factory):
    drafter = make_draft(tiny_llama_dir)
    tcfg = AutoConfig.from_pretrained(tiny_llama_dir)
    info = {"name_or_path": str(tiny_llama_dir), "gguf_file": None, "architecture": "LlamaForCausalLM",
            "model_type": "llama", "num_hidden_layers": tcfg.num_hidden_layers, "hidden_size": tcfg.hidden_size,
            "vocab_size": tcfg.vocab_size}
    return drafter, save_draft(drafter, tmp_path_factory.mktemp("peagle") / "final", info)


def test_export_fields(saved, tmp_path):
    drafter, ddir = saved
    spec = json.loads((export(ddir, "speculators", tmp_path / "s", outtype="f32") / "config.json").read_text())
    assert spec["speculators_model_type"] == "peagle" and spec["architectures"] == ["PEagleSpeculator"]
    assert spec["mask_token_id"] == MASK and spec["speculators_config"]["algorithm"] == "peagle"
    assert spec["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == K
    e3 = json.loads((export(ddir, "eagle3", tmp_path / "e") / "config.json").read_text())
    assert e3["architectures"] == ["LlamaForCausalLMEagle3"] and e3["mask_token_id"] == MASK
    w = load_file(str(tmp_path / "e" / "model.safetensors"))
    assert w["mask_hidden"].shape == (1, 1, len(AUX) * drafter.config.target_hidden_size)
    assert w["mask_hidden"].dtype == torch.bfloat16  # the serving dtype by default
    from drafthead.export.peagle import load_exported

    cfg = json.loads((tmp_path / "e" / "config.json").read_text())
    del cfg["mask_token_id"]  # an EAGLE3 export, as far as the reader can tell
    (tmp_path / "e" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ExportError, match=r"not a P-EAGLE export \(config.json mask_token_id and the mask_hidden"):
        load_exported(tmp_path / "e")
    with pytest.raises(ExportError, match=r"proposes 1\.\.3 tokens"):
        export(ddir, "speculators", tmp_path / "bad", num_speculative_tokens=K + 1)
    assert not (tmp_path / "bad").exists()


def test_speculators_peagle_model_gives_our_logits(saved, tiny_llama_dir, tmp_path, monkeypatch,
                                                   speculators_models):
    """speculators 0.9.0's `PEagleDraftModel.from_pretrained` loads our export offline; its training forward
    (every chain kept: down-sampling ratio 1) gives, element by element (anchor a, depth d), the logits our
    runtime's extend gives for draft d+1 after the prefix up to a."""
    import huggingface_hub.constants as hub_constants
    import speculators.models.peagle.core as peagle_core
    from speculators.models.peagle import PEagleDraftModel, PEagleSpeculatorConfig

    drafter, ddir = saved
    out = export(ddir, "speculators", tmp_path / "spec", verifier=str(tiny_llama_dir), store_embedding=True,
                 outtype="f32")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    config = PEagleSpeculatorConfig.from_pretrained(out)
    config.transformer_layer_config._attn_implementation = "eager"  # flex attention needs a compiler on CPU
    model = PEagleDraftModel.from_pretrained(out, config=config).float().eval()
    assert model.mask_token_id == MASK and torch.equal(model.mask_hidden, drafter.mask_hidden)

    picked = {}
    real = peagle_core.generate_cod_sample_indices

    def cod(**kw):
        picked["anchor"], picked["depth"] = real(**kw)
        return picked["anchor"], picked["depth"]

    monkeypatch.setattr(peagle_core, "generate_cod_sample_indices", cod)
    c = drafter.config
    T = 8
    x = ids(c.vocab_size, T, seed=3)
    aux = torch.randn(1, T, len(AUX) * c.target_hidden_size, generator=torch.Generator().manual_seed(4))
    seen = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: seen.append(o.detach()))
    with torch.no_grad():
        model(hidden_states=aux, input_ids=x, document_ids=torch.zeros_like(x), loss_mask=torch.ones(1, T),
              verifier_last_hidden_states=torch.randn(1, T, c.target_hidden_size), num_depths=K,
              down_sample_ratio=1.0, down_sample_ratio_min=1.0)
    hook.remove()
    theirs = seen[0][0]  # [elements, N]
    anchor, depth = picked["anchor"].tolist(), picked["depth"].tolist()
    assert max(depth) == K - 1 and len(anchor) == theirs.shape[0]
    checked = 0
    for e, (a, d) in enumerate(zip(anchor, depth)):
        if a < 0 or a + d >= T:
            continue
        state = drafter.draft_state(1, 64, torch.device("cpu"))
        state.extend(x[:, : a + 1], aux[:, : a + 1], torch.tensor([a + 1]))  # speculators pairs ids[t], hidden[t]
        torch.testing.assert_close(state.all_logits[0, d], theirs[e], rtol=0, atol=1e-4)
        checked += 1
    assert checked > T  # depth 0 at every anchor, and the mask entries of most

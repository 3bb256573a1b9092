"""The LoRA self-drafter (drafthead/lora.py) against its outside references, on tiny random Llama and
Qwen3 targets: HF's own hidden states (a fresh draft is the plain early exit), peft (the `to=peft` adapter
loaded by `PeftModel` on the truncated target gives the draft's logits), transformers (the `to=hf`
standalone model gives them too and, as `generate(assistant_model=...)`, leaves greedy output unchanged),
and the runtime (confidence stop, sampled losslessness). llama.cpp's `-md` run is tests/test_llama_cpp_lora.py."""
from __future__ import annotations

import json

import pytest
import torch

from drafthead.export import export
from drafthead.registry import draft_state_dict, load_draft, save_draft
from drafthead.runtime import SpecConfig, SpeculativeGenerator
from drafthead.target import load_target
from drafthead.trainer.config import ConfigError, load_config
from drafthead.trainer.prepare import build_draft

E = 1  # exit after the tiny targets' layer 1 (of 4): layers 0 shallow, 1 the exit block


def samples(vocab: int, n: int = 4, length: int = 40, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"id": f"s{i}", "input_ids": torch.randint(3, vocab, (length,), generator=g).tolist(),
             "loss_mask": [0] * 8 + [1] * (length - 8)} for i in range(n)]


def built(tdir, *over: str):
    cfg = load_config(["drafter.family=lora", f"target.name_or_path={tdir}", "target.dtype=float32",
                       "train.dtype=float32", f"drafter.lora.exit_layer={E}", "drafter.lora.rank=4", *over])
    target = load_target(str(tdir), dtype="float32")
    torch.manual_seed(0)
    ds = build_draft(cfg, target, samples(target.config.vocab_size), torch.device("cpu"), log=lambda *a: None)
    with torch.no_grad():  # trained-looking adapters: B away from its zero init
        for name, p in ds.drafter.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return target, ds.drafter


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def arch(request, tiny_llama_dir, tiny_qwen3_dir):
    return request.param, tiny_llama_dir if request.param == "llama" else tiny_qwen3_dir


def draft_logits(drafter, target, ids: torch.Tensor) -> torch.Tensor:
    """The draft's logits on ids [1, T]: the target's layers < E (HF hidden_states[E]), then the drafter."""
    with torch.no_grad():
        h = target.model(ids, output_hidden_states=True).hidden_states[E]  # [1, T, H] input of layer E
        return drafter.target_lm_head(drafter.exit_hidden(h))


def test_a_fresh_draft_is_the_plain_early_exit(arch):
    """B = 0 (peft's init): the drafter's output at every position is the target's own layer E+n-1 output
    through its final norm and head, taken from HF's hidden states."""
    _, tdir = arch
    cfg = load_config(["drafter.family=lora", f"target.name_or_path={tdir}", f"drafter.lora.exit_layer={E}"])
    target = load_target(str(tdir), dtype="float32")
    ds = build_draft(cfg, target, samples(target.config.vocab_size), torch.device("cpu"), log=lambda *a: None)
    ids = torch.tensor([samples(target.config.vocab_size, n=1, seed=3)[0]["input_ids"]])
    with torch.no_grad():
        hs = target.model(ids, output_hidden_states=True).hidden_states
        want = target.model.lm_head(target.model.model.norm(hs[E + 1]))
    torch.testing.assert_close(draft_logits(ds.drafter, target, ids), want, rtol=1e-5, atol=1e-5)


def test_training_shares_the_target_tensors_and_saves_only_adapters(arch, tmp_path):
    _, tdir = arch
    target, drafter = built(tdir)
    tl = target.model.model.layers[E]
    # one copy in memory: the drafter's frozen tensors are views of the target's storage
    assert drafter.layers[0].self_attn.q_proj.base_layer.weight.data_ptr() == tl.self_attn.q_proj.weight.data_ptr()
    assert drafter.target_lm_head.weight.data_ptr() == target.model.lm_head.weight.data_ptr()
    assert drafter.norm.weight.data_ptr() == target.model.model.norm.weight.data_ptr()
    trainable = {n for n, p in drafter.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    saved = draft_state_dict(drafter)
    assert set(saved) == trainable  # final/ holds the adapters alone
    path = save_draft(drafter, tmp_path / "final", target.info())
    with pytest.raises(ValueError, match="built from the target's own layers: pass target"):
        load_draft(path)
    back = load_draft(path, target=target.model)
    ids = torch.tensor([samples(target.config.vocab_size, n=1, seed=4)[0]["input_ids"]])
    torch.testing.assert_close(draft_logits(back, target, ids), draft_logits(drafter, target, ids))
    assert torch.equal(tl.self_attn.q_proj.weight, back.layers[0].self_attn.q_proj.base_layer.weight)


def test_peft_adapter_export_loads_in_peft_and_gives_the_drafts_logits(arch, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _, tdir = arch
    target, drafter = built(tdir)
    path = save_draft(drafter, tmp_path / "final", {**target.info(), "name_or_path": str(tdir)})
    out = export(path, "peft", tmp_path / "peft")
    meta = json.loads((out / "truncation.json").read_text())
    assert meta["num_hidden_layers"] == E + 1 and meta["exit_layer"] == E
    base = AutoModelForCausalLM.from_pretrained(tdir, num_hidden_layers=meta["num_hidden_layers"], dtype=torch.float32)
    model = PeftModel.from_pretrained(base, out).eval()
    ids = torch.tensor([samples(target.config.vocab_size, n=1, seed=5)[0]["input_ids"]])
    want = draft_logits(drafter, target, ids)
    with torch.no_grad():
        got = model(ids).logits
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        merged = model.merge_and_unload()  # and merged, as a user would serve it
        torch.testing.assert_close(merged(ids).logits, want, rtol=1e-4, atol=1e-5)


def test_standalone_hf_export_is_the_draft_and_an_assistant_model(arch, tmp_path):
    """`to=hf` loads with AutoModelForCausalLM (E+n layers) and gives the draft's logits; HF's assisted
    generation with it as `assistant_model` gives the target's greedy output unchanged."""
    from transformers import AutoModelForCausalLM

    _, tdir = arch
    target, drafter = built(tdir)
    path = save_draft(drafter, tmp_path / "final", {**target.info(), "name_or_path": str(tdir)})
    out = export(path, "hf", tmp_path / "hf")
    draft = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert draft.config.num_hidden_layers == E + 1 and draft.config.model_type == target.config.model_type
    ids = torch.tensor([samples(target.config.vocab_size, n=1, seed=6)[0]["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(draft(ids).logits, draft_logits(drafter, target, ids), rtol=1e-4, atol=1e-5)
        prompt = ids[:, :12]
        kw = dict(max_new_tokens=24, do_sample=False, pad_token_id=0)
        plain = target.model.generate(prompt, **kw)
        assisted = target.model.generate(prompt, assistant_model=draft, **kw)
    assert torch.equal(plain, assisted)


def test_gguf_export_holds_the_standalone_model(tmp_path, tiny_llama_dir):
    """`to=gguf` (llama targets): the standalone model's tensors in llama.cpp's names and rope order."""
    import gguf
    import numpy as np

    from drafthead.export.gguf import rope_unpermute
    from drafthead.export.lora import standalone_model
    from drafthead.registry import read_draft
    from test_families import weightless_gguf

    target, drafter = built(tiny_llama_dir)
    tdir = tmp_path / "target"
    import shutil

    shutil.copytree(tiny_llama_dir, tdir)
    weightless_gguf(tdir / "target.gguf", target)
    path = save_draft(drafter, tmp_path / "final", {**target.info(), "name_or_path": str(tdir)})
    out = export(path, "gguf", tmp_path / "draft.gguf")
    r = gguf.GGUFReader(str(out))
    assert r.fields["general.architecture"].contents() == "llama"
    assert int(r.fields["llama.block_count"].contents()) == E + 1
    assert len(r.fields["tokenizer.ggml.tokens"].contents()) == target.config.vocab_size
    want = standalone_model(read_draft(path), target.model).state_dict()
    got = {t.name: torch.from_numpy(np.asarray(t.data).reshape(tuple(int(x) for x in reversed(t.shape))).copy())
           for t in r.tensors}
    c = target.config
    torch.testing.assert_close(rope_unpermute(got[f"blk.{E}.attn_q.weight"], c.num_attention_heads),
                               want[f"model.layers.{E}.self_attn.q_proj.weight"])
    torch.testing.assert_close(got[f"blk.{E}.ffn_down.weight"], want[f"model.layers.{E}.mlp.down_proj.weight"])
    torch.testing.assert_close(got["blk.0.attn_v.weight"], want["model.layers.0.self_attn.v_proj.weight"])
    torch.testing.assert_close(got["token_embd.weight"], want["model.embed_tokens.weight"])


def test_multi_step_depths_are_the_chain_the_runtime_drafts(arch):
    """num_draft_tokens=3: depth i at row t is the draft run on the real prefix x_0..x_t followed by its own
    argmax tokens of depths < i. Reference: that sequence through HF's target (layers < E) and the draft's
    teacher-forced exit block, one sequence per row; then a training step gives adapters alone gradients."""
    _, tdir = arch
    target, drafter = built(tdir, "drafter.lora.num_draft_tokens=3")
    assert drafter.shallow is not None and len(drafter.shallow) == E
    assert not any(k.startswith("shallow") for k in drafter.state_dict())  # the target's, never saved
    V = target.config.vocab_size
    ids = torch.tensor([s["input_ids"] for s in samples(V, n=2, length=24, seed=9)])  # [2, 24]
    with torch.no_grad():
        aux = target.model(ids, output_hidden_states=True).hidden_states[E]  # [2, 24, H]
        masks = [torch.ones_like(ids, dtype=torch.bool)] * 3
        got = [(b.tolist(), t.tolist(), lg) for b, t, lg in drafter.depths(ids, aux, masks)]
    for b, t in ((0, 3), (1, 10), (1, 20)):
        chain = ids[b, : t + 1].tolist()
        for i in range(3):
            want = draft_logits(drafter, target, torch.tensor([chain]))[0, -1]
            rows, cols, logits = got[i]
            row = next(r for r, (bb, tt) in enumerate(zip(rows, cols)) if (bb, tt) == (b, t))
            torch.testing.assert_close(logits[row], want, rtol=1e-4, atol=1e-4)
            chain.append(int(logits[row].argmax()))
    # training: three depths reported, finite loss, gradients on adapters only
    lm = torch.zeros_like(ids)
    lm[:, 8:] = 1
    probs = torch.softmax(torch.randn(2, 24, V), -1)
    out = drafter(ids, aux, probs, probs.argmax(-1), lm)
    assert torch.isfinite(out["loss"]) and out["step_loss"].shape == (3,)
    assert out["count"].tolist() == [32.0, 32.0, 32.0]  # x_{t+1+i} in 8..23: 16 rows each depth
    out["loss"].backward()
    grads = {n for n, p in drafter.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert grads and all(".lora_" in n for n in grads)
    assert all(p.grad is None for layer in drafter.shallow for p in layer.parameters())


def test_confidence_stop_drafts_less_and_stays_lossless(tiny_llama_dir):
    target, drafter = built(tiny_llama_dir)
    gen = SpeculativeGenerator(target, drafter)
    prompts = [s["input_ids"][:12] for s in samples(target.config.vocab_size, n=3, seed=7)]
    ar = [r.tokens for r in gen.generate(prompts, 20, SpecConfig(mode="ar"))]
    full = gen.generate(prompts, 20, SpecConfig(mode="chain", num_speculative_tokens=4, batch_size=3))
    cut = gen.generate(prompts, 20, SpecConfig(mode="chain", num_speculative_tokens=4, batch_size=3,
                                               draft_stop_prob=0.5))
    assert [r.tokens for r in full] == ar and [r.tokens for r in cut] == ar
    drafted = lambda rs: sum(sum(r.num_drafted) for r in rs) / sum(r.num_rounds for r in rs)  # noqa: E731
    assert drafted(cut) < drafted(full) == 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_self_draft_that_is_the_whole_target_drafts_its_tokens(dtype):
    """Exit block = the target's own last layer, adapters at zero: the draft is the target, so every greedy draft is
    accepted. The runtime runs the exit block on slot 0 of its own cache through the target's block math; before
    the one-call decode layers were keyed to their layer, slot 0 ran target layer 0's fused weights instead."""
    from test_runtime import tiny_target

    from drafthead.lora import LoraDrafter, LoraOptions, build

    target = tiny_target("llama", seed=2, dtype=dtype)
    L = target.config.num_hidden_layers
    drafter = LoraDrafter(build(target.config, LoraOptions(exit_layer=L - 1, rank=4), None, None)).to(dtype)
    drafter.attach_target(target.model, share=True)
    gen = SpeculativeGenerator(target, drafter.eval())
    prompts = [[3, 5, 1, 6, 9, 11, 4], [7, 8, 2, 2, 10]]
    res = gen.generate(prompts, 24, SpecConfig(mode="chain", num_speculative_tokens=3, batch_size=2))
    assert [r.tokens for r in res] == [r.tokens for r in gen.generate(prompts, 24, SpecConfig(mode="ar"))]
    assert [a == d for r in res for a, d in zip(r.accept_lens, r.num_drafted)] == [True] * sum(
        r.num_rounds for r in res)


def test_sampled_chain_keeps_the_target_distribution():
    """Rejection sampling with the self-draft's q keeps the target's joint distribution of the first three
    tokens (the total-variation check of the other families, tests/test_runtime.py)."""
    from test_runtime import V_SMALL, empirical_joint, exact_joint, tiny_target

    from drafthead.lora import LoraDrafter, LoraOptions, build

    target = tiny_target("llama", vocab=V_SMALL, seed=2, dtype=torch.float32, head_scale=20.0)
    target.model.config.eos_token_id = target.model.generation_config.eos_token_id = None
    torch.manual_seed(4)
    drafter = LoraDrafter(build(target.config, LoraOptions(exit_layer=1, rank=4), None, None))
    drafter.attach_target(target.model)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    prompt = [3, 5, 1, 6]
    spec = SpecConfig(mode="chain", num_speculative_tokens=2, temperature=1.0, batch_size=1000)
    res = SpeculativeGenerator(target, drafter.eval()).generate([prompt] * 8000, 3, spec)
    assert sum(r.accept_lens[0] for r in res if r.accept_lens) > 500  # the drafts do get accepted
    tv = 0.5 * float((empirical_joint(res, 3) - exact_joint(target, prompt, 3, 1.0, 1.0)).abs().sum())
    assert tv < 0.07, tv


def test_bad_options_are_clear_errors(tiny_llama_dir):
    with pytest.raises(ConfigError, match=r"'drafter.lora.rank': 0 \(must be >= 1\)"):
        load_config(["drafter.family=lora", "drafter.lora.rank=0"])
    with pytest.raises(ConfigError, match=r"'drafter.lora.num_draft_tokens': 0 \(must be >= 1\)"):
        load_config(["drafter.family=lora", "drafter.lora.num_draft_tokens=0"])
    with pytest.raises(ConfigError, match=r"'drafter.lora.step_decay': 1.5 \(must be in \(0, 1\]\)"):
        load_config(["drafter.family=lora", "drafter.lora.step_decay=1.5"])
    with pytest.raises(ConfigError, match=r"'drafter.lora.target_modules'"):
        load_config(["drafter.family=lora", "drafter.lora.target_modules=[qkv]"])
    target = load_target(str(tiny_llama_dir), dtype="float32")
    for over, msg in ((["drafter.lora.exit_layer=4"], "past the target's 4 layers"),
                      (["drafter.lora.exit_layer=1", "capture.layer_ids=[2]"], "reads the input of its exit layer")):
        cfg = load_config(["drafter.family=lora", f"target.name_or_path={tiny_llama_dir}", *over])
        with pytest.raises(ValueError, match=msg):
            build_draft(cfg, target, samples(target.config.vocab_size), torch.device("cpu"), log=lambda *a: None)
    from drafthead.lora import LoraDrafter, LoraOptions, build  # a multi-step draft without the target's layers
    d = LoraDrafter(build(target.config, LoraOptions(exit_layer=1, rank=4, num_draft_tokens=2), None, None))
    ids = torch.zeros(1, 6, dtype=torch.long)
    V = target.config.vocab_size
    with pytest.raises(ValueError, match=r"num_draft_tokens > 1 needs the target's layers < exit_layer"):
        d(ids, torch.zeros(1, 6, target.config.hidden_size), torch.full((1, 6, V), 1 / V), ids, ids)

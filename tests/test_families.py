"""The family contract: every registered drafter family, on tiny random Llama and Qwen3 targets, through
the same checks. A new family gets them by registering (drafthead.registry.FAMILIES):

- it builds from a recipe through the shared trainer code (vocabulary, init, teacher head);
- three training steps on one fixed batch lower its loss;
- save -> load gives back every tensor bit for bit;
- greedy speculative output equals greedy AR output in every drafting mode it declares;
- every exporter it declares round-trips through its reader (or says why this target cannot take it).
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from drafthead.export import ExportError, export
from drafthead.family import Drafter, resolve
from drafthead.losses import Objective
from drafthead.registry import FAMILIES, NOT_SAVED, draft_state_dict, load_draft, save_draft
from drafthead.runtime.contract import DraftMode, DraftState, hooks
from drafthead.runtime import SpecConfig, SpeculativeGenerator
from drafthead.target import load_target
from drafthead.trainer.engines import TorchEngine
from drafthead.trainer.step import drafter_inputs, evaluate, forward_backward, make_batch
from drafthead.trainer.config import load_config
from drafthead.trainer.dist import Dist
from drafthead.trainer.prepare import build_draft

ROOT = Path(__file__).resolve().parents[1]
ARCHS = ["llama", "qwen3"]
# small enough for a tiny target (vocab ~320, 4 layers, hidden 64), in every family's own section
SMALL = {"eagle3": ["drafter.eagle3.draft_vocab_size=128", "drafter.eagle3.num_draft_tokens=2",
                    "capture.layer_ids=[1,2,3]"],
         "mtp": ["drafter.mtp.num_draft_tokens=2"],
         # token 2 never occurs in `samples` (ids from 3 up): the mask token
         "dflash": ["drafter.dflash.mask_token_id=2", "drafter.dflash.block_size=4", "drafter.dflash.num_layers=2",
                    "drafter.dflash.target_layer_ids=[0,2]"],
         "dspark": ["drafter.dspark.mask_token_id=2", "drafter.dspark.block_size=4", "drafter.dspark.num_layers=2",
                    "drafter.dspark.target_layer_ids=[0,2]", "drafter.dspark.markov_rank=8"],
         "domino": ["drafter.domino.mask_token_id=2", "drafter.domino.block_size=4", "drafter.domino.num_layers=2",
                    "drafter.domino.target_layer_ids=[0,2]", "drafter.domino.gru_hidden_dim=16",
                    "drafter.domino.emb_dim=8"],
         "lora": ["drafter.lora.exit_layer=1", "drafter.lora.rank=4"],
         "peagle": ["drafter.peagle.draft_vocab_size=128", "drafter.peagle.num_draft_tokens=3",
                    "drafter.peagle.mask_token_id=2", "capture.layer_ids=[1,2,3]"]}


def samples(vocab: int, n: int = 4, length: int = 40, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(3, vocab, (length,), generator=g).tolist()
        mask = [0] * 8 + [1] * (length - 8)  # a prompt, then the supervised answer
        out.append({"id": f"s{i}", "input_ids": ids, "loss_mask": mask})
    return out


@pytest.fixture(scope="module", params=[(f, a) for f in FAMILIES for a in ARCHS],
                ids=[f"{f}-{a}" for f in FAMILIES for a in ARCHS])
def built(request, tiny_llama_dir, tiny_qwen3_dir, tmp_path_factory):
    name, arch = request.param
    tdir = tiny_llama_dir if arch == "llama" else tiny_qwen3_dir
    cfg = load_config([f"drafter.family={name}", f"target.name_or_path={tdir}", "target.dtype=float32",
                       "train.dtype=float32", "train.lr=1e-3", "train.warmup_ratio=0", "train.grad_clip=0",
                       *SMALL.get(name, [])])
    target = load_target(str(tdir), dtype="float32")
    torch.manual_seed(0)
    train = samples(target.config.vocab_size)
    ds = build_draft(cfg, target, train, torch.device("cpu"), log=lambda *a: None)
    return {"name": name, "arch": arch, "cfg": cfg, "target": target, "ds": ds, "train": train,
            "tdir": tdir, "tmp": tmp_path_factory.mktemp(f"{name}-{arch}")}


def missing_hooks(obj: object, protocol: type) -> list[str]:
    """The names `protocol` declares that obj lacks: its methods defined by obj's own class (the shared code never
    probes), its attributes held by obj."""
    methods = {n for c in protocol.__mro__ for n, v in vars(c).items() if callable(v)}
    return [h for h in hooks(protocol)
            if not (callable(getattr(type(obj), h, None)) if h in methods else hasattr(obj, h))]


def test_speaks_every_declared_hook(built):
    """Every name of the `Drafter` protocol is the family's, and every draft state follows `DraftState` and the
    protocol of each mode it drafts in (`DraftMode.state`); the hooks answer in the declared shapes."""
    d = built["ds"].drafter
    assert not missing_hooks(d, Drafter), missing_hooks(d, Drafter)
    assert isinstance(d.reads_target_head, bool) and isinstance(d.shares_target_layers, bool)
    assert d.check_data(built["train"]) == [] and all(isinstance(k, str) for k in d.target_tensors())
    assert d.reads_target_head == ("target_lm_head.weight" in d.state_dict())
    assert d.shares_target_layers == callable(getattr(type(d), "attach_target", None))
    own = d.runtime_module()
    assert own is None or isinstance(own, torch.nn.Module)
    state = (own or d).draft_state(1, 16, torch.device("cpu"))
    assert not missing_hooks(state, DraftState), missing_hooks(state, DraftState)
    for name, mode in d.draft_modes.items():
        assert DraftState in mode.state.__mro__, name  # a mode protocol extends DraftState
        assert not missing_hooks(state, mode.state), (name, missing_hooks(state, mode.state))


def test_builds_with_the_declared_vocabulary_and_features(built):
    fam, ds, target = FAMILIES[built["name"]], built["ds"], built["target"]
    assert ds.drafter.family == fam.name and isinstance(ds.drafter, fam.model)
    assert (ds.d2t is not None) == fam.predicts_draft_vocab(getattr(built["cfg"].drafter, fam.name))
    assert ds.drafter.features in ("aux", "last")
    assert ds.drafter.draft_modes and all(isinstance(m, DraftMode) for m in ds.drafter.draft_modes.values())
    assert ds.drafter.check_target(target.config) == []
    assert all(0 <= i < target.num_layers for i in ds.drafter.capture_layer_ids())
    assert torch.equal(ds.drafter.embed_tokens.weight, target.model.get_input_embeddings().weight)


def test_three_steps_lower_the_loss_on_a_fixed_batch(built):
    fam, ds, target, cfg = FAMILIES[built["name"]], built["ds"], built["target"], built["cfg"]
    drafter = ds.drafter
    batch = make_batch(built["train"], target, drafter.capture_layer_ids(), torch.float32, False,
                         torch.device("cpu"), fam.predicts_draft_vocab(getattr(cfg.drafter, fam.name)))
    before = drafter.state_dict()
    before = {k: v.clone() for k, v in before.items()}
    engine = TorchEngine(drafter, cfg, 100, Dist())
    losses = []
    for _ in range(4):  # three optimizer steps, the loss read before each and after the last
        out = forward_backward(engine, batch, ds.head, "float32", torch.device("cpu"))
        losses.append(float(out["loss"].detach()))
        engine.step()
        assert out["correct"].shape == out["count"].shape == (drafter.config.num_draft_tokens,)
    assert losses[-1] < losses[0], losses
    res = evaluate(drafter, [batch], ds.head, Dist())  # the held-out eval reads every key the forward returns
    assert 0 <= res["eval/acc_0"] <= 1 and res["eval/sim_accept_len"] >= 1
    assert ("eval/alpha_0" in res) == bool(fam.losses)  # the expected acceptance, from every family with losses
    if fam.losses:
        assert 0 < res["eval/alpha_0"] <= 1
    shared = [p for d in ("trainer", "eval", "drafthead/runtime", "drafthead/export") for p in (ROOT / d).glob("*.py")]
    shared += [p for p in (ROOT / "drafthead").glob("*.py") if p.stem not in FAMILIES and p.stem != "family"]
    for name, (num, den) in out.get("ratios", {}).items():  # the family's own metrics, none named by shared code
        assert f"eval/{name}" in res or f"eval/{name}_0" in res or float(den.sum()) == 0, name
        named = [p.relative_to(ROOT) for p in shared if f"eval/{name}" in p.read_text() or f'"{name}"' in p.read_text()]
        assert not named, f"{fam.name}'s metric {name!r} is named in shared code: {named}"
    if "confidence_error" in out.get("ratios", {}):
        assert 0 <= res["eval/confidence_error"] <= 1
    drafter.load_state_dict(before)  # the other checks start from the built drafter


def test_every_declared_loss_trains(built):
    """Each `train.loss` the family declares gives a finite loss with a gradient; `kl` is the default to the bit."""
    fam, ds, target = FAMILIES[built["name"]], built["ds"], built["target"]
    if not fam.losses:
        pytest.skip(f"{fam.name} trains its own loss only")
    drafter = ds.drafter
    batch = make_batch(built["train"], target, drafter.capture_layer_ids(), torch.float32, False,
                       torch.device("cpu"), fam.predicts_draft_vocab(getattr(built["cfg"].drafter, fam.name)))
    inputs = drafter_inputs(batch, ds.head)
    torch.manual_seed(0)
    base = drafter(**inputs)["loss"]
    for name in fam.losses:
        drafter.zero_grad()
        torch.manual_seed(0)  # block drafters sample their anchors
        loss = drafter(**inputs, objective=Objective(name))["loss"]
        loss.backward()
        grads = [p.grad for p in drafter.parameters() if p.requires_grad and p.grad is not None]
        assert torch.isfinite(loss) and grads and any(float(g.abs().sum()) > 0 for g in grads), name
        if name == "kl":
            assert torch.equal(loss.detach(), base.detach())
    drafter.zero_grad()


def test_save_load_is_bit_identical(built):
    ds, target, tmp = built["ds"], built["target"], built["tmp"]
    path = save_draft(ds.drafter, tmp / "final", target.info())
    back = load_draft(path, target=target.model)
    want, got = draft_state_dict(ds.drafter), draft_state_dict(back)
    assert want.keys() == got.keys()
    for k in want:
        assert want[k].dtype == got[k].dtype and torch.equal(want[k], got[k]), k
    assert torch.equal(back.embed_tokens.weight, ds.drafter.embed_tokens.weight)


def test_greedy_speculative_equals_ar_in_every_declared_mode(built):
    ds, target = built["ds"], built["target"]
    torch.manual_seed(1)
    with torch.no_grad():  # a drafter that agrees with the target sometimes and not always
        for p in ds.drafter.parameters():
            if p.requires_grad:
                p.add_(0.02 * torch.randn_like(p))
    gen = SpeculativeGenerator(target, ds.drafter)
    prompts = [s["input_ids"][:12] for s in samples(target.config.vocab_size, n=3, seed=5)]
    ar = [r.tokens for r in gen.generate(prompts, 16, SpecConfig(mode="ar"))]
    for mode in ds.drafter.draft_modes:
        for batch_size in (1, 3):
            spec = SpecConfig(mode=mode, num_speculative_tokens=3, tree_nodes=6, topk=2, batch_size=batch_size)
            got = [r.tokens for r in gen.generate(prompts, 16, spec)]
            assert got == ar, (mode, batch_size)


def weightless_gguf(path, target) -> None:
    """Dims and tokenizer metadata of the target as a GGUF (what `to=gguf` exports read from a target)."""
    import gguf

    c = target.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_embedding_length(c.hidden_size)
    w.add_context_length(c.max_position_embeddings)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"tok{i}" for i in range(c.vocab_size)])
    w.add_token_types([1] * c.vocab_size)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_every_declared_exporter_round_trips(built):
    fam, ds, target, tmp = FAMILIES[built["name"]], built["ds"], built["target"], built["tmp"]
    tdir = tmp / "target"  # the target as a local dir with a GGUF beside it, for formats that copy its tokenizer
    if not tdir.exists():
        shutil.copytree(built["tdir"], tdir)
        weightless_gguf(tdir / "target.gguf", target)
    path = save_draft(ds.drafter, tmp / "export_src", {**target.info(), "name_or_path": str(tdir)})
    saved = {k: v for k, v in draft_state_dict(ds.drafter).items() if k not in NOT_SAVED}
    skipped = []
    for fmt in fam.exporters:
        out = tmp / (f"{fmt}.gguf" if fmt == "gguf" else fmt)
        try:
            export(path, fmt, out, target=str(tdir))
        except ExportError as e:  # a format this target architecture cannot take: said, not silent
            skipped.append(f"to={fmt}: {e}")
            assert not out.exists()
            continue
        if fmt in fam.no_reader:  # merged formats: proved by the family's own tests, which it names
            assert "tests/" in fam.no_reader[fmt], (fam.name, fmt)
            continue
        assert fmt in fam.readers, f"{fam.name}: exporter {fmt!r} wrote {out} but declares no reader"
        back = resolve(fam.readers[fmt])(out)
        assert back.keys() == saved.keys(), (fmt, sorted(set(back) ^ set(saved)))
        for k, v in saved.items():  # bit for bit at the dtype the format wrote (vLLM / SGLang layouts: bf16)
            b = back[k].to(v.dtype)
            assert torch.equal(b, v) or torch.equal(b, v.to(torch.bfloat16).to(v.dtype)), (fmt, k)
    if skipped:
        assert len(skipped) < len(fam.exporters), skipped  # at least one format works on every target
        print("\n".join(skipped))

"""trainer/capture.py: hook capture == HF hidden_states, offline == online features, resumable and
verified shards. Tiny random Llama / Qwen3 targets from conftest.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from drafthead.trainer import capture
from drafthead.target import TargetHead, lm_head_weight, load_target
from drafthead.trainer import data as tdata
from drafthead.trainer.step import teacher_targets
from drafthead.trainer.capture import CaptureError, ShardedFeatures, capture_offline, collate, features_for_batch

LAYERS = [1, 2, 3]


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return load_target(str(tiny_llama_dir), dtype="float32")


@pytest.fixture(scope="module")
def qwen3(tiny_qwen3_dir):
    return load_target(str(tiny_qwen3_dir), dtype="float32")


@pytest.fixture(scope="module")
def samples(llama, tiny_sharegpt, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:  # the datasets cache of the JSON file goes to tmp
        mp.setenv("DRAFTHEAD_CACHE", str(tmp_path_factory.mktemp("cache")))
        convs, _ = tdata.load_conversations(str(tiny_sharegpt))
    out, _ = tdata.tokenize_conversations(llama.tokenizer, convs, max_length=128)  # no cache_key: nothing written
    assert len(out) == 40 and any(len(s["input_ids"]) == 128 for s in out)
    return out


@pytest.fixture(autouse=True)
def _tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTHEAD_CACHE", str(tmp_path / "cache"))


def alone(target, sample, dtype=torch.bfloat16) -> dict:
    """Online features of one sample in a batch of its own (no padding)."""
    b = features_for_batch(target, collate([sample], target.tokenizer.pad_token_id), LAYERS, dtype)
    return {k: v[0] for k, v in b.items()}


# ----------------------------------------------------------------------------- parity with HF

@pytest.mark.parametrize("which", ["llama", "qwen3"])
def test_capture_matches_hf_hidden_states(which, request):
    target = request.getfixturevalue(which)
    torch.manual_seed(0)
    V = target.config.vocab_size
    ids = torch.randint(0, V, (3, 17))
    attn = torch.ones(3, 17, dtype=torch.long)
    attn[1, 11:] = 0  # right padding
    attn[2, 5:] = 0
    batch = {"input_ids": ids, "attention_mask": attn, "loss_mask": attn.clone()}
    with torch.no_grad():
        ref = target.model(input_ids=ids, attention_mask=attn, output_hidden_states=True)
    hs = ref.hidden_states  # N+1 entries: embeddings, layer outputs, last = after the final norm
    assert len(hs) == target.num_layers + 1
    ids_all = list(range(target.num_layers))
    out = features_for_batch(target, batch, ids_all, torch.float32)
    H = target.hidden_size
    assert out["aux"].shape == (3, 17, len(ids_all) * H) and out["last"].shape == (3, 17, H)
    for j, i in enumerate(ids_all):  # id i = input of decoder layer i = hidden_states[i]
        torch.testing.assert_close(out["aux"][..., j * H:(j + 1) * H], hs[i], rtol=0, atol=0)
    torch.testing.assert_close(out["last"], hs[-1], rtol=0, atol=0)  # after the final norm
    # the lm_head reads `last`: teacher logits recomputed from it are the target's logits
    torch.testing.assert_close(target.model.lm_head(out["last"]), ref.logits, rtol=1e-6, atol=1e-6)
    # a chosen subset comes out in the order asked for, cast to the capture dtype
    sub = features_for_batch(target, batch, [3, 1], torch.bfloat16)
    assert sub["aux"].dtype == torch.bfloat16 and sub["last"].dtype == torch.bfloat16
    assert torch.equal(sub["aux"], torch.cat([hs[3], hs[1]], -1).to(torch.bfloat16))
    # padding of other rows does not change a row's features
    solo = features_for_batch(target, {k: v[2:3, :5] for k, v in batch.items()}, ids_all, torch.float32)
    torch.testing.assert_close(solo["aux"][0], out["aux"][2, :5], rtol=1e-5, atol=1e-5)


def test_capture_rejects_out_of_range_layer_ids(llama, samples):
    with pytest.raises(ValueError, match=r"layer ids \[4\] out of range.*4 decoder layers"):
        features_for_batch(llama, collate(samples[:1]), [1, 4], torch.float32)


# ----------------------------------------------------------------------------- offline == online

def test_offline_features_equal_online_features(llama, samples, tmp_path):
    """One sample per target forward (batch_tokens below every sample length): bit-identical to online."""
    on_disk = []  # shards present each time the hook runs: it runs once a shard is written
    m = capture_offline(llama, samples, tmp_path / "cap", LAYERS, torch.bfloat16, shard_samples=16,
                        batch_tokens=1, progress=False,
                        after_shard=lambda: on_disk.append(len(list((tmp_path / "cap").glob("shard_*")))))
    assert m["complete"] and m["num_samples"] == 40 and [s["num_samples"] for s in m["shards"]] == [16, 16, 8]
    assert on_disk == [1, 2, 3]
    feats = ShardedFeatures(tmp_path / "cap")
    assert len(feats) == 40 and feats.lengths == [len(s["input_ids"]) for s in samples]
    assert m["num_tokens"] == sum(feats.lengths)
    for i, s in enumerate(samples):
        got, want = feats[i], alone(llama, s)
        assert got["input_ids"].tolist() == s["input_ids"] and got["loss_mask"].tolist() == s["loss_mask"]
        assert got["aux"].dtype == torch.bfloat16 and got["last"].dtype == torch.bfloat16
        assert torch.equal(got["aux"], want["aux"]), i
        assert torch.equal(got["last"], want["last"]), i


def test_offline_batched_capture_within_one_bf16_ulp_of_online(llama, samples, tmp_path):
    """Several padded samples per forward: the fp32 matmuls see other shapes, so a value can round to the
    neighbouring bf16 number (CPU kernels are not batch-invariant). Never more than that."""
    capture_offline(llama, samples, tmp_path / "cap", LAYERS, torch.bfloat16, shard_samples=16,
                    batch_tokens=4096, progress=False)
    feats = ShardedFeatures(tmp_path / "cap")
    for i, s in enumerate(samples):
        got, want = feats[i], alone(llama, s)
        for k in ("aux", "last"):
            torch.testing.assert_close(got[k].float(), want[k].float(), rtol=2 ** -7, atol=1e-5)


# ----------------------------------------------------------------------------- resume after a kill

def _read_all(folder: Path) -> list[dict]:
    f = ShardedFeatures(folder)
    return [f[i] for i in range(len(f))]


def test_offline_capture_resumes_after_kill(llama, samples, tmp_path, monkeypatch):
    ref_dir, dir_ = tmp_path / "ref", tmp_path / "cap"
    samples = samples[:24]
    ref = capture_offline(llama, samples, ref_dir, LAYERS, torch.bfloat16, shard_samples=8, batch_tokens=1,
                          progress=False)

    real, calls = capture.capture, {"n": 0}

    def dying_capture(*a, **k):  # the target forward dies mid-way through the second shard
        calls["n"] += 1
        if calls["n"] > 8 + 3:
            raise KeyboardInterrupt("killed")
        return real(*a, **k)

    monkeypatch.setattr(capture, "capture", dying_capture)
    with pytest.raises(KeyboardInterrupt):
        capture_offline(llama, samples, dir_, LAYERS, torch.bfloat16, shard_samples=8, batch_tokens=1,
                        progress=False)
    m = json.loads((dir_ / "manifest.json").read_text())
    assert not m["complete"] and [s["file"] for s in m["shards"]] == ["shard_00000.safetensors"]
    with pytest.raises(CaptureError, match="incomplete"):
        ShardedFeatures(dir_)
    # a write killed half-way leaves a temp file behind
    (dir_ / ".shard_00001.safetensors.tmp-w").write_bytes(b"half a shard")

    monkeypatch.setattr(capture, "capture", real)
    calls["n"] = 0
    counted = {"n": 0}

    def counting(*a, **k):
        counted["n"] += 1
        return real(*a, **k)

    monkeypatch.setattr(capture, "capture", counting)
    m2 = capture_offline(llama, samples, dir_, LAYERS, torch.bfloat16, shard_samples=8, batch_tokens=1,
                         progress=False)
    assert counted["n"] == 24 - 8  # only the missing samples were captured again
    assert not list(dir_.glob(".*.tmp-*"))
    assert m2["complete"] and m2["num_tokens"] == ref["num_tokens"]
    assert [(s["file"], s["first_sample"], s["num_samples"], s["num_tokens"]) for s in m2["shards"]] == \
        [(s["file"], s["first_sample"], s["num_samples"], s["num_tokens"]) for s in ref["shards"]]
    got, want = _read_all(dir_), _read_all(ref_dir)
    assert len(got) == len(want) == 24
    for a, b in zip(got, want):
        for k in ("input_ids", "loss_mask", "aux", "last"):
            assert torch.equal(a[k], b[k])
    with safe_open(str(dir_ / "shard_00001.safetensors"), "pt") as f:  # shard k holds samples [8k, 8k+8)
        assert json.loads(f.metadata()["ids"]) == [s["id"] for s in samples[8:16]]
    # a finished capture run again does nothing
    counted["n"] = 0
    capture_offline(llama, samples, dir_, LAYERS, torch.bfloat16, shard_samples=8, batch_tokens=1, progress=False)
    assert counted["n"] == 0


# ----------------------------------------------------------------------------- damaged captures

@pytest.fixture()
def captured(llama, samples, tmp_path) -> Path:
    d = tmp_path / "cap"
    capture_offline(llama, samples[:12], d, LAYERS, torch.bfloat16, shard_samples=4, batch_tokens=4096,
                    progress=False)
    return d


def test_truncated_shard_is_named(captured, llama, samples):
    shard = captured / "shard_00001.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    with pytest.raises(CaptureError, match=r"truncated.*shard_00001\.safetensors"):
        ShardedFeatures(captured)
    with pytest.raises(CaptureError, match=r"shard_00001\.safetensors"):  # also when resuming the capture
        capture_offline(llama, samples[:12], captured, LAYERS, torch.bfloat16, shard_samples=4, progress=False)


def test_corrupted_shard_is_named(captured):
    shard = captured / "shard_00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit in the tensor data
    shard.write_bytes(bytes(data))
    with pytest.raises(CaptureError, match=r"corrupted.*shard_00002\.safetensors"):
        ShardedFeatures(captured)


def test_missing_shard_and_missing_manifest(captured, tmp_path):
    (captured / "shard_00000.safetensors").unlink()
    with pytest.raises(CaptureError, match=r"missing.*shard_00000\.safetensors"):
        ShardedFeatures(captured)
    with pytest.raises(CaptureError, match=r"no manifest\.json.*drafthead capture"):
        ShardedFeatures(tmp_path / "empty")


def test_stale_tmp_file_is_cleaned(captured, llama, samples):
    stale = captured / ".shard_00003.safetensors.tmp-w"
    stale.write_bytes(b"\0" * 10)
    m = capture_offline(llama, samples[:12], captured, LAYERS, torch.bfloat16, shard_samples=4, progress=False)
    assert not stale.exists() and m["complete"] and len(m["shards"]) == 3


@pytest.mark.parametrize("change,kw", [("layer_ids", {"layer_ids": [0, 1, 2]}),
                                       ("dtype", {"dtype": torch.float32}),
                                       ("shard_samples", {"shard_samples": 6}),
                                       ("argmax", {"argmax": True})])
def test_capture_dir_from_another_setup_is_refused(captured, llama, samples, change, kw):
    args = {"layer_ids": LAYERS, "dtype": torch.bfloat16, "shard_samples": 4, "argmax": False, **kw}
    with pytest.raises(CaptureError, match=rf"existing capture was made with {change}=.*this run has.*capture\.dir"):
        capture_offline(llama, samples[:12], captured, args["layer_ids"], args["dtype"],
                        shard_samples=args["shard_samples"], progress=False, argmax=args["argmax"])


def test_capture_of_an_older_format_is_named(captured):
    m = json.loads((captured / "manifest.json").read_text())
    m["format"] = "drafthead-capture-1"  # no stored argmax yet
    (captured / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(CaptureError, match=r"capture format 'drafthead-capture-1'.*drafthead-capture-2.*capture again"):
        ShardedFeatures(captured)


# ----------------------------------------------------------------------------- stored target argmax

def test_stored_argmax_is_the_targets_where_the_next_token_is_supervised(llama, samples, tmp_path):
    """argmax=True stores the full-vocab argmax of the target's lm_head over `last` at positions j whose
    next token is supervised, -1 elsewhere; offline == online, and both equal what TargetHead computes."""
    capture_offline(llama, samples, tmp_path / "cap", LAYERS, torch.bfloat16, shard_samples=16, batch_tokens=1,
                    progress=False, argmax=True)
    feats = ShardedFeatures(tmp_path / "cap")
    head = TargetHead(lm_head_weight(llama.model), None)
    pad = llama.tokenizer.pad_token_id
    n_sup = 0
    for i, s in enumerate(samples):
        got = feats[i]
        online = features_for_batch(llama, collate([s], pad), LAYERS, torch.bfloat16, argmax=True)["argmax"][0]
        assert got["argmax"].dtype == torch.int32 and torch.equal(got["argmax"].long(), online), i
        mask = torch.tensor(s["loss_mask"]).bool()
        need = torch.zeros_like(mask)
        need[:-1] = mask[1:]
        assert (online[~need] == -1).all()
        _, top = head(got["last"][need])
        assert torch.equal(online[need], top), i
        n_sup += int(need.sum())
    assert n_sup > 100
    # collate_features pads the stored argmax with -1, like the positions it does not cover
    b = capture.collate_features([feats[0], feats[1]], pad)
    n0 = feats.lengths[0]
    assert b["argmax"].shape == b["input_ids"].shape
    assert (b["argmax"][0, n0:] == -1).all() and torch.equal(b["argmax"][0, :n0], feats[0]["argmax"].long())
    # a capture without it has no such key
    capture_offline(llama, samples[:4], tmp_path / "plain", LAYERS, torch.bfloat16, shard_samples=4, progress=False)
    assert "argmax" not in ShardedFeatures(tmp_path / "plain")[0]


def test_teacher_targets_with_the_stored_argmax_equal_the_recomputed_ones(llama, samples):
    """The trainer's teacher: with a stored argmax the head computes only the draft-vocab rows; the
    distribution and targets are the same as when it computes the full vocabulary itself."""
    pad = llama.tokenizer.pad_token_id
    b = features_for_batch(llama, collate(samples[:3], pad), LAYERS, torch.float32, argmax=True)
    draft = torch.arange(0, llama.config.vocab_size, 3)  # any sorted subset
    head = TargetHead(lm_head_weight(llama.model), draft)
    p_full, t_full = teacher_targets(head, b["last"], b["loss_mask"])
    p_stored, t_stored = teacher_targets(head, b["last"], b["loss_mask"], b["argmax"])
    assert torch.equal(t_full, t_stored) and (t_full >= 0).sum() > 10
    torch.testing.assert_close(p_full, p_stored, rtol=0, atol=0)
    rows = t_full >= 0
    torch.testing.assert_close(p_full[rows].sum(-1), torch.ones(int(rows.sum())), rtol=0, atol=1e-5)
    ref = (b["last"][rows] @ lm_head_weight(llama.model)[draft].T).softmax(-1)  # [M, N]
    torch.testing.assert_close(p_full[rows], ref, rtol=1e-5, atol=1e-6)


def test_capture_dir_from_another_target_is_refused(captured, qwen3, samples):
    """Same tokenizer, hidden size and layers, but another model: its features would be wrong."""
    with pytest.raises(CaptureError, match=r"existing capture was made with target=.*LlamaForCausalLM.*"
                                           r"Qwen3ForCausalLM"):
        capture_offline(qwen3, samples[:12], captured, LAYERS, torch.bfloat16, shard_samples=4, progress=False)


def test_capture_dir_with_other_samples_is_refused(captured, llama, samples):
    with pytest.raises(CaptureError, match=r"sample_ids"):
        capture_offline(llama, samples[1:13], captured, LAYERS, torch.bfloat16, shard_samples=4, progress=False)

"""A target split over ranks (target.tensor_parallel, transformers' tp plan on a torch DeviceMesh, gloo on CPU):
captured features, teacher logits, argmax and fingerprint equal the whole target's; a 2-rank split run trains
the same draft as one rank; offline capture writes the same shards; what cannot be split is a named error."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from test_train import ROOT, args, free_port, train
from drafthead.trainer.config import ConfigError, load_config
from drafthead.trainer.dist import check_tensor_parallel

WORKER = r'''
import json, sys, torch
from drafthead.target import TargetHead, load_target, lm_head_weight
from drafthead.trainer.capture import collate, features_for_batch
from drafthead.trainer.dist import init_distributed
path, out = sys.argv[1], sys.argv[2]
d = init_distributed(2)
split = load_target(path, dtype="float32", tp_mesh=d.tp_mesh)
whole = load_target(path, dtype="float32")
g = torch.Generator().manual_seed(0)
samples = [{"input_ids": torch.randint(0, 200, (n,), generator=g).tolist(), "loss_mask": [0] * 3 + [1] * (n - 3)}
           for n in (17, 11, 23)]
batch = collate(samples, 0)
a = features_for_batch(split, dict(batch), [1, 2, 3], torch.float32, argmax=True)
b = features_for_batch(whole, dict(batch), [1, 2, 3], torch.float32, argmax=True)
ids = torch.arange(0, 200, 3)
ha, hb = TargetHead(lm_head_weight(split.model), ids), TargetHead(lm_head_weight(whole.model), ids)
la, lb = ha.weight @ a["last"][0].T, hb.weight @ b["last"][0].T
res = {"aux": (a["aux"] - b["aux"]).abs().max().item(), "last": (a["last"] - b["last"]).abs().max().item(),
       "teacher": (la - lb).abs().max().item(), "argmax_equal": bool(torch.equal(a["argmax"], b["argmax"])),
       "fingerprint_equal": split.fingerprint == whole.fingerprint, "split": type(split.model.model.layers[0]
       .self_attn.q_proj.weight).__name__}
if d.rank == 0:
    open(out, "w").write(json.dumps(res))
'''


def torchrun2(argv: list[str], env_extra: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           *argv]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return p


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_split_target_features_equal_the_whole_target(arch: str, tiny_llama_dir, tiny_qwen3_dir, tmp_path) -> None:
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    out = tmp_path / "res.json"
    torchrun2([str(worker), str(tiny_llama_dir if arch == "llama" else tiny_qwen3_dir), str(out)],
              {"PYTHONPATH": str(ROOT)})
    res = json.loads(out.read_text())
    assert res["split"] == "DTensor"  # the weights really are split
    assert res["aux"] < 1e-5 and res["last"] < 1e-5 and res["teacher"] < 1e-5, res  # fp32, summation order only
    assert res["argmax_equal"] and res["fingerprint_equal"], res


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "final" / "model.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["online", "offline"])
def test_split_target_run_trains_the_draft_of_one_rank(mode: str, tiny_llama_dir, tiny_sharegpt, tmp_path,
                                                       monkeypatch) -> None:
    over = {"train.max_steps": 4, "capture.mode": mode, "capture.dtype": "float32", "data.num_holdout": 4,
            "train.eval_samples": 4}
    one, two = tmp_path / "one", tmp_path / "two"
    env = {"DRAFTHEAD_CACHE": str(tmp_path / "cache")}
    monkeypatch.setenv("DRAFTHEAD_CACHE", env["DRAFTHEAD_CACHE"])
    train.main(args(one, tiny_llama_dir, tiny_sharegpt, **over))
    p = torchrun2([str(ROOT / "train.py"), *args(two, tiny_llama_dir, tiny_sharegpt, **over),
                   "target.tensor_parallel=2"], env)
    assert "(1 data-parallel x 2 tensor-parallel)" in p.stdout and "memory per rank before activations" in p.stdout
    a, b = final_weights(one), final_weights(two)
    assert a.keys() == b.keys()
    worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    print(f"{mode}: largest weight difference after 4 steps {worst:.2e}")
    assert worst < 1e-4, worst  # features differ by summation order (~1e-7); 4 AdamW steps carry it this far
    if mode == "offline":  # the shards themselves: same samples, same features
        sa, sb = load_file(str(one / "capture" / "shard_00000.safetensors")), load_file(
            str(two / "capture" / "shard_00000.safetensors"))
        assert sa.keys() == sb.keys() and all(torch.allclose(sa[k].float(), sb[k].float(), atol=1e-5) for k in sa)
    st = json.loads((two / "checkpoints" / "step_4" / "trainer_state.json").read_text())
    assert st["tensor_parallel"] == 2 and st["world"] == 2


def test_bad_tensor_parallel_sizes_are_named_errors(tiny_llama_dir, tmp_path) -> None:
    with pytest.raises(ValueError, match="target.tensor_parallel=4 needs 4 ranks to split the target over, the "
                                         "world has 2"):
        check_tensor_parallel(4, 2)
    with pytest.raises(ValueError, match="target.tensor_parallel=2 does not divide the world size 3"):
        check_tensor_parallel(2, 3)
    from drafthead.target import check_split

    with pytest.raises(ValueError, match="target.tensor_parallel=3 does not divide the target's 4 attention heads "
                                         "and 2 key/value heads"):
        check_split(str(tiny_llama_dir), 3)
    check_split(str(tiny_llama_dir), 2)
    base = [f"output_dir={tmp_path}", "target.tensor_parallel=2", "budget.minutes=null"]
    for extra, match in (([], None), (["budget.minutes=30"], "cannot be combined with budget.minutes"),
                         (["train.deepspeed=zero2"], "cannot be combined with train.deepspeed"),
                         (["data.regenerate.enabled=true"], "cannot be combined with data.regenerate.enabled"),
                         (["recipe=lora_smollm2"], "cannot be combined with drafter.family=lora"),
                         (["target.tensor_parallel=0"], "'target.tensor_parallel': 0 .must be >= 1")):
        if match is None:
            assert load_config(base + extra).target.tensor_parallel == 2
        else:
            with pytest.raises(ConfigError, match=match):
                load_config(base + extra)


def test_dry_run_prints_the_70b_memory_plan(tmp_path, capsys) -> None:
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
                tie_word_embeddings=False).save_pretrained(tmp_path / "llama70b")  # the geometry, no weights
    train.main(["recipe=eagle3_llama70b", f"target.name_or_path={tmp_path / 'llama70b'}", "train.dry_run=true",
                f"output_dir={tmp_path / 'run'}"])
    out = capsys.readouterr().out
    assert "70.6B params in bfloat16" in out and "tensor_parallel=8" in out
    assert "target 16.4 GiB (1/8 of 131.4)" in out and "draft 24.8 GiB" in out
    assert not (tmp_path / "run").exists()  # nothing loaded, nothing written

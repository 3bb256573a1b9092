"""One training step's math around the drafter: deterministic batches, the teacher's targets, the micro-step
under the run's precision, and the held-out evaluation (the same forward without the backward).

Drafter files stay free of all of this; `train.py` strings these pieces together top to bottom.
"""
from __future__ import annotations

import random
from typing import Any

import torch
from torch import nn

from drafthead.hardware import DTYPES, resolve_dtype
from drafthead.layers import softmax_floored
from drafthead.losses import Objective
from drafthead.target import Target, TargetHead
from drafthead.trainer.capture import collate, collate_features, features_for_batch
from drafthead.trainer.dist import Dist, all_reduce_data


# ---------------------------------------------------------------------------------------------
# batching: deterministic, length-grouped, resumable
def epoch_batches(lengths: list[int], batch_size: int, seed: int, epoch: int, world: int, rank: int,
                  batch_tokens: int | None = None) -> list[list[int]]:
    """Batches of sample indices for this rank and epoch. Same seed -> same batches (resume relies on it).

    Samples are shuffled, grouped in windows of 64 batches, sorted by length inside a window (less
    padding), cut into batches (by count, or packed up to `batch_tokens` padded tokens), and the batches
    are shuffled again. Every rank gets the same number of batches.
    """
    g = random.Random(seed * 1000003 + epoch)
    idx = list(range(len(lengths)))
    g.shuffle(idx)
    window = max(batch_size, 1) * 64
    batches: list[list[int]] = []
    for w in range(0, len(idx), window):
        chunk = sorted(idx[w: w + window], key=lambda i: lengths[i])
        if batch_tokens:
            cur: list[int] = []
            for i in chunk:
                if cur and (len(cur) + 1) * max(lengths[i], max(lengths[j] for j in cur)) > batch_tokens:
                    batches.append(cur)
                    cur = []
                cur.append(i)
            if cur:
                batches.append(cur)
        else:
            batches += [chunk[s: s + batch_size] for s in range(0, len(chunk), batch_size)]
    g.shuffle(batches)
    per_rank = len(batches) // world
    if per_rank == 0:
        raise ValueError(f"not enough training data: {len(lengths)} samples make {len(batches)} batches for "
                         f"{world} ranks")
    return batches[rank * per_rank: (rank + 1) * per_rank]


# ---------------------------------------------------------------------------------------------
# one step's math around the drafter
def teacher_targets(head: TargetHead, last: torch.Tensor, loss_mask: torch.Tensor,
                    argmax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher distribution over the draft vocab [B, T, N] fp32 (the full vocab for a head without draft
    ids; softmax taken once here, not once per TTT step) and the full-vocab argmax [B, T] at positions j
    whose next token is supervised (loss_mask[j+1] == 1); elsewhere zeros / -1. `argmax` [B, T]: the one
    the capture stored, so the head only computes the N draft-vocab logits."""
    B, T, _ = last.shape
    need = torch.zeros(B, T, dtype=torch.bool, device=last.device)
    need[:, :-1] = loss_mask[:, 1:].bool()
    b, t = need.nonzero(as_tuple=True)
    stored = argmax is not None and not head.full  # a full-vocab head gets the argmax from its own logits
    logits, top = head(last[b, t], argmax=not stored)
    probs = torch.zeros(B, T, logits.shape[-1], dtype=torch.float32, device=last.device)
    probs[b, t] = softmax_floored(logits)  # no denormal tail: the loss reads these rows twice a TTT step
    if stored:
        return probs, torch.where(need, argmax.to(last.device), -1)
    tgt = torch.full((B, T), -1, dtype=torch.long, device=last.device)
    tgt[b, t] = top
    return probs, tgt


def make_batch(items: list[Any], target: Target, layer_ids: list[int], feat_dtype: torch.dtype, offline: bool,
               device: torch.device, argmax: bool = False) -> dict[str, torch.Tensor]:
    """Collate samples (online: token lists, capture now, with the target argmax when `argmax`; offline:
    stored features, with the argmax when the capture stored it)."""
    pad = target.tokenizer.pad_token_id if target.tokenizer is not None else 0
    if offline:
        batch = collate_features(items, pad)
    else:
        batch = features_for_batch(target, collate(items, pad), layer_ids, feat_dtype, argmax)
    return {k: v.to(device) for k, v in batch.items()}


def objective(train: Any) -> Objective | None:
    """`train.loss` (+ its knobs) as the training forward's `objective`; None = the family's own loss."""
    return None if train.loss is None else Objective(train.loss, train.lk_eta, train.lk_kl_scale)


def drafter_inputs(batch: dict[str, torch.Tensor], head: TargetHead, objective: Objective | None = None
                   ) -> dict[str, Any]:
    """The training forward's arguments (the same for every family; each reads the features it needs).
    `objective` goes in only when `train.loss` names one: families without `losses` never receive it."""
    teacher, tgt = teacher_targets(head, batch["last"], batch["loss_mask"], batch.get("argmax"))
    args: dict[str, Any] = {"input_ids": batch["input_ids"], "aux_hidden": batch["aux"], "last_hidden": batch["last"],
                            "teacher_probs": teacher, "target_argmax": tgt, "loss_mask": batch["loss_mask"]}
    if objective is not None:
        args["objective"] = objective
    return args


def forward_backward(engine: Any, batch: dict[str, torch.Tensor], head: TargetHead, dtype: str,
                     device: torch.device, objective: Objective | None = None) -> dict[str, torch.Tensor]:
    """One micro-step: teacher targets, drafter forward under the run's precision, backward."""
    with autocast(dtype, device, engine.kind):
        out = engine.forward(**drafter_inputs(batch, head, objective))
    engine.backward(out["loss"])
    return out


def autocast(dtype: str, device: torch.device, engine_kind: str):
    """Mixed precision for the drafter forward: bf16 autocast where bf16 is native (`auto`: CUDA, AMX /
    AVX512-BF16 CPUs), fp32 elsewhere. Master weights stay fp32. DeepSpeed on GPU handles bf16 itself."""
    if dtype not in DTYPES:
        raise ValueError(f"train.dtype={dtype!r}: use auto, bfloat16 or float32")
    enabled = resolve_dtype(dtype, device, "train") == torch.bfloat16 and not (
        engine_kind == "deepspeed" and device.type == "cuda")
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


# ---------------------------------------------------------------------------------------------
# evaluation: TTT accuracies on held-out data, simulated acceptance length
def simulated_tau(acc: list[float], k: int) -> float:
    """1 + sum_{i<k} prod_{j<=i} acc_j: the accepted length (bonus token included) a chain of k drafts reaches when
    depth j is right with probability acc_j (the held-out accuracies)."""
    tau, prod = 1.0, 1.0
    for a in acc[:k]:
        prod *= a
        tau += prod
    return tau



@torch.no_grad()
def evaluate(model: nn.Module, batches: list[dict[str, torch.Tensor]], head: TargetHead, d: Dist,
             objective: Objective | None = None) -> dict[str, float]:
    """Held-out acc_k, loss (under the run's objective) and the simulated accept length, plus every ratio the
    drafter returns (`Drafter`: `ratios`, summed over batches and ranks before dividing; alpha_k among them)."""
    was = model.training
    model.eval()
    correct = count = loss = alpha = None
    ratios: dict[str, torch.Tensor] = {}  # name -> [2, ...] numerator, denominator
    nb = 0
    for batch in batches:
        out = model(**drafter_inputs(batch, head, objective))
        correct = out["correct"] if correct is None else correct + out["correct"]
        count = out["count"] if count is None else count + out["count"]
        if "alpha" in out:
            alpha = out["alpha"] if alpha is None else alpha + out["alpha"]
        loss = out["loss"].detach() if loss is None else loss + out["loss"].detach()
        for name, (num, den) in out.get("ratios", {}).items():
            got = torch.stack([num.detach(), den.detach()]).double().cpu()
            ratios[name] = got if name not in ratios else ratios[name] + got
        nb += 1
    model.train(was)
    if correct is None:
        return {}
    correct, count = all_reduce_data(correct, d), all_reduce_data(count, d)
    acc = (correct / count.clamp(min=1)).tolist()
    res = {f"eval/acc_{i}": a for i, a in enumerate(acc)}
    if alpha is not None:  # the expected acceptance under sampling, beside the greedy acc_k
        res.update({f"eval/alpha_{i}": a for i, a in enumerate((all_reduce_data(alpha, d) / count.clamp(min=1))
                                                                 .tolist())})
    res["eval/loss"] = float(all_reduce_data(loss, d)) / (nb * d.dp)
    res["eval/sim_accept_len"] = simulated_tau(acc, len(acc))
    for name, got in ratios.items():
        num, den = all_reduce_data(got, d)
        if num.dim() == 0:  # a scalar with nothing counted is left out, not reported as 0
            if den > 0:
                res[f"eval/{name}"] = float(num / den)
        else:
            res.update({f"eval/{name}_{i}": n / c if c > 0 else 0.0 for i, (n, c) in enumerate(zip(num.tolist(),
                                                                                             den.tolist()))})
    return res

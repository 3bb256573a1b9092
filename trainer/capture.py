"""Target hidden-state capture: one function for both modes.

- Online: `features_for_batch` runs inside the training step.
- Offline: `capture_offline` writes sharded safetensors + `manifest.json`; `ShardedFeatures` reads them.
  Both go through `features_for_batch`, so offline and online give identical features (tested).

Shard `shard_{k:05d}.safetensors` holds samples [k*S, (k+1)*S) of the (deterministic) sample list,
flattened over tokens: `input_ids` int32 [Ntok], `loss_mask` uint8 [Ntok], `aux` [Ntok, L*H],
`last` [Ntok, H] (capture dtype), `offsets` int64 [n+1], and with `argmax=True` (drafters with a reduced
vocabulary) `argmax` int32 [Ntok]: the target's full-vocabulary argmax at positions whose next token is
supervised, -1 elsewhere. Teacher logits are not stored: they are recomputed from `last` with the frozen
target head over the draft vocabulary only; the stored argmax spares each training pass the full-vocabulary
matmul, which was ~15% of a default-recipe step. Shards are written atomically and the manifest
(with sha256 and byte counts) is rewritten after each shard, so a killed capture resumes at the first
missing shard without duplicating or losing samples.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import signal
import time
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from drafthead.io import atomic_write_json, clean_stale_tmp, writing
from drafthead.target import Target, capture, full_argmax, lm_head_weight
from drafthead.trainer.dist import Dist, tp_broadcast
from drafthead.trainer.interrupt import GracefulStop, Interrupted, signal_name

MANIFEST = "manifest.json"
# On SIGINT/SIGTERM a shard in flight is finished only if it will end within this many seconds (estimated from
# its progress), else dropped: schedulers allow a grace of ~30 s before SIGKILL, and a default shard of 256
# conversations takes minutes on a small CPU.
FINISH_SHARD_WITHIN_S = 20.0
FORMAT = "drafthead-capture-2"  # 2: optional stored target argmax


def collate(samples: list[dict], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad token lists. -> input_ids, loss_mask, attention_mask [B, T]."""
    T = max(len(s["input_ids"]) for s in samples)
    B = len(samples)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.long)
    attn = torch.zeros(B, T, dtype=torch.long)
    for b, s in enumerate(samples):
        n = len(s["input_ids"])
        ids[b, :n] = torch.as_tensor(s["input_ids"])
        mask[b, :n] = torch.as_tensor(s["loss_mask"])
        attn[b, :n] = 1
    return {"input_ids": ids, "loss_mask": mask, "attention_mask": attn}


def features_for_batch(target: Target, batch: dict[str, torch.Tensor], layer_ids: list[int],
                       dtype: torch.dtype, argmax: bool = False) -> dict[str, torch.Tensor]:
    """Add `aux` [B, T, L*H] and `last` [B, T, H] (in `dtype`) to a collated batch, and with `argmax` the
    target's full-vocabulary argmax [B, T] (long) where the next token is supervised (-1 elsewhere),
    computed from `last` as stored, so online and offline batches agree."""
    dev = next(target.model.parameters()).device
    aux, last = capture(target.model, batch["input_ids"].to(dev), batch["attention_mask"].to(dev), layer_ids,
                        dtype=dtype)
    out = dict(batch)
    out["aux"] = aux if aux is not None else last.new_zeros(*last.shape[:-1], 0)  # no aux layers: [B, T, 0]
    out["last"] = last
    if argmax:
        need = torch.zeros_like(batch["loss_mask"], dtype=torch.bool, device=dev)  # [B, T]
        need[:, :-1] = batch["loss_mask"][:, 1:].to(dev).bool()
        top = torch.full(need.shape, -1, dtype=torch.long, device=dev)  # [B, T]
        top[need] = full_argmax(lm_head_weight(target.model), last[need])
        out["argmax"] = top
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


class CaptureError(ValueError):
    """A capture folder that does not match the run, or shards that are missing, cut short or changed."""


def read_manifest(folder: str | Path) -> dict | None:
    p = Path(folder) / MANIFEST
    if not p.exists():
        return None
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise CaptureError(f"{p}: manifest is not valid JSON ({e})") from None


def verify_shards(folder: str | Path, manifest: dict, checksum: bool = True) -> None:
    """Raise CaptureError naming the first missing, truncated or corrupted shard."""
    folder = Path(folder)
    for sh in manifest["shards"]:
        p = folder / sh["file"]
        if not p.exists():
            raise CaptureError(f"capture shard missing: {p}")
        size = p.stat().st_size
        if size != sh["bytes"]:
            raise CaptureError(f"capture shard truncated or changed: {p} has {size} bytes, manifest says {sh['bytes']}")
        if checksum and _sha256(p) != sh["sha256"]:
            raise CaptureError(f"capture shard corrupted: {p} (sha256 mismatch)")


def capture_offline(target: Target, samples: list[dict], out_dir: str | Path, layer_ids: list[int],
                    dtype: torch.dtype = torch.bfloat16, shard_samples: int = 256, batch_tokens: int = 4096,
                    progress: bool = True, argmax: bool = False,
                    after_shard: Callable[[], Any] | None = None, stop: GracefulStop | None = None,
                    d: Dist | None = None) -> dict:
    """Capture features for `samples` into `out_dir`, resuming where a previous run stopped. `argmax`:
    also store the target's full-vocabulary argmax (see the module docstring). `after_shard` runs once each
    shard is on disk (train.py hands the freed heap back there: batches of varying shapes fragment it).
    `stop`: a SIGINT/SIGTERM lets the shard in flight finish and land, then raises `Interrupted`.
    `d` with a split target (tensor parallel): every rank of the tp group calls this and runs the same target
    batches; the group's first rank decides (shards to do, a signal's outcome) and alone writes."""
    tp = d is not None and d.tp > 1
    if tp and d.tp_rank != 0:
        return _follow_capture(target, samples, layer_ids, dtype, shard_samples, batch_tokens, argmax, stop, d)
    out = Path(out_dir)
    try:
        with writing(out):
            out.mkdir(parents=True, exist_ok=True)
        clean_stale_tmp(out)
        manifest, todo = _plan_capture(target, samples, out, layer_ids, dtype, shard_samples, argmax)
    except (CaptureError, OSError) as e:
        if tp:
            tp_broadcast(("error", f"{type(e).__name__}: {e}"), d)
        raise
    if tp:
        tp_broadcast(("todo", todo), d)
    return _lead_capture(target, samples, out, manifest, todo, layer_ids, dtype, shard_samples, batch_tokens,
                         progress, argmax, after_shard, stop, d if tp else None)


def _plan_capture(target: Target, samples: list[dict], out: Path, layer_ids: list[int], dtype: torch.dtype,
                  shard_samples: int, argmax: bool) -> tuple[dict, list[int]]:
    """The manifest (checked against this run when one exists) and the first sample of each shard to do."""
    spec = {"format": FORMAT, "target": target.info(), "layer_ids": list(layer_ids), "dtype": str(dtype).split(".")[-1],
            "hidden_size": target.hidden_size, "num_samples": len(samples), "shard_samples": shard_samples,
            "sample_ids": _ids_digest(samples), "argmax": bool(argmax)}
    manifest = read_manifest(out)
    if manifest is not None:
        if "fingerprint" not in manifest.get("target", {}):  # captured before targets had fingerprints
            spec["target"] = {k: v for k, v in spec["target"].items() if k != "fingerprint"}
        for k in ("format", "target", "layer_ids", "dtype", "hidden_size", "num_samples", "shard_samples",
                  "sample_ids", "argmax"):
            if manifest.get(k) != spec[k]:
                raise CaptureError(f"{out}: existing capture was made with {k}={manifest.get(k)!r}, this run has "
                                   f"{spec[k]!r}; use another capture.dir or delete it")
        verify_shards(out, manifest, checksum=False)
    else:
        manifest = {**spec, "shards": [], "complete": False}
    done = {sh["first_sample"] for sh in manifest["shards"]}
    return manifest, [s for s in range(0, len(samples), shard_samples) if s not in done]


def _lead_capture(target: Target, samples: list[dict], out: Path, manifest: dict, todo: list[int],
                  layer_ids: list[int], dtype: torch.dtype, shard_samples: int, batch_tokens: int, progress: bool,
                  argmax: bool, after_shard: Callable[[], Any] | None, stop: GracefulStop | None,
                  d: Dist | None) -> dict:
    """Capture and write the shards in `todo` (with `d`: tell the tp group each decision it must share)."""
    share = (lambda x: tp_broadcast(x, d)) if d is not None else (lambda x: x)
    pad_id = target.tokenizer.pad_token_id if target.tokenizer is not None else 0
    n_tok_total = sum(len(s["input_ids"]) for s in samples)
    bar = tqdm(total=n_tok_total, unit="tok", desc="capture", disable=not progress, dynamic_ncols=True)
    bar.update(sum(sh["num_tokens"] for sh in manifest["shards"]))
    n_shards = -(-len(samples) // shard_samples)
    for first in todo:
        t_shard = time.perf_counter()

        def give_up(frac: float) -> bool:  # a signal came: finish the shard only if it ends within the grace
            if stop is None or stop.requested is None:
                return share(False)
            return share((time.perf_counter() - t_shard) * (1 - frac) / max(frac, 1e-9) > FINISH_SHARD_WITHIN_S)

        grace = f"finishing the shard in flight if it ends within {FINISH_SHARD_WITHIN_S:.0f} s, else dropping it"
        with stop.deferred(grace) if stop is not None else contextlib.nullcontext():
            chunk = samples[first: first + shard_samples]
            tensors = _capture_chunk(target, chunk, layer_ids, dtype, batch_tokens, pad_id, bar, argmax, give_up)
            if tensors is None:
                bar.close()
                raise Interrupted(stop.requested, f"capture stopped by {signal_name(stop.requested)}: the shard "
                                  f"in flight would have taken more than {FINISH_SHARD_WITHIN_S:.0f} s to finish and "
                                  f"was dropped; {len(manifest['shards'])} of {n_shards} shards in {out}; the same "
                                  f"command resumes at the next shard")
            name = f"shard_{first // shard_samples:05d}.safetensors"
            tmp = out / f".{name}.tmp-w"
            with writing(out / name):
                save_file(tensors, str(tmp), metadata={"ids": json.dumps([s["id"] for s in chunk])})
                tmp.replace(out / name)
            p = out / name
            manifest["shards"].append({"file": name, "first_sample": first, "num_samples": len(chunk),
                                       "num_tokens": int(tensors["input_ids"].numel()), "bytes": p.stat().st_size,
                                       "sha256": _sha256(p)})
            manifest["shards"].sort(key=lambda s: s["first_sample"])
            atomic_write_json(out / MANIFEST, manifest)
            del tensors
        if share(stop is not None and stop.requested is not None):
            bar.close()
            raise Interrupted(stop.requested, f"capture stopped by {signal_name(stop.requested)} with "
                              f"{len(manifest['shards'])} of {n_shards} shards in {out}; "
                              f"the same command resumes at the next shard")
        if after_shard is not None:
            after_shard()
    bar.close()
    manifest["complete"] = True
    manifest["num_tokens"] = sum(sh["num_tokens"] for sh in manifest["shards"])
    atomic_write_json(out / MANIFEST, manifest)
    return manifest


def _follow_capture(target: Target, samples: list[dict], layer_ids: list[int], dtype: torch.dtype,
                    shard_samples: int, batch_tokens: int, argmax: bool, stop: GracefulStop | None, d: Dist) -> dict:
    """A tp group's other ranks: the same target batches as the first rank (a split forward is a collective),
    its decisions received, nothing written."""
    kind, todo = tp_broadcast(None, d)
    if kind == "error":
        raise CaptureError(f"the capture's first rank stopped: {todo}")
    pad_id = target.tokenizer.pad_token_id if target.tokenizer is not None else 0
    bar = tqdm(disable=True)
    for first in todo:
        chunk = samples[first: first + shard_samples]
        with stop.deferred("following the capture's first rank") if stop is not None else contextlib.nullcontext():
            got = _capture_chunk(target, chunk, layer_ids, dtype, batch_tokens, pad_id, bar, argmax,
                                 lambda frac: tp_broadcast(None, d))
        if got is None or tp_broadcast(None, d):
            raise Interrupted(stop.requested if stop is not None and stop.requested else signal.SIGTERM,
                              "capture stopped on the first rank's signal")
        del got
    return {"shards": [], "complete": True, "follower": True}


def _ids_digest(samples: list[dict]) -> str:
    h = hashlib.sha256()
    for s in samples:
        h.update(str(s["id"]).encode() + b"\0" + str(len(s["input_ids"])).encode() + b"\n")
    return h.hexdigest()[:16]


def _capture_chunk(target: Target, chunk: list[dict], layer_ids: list[int], dtype: torch.dtype,
                   batch_tokens: int, pad_id: int, bar: tqdm, argmax: bool = False,
                   give_up: Callable[[float], bool] | None = None) -> dict[str, torch.Tensor] | None:
    """One shard's tensors; None when `give_up(share of its tokens done)`, asked after each target batch, says
    to drop it."""
    order = sorted(range(len(chunk)), key=lambda i: len(chunk[i]["input_ids"]))  # less padding
    per_sample: dict[int, tuple[torch.Tensor, ...]] = {}
    total, done = sum(len(s["input_ids"]) for s in chunk), 0
    i = 0
    while i < len(order):
        if done and give_up is not None and give_up(done / total):
            return None
        j, longest = i, 0
        while j < len(order) and max(longest, len(chunk[order[j]]["input_ids"])) * (j - i + 1) <= max(
                batch_tokens, len(chunk[order[i]]["input_ids"])):
            longest = max(longest, len(chunk[order[j]]["input_ids"]))
            j += 1
        idx = order[i:j]
        batch = features_for_batch(target, collate([chunk[k] for k in idx], pad_id), layer_ids, dtype, argmax)
        for b, k in enumerate(idx):
            n = len(chunk[k]["input_ids"])
            per_sample[k] = (batch["aux"][b, :n].cpu(), batch["last"][b, :n].cpu()) + (
                (batch["argmax"][b, :n].to(torch.int32).cpu(),) if argmax else ())
            bar.update(n)
            done += n
        i = j
    lens = [len(s["input_ids"]) for s in chunk]
    offsets = torch.zeros(len(chunk) + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(torch.tensor(lens), 0)
    out = {
        "input_ids": torch.cat([torch.as_tensor(s["input_ids"], dtype=torch.int32) for s in chunk]),
        "loss_mask": torch.cat([torch.as_tensor(s["loss_mask"], dtype=torch.uint8) for s in chunk]),
        "aux": torch.cat([per_sample[k][0] for k in range(len(chunk))]).contiguous(),
        "last": torch.cat([per_sample[k][1] for k in range(len(chunk))]).contiguous(),
        "offsets": offsets,
    }
    if argmax:
        out["argmax"] = torch.cat([per_sample[k][2] for k in range(len(chunk))])
    return out


class ShardedFeatures:
    """Random access to captured samples: `feats[i]` -> dict(input_ids, loss_mask, aux, last[, argmax])."""

    def __init__(self, folder: str | Path, checksum: bool = True) -> None:
        self.folder = Path(folder)
        m = read_manifest(self.folder)
        if m is None:
            raise CaptureError(f"{self.folder}: no {MANIFEST}; run `drafthead capture` first")
        if not m.get("complete"):
            raise CaptureError(f"{self.folder}: capture is incomplete ({len(m['shards'])} shards); rerun "
                               f"`drafthead capture` with the same recipe to resume it")
        if m.get("format") != FORMAT:
            raise CaptureError(f"{self.folder}: capture format {m.get('format')!r}, this drafthead reads {FORMAT!r}; "
                               f"delete it (or use another capture.dir) and capture again")
        verify_shards(self.folder, m, checksum=checksum)
        self.manifest = m
        self.keys = ("input_ids", "loss_mask", "aux", "last") + (("argmax",) if m.get("argmax") else ())
        self.layer_ids = m["layer_ids"]
        self._handles: dict[str, Any] = {}
        self._index: list[tuple[str, int, int]] = []  # (file, start, end) per sample
        self.lengths: list[int] = []
        for sh in m["shards"]:
            with safe_open(str(self.folder / sh["file"]), "pt") as f:
                offsets = f.get_tensor("offsets").tolist()
            for a, b in zip(offsets[:-1], offsets[1:]):
                self._index.append((sh["file"], a, b))
                self.lengths.append(b - a)

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        file, a, b = self._index[i]
        if file not in self._handles:
            self._handles[file] = safe_open(str(self.folder / file), "pt")
        f = self._handles[file]
        return {k: f.get_slice(k)[a:b] for k in self.keys}


def collate_features(items: list[dict[str, torch.Tensor]], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad captured samples into a batch with aux/last."""
    batch = collate([{"input_ids": it["input_ids"].long(), "loss_mask": it["loss_mask"].long()} for it in items],
                    pad_id)
    B, T = batch["input_ids"].shape
    aux = items[0]["aux"].new_zeros(B, T, items[0]["aux"].shape[-1])
    last = items[0]["last"].new_zeros(B, T, items[0]["last"].shape[-1])
    top = torch.full((B, T), -1, dtype=torch.long) if "argmax" in items[0] else None  # stored target argmax
    for b, it in enumerate(items):
        n = it["input_ids"].shape[0]
        aux[b, :n], last[b, :n] = it["aux"], it["last"]
        if top is not None:
            top[b, :n] = it["argmax"].long()
    batch["aux"], batch["last"] = aux, last
    if top is not None:
        batch["argmax"] = top
    return batch

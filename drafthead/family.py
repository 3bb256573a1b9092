"""What the shared code (trainer, runtime, eval, export) asks of a drafter family, and nothing more.

A family is one file, `drafthead/<name>.py`, ending in `FAMILY = Family(...)`, plus one line in
`drafthead.registry.FAMILIES`. The shared code never names a family: it reads the `Family` record and
talks to the drafter module through the `Drafter` protocol below. docs/adding_a_family.md walks through
both; tests/test_families.py runs every registered family through the same checks.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

if TYPE_CHECKING:  # the runtime's contract; family.py stays free of the runtime at run time
    from drafthead.runtime.contract import DraftMode, DraftState


@dataclass(frozen=True)
class Family:
    name: str
    options: type  # dataclass: the recipe section `drafter.<name>.*`; its `validate()` raises ValueError
    config: type  # dataclass saved as `final/config.json` "draft" (fields include `num_draft_tokens`)
    model: type  # nn.Module built from `config`; speaks the `Drafter` protocol
    # (target HF config, options, capture.layer_ids or None, draft vocab size or None) -> config
    build: Callable[[Any, Any, list[int] | None, int | None], Any]
    # (drafter, target, options) -> a few words on what was taken from the target; d2t/t2d are set before
    init: Callable[[nn.Module, Any, Any], str]
    # predicts over a draft vocabulary (d2t / t2d from the loss-masked training tokens, sized by
    # `options.draft_vocab_size`): the capture then stores the target's full-vocab argmax and the teacher
    # head computes the draft rows only. False = the full target vocabulary; a function of the options where the
    # recipe chooses (DFlash: `draft_vocab_size` set or null). Read it through `predicts_draft_vocab`.
    reduced_vocab: bool | Callable[[Any], bool]
    # export format -> "module:function" (imported when used, so a family file does not import exporters);
    # each function is `export(draft: LoadedDraft, out, target=None, **options) -> Path`, its keyword
    # options are what `drafthead export` accepts for that format
    exporters: dict[str, str] = field(default_factory=dict)
    # export format -> "module:function" reading a written export back into the draft's own tensor names
    # (`read_back(path) -> dict[str, Tensor]`): the contract test's round trip, and a user's check
    readers: dict[str, str] = field(default_factory=dict)
    # export formats with no reader, each with why and what proves it instead (a format that merges the
    # draft into a standalone model cannot be read back into the draft's own tensors)
    no_reader: dict[str, str] = field(default_factory=dict)
    # export format -> vLLM's speculative `method` for a draft exported in it: the layouts vLLM serves this family
    # from (drafthead eval engine=vllm exports the first; tests/test_vllm.py runs every one in vLLM's CPU build)
    vllm: dict[str, str] = field(default_factory=dict)
    # keys beside `method` in vLLM's speculative_config for this family's drafts (P-EAGLE: parallel_drafting, which
    # vLLM does not read from the draft's own config.json)
    vllm_config: dict[str, Any] = field(default_factory=dict)
    # export options `engine=vllm` passes when it exports for vLLM (MTP: `layout=served`, a target with no MTP
    # convention written in one vLLM serves)
    vllm_export: dict[str, Any] = field(default_factory=dict)
    # the export is the target with the draft inside it (MTP layers): vLLM serves the export itself as the model,
    # with `method` and no draft model
    vllm_in_target: bool = False
    # vLLM layouts of this family its CPU build refuses, each with vLLM's own words (what a user would meet)
    vllm_refused: dict[str, str] = field(default_factory=dict)
    # the `train.loss` values its training forward takes as `objective` (drafthead/losses.py LOSSES); () = the
    # family trains its own loss only and `train.loss` must stay null
    losses: tuple[str, ...] = ()
    # "draft" keys renamed since a draft directory was written: old name -> new name (read on load)
    renamed_keys: dict[str, str] = field(default_factory=dict)
    # (options, the drafter's built config) -> a one-line description for the training log
    describe: Callable[[Any, Any], str] | None = None
    # a held-out eval's results ({"eval/...": value}) -> the training log's words for them after acc_0 (default:
    # the simulated accept length)
    eval_summary: Callable[[dict[str, float]], str] | None = None

    def predicts_draft_vocab(self, options: Any) -> bool:
        """Whether a draft built from these options predicts over a draft vocabulary (`reduced_vocab`)."""
        return self.reduced_vocab(options) if callable(self.reduced_vocab) else self.reduced_vocab


class Drafter(Protocol):
    """The drafter module as the shared code sees it (attributes and methods every family provides).

    Training (trainer/):
        forward(input_ids [B, T], aux_hidden [B, T, F], last_hidden [B, T, H], teacher_probs [B, T, N],
                target_argmax [B, T], loss_mask [B, T][, objective]) -> {"loss", "step_loss", "correct", "count"}
        (the last three [num_draft_tokens]: per draft depth). A family reads the features it needs. A family
        with `losses` takes `objective` (drafthead/losses.py) and, out of training, returns "alpha" too: the
        expected acceptance sum min(p, q) summed per depth over the rows `count` counts. Metrics of
        its own go in `ratios`, {name: (numerator, denominator)}, scalars or vectors summed over held-out batches
        and ranks; the held-out eval reports `eval/<name>` = their ratio (a vector: `eval/<name>_<i>`), naming
        none itself. Block drafters report `block_accept_len` and `cond_acc`, DSpark `confidence_error`.
        `schedule(step, total_steps)`: called before each optimizer step's forward with where the run is (the
        planned total moves with the time budget); a loss that changes over training reads it (Domino's
        curriculum), the others ignore it. Held-out evals run at the step's setting.
    Capture: `capture_layer_ids()` (inputs of these target decoder layers, `[]` = none); the target's last
        hidden state (after its final norm) is always captured, the teacher distribution comes from it.
    Runtime (drafthead/runtime):
        `features` "aux" (the captured layers) or "last" (the last hidden state): what a draft prefix entry
        reads; `draft_modes` its table of proposal shapes, name -> `runtime.draft.DraftMode` (the first is its
        default; CHAIN and TREE are shared, a family adds its own, as DFlash adds BLOCK); `check_target(tcfg)`
        the mismatches with a target, as messages; `draft_state(batch, capacity, device)` a fresh drafting
        state: a `runtime.contract.DraftState` (bind / select / extend) that also follows each of its modes'
        protocol (`DraftMode.state`: chain, tree, or the family's own, as DFlash's block). `bind(target,
        session)` hands it read-only views of the target's layers and of the batch (`contract.TargetLayers`,
        `contract.SessionView`): a drafter that runs the target's own layers and cache keeps them, the others
        ignore them. `runtime_module()` what the runtime drafts with: a module of the family's own (a LoRA
        self-draft's merged adapters), or None for a copy of the drafter with its linears packed for the CPU
        kernels.
    Data: `check_data(samples) -> list[str]` problems with the training samples (dicts with input_ids),
        checked when the draft is built (e.g. a DFlash mask token that occurs in the data); [] when none.
    Saving: every tensor of `state_dict()` except `registry.NOT_SAVED` and `target_tensors()` (the target's
        embedding, head and layers a family reads through: taken back from the target on load).
        `reads_target_head`: the drafter holds a frozen `target_lm_head` (filled from the target's head on
        load: the rows `head_rows()` names, its draft vocabulary's target ids, or every row for None);
        `shares_target_layers`: it is built on the target's own layers, so loading needs the target model and
        calls `attach_target(target_model)`, which only such families define.
    Every drafter class has all of these, most from `OwnLayers` below (tests/test_families.py checks it): the
    shared code never probes.
    """

    family: str
    config: Any
    features: str
    draft_modes: dict[str, DraftMode]
    reads_target_head: bool
    shares_target_layers: bool
    embed_tokens: nn.Embedding

    def capture_layer_ids(self) -> list[int]: ...

    def check_target(self, tcfg: Any) -> list[str]: ...

    def check_data(self, samples: list[dict]) -> list[str]: ...

    def target_tensors(self) -> Iterable[str]: ...

    def runtime_module(self) -> nn.Module | None: ...

    def draft_state(self, batch: int, capacity: int, device: torch.device) -> DraftState: ...

    def schedule(self, step: int, total_steps: int) -> None: ...

    def head_rows(self) -> torch.Tensor | None: ...


class OwnLayers:
    """The `Drafter` hooks' answers for a drafter that runs only its own layers and holds nothing of the target
    beyond `registry.NOT_SAVED`, in one place: a family's class lists it before nn.Module and overrides what
    differs (DFlash reads the target's head and checks its mask token; LoRA shares the target's layers)."""

    reads_target_head = False
    shares_target_layers = False

    def check_data(self, samples: list[dict]) -> list[str]:
        return []  # any token ids train

    def target_tensors(self) -> tuple[str, ...]:
        return ()  # the target's embedding (and head, where read) are registry.NOT_SAVED

    def runtime_module(self) -> nn.Module | None:
        return None  # the runtime drafts with a copy whose linears are packed for the CPU kernels

    def schedule(self, step: int, total_steps: int) -> None:
        """Nothing moves with training's progress (a loss that does overrides this)."""

    def head_rows(self) -> torch.Tensor | None:
        return None  # a `target_lm_head`, where the family reads one, holds every row of the target's head


def resolve(spec: str) -> Callable[..., Any]:
    """"module:function" -> the function (exporters are declared by name so nothing is imported early)."""
    import importlib

    module, func = spec.split(":")
    return getattr(importlib.import_module(module), func)

"""P-EAGLE (arXiv 2602.01469): an EAGLE3 draft that proposes all K tokens of a round in one forward.

Why: a chain round of EAGLE3 pays one draft forward per drafted token; on a CPU, where a small target's step
costs only a few draft forwards, that is what keeps a trained draft level with the free n-gram drafter. P-EAGLE
appends K-1 mask entries behind the last real entry: each holds a reserved token (`mask_token_id`) and a
learnable stand-in for the target features it cannot have (`mask_hidden`, the width of the captured features),
sits at the next position, and sees the real prefix and the mask entries before it. So the entry of depth d
predicts token d+1 without knowing drafts 1..d, and one forward gives all K.

Training is EAGLE3's training-time test with step i >= 1 fed (mask token, fc(mask_hidden)) instead of the
previous step's token and output: TTT's attention (step-0 keys causal, then each row's own earlier steps) is
P-EAGLE's mask (an element sees the real elements up to its anchor and its own chain). The references subsample
deeper chains (COD: depth d keeps ~0.7^d of them); here every chain trains and `step_decay` gives depth i the
weight 0.8^i. The files are EAGLE3's plus `mask_hidden` and `mask_token_id`: vLLM serves them as eagle3 with
`parallel_drafting` (docs/peagle.md).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from drafthead import eagle3
from drafthead.dflash import mask_token_in_data, mask_token_problem
from drafthead.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Options
from drafthead.family import Family
from drafthead.layers import take_rows
from drafthead.losses import LOSSES
from drafthead.runtime.contract import ChainDraft, SpecConfig, inference
from drafthead.runtime.draft import CHAIN, DraftRunner
from drafthead.runtime.sampling import greedy, probs, sample


@dataclass
class PeagleOptions(Eagle3Options):
    """The recipe section `drafter.peagle.*` (EAGLE3's options, and the mask token)."""

    num_draft_tokens: int = 4  # K: tokens one draft forward proposes (1 real entry + K-1 mask entries); serving <= K
    mask_token_id: int | None = None  # the mask entries' token: a row of the target's embedding the data never holds

    def validate(self) -> None:
        super().validate()
        if self.mask_token_id is None:
            raise ValueError("mask_token_id: required (a token id of the target's vocabulary that never occurs in "
                             "the data, e.g. an unused special token)")


@dataclass
class PeagleConfig(Eagle3Config):
    mask_token_id: int = 0  # the token of the K-1 mask entries (speculators / vLLM `mask_token_id`)


def check_depth(spec: SpecConfig, drafter: Any) -> str | None:
    """A round drafts at most K tokens: entries past the trained mask depths have never been trained."""
    k = drafter.config.num_draft_tokens
    if spec.num_speculative_tokens > k:
        return (f"num_speculative_tokens={spec.num_speculative_tokens}: this P-EAGLE draft proposes at most {k} tokens "
                f"a round (the depths it was trained with, drafter.peagle.num_draft_tokens); use "
                f"num_speculative_tokens <= {k}")
    return None


PARALLEL = replace(CHAIN, check=check_depth)  # a chain whose K tokens come from one forward (ParallelRunner)


class PeagleDrafter(Eagle3Drafter):
    """EAGLE3's layer, fc and head, plus `mask_hidden` [1, 1, A*Ht] (the speculators / vLLM shape)."""

    family = "peagle"
    draft_modes = {"chain": PARALLEL}
    config: PeagleConfig

    def __init__(self, c: PeagleConfig) -> None:
        super().__init__(c)
        self.mask_hidden = nn.Parameter(torch.randn(1, 1, len(c.aux_layer_ids) * c.target_hidden_size))

    def check_target(self, tcfg: Any) -> list[str]:
        problems = super().check_target(tcfg)
        if (bad := mask_token_problem(self.config.mask_token_id, tcfg.vocab_size)) is not None:
            problems.append(bad)
        return problems

    def check_data(self, samples: list[dict]) -> list[str]:
        """The mask token must never occur in the data: a real entry holding it would look like a mask entry."""
        return mask_token_in_data(self.family, self.config.mask_token_id, samples)

    def draft_state(self, batch: int, capacity: int, device: torch.device) -> ParallelRunner:
        return ParallelRunner(self, batch, capacity, device)

    def mask_feature(self) -> torch.Tensor:
        """fc(mask_hidden) [H]: the hidden input of every mask entry (fc_norm first, as for real features)."""
        return self.fuse(self.mask_hidden)[0, 0]

    def step_inputs(self, i: int, input_ids: torch.Tensor, hidden: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 0 as EAGLE3; step i >= 1 is the mask entry of depth i at every row: the mask token's embedding
        beside fc(mask_hidden) [B, T, H] each (it knows neither the drafts before it nor their features)."""
        if i == 0:
            return super().step_inputs(i, input_ids, hidden)
        B, T = input_ids.shape
        emb = self.embed_tokens.weight[self.config.mask_token_id].to(hidden.dtype)  # [H]
        return emb.expand(B, T, -1), self.mask_feature().to(hidden.dtype).expand(B, T, -1)


class ParallelRunner(DraftRunner):
    """Drafting state of a P-EAGLE draft: every `extend` runs the new prefix entries and K-1 mask entries behind
    each request's last one in the same draft forward, so a round's K drafts are ready when it starts and `chain`
    runs no draft forward. The mask entries sit in the cache past the prefix and the next extend overwrites them."""

    def __init__(self, drafter: nn.Module, batch: int, capacity: int, device: torch.device) -> None:
        self.extra = drafter.config.num_draft_tokens - 1  # mask entries per request
        super().__init__(drafter, batch, capacity + self.extra, device)
        self.all_logits = torch.zeros(batch, 0, 0, device=device)  # [B, K, N] the logits of drafts 1..K (extend)
        self._mask: torch.Tensor | None = None  # [H] fc(mask_hidden) in the cache's dtype, made once

    def select(self, rows: torch.Tensor) -> None:
        super().select(rows)
        self.all_logits = self.all_logits[rows]

    @inference
    def extend(self, tokens: torch.Tensor, feats: torch.Tensor, counts: torch.Tensor) -> None:
        """Append prefix entries (tokens [B, T] = x_{t+1}, feats [B, T, F] = f_t, counts[b] valid) and run the mask
        entries behind each request's last one in the same forward."""
        B, T = tokens.shape
        M, dev = self.extra, tokens.device
        hidden = self.drafter.fuse(feats)  # [B, T, H]
        if self._mask is None:
            self._mask = self.drafter.mask_feature().to(hidden.dtype)
        mask = self._mask
        at = counts[:, None] + torch.arange(M, device=dev)  # [B, M] where each request's mask entries go
        rows = torch.arange(B, device=dev)[:, None]
        ids = F.pad(tokens, (0, M))  # [B, T+M] (entries past a request's count are padding)
        ids[rows, at] = self.drafter.config.mask_token_id
        hid = F.pad(hidden, (0, 0, 0, M))  # [B, T+M, H]
        hid[rows, at] = mask.to(hid.dtype)
        self.num_spec = 0
        positions = self.lens[:, None] + torch.arange(T + M, device=dev)  # [B, T+M] mask d at last + d
        last = counts - 1
        logits, out = self.decode(ids, hid, positions, None, torch.cat([last[:, None], at], 1))  # [B, K, N]
        self.num_spec = 0
        self.all_logits = logits
        self.logits, self.hidden = logits[:, 0], take_rows(out, last)[:, 0]  # [B, N], [B, H]
        self.lens = self.lens + counts

    @inference
    def chain(self, k: int, temperature: float, top_p: float, gen: torch.Generator | None) -> ChainDraft:
        """k <= K drafts from the logits the last extend made: each greedy, or sampled from its own distribution
        (a proposal need not condition on the drafts before it for speculative sampling to stay lossless)."""
        logits = self.all_logits[:, :k]  # [B, k, N]
        B = logits.shape[0]
        if temperature <= 0:
            return ChainDraft(self.to_target(greedy(logits.flatten(0, 1)).view(B, k)))
        q = probs(logits, temperature, top_p)  # [B, k, N]
        d = sample(q, torch.rand(B, k, generator=gen, device=q.device))  # [B, k]
        return ChainDraft(self.to_target(d), self.full_probs(q))


# ---- the family record ------------------------------------------------------------------------------
def build(tcfg: Any, options: PeagleOptions, layer_ids: list[int] | None, draft_vocab_size: int | None
          ) -> PeagleConfig:
    base = eagle3.build(tcfg, options, layer_ids, draft_vocab_size)
    assert options.mask_token_id is not None, "PeagleOptions.validate requires it"
    return PeagleConfig(**base.to_dict(), mask_token_id=options.mask_token_id)


def describe(options: PeagleOptions, config: PeagleConfig) -> str:
    return (f"aux layers {config.aux_layer_ids}, {config.num_draft_tokens} drafts a forward "
            f"({config.num_draft_tokens - 1} mask entries, token {config.mask_token_id})")


FAMILY = Family(
    name="peagle", options=PeagleOptions, config=PeagleConfig, model=PeagleDrafter, build=build, init=eagle3.init,
    losses=LOSSES, reduced_vocab=True, describe=describe,
    exporters={"speculators": "drafthead.export.peagle:to_speculators", "eagle3": "drafthead.export.peagle:to_eagle3"},
    readers={"speculators": "drafthead.export.peagle:read_back", "eagle3": "drafthead.export.peagle:read_back"},
    vllm={"eagle3": "eagle3", "speculators": "eagle3"}, vllm_config={"parallel_drafting": True},
)

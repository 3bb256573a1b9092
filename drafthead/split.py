"""Targets split over ranks by tensor parallelism hold DTensor weights; code that reads a weight as a whole
(drafter inits, the teacher head, the fingerprint) gathers it here. A leaf: imports nothing of drafthead."""
from __future__ import annotations

import torch
from torch import nn


def whole(t: torch.Tensor) -> torch.Tensor:
    """A split weight gathered whole (a collective: every rank of its mesh calls it together); a plain tensor
    as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def whole_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """module.state_dict() with split weights gathered (every rank of the mesh calls it together)."""
    return {k: whole(v) for k, v in module.state_dict().items()}

"""Embedding requests between their chunks and at their end: each chunk's pooled rows
(StepResult.pooled) are added up per sequence, and a finished prompt's sum or row becomes its
embedding (the mean's division, Matryoshka truncation, L2 normalization)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagellm.core.step_plan import PlannedSeq
from pagellm.pooling_params import PoolingParams


class PooledPrompts:
    """What the chunks computed so far have pooled, by sequence id. A chunk that starts at position 0
    starts over: a prompt preempted and prefilled again is pooled once."""

    def __init__(self) -> None:
        self._pooled: dict[str, torch.Tensor] = {}

    def add(self, seq: PlannedSeq, rows: torch.Tensor) -> None:
        """Take in the pooled rows of `seq`'s chunk (its plan's `pool` reduction)."""
        before = self._pooled.get(seq.request_id)
        self._pooled[seq.request_id] = before + rows if seq.pool == "sum" and seq.start > 0 else rows

    def pop(self, seq_id: str) -> torch.Tensor:
        return self._pooled.pop(seq_id)

    def drop(self, seq_id: str) -> None:
        """Forget a sequence that ends without an embedding (aborted, failed)."""
        self._pooled.pop(seq_id, None)

    def __len__(self) -> int:
        return len(self._pooled)


def embedding(pooled: torch.Tensor, params: PoolingParams, num_tokens: int) -> list[float]:
    """A finished prompt's embedding from what its chunks pooled (`params` resolved): the mean
    divides the sum by the token count; `dimensions` keeps the first ones before normalizing, as
    vLLM does, so a shortened embedding is a unit vector too."""
    x = pooled.float()
    if params.pooling_type == "MEAN":
        x = x / num_tokens
    if params.dimensions is not None:
        x = x[:params.dimensions]
    if params.normalize:
        x = F.normalize(x, p=2, dim=-1)
    return x.cpu().tolist()

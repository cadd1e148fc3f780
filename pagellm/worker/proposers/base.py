"""The interface every proposer implements."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Sequence

if TYPE_CHECKING:
    import torch

    from pagellm.core.step_plan import SampleSpec


@dataclass(frozen=True)
class ProposalQuery:
    """One sequence asking for proposals: its id (a proposer with state per sequence keys it so),
    its tokens so far (prompt, output and what this step gave it), how many tokens to propose at
    most, and how it samples (params, and its output so far for the logits processors)."""

    request_id: str
    context: Sequence[int]
    num_tokens: int
    sampler: SampleSpec


@dataclass
class Proposal:
    """Tokens to verify, and the distribution each was drawn from: [len(token_ids), vocab] float32,
    or None for a deterministic proposer (a point mass on each token: verification then compares
    them with the target's own draws, rejection_sampler.py)."""

    token_ids: list[int]
    probs: torch.Tensor | None = None


class Proposer(ABC):
    @abstractmethod
    def propose_for(self, queries: Sequence[ProposalQuery]) -> list[Proposal]:
        """For each query, up to `num_tokens` tokens to follow its context; none when it has no guess."""

    def release(self, request_ids: Iterable[str]) -> None:
        """Forget these sequences (finished, aborted or preempted): a proposer holding state per
        sequence (a draft model's KV blocks) gives it back."""

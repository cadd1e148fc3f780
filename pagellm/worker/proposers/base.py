"""The interface every proposer implements."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Sequence

if TYPE_CHECKING:
    import torch

    from pagellm.core.step_plan import PlannedSeq, SampleSpec


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
    # True: the runner shows it every forward pass's hidden states (observe), before sampling.
    reads_hidden_states = False

    @abstractmethod
    def propose_for(self, queries: Sequence[ProposalQuery]) -> list[Proposal]:
        """For each query, up to `num_tokens` tokens to follow its context; none when it has no guess."""

    def release(self, request_ids: Iterable[str]) -> None:
        """Forget these sequences (finished, aborted or preempted): a proposer holding state per
        sequence (a draft model's KV blocks) gives it back."""

    def observe(self, seqs: Sequence[PlannedSeq], hidden: torch.Tensor) -> None:
        """A step's forward pass ran over `seqs` (their tokens concatenated in this order, drafts to
        verify included) and gave `hidden`, the target's final hidden state of each token: a proposer
        that reads them (reads_hidden_states) takes what it needs before the next step overwrites it."""

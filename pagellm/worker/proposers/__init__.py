"""Proposers for speculative decoding: each proposes the tokens that a sequence's next step
verifies (docs/speculative-decoding.md).

A proposer runs in the model runner after a step's tokens are sampled, so that one that needs a
model (a draft model, the target's own MTP heads reading its hidden states) can be a second
implementation of the same interface. What it proposes is only ever a guess: the runner's
verification keeps exactly the tokens the target model would have produced.
"""
from __future__ import annotations

from pagellm.config import SpeculativeConfig
from pagellm.worker.proposers.base import Proposal, ProposalQuery, Proposer

__all__ = ["Proposal", "ProposalQuery", "Proposer", "make_proposer"]


def make_proposer(config: SpeculativeConfig) -> Proposer:
    """The proposer of a method without weights (a draft model's and an MTP layer's are built with
    their weights by the engine builder: pagellm/engine/draft.py, pagellm/engine/mtp.py)."""
    if config.method == "ngram":
        from pagellm.worker.proposers.ngram import NgramProposer

        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    raise ValueError(f"speculative_config method {config.method!r} has no proposer without a model")

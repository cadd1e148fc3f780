"""The step plan: what the model runner must do this step, as plain data (and the plain-data
parts of what a step gives back).

The scheduler decides; the plan carries the decision to the runner without any scheduler
object: each sequence's tokens to compute, their first position, its block tables, and who
samples from its last position. The runner (and, through it, every tensor-parallel rank)
reads nothing else.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    import torch

from pagellm.sampling_params import SamplingParams


@dataclass(frozen=True)
class SampleSpec:
    """A sequence that samples its next token from a planned sequence's last logits: the
    sequence itself, or a sibling forked from it this step."""

    request_id: str
    params: SamplingParams
    # The sequence's tokens so far, for the penalties; read, never written, by the runner.
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    # Structured outputs: bit t of this int32 row (t // 32, t % 32) allows token t; None: all allowed.
    token_bitmask: torch.Tensor | None = None


@dataclass(frozen=True)
class PlannedSeq:
    request_id: str
    token_ids: list[int]   # the tokens this step computes (a prefill chunk, or one decode token)
    start: int             # the position of token_ids[0]
    block_tables: tuple[list[int], ...]  # one per KV group (one unless some layers slide)
    samplers: list[SampleSpec] = field(default_factory=list)  # empty while a prefill is unfinished
    # The user's request this sequence belongs to (n > 1 and beams fork sequences `<id>#<i>`).
    user_request_id: str = ""
    # Prompt logprobs: positions prompt_logprob_start .. + len(prompt_targets) - 1 of this step
    # give the logprob of prompt_targets (the prompt tokens after them), with the top
    # `prompt_logprobs` alternatives. None: none asked for, or all computed already.
    prompt_logprobs: int | None = None
    prompt_logprob_start: int = 0
    prompt_targets: list[int] = field(default_factory=list)
    # An embedding request's chunk: what its hidden rows give the pooling ("sum", "last" or "first",
    # pagellm.pooling_params.chunk_reduction); None: nothing.
    pool: str | None = None
    # Speculative decoding: the last len(draft_token_ids) of token_ids are proposed tokens to verify
    # (samplers[0] samples each of their positions and the one before them); and how many tokens the
    # runner's proposer should propose, after this step's sampling, for the next step to verify.
    draft_token_ids: list[int] = field(default_factory=list)
    num_proposals: int = 0

    def __post_init__(self) -> None:
        if not self.user_request_id:
            object.__setattr__(self, "user_request_id", self.request_id)


@dataclass
class StepPlan:
    seqs: list[PlannedSeq]
    # (src, dst) block copies to make before the forward pass (copy-on-write).
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    def subset(self, seqs: list[PlannedSeq]) -> StepPlan:
        """A plan for some of the sequences only, with only the copies into their own blocks:
        copying again into a block another subset has written since would erase its new token."""
        owned = {b for s in seqs for table in s.block_tables for b in table}
        return StepPlan(seqs, [(src, dst) for src, dst in self.block_copies if dst in owned])


@dataclass
class PromptLogprobs:
    """Prompt logprobs one step computed for a sequence: entry i scores prompt token
    `token_ids[i]` (at position start + i + 1) given the tokens before it."""

    start: int
    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]                        # 1: the most likely token
    top: list[list[tuple[int, float]]]      # the top-k (token, logprob) pairs, best first

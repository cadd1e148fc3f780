"""The engine's record of one request: its tokens, its progress and its state."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED}


@dataclass(eq=False)
class Request:
    """One sequence being generated.

    `num_computed_tokens` counts the leading tokens of `all_token_ids` whose K/V sit in
    the cache. A step computes the next chunk; when a step reaches the end of
    `all_token_ids`, the model samples one more token. Prefill, chunked prefill, decode
    and recomputation after preemption are all this one rule.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.time)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    cumulative_logprob: float = 0.0
    first_token_time: float | None = None
    finished_time: float | None = None
    first_scheduled_time: float | None = None  # set when the scheduler first admits it
    # The context window: a sequence stops with "length" when it reaches it.
    max_model_len: int | None = None
    # Prefix caching: an optional tenant salt, the chained hashes of the full blocks
    # so far, how many of those are indexed, and how many prompt tokens were reused.
    cache_salt: str | None = None
    block_hashes: list[bytes] = field(default_factory=list)
    num_hashed_blocks: int = 0
    num_cached_tokens: int = 0
    # Parallel sampling: the user's request id, this sequence's index in it, and how
    # many sibling sequences to fork from it once its prompt is computed.
    group_id: str = ""
    index: int = 0
    pending_forks: int = 0
    # Beam search: the step reports this sequence's candidates and its caller (not the
    # engine core) chooses and appends its next token.
    caller_appends: bool = False
    # Prompt logprobs (when sampling_params.prompt_logprobs is set): entry i is prompt token
    # i + 1's, computed as the prefill passes position i; kept across preemption.
    prompt_logprobs: list = field(default_factory=list)
    # Structured outputs: the sequence's parser state (engine/structured_outputs.Grammar), advanced
    # by the engine core with every token it samples; forked with the sequence.
    grammar: Any = None
    # An embedding (pooling) request: its prompt is prefilled, its hidden states pooled, nothing
    # sampled; it finishes when the prompt is computed. Resolved (every field set) by the engine.
    pooling_params: PoolingParams | None = None
    # Speculative decoding: tokens proposed for its next step to verify, and how many to ask the
    # proposer for (adapted to how many it accepts: core/spec_decode.py; None: the configured most).
    draft_token_ids: list[int] = field(default_factory=list)
    lookahead: int | None = None

    @property
    def prompt_logprobs_pending(self) -> bool:
        """Whether prefill must still compute (and not take from the prefix cache) positions
        whose prompt logprobs are asked for."""
        return (self.sampling_params.prompt_logprobs is not None
                and len(self.prompt_logprobs) < self.num_prompt_tokens - 1)

    @property
    def needs_every_position(self) -> bool:
        """Whether prefill must pass every prompt position through the model, taking none from the
        prefix cache: prompt logprobs to compute, or an embedding pooled over all positions."""
        return self.prompt_logprobs_pending or (self.pooling_params is not None
                                                and self.pooling_params.needs_every_position)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens_to_compute(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens or 0

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def __post_init__(self) -> None:
        if not self.group_id:
            self.group_id = self.request_id

    def fork(self, request_id: str, index: int, sampling_params: SamplingParams) -> Request:
        """A sibling sequence at the same point: same tokens, same progress."""
        return Request(
            request_id=request_id, prompt_token_ids=self.prompt_token_ids, sampling_params=sampling_params,
            eos_token_ids=self.eos_token_ids, prompt=self.prompt, arrival_time=self.arrival_time,
            output_token_ids=list(self.output_token_ids), num_computed_tokens=self.num_computed_tokens,
            status=self.status, max_model_len=self.max_model_len, cache_salt=self.cache_salt,
            num_cached_tokens=self.num_cached_tokens, group_id=self.group_id, index=index,
            cumulative_logprob=self.cumulative_logprob, caller_appends=self.caller_appends,
            grammar=None if self.grammar is None else self.grammar.fork(),
        )

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without building the concatenation."""
        prompt, output, p = self.prompt_token_ids, self.output_token_ids, len(self.prompt_token_ids)
        if start >= p:
            return output[start - p:end - p]
        if end <= p:
            return prompt[start:end]
        return prompt[start:] + output[:end - p]

    @property
    def can_speculate(self) -> bool:
        """Whether its next tokens can be proposed and verified: not while its caller picks them
        (beam search). Under a grammar, each verified position gets the mask of the grammar's state
        after the proposals before it (structured_outputs.attach_bitmasks)."""
        return not self.caller_appends

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.time()

    def check_stop(self) -> bool:
        """Finish the request on eos, a stop token or max_tokens; True if it finished."""
        params = self.sampling_params
        n_out = len(self.output_token_ids)
        last = self.output_token_ids[-1]
        # The structured output is complete: at the token that completed it, not at the tokens a
        # verification accepted after it in the same step (the grammar has seen them all by now).
        if self.grammar is not None and self.grammar.end is not None and n_out >= self.grammar.end:
            return self.finish(RequestStatus.FINISHED_STOPPED)
        if n_out >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                return self.finish(RequestStatus.FINISHED_STOPPED)
            if last in params.stop_token_ids:
                return self.finish(RequestStatus.FINISHED_STOPPED, stop_reason=last)
        if params.max_tokens is not None and n_out >= params.max_tokens:
            return self.finish(RequestStatus.FINISHED_LENGTH)
        if self.max_model_len is not None and self.num_tokens >= self.max_model_len:
            return self.finish(RequestStatus.FINISHED_LENGTH)
        return False

    def finish(self, status: RequestStatus, stop_reason: int | str | None = None) -> bool:
        self.status = status
        self.stop_reason = stop_reason
        self.finished_time = time.time()
        return True

"""What the engine hands back: vLLM-shaped request and completion outputs."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop string or stop token that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    # When the scheduler first gave the request a step (its prefill began): arrival to here is
    # its time in the queue.
    first_scheduled_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # Prompt tokens whose KV came from the prefix cache instead of a forward pass.
    num_cached_tokens: int = 0
    # Set when processing this request failed: it was aborted, the others carry on.
    error: str | None = None
    # With SamplingParams.prompt_logprobs: None for the first prompt token (nothing precedes
    # it), then each prompt token's logprob and its top alternatives, as in vLLM.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # An embedding request's result (its `outputs` are empty): the pooled, possibly normalized vector.
    embedding: list[float] | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """What `LLM.embed` returns per prompt, shaped as vLLM's: the vector is `.outputs.embedding`."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """What `LLM.score` returns per pair, shaped as vLLM's: the score is `.outputs.score`; the
    prompt tokens are the pair's two texts' (each embedded on its own)."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True

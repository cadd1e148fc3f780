"""Beam search as users see it: its parameters (`LLM.beam_search`, the server's
`use_beam_search`) and its outputs. The search itself, transformers' rule mapped onto KV blocks,
is the engine's: engine/beams.py."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"beam_width must be an integer >= 1, got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")


@dataclass
class BeamSearchSequence:
    token_ids: list[int]  # generated tokens only (an ending eos included)
    text: str
    cumulative_logprob: float
    score: float  # cumulative_logprob / len(token_ids) ** length_penalty


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first

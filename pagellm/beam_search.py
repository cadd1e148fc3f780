"""Beam search: its parameters, its outputs, and the selection rule of one round.

The rule follows Hugging Face transformers' `generate(num_beams=W, do_sample=False,
early_stopping=True)`: each round keeps the 2W best continuations of all live beams;
those that end (eos or the length limit) among the first W become finished
hypotheses scored by sum of logprobs / generated_length ** length_penalty; the W best
of the rest live on. Scores are float32, as there, so near-ties break the same way.
The engine maps each round onto KV blocks: a beam chosen twice is forked (its blocks
shared by reference), a beam not chosen is dropped (its references released).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

_DEAD = np.float32(-1e9)


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


@dataclass
class Beam:
    seq_id: str
    tokens: list[int]
    score: np.float32  # sum of logprobs of the generated tokens


@dataclass
class Selection:
    parent: str  # seq_id of the beam this continues
    token: int
    score: np.float32


@dataclass
class BeamState:
    """The live beams and finished hypotheses of one prompt."""

    params: BeamSearchParams
    eos_token_ids: frozenset[int]
    live: list[Beam] = field(default_factory=list)
    finished: list[tuple[np.float32, list[int], np.float32]] = field(default_factory=list)
    done: bool = False

    def select(self, candidates: dict[str, list[tuple[int, float]]]) -> list[Selection]:
        """One round. `candidates[seq_id]` holds each live beam's top 2W (token,
        logprob) pairs. Returns the beams of the next round (empty when done)."""
        w = self.params.beam_width
        by_id = {b.seq_id: b for b in self.live}
        pool = []
        for b in self.live:
            for token, lp in candidates[b.seq_id]:
                pool.append((np.float32(np.float32(lp) + b.score), b.seq_id, token))
        # Stable on ties in beam order, then in each beam's logprob order.
        pool.sort(key=lambda c: -c[0])
        pool = pool[:2 * w]
        gen_len = len(self.live[0].tokens) + 1
        at_limit = gen_len >= self.params.max_tokens
        all_finished = len(self.finished) >= w
        nxt: list[Selection] = []
        new_finished = []
        for rank, (score, parent, token) in enumerate(pool):
            ends = at_limit or (not self.params.ignore_eos and token in self.eos_token_ids)
            if ends:
                if rank < w and not all_finished:
                    norm = np.float32(score / np.float32(gen_len ** self.params.length_penalty))
                    new_finished.append((norm, by_id[parent].tokens + [token], score))
            elif len(nxt) < w:
                nxt.append(Selection(parent, token, score))
        merged = self.finished + new_finished
        merged.sort(key=lambda f: -f[0])
        self.finished = merged[:w]
        if not nxt or self._cannot_improve(nxt, gen_len):
            self.done = True
            return []
        return nxt

    def _cannot_improve(self, nxt: list[Selection], gen_len: int) -> bool:
        """early_stopping=True: stop once W hypotheses are finished."""
        return len(self.finished) >= self.params.beam_width

    def results(self, decode) -> BeamSearchOutput:
        seqs = [BeamSearchSequence(tokens, decode(tokens), float(cum), float(norm))
                for norm, tokens, cum in self.finished]
        return BeamSearchOutput(seqs)

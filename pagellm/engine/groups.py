"""What the engine tracks per user request beyond what the scheduler knows: the sequences of
a request with n (or best_of) samples, or the beams of a beam search."""
from __future__ import annotations

from dataclasses import dataclass, field

from pagellm.beam_search import BeamState
from pagellm.core.request import Request
from pagellm.engine.detokenizer import IncrementalDetokenizer
from pagellm.outputs import Logprob
from pagellm.sampling_params import SamplingParams


@dataclass
class SeqText:
    """One sequence's text so far, and its logprobs when asked for."""

    request: Request
    detokenizer: IncrementalDetokenizer
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None


@dataclass
class SampleGroup:
    """One user request: its n (or best_of) sequences, `<id>`, `<id>#1`, ..."""

    request_id: str
    num_seqs: int
    params: SamplingParams
    seqs: dict[int, SeqText]

    def seq_ids(self) -> list[str]:
        return [self.request_id] + [f"{self.request_id}#{i}" for i in range(1, self.num_seqs)]

    @property
    def first(self) -> Request:
        return self.seqs[0].request

    @property
    def finished(self) -> bool:
        return len(self.seqs) == self.num_seqs and all(s.request.is_finished for s in self.seqs.values())


@dataclass
class BeamGroup:
    """One beam-search request: its live beams (each a sequence in the scheduler) and
    the candidates they have reported this round."""

    request_id: str
    state: BeamState
    requests: dict[str, Request]
    root: Request
    pending: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    next_seq: int = 1

    def seq_ids(self) -> list[str]:
        return list(self.requests)

    @property
    def first(self) -> Request:
        return self.root

    @property
    def finished(self) -> bool:
        return self.state.done


Group = SampleGroup | BeamGroup

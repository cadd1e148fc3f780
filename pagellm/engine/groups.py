"""What the engine tracks per user request beyond what the engine core knows: its
sequences (n or best_of samples, or the live beams of a beam search) and their text."""
from __future__ import annotations

from dataclasses import dataclass, field

from pagellm.core.request import Request
from pagellm.engine.beams import BeamRound
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
class SequenceGroup:
    """One user request. Its sequences are `<id>`, `<id>#1`, ...: the n (or best_of)
    samples, whose text `texts` follows by index; or, with `beams`, the live beams, which
    are forked and dropped between rounds and whose text is decoded once at the end."""

    request_id: str
    root: Request              # the first sequence: the prompt, arrival time, cached tokens
    params: SamplingParams
    num_seqs: int              # samples (n or best_of); 1 for a beam search (its beams fork)
    texts: dict[int, SeqText] = field(default_factory=dict)
    beams: BeamRound | None = None

    def seq_ids(self) -> list[str]:
        """Every sequence id the request holds or will hold (forks pending included)."""
        if self.beams is not None:
            return list(self.beams.live)
        return [self.request_id] + [f"{self.request_id}#{i}" for i in range(1, self.num_seqs)]

    @property
    def finished(self) -> bool:
        if self.beams is not None:
            return self.beams.state.done
        return len(self.texts) == self.num_seqs and all(s.request.is_finished for s in self.texts.values())

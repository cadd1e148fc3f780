"""Beam search in the engine: the selection rule of one round, and the rounds driven from outside
the engine core through its public steps. `pagellm/beam_search.py` holds what users see of it
(its parameters and outputs).

The rule follows Hugging Face transformers' `generate(num_beams=W, do_sample=False,
early_stopping=True)`: each round keeps the 2W best continuations of all live beams;
those that end (eos or the length limit) among the first W become finished
hypotheses scored by sum of logprobs / generated_length ** length_penalty; the W best
of the rest live on. Scores are float32, as there, so near-ties break the same way.

Each beam is a sequence in the core marked `caller_appends`: a step reports its top 2W
continuations instead of appending a token. Once every live beam of a request has
reported, `BeamRound.advance` chooses the next round (`BeamState.select`) and applies it with
the core's own operations: a beam chosen more than once is forked (its blocks shared by
reference), a beam not chosen is finished (its references released), and each chosen
beam gets its token.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pagellm.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from pagellm.core.request import Request, RequestStatus
from pagellm.engine.core import EngineCore


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


@dataclass
class BeamRound:
    """A beam search's live beams (the core's sequences `<id>`, `<id>#1`, ...) and the candidates
    they have reported this round."""

    request_id: str
    state: BeamState
    live: dict[str, Request]
    pending: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    next_seq: int = 1  # the suffix of the next sequence forked

    def report(self, seq_id: str, candidates: list[tuple[int, float]]) -> bool:
        """Record a beam's candidates; True once every live beam of the round has reported."""
        self.pending[seq_id] = candidates
        return len(self.pending) == len(self.state.live)

    def advance(self, core: EngineCore) -> tuple[list[str], list[str]]:
        """Run one round on the reported candidates. Returns the sequence ids it created and
        the ones it finished."""
        state = self.state
        old = {b.seq_id: b for b in state.live}
        selections = state.select(self.pending)
        self.pending = {}
        chosen = {sel.parent for sel in selections}
        dropped = [sid for sid in old if state.done or sid not in chosen]
        for sid in dropped:
            core.finish(sid, RequestStatus.FINISHED_STOPPED)
            del self.live[sid]
        if state.done:  # no selections: the best hypotheses are final
            return [], dropped
        created, reused, appends, live = [], set(), [], []
        for sel in selections:
            if sel.parent in reused:
                sid = f"{self.request_id}#{self.next_seq}"
                self.next_seq += 1
                self.live[sid] = core.fork(sel.parent, sid, self.next_seq)
                created.append(sid)
            else:
                reused.add(sel.parent)
                sid = sel.parent
            appends.append((sid, sel.token))
            live.append(Beam(sid, old[sel.parent].tokens + [sel.token], sel.score))
        # Tokens go in only after every fork, so each child starts from its parent's state.
        for sid, token in appends:
            core.append_token(sid, token)
        state.live = live
        return created, dropped

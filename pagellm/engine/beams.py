"""Beam search driven from outside the engine core, through its public steps.

Each beam is a sequence in the core marked `caller_appends`: a step reports its top 2W
continuations instead of appending a token. Once every live beam of a request has
reported, `advance` chooses the next round (`BeamState.select`) and applies it with the
core's own operations: a beam chosen more than once is forked (its blocks shared by
reference), a beam not chosen is finished (its references released), and each chosen
beam gets its token.
"""
from __future__ import annotations

from pagellm.beam_search import Beam
from pagellm.core.request import RequestStatus
from pagellm.engine.core import EngineCore
from pagellm.engine.groups import SequenceGroup


def report(group: SequenceGroup, seq_id: str, candidates: list[tuple[int, float]]) -> bool:
    """Record a beam's candidates; True once every live beam of the round has reported."""
    group.beams.pending[seq_id] = candidates
    return len(group.beams.pending) == len(group.beams.state.live)


def advance(core: EngineCore, group: SequenceGroup) -> tuple[list[str], list[str]]:
    """Run one round on the reported candidates. Returns the sequence ids it created and
    the ones it finished."""
    state = group.beams.state
    old = {b.seq_id: b for b in state.live}
    selections = state.select(group.beams.pending)
    group.beams.pending = {}
    chosen = {sel.parent for sel in selections}
    dropped = [sid for sid in old if state.done or sid not in chosen]
    for sid in dropped:
        core.finish(sid, RequestStatus.FINISHED_STOPPED)
        del group.live[sid]
    if state.done:  # no selections: the best hypotheses are final
        return [], dropped
    created, reused, appends, live = [], set(), [], []
    for sel in selections:
        if sel.parent in reused:
            sid = f"{group.request_id}#{group.next_seq}"
            group.next_seq += 1
            group.live[sid] = core.fork(sel.parent, sid, group.next_seq)
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

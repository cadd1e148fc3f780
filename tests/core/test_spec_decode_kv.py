"""Speculative decoding in the scheduler and the KV managers, without a model: proposals get slots
from the pool, the rejected ones' blocks go back, only accepted tokens are hashed into the prefix
cache, and the step limits (max_tokens, the batch-size switch-off) hold."""
from __future__ import annotations

import pytest

from pagellm.config import SpeculativeConfig
from pagellm.core.kv.coordinator import KVCoordinator
from pagellm.core.request import Request
from pagellm.core.scheduler import Scheduler
from pagellm.core.spec_decode import next_lookahead
from pagellm.sampling_params import SamplingParams

SPEC = SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=2)


def _scheduler(kv) -> Scheduler:
    return Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, speculative=SPEC)


def _prefilled(sched: Scheduler, rid: str, prompt: list[int], drafts: list[int], max_tokens: int = 20,
               eos: frozenset[int] = frozenset()) -> Request:
    """A request whose prompt is computed and first token sampled, with `drafts` proposed."""
    req = Request(rid, prompt, SamplingParams(max_tokens=max_tokens), eos_token_ids=eos)
    sched.add_request(req)
    out = sched.schedule()
    assert [s.num_proposals for s in out.scheduled if s.request is req] == [4]
    sched.update_after_step(out, {rid: [50]}, {rid: drafts})
    return req


@pytest.mark.parametrize("make_kv", [lambda: KVCoordinator(16, 2), lambda: KVCoordinator(16, 2, [None, 3])],
                         ids=["paged", "sliding"])
@pytest.mark.parametrize("accepted", [0, 1, 4])
def test_rejected_proposals_give_their_blocks_back(make_kv, accepted):
    kv = make_kv()
    sched = _scheduler(kv)
    req = _prefilled(sched, "r", [1, 2, 3, 4, 5], [60, 61, 62, 63])
    out = sched.schedule()
    (s,) = out.scheduled
    assert (s.num_new_tokens, s.draft_token_ids) == (5, [60, 61, 62, 63])
    assert out.plan().seqs[0].token_ids == [50, 60, 61, 62, 63]
    assert len(kv.block_table("r")) == 5  # 10 slots: positions 0 .. 9
    tokens = [60, 61, 62, 63][:accepted] + [70]
    sched.update_after_step(out, {"r": tokens}, {"r": [71]})
    assert req.output_token_ids == [50, *tokens]
    assert req.num_computed_tokens == req.num_tokens - 1 == 6 + accepted
    # The blocks past its tokens went back (the last token's slot comes with the next step).
    assert len(kv.block_table("r")) == min(5, -(-req.num_tokens // 2))
    assert req.num_hashed_blocks == req.num_computed_tokens // 2  # only computed (accepted) tokens cached
    assert req.draft_token_ids == [71]
    assert sched.spec_stats.num_accepted_tokens == accepted and sched.spec_stats.num_draft_tokens == 4
    assert req.lookahead == next_lookahead(4, 4, accepted, 4)
    kv.check_integrity()
    sched.finish_request("r", req.status)
    kv.check_integrity()
    assert kv.num_used_blocks == 0


def test_a_stop_token_among_accepted_tokens_ends_the_request_there():
    kv = KVCoordinator(16, 2)
    sched = _scheduler(kv)
    req = _prefilled(sched, "r", [1, 2, 3], [60, 61, 62], eos=frozenset({61}))
    out = sched.schedule()
    sched.update_after_step(out, {"r": [60, 61, 62, 70]})
    assert req.output_token_ids == [50, 60, 61] and req.status.value == "stop"
    assert kv.num_used_blocks == 0 and "r" not in sched.requests


def test_proposals_never_reach_past_max_tokens():
    sched = _scheduler(KVCoordinator(16, 2))
    _prefilled(sched, "r", [1, 2, 3], [60, 61, 62, 63], max_tokens=3)
    (s,) = sched.schedule().scheduled
    assert s.draft_token_ids == [60]  # 1 sampled; this step yields at most 2 more: 1 draft and 1 token


def test_a_large_batch_stops_proposing():
    sched = _scheduler(KVCoordinator(32, 2))
    reqs = [Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=20)) for i in range(2)]
    for req in reqs:
        sched.add_request(req)
    out = sched.schedule()
    assert [s.num_proposals for s in out.scheduled] == [4, 4]
    sched.update_after_step(out, {"r0": [50], "r1": [50]}, {"r0": [60, 61], "r1": [60, 61]})
    sched.add_request(Request("r2", [1, 2, 3], SamplingParams(max_tokens=20)))
    out = sched.schedule()  # 3 sequences > disable_by_batch_size 2: no proposal verified or asked for
    assert len(out.scheduled) == 3
    assert all(not s.draft_token_ids and not s.num_proposals for s in out.scheduled)


@pytest.mark.parametrize("lookahead, proposed, accepted, expected", [
    (4, 4, 4, 4), (2, 2, 2, 4), (4, 1, 1, 4), (1, 1, 0, 1), (4, 4, 2, 3), (8, 8, 0, 1)])
def test_lookahead_adapts_to_acceptance(lookahead, proposed, accepted, expected):
    assert next_lookahead(lookahead, proposed, accepted, 8 if lookahead == 8 else 4) == expected

"""The scheduler, with the model replaced by a rule that makes the next token."""
from __future__ import annotations

import random

from pagellm.core.kv.coordinator import KVCoordinator
from pagellm.core.request import Request, RequestStatus
from pagellm.core.scheduler import Scheduler
from pagellm.sampling_params import SamplingParams

EOS = 0


def fake_next_token(req: Request) -> int:
    # Deterministic in the sequence so far, as greedy decoding is.
    return (sum(req.all_token_ids) * 31 + len(req.all_token_ids)) % 97 + 1


def run(sched: Scheduler, max_steps: int = 10_000) -> dict:
    """Step until every request has finished, checking invariants every step."""
    steps = 0
    seen_max_batch = 0
    while sched.num_unfinished:
        out = sched.schedule()
        assert not out.is_empty, "no progress: the scheduler deadlocked"
        assert out.num_batched_tokens <= sched.max_num_batched_tokens
        assert len(sched.running) <= sched.max_num_seqs
        seen_max_batch = max(seen_max_batch, len(out.scheduled))
        for s in out.scheduled:
            table = sched.kv.block_table(s.request.request_id)
            assert len(table) * sched.kv.block_size >= s.start + s.num_new_tokens
        sampled = {s.request.request_id: [fake_next_token(s.request)] for s in out.scheduled if s.samples}
        sched.update_after_step(out, sampled)
        steps += 1
        assert steps < max_steps
    assert sched.kv.pool.num_free_blocks == sched.kv.num_blocks
    return {"steps": steps, "max_batch": seen_max_batch}


def make(num_blocks=64, block_size=4, max_num_seqs=8, max_tokens_budget=64) -> Scheduler:
    return Scheduler(KVCoordinator(num_blocks, block_size), max_num_seqs, max_tokens_budget)


def add(sched: Scheduler, rid: str, prompt_len: int, max_tokens: int) -> Request:
    req = Request(rid, [random.randint(1, 90) for _ in range(prompt_len)], SamplingParams(max_tokens=max_tokens))
    sched.add_request(req)
    return req


def reference_outputs(prompts: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
    out = {}
    for rid, prompt in prompts.items():
        req = Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens))
        while len(req.output_token_ids) < max_tokens:
            req.append_token(fake_next_token(req))
        out[rid] = req.output_token_ids
    return out


def test_continuous_batching_mixes_prefill_and_decode():
    random.seed(0)
    sched = make(max_tokens_budget=20)
    reqs = [add(sched, f"r{i}", random.randint(3, 30), 10) for i in range(6)]
    mixed = 0
    while sched.num_unfinished:
        out = sched.schedule()
        assert out.num_batched_tokens <= 20
        kinds = {"decode" if s.start >= s.request.num_prompt_tokens else "prefill" for s in out.scheduled}
        mixed += kinds == {"decode", "prefill"}
        sched.update_after_step(out, {s.request.request_id: [fake_next_token(s.request)]
                                      for s in out.scheduled if s.samples})
    # Later prompts were prefilled in the same steps as the earlier requests' decodes.
    assert mixed >= 3
    assert all(len(r.output_token_ids) == 10 for r in reqs)


def test_preemption_takes_the_most_recently_admitted():
    """README's rule: when blocks run out, the request admitted last is preempted (it has done
    the least work), and it goes back to the front of the queue."""
    sched = make(num_blocks=6, block_size=4, max_num_seqs=8, max_tokens_budget=64)
    reqs = [add(sched, f"r{i}", 8, 20) for i in range(3)]  # 2 full blocks each: all 6 blocks taken
    out = sched.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["r0", "r1", "r2"]
    sched.update_after_step(out, {s.request.request_id: [5] for s in out.scheduled})
    # Each now has 9 tokens; the 9th needs a third block, and none is free.
    out = sched.schedule()
    assert [r.request_id for r in out.preempted] == ["r2"]
    assert sched.waiting[0] is reqs[2] and reqs[2].num_computed_tokens == 0
    assert [s.request.request_id for s in out.scheduled] == ["r0", "r1"]  # in r2's two freed blocks
    assert reqs[0].num_preemptions == reqs[1].num_preemptions == 0


def test_preemption_recomputes_and_preserves_outputs():
    random.seed(1)
    prompts = {f"r{i}": [random.randint(1, 90) for _ in range(random.randint(5, 20))] for i in range(8)}
    expected = reference_outputs(prompts, 24)
    # 14 blocks of 4 tokens: far less than 8 requests of up to 44 tokens need at once.
    sched = make(num_blocks=14, block_size=4, max_num_seqs=8, max_tokens_budget=64)
    reqs = [Request(rid, list(p), SamplingParams(max_tokens=24)) for rid, p in prompts.items()]
    for r in reqs:
        sched.add_request(r)
    run(sched)
    assert sched.num_preemptions > 0
    for r in reqs:
        assert r.output_token_ids == expected[r.request_id]
        assert r.status == RequestStatus.FINISHED_LENGTH


def test_chunked_prefill_over_several_steps():
    sched = make(max_tokens_budget=8)
    req = add(sched, "long", 30, 3)
    chunks = []
    while req.num_computed_tokens < 30:
        out = sched.schedule()
        chunks.append(out.scheduled[0].num_new_tokens)
        sched.update_after_step(out, {s.request.request_id: [7] for s in out.scheduled if s.samples})
    assert chunks == [8, 8, 8, 6]
    run(sched)


def test_admission_waits_for_blocks_and_is_fcfs():
    sched = make(num_blocks=4, block_size=4, max_tokens_budget=64)
    a = add(sched, "a", 12, 2)
    b = add(sched, "b", 12, 2)
    out = sched.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["a"]
    assert b.status == RequestStatus.WAITING
    run(sched)


def test_abort_at_any_point_frees_everything():
    """Abort two requests after every possible number of steps (waiting, mid-prefill in chunks of
    5 tokens, decoding, finished): their blocks are back at once, the others' outputs are
    unchanged."""
    random.seed(2)
    prompts = {f"r{i}": [random.randint(1, 90) for _ in range(n)] for i, n in enumerate([17, 12, 9, 14])}
    expected = reference_outputs(prompts, 6)
    phases = set()
    for abort_after in range(0, 16):
        sched = make(num_blocks=40, block_size=2, max_tokens_budget=5)
        reqs = {rid: Request(rid, list(p), SamplingParams(max_tokens=6)) for rid, p in prompts.items()}
        for r in reqs.values():
            sched.add_request(r)
        for _ in range(abort_after):
            out = sched.schedule()
            sched.update_after_step(out, {s.request.request_id: [fake_next_token(s.request)]
                                          for s in out.scheduled if s.samples})
        for rid in ("r1", "r3"):
            r = reqs[rid]
            phases.add("finished" if r.is_finished else "waiting" if r.status == RequestStatus.WAITING
                       else "prefill" if r.num_computed_tokens < r.num_prompt_tokens else "decode")
            held = len(sched.kv.block_tables.get(rid, []))
            free = sched.kv.pool.num_free_blocks
            sched.finish_request(rid, RequestStatus.FINISHED_ABORTED)
            assert sched.kv.pool.num_free_blocks == free + held  # back at once (none are shared here)
            assert rid not in sched.kv.block_tables
            if not r.status == RequestStatus.FINISHED_LENGTH:
                assert r.status == RequestStatus.FINISHED_ABORTED
        run(sched)
        for rid in ("r0", "r2"):
            assert reqs[rid].output_token_ids == expected[rid]
    assert phases >= {"waiting", "prefill", "decode", "finished"}


def test_max_num_seqs_caps_the_batch():
    sched = make(num_blocks=200, max_num_seqs=3, max_tokens_budget=512)
    for i in range(10):
        add(sched, f"r{i}", 4, 5)
    stats = run(sched)
    assert stats["max_batch"] == 3

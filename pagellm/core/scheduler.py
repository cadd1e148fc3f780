"""Iteration-level (continuous batching) scheduling with preemption by recomputation or by swapping.

Each step the scheduler picks the requests that run and how many of their tokens each
computes: the running requests first (a decode is one token, an unfinished prefill its
next chunk), then waiting requests in arrival order while the token budget, the
sequence limit and the free blocks allow. It never touches tensors.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable

from pagellm.config import SpeculativeConfig
from pagellm.core.kv import KVManager
from pagellm.core.request import Request, RequestStatus
from pagellm.core.spec_decode import SpecDecodeStats, next_lookahead
from pagellm.core.step_plan import PlannedSeq, SampleSpec, StepPlan
from pagellm.pooling_params import chunk_reduction


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    block_tables: tuple[list[int], ...]  # one per KV group (core/kv/groups.py)
    # Sibling sequences forked from this one this step: they sample from its logits.
    forks: list[Request] = field(default_factory=list)
    # Speculative decoding: proposed tokens this step verifies (the last of its num_new_tokens), and
    # how many the runner should propose after it for the next step.
    draft_token_ids: list[int] = field(default_factory=list)
    num_proposals: int = 0

    @property
    def block_table(self) -> list[int]:
        """The first KV group's table (the only one unless some layers slide)."""
        return self.block_tables[0]

    @property
    def start(self) -> int:
        """Position of the first token this step computes."""
        return self.request.num_computed_tokens

    @property
    def num_sequence_tokens(self) -> int:
        """Tokens of the sequence itself this step computes (not the proposed ones)."""
        return self.num_new_tokens - len(self.draft_token_ids)

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the sequence, so a token is sampled."""
        return self.start + self.num_sequence_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # (src, dst) physical block copies to make before the forward pass (copy-on-write).
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # Moves between the pool and a second tier (core/kv/tiered.py), made before anything else.
    tier_ops: list = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def plan(self) -> StepPlan:
        """What the model runner needs of this decision, as data (read from the requests now)."""
        seqs = []
        for s in self.scheduled:
            req = s.request
            pooling = req.pooling_params
            samplers = [SampleSpec(r.request_id, r.sampling_params, r.prompt_token_ids, r.output_token_ids)
                        for r in (req, *s.forks)] if s.samples and pooling is None else []
            end = s.start + s.num_sequence_tokens
            pool = None if pooling is None else chunk_reduction(pooling.pooling_type, s.start, end, req.num_tokens)
            seq = PlannedSeq(req.request_id, req.token_slice(s.start, end) + s.draft_token_ids, s.start,
                             s.block_tables, samplers, req.group_id, pool=pool, draft_token_ids=s.draft_token_ids,
                             num_proposals=s.num_proposals)
            if req.prompt_logprobs_pending:
                # Positions first .. last - 1 predict prompt tokens first + 1 .. last (the last
                # prompt position predicts the first output token: not a prompt logprob).
                first = max(s.start, len(req.prompt_logprobs))
                last = min(end, req.num_prompt_tokens - 1)
                if first < last:
                    seq = replace(seq, prompt_logprobs=req.sampling_params.prompt_logprobs, prompt_logprob_start=first,
                                  prompt_targets=req.prompt_token_ids[first + 1:last + 1])
            seqs.append(seq)
        return StepPlan(seqs, self.block_copies)


# Preemptions remembered by sequence id (the count itself is kept whole).
RECENT_PREEMPTIONS = 32


class Scheduler:
    def __init__(self, kv: KVManager, max_num_seqs: int, max_num_batched_tokens: int,
                 preemption_mode: str = "recompute", speculative: SpeculativeConfig | None = None,
                 swap_cheaper: Callable[[int, int], bool] | None = None) -> None:
        """`preemption_mode`: "recompute" frees a victim's blocks (its cached prefix may survive);
        "swap" sends them to the KV manager's second tier first; "auto" swaps when
        `swap_cheaper(num_tokens, num_blocks)` (the engine's measured rates, engine/swap_cost.py)
        says moving the bytes beats recomputing the tokens (never, without it).
        `speculative`: a decoding sequence's proposed tokens are scheduled after its last one, to be
        verified in the same forward pass (core/spec_decode.py)."""
        self.kv = kv
        self.speculative = speculative
        self.spec_stats = SpecDecodeStats()
        # Sequences that gave their blocks back since take_released (speculating only): a proposer
        # keeping state per sequence (a draft model's own KV cache) must give its back too.
        self.released: list[str] = []
        self.preemption_mode = preemption_mode
        self.swap_cheaper = swap_cheaper or (lambda num_tokens, num_blocks: False)
        self.num_swaps = 0
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        # Admission order: the last one is the most recently admitted, the first to preempt.
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        # The latest preemptions, (time, sequence id), newest last: for the dashboard.
        self.recent_preemptions: deque[tuple[float, str]] = deque(maxlen=RECENT_PREEMPTIONS)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        speculate = self._speculating()
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.num_tokens_to_compute == 0:
                i += 1  # a beam holding its blocks while its siblings catch up
                continue
            drafts = self._drafts(req, budget) if speculate else []
            # Slots for the proposals only when the pool has them: short of blocks, decode plainly.
            if drafts and self.kv.allocate_slots(req, 1 + len(drafts)):
                out.scheduled.append(ScheduledRequest(req, 1 + len(drafts), self.kv.group_tables(req.request_id),
                                                      draft_token_ids=drafts))
                budget -= 1 + len(drafts)
                i += 1
                continue
            n = self.kv.chunk_tokens(req, min(req.num_tokens_to_compute, budget))
            while not self.kv.allocate_slots(req, n):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.scheduled.append(ScheduledRequest(req, n, self.kv.group_tables(req.request_id)))
                budget -= n
                i += 1
                continue
            break
        # A step that had to preempt is short of blocks: admitting more would thrash.
        if not out.preempted:
            while self.waiting and budget > 0:
                req = self.waiting[0]
                if len(self.running) + 1 + req.pending_forks > self.max_num_seqs:
                    break
                scheduled = self._admit(req, budget)
                if scheduled is None:
                    break
                out.scheduled.append(scheduled)
                budget -= scheduled.num_new_tokens
        for s in out.scheduled:
            if s.samples and s.request.pending_forks:
                s.forks = self._fork(s)
            if speculate and s.samples and s.request.can_speculate:
                s.num_proposals = s.request.lookahead or self.speculative.num_speculative_tokens
        out.block_copies = self.kv.take_copies()
        out.tier_ops = self.kv.take_tier_ops()
        return out

    def _speculating(self) -> bool:
        """Speculation runs while the batch is small: a large one is compute-bound, where verifying
        rejected tokens would cost more than the steps it saves. Waiting requests count (as vLLM's
        disable_by_batch_size counts enqueued ones): they join the batch as soon as they can."""
        return self.speculative is not None and self.num_unfinished <= self.speculative.disable_by_batch_size

    def decode_rows(self, out: SchedulerOutput) -> int | None:
        """The rows of a step that only decodes (each sequence its last token and the proposals it
        verifies), whose time spec_stats keeps; None for another step (a prompt's chunk costs per
        token what these rows do not) or without speculation. Read before the step runs."""
        if self.speculative is None or not all(
                s.samples and s.num_sequence_tokens == 1 and s.start >= s.request.num_prompt_tokens
                for s in out.scheduled):
            return None
        return out.num_batched_tokens

    def _drafts(self, req: Request, budget: int) -> list[int]:
        """The proposed tokens to verify after a decoding request's last token: as many as the token
        budget, max_tokens and the context window leave room for (the accepted ones and one more
        token must fit)."""
        if req.num_tokens_to_compute != 1 or not req.draft_token_ids:
            return []
        k = min(len(req.draft_token_ids), budget - 1)
        if req.sampling_params.max_tokens is not None:
            k = min(k, req.sampling_params.max_tokens - len(req.output_token_ids) - 1)
        if req.max_model_len is not None:
            k = min(k, req.max_model_len - req.num_tokens - 1)
        return req.draft_token_ids[:k] if k > 0 else []

    def _admit(self, req: Request, budget: int) -> ScheduledRequest | None:
        """Start a waiting request from its longest cached prefix, if its blocks can be had."""
        blocks, num_cached = ([], 0) if req.needs_every_position else self.kv.get_computed_blocks(req)
        req.num_computed_tokens = num_cached
        n = self.kv.chunk_tokens(req, min(req.num_tokens - num_cached, budget))
        if not self.kv.allocate_slots(req, n, blocks):
            req.num_computed_tokens = 0
            return None
        self.kv.record_prefix_lookup(req.num_tokens, num_cached)
        if req.num_preemptions == 0:
            req.num_cached_tokens = num_cached
        self.waiting.popleft()
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.time()
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        return ScheduledRequest(req, n, self.kv.group_tables(req.request_id))

    def _fork(self, s: ScheduledRequest) -> list[Request]:
        """Fork the siblings of a request whose prompt this step completes. They share
        every block by reference and sample their first token from the same logits."""
        parent = s.request
        children = []
        for i in range(1, parent.pending_forks + 1):
            params = parent.sampling_params
            if params.seed is not None:
                params = replace(params, seed=params.seed + i)
            child = self.fork_request(parent, f"{parent.group_id}#{i}", i, params)
            child.num_computed_tokens = s.start + s.num_new_tokens
            children.append(child)
        parent.pending_forks = 0
        return children

    def fork_request(self, parent: Request, child_id: str, index: int, params) -> Request:
        """A new sequence continuing `parent` from where it is now. If the parent holds
        blocks, the child shares them all by reference (copy-on-write later); if it
        was preempted, the child waits to be recomputed like it."""
        child = parent.fork(child_id, index, params)
        self.requests[child_id] = child
        if self.kv.holds(parent.request_id):
            self.kv.fork(parent, child)
            self.running.append(child)
        else:
            child.num_computed_tokens = 0
            child.status = RequestStatus.WAITING
            self.waiting.appendleft(child)
        return child

    def _preempt(self, req: Request) -> None:
        """Free all of a request's blocks and queue it first to compute them again later (or, swapped,
        to bring them back from the second tier)."""
        swap = self.preemption_mode == "swap" or (
            self.preemption_mode == "auto"
            and self.swap_cheaper(req.num_computed_tokens, len(self.kv.block_table(req.request_id))))
        if swap and self.kv.swap_out(req):
            self.num_swaps += 1
        self.kv.free(req)
        self._released(req)
        req.num_computed_tokens = 0
        req.draft_token_ids = []
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.recent_preemptions.append((time.time(), req.request_id))
        self.waiting.appendleft(req)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish (or abort) a request wherever it is; its blocks return to the pool."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if not req.is_finished:
            req.finish(status)
        self.kv.free(req)
        self._released(req)
        return req

    def _released(self, req: Request) -> None:
        if self.speculative is not None:
            self.released.append(req.request_id)

    def take_released(self) -> list[str]:
        """The sequences freed (finished, aborted, preempted) since the last call."""
        released, self.released = self.released, []
        return released

    def update_after_step(self, out: SchedulerOutput, sampled: dict[str, list[int]],
                          drafts: dict[str, list[int]] | None = None) -> list[Request]:
        """Advance each scheduled request past the tokens it computed and append what it sampled, up
        to the first token that ends it (eos, a stop token, its length limit); finished requests
        are freed after their computed full blocks are cached, and so are pooling requests whose
        prompt is computed. A speculating request's accepted proposals were computed too (its
        sampled tokens are the accepted ones and one more); the blocks of the rejected ones go
        back. `drafts`: the runner's proposals for each sequence's next step. Returns the requests
        that received a token."""
        updated, finished = [], []
        for s in out.scheduled:
            req = s.request
            req.num_computed_tokens += s.num_sequence_tokens
            if req.pooling_params is not None:
                self.kv.cache_full_blocks(req)
                if req.num_computed_tokens == req.num_tokens:
                    self.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
                continue
            for seq in [req, *s.forks]:
                tokens = sampled.get(seq.request_id)
                if not tokens:
                    continue
                appended = _append(seq, tokens)
                if seq is req and s.draft_token_ids:
                    self._verified(req, len(s.draft_token_ids), len(tokens) - 1, appended)
                seq.draft_token_ids = (drafts or {}).get(seq.request_id, [])
                updated.append(seq)
                if seq.is_finished:
                    finished.append(seq)
            self.kv.cache_full_blocks(req)
        for seq in finished:
            self.finish_request(seq.request_id, seq.status)
        return updated

    def _verified(self, req: Request, proposed: int, accepted: int, appended: int) -> None:
        """Account for a verification: the accepted proposals' K/V are computed, the rejected ones'
        slots released, and the request's next lookahead adapted."""
        req.num_computed_tokens += min(accepted, appended)
        self.kv.truncate(req, req.num_tokens)
        self.spec_stats.record(proposed, accepted)
        most = self.speculative.num_speculative_tokens
        req.lookahead = next_lookahead(req.lookahead or most, proposed, accepted, most)


def _append(req: Request, tokens: list[int]) -> int:
    """Append tokens up to the first that finishes the request; how many were appended."""
    for i, token in enumerate(tokens):
        req.append_token(token)
        if req.check_stop():
            return i + 1
    return len(tokens)

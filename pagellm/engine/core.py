"""The engine core: schedule -> execute -> update, and nothing else.

It knows sequences (`Request`), not what users asked for: parallel samples, beams,
text and logprob formatting live outside it (`LLMEngine`, `engine/beams.py`,
`OutputProcessor`) and drive it through the public methods below.

A sequence can only fail its own request: a step whose batch raises is retried on halves
of the batch until the requests that fail alone are found (`_execute`).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

import torch

from pagellm.core.kv import KVManager
from pagellm.core.request import Request, RequestStatus
from pagellm.core.scheduler import Scheduler, SchedulerOutput
from pagellm.core.stats import EngineStats, KVCacheStats, KVOffloadStats, PrefixCacheStats, SchedulerStats
from pagellm.core.step_plan import PlannedSeq, StepPlan
from pagellm.engine.pooling import PooledPrompts
from pagellm.engine.swap_cost import SwapCost
from pagellm.errors import EngineFatalError
from pagellm.executor.base import Executor
from pagellm.timing import PhaseTimer, phase
from pagellm.worker.kv_tier import DiskKVTier
from pagellm.worker.model_runner import StepResult
from pagellm.worker.sampler import ROW_ERRORS, SamplerOutput

logger = logging.getLogger("pagellm.engine")

Failure = tuple[Exception, str]  # (the error, its cause as counted in stats().request_failures)


@dataclass
class CoreStep:
    """What one step did. Sequences of a failed request are already aborted and appear
    nowhere but in `failures`."""

    sampled: SamplerOutput | None = None
    # Sequence id -> the rows in `sampled` of the tokens it received, in order (one, or a speculating
    # sequence's accepted proposals and the token after them; cut at a token that finished it).
    rows: dict[str, list[int]] = field(default_factory=dict)
    updated: list[Request] = field(default_factory=list)     # received tokens (stop rules applied)
    held: list[str] = field(default_factory=list)            # sampled, but the caller picks the token
    forked: list[Request] = field(default_factory=list)      # sequences forked this step (n > 1)
    failures: dict[str, Failure] = field(default_factory=dict)  # request (group) id -> why it failed
    # Embedding requests whose prompt this step completed (finished, blocks freed): what they pooled.
    pooled: dict[str, tuple[Request, torch.Tensor]] = field(default_factory=dict)


class EngineCore:
    def __init__(self, executor: Executor, kv: KVManager, scheduler: Scheduler, eos_token_ids: frozenset[int],
                 kv_tier: DiskKVTier | None = None, costs: SwapCost | None = None) -> None:
        self.executor = executor
        self.kv = kv
        self.scheduler = scheduler
        self.eos_token_ids = eos_token_ids
        self.timer: PhaseTimer | None = None
        self.num_prompt_tokens_computed = 0  # prompt tokens that went through a forward pass
        self.num_tokens_computed = 0  # every token that went through one (recomputation included)
        self.num_generation_tokens = 0
        self.num_step_failures = 0  # steps whose batch raised (and was bisected)
        # Structured outputs (engine/structured_outputs.py): set by the engine on first use.
        self.grammars = None
        # Rank 0's KV tier (its stats stand for every rank's); the executor makes the KV manager's
        # moves to and from each rank's (core/kv/tiered.py).
        self.kv_tier = kv_tier
        # What a step costs per token, measured here, read by preemption_mode "auto".
        self.costs = costs or SwapCost(kv_tier)
        self.pooled = PooledPrompts()  # embedding requests' pooled chunks so far

    # ---- sequences: what the layers above may do between steps ----------------------------
    def add(self, seq: Request) -> None:
        self.scheduler.add_request(seq)

    def finish(self, seq_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """Finish a sequence wherever it is; its blocks return to the pool at once."""
        self.scheduler.finish_request(seq_id, status)
        self.pooled.drop(seq_id)
        self._release()

    def _release(self) -> None:
        """Tell the runner which sequences are gone, so its proposer frees what it kept for them."""
        released = self.scheduler.take_released()
        if released:
            self.executor.release_sequences(released)

    def fork(self, parent_id: str, child_id: str, index: int) -> Request:
        """A new sequence continuing `parent_id` from where it is, sharing its blocks."""
        parent = self.scheduler.requests[parent_id]
        return self.scheduler.fork_request(parent, child_id, index, parent.sampling_params)

    def append_token(self, seq_id: str, token: int) -> None:
        """Give a held sequence (see `Request.caller_appends`) the token its caller chose."""
        self.scheduler.requests[seq_id].append_token(token)
        self.num_generation_tokens += 1

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ---- the step --------------------------------------------------------------------------
    def step(self) -> CoreStep:
        try:
            return self._step()
        finally:
            self._release()

    def _step(self) -> CoreStep:
        with phase(self.timer, "schedule"):
            sched = self.scheduler.schedule()
        if sched.tier_ops:  # even when nothing runs: promoted blocks are in the pool's index now
            with phase(self.timer, "kv_tier"):
                self.executor.apply_tier_ops(sched.tier_ops)
        if sched.is_empty:
            return CoreStep()
        rows = self.scheduler.decode_rows(sched)
        started = time.perf_counter()
        try:
            step = self._run(sched)
        except EngineFatalError:
            raise
        except Exception as e:  # a bug after the model ran: these sequences' state is unknown
            logger.exception("engine step failed outside the model; failing its %d sequences", len(sched.scheduled))
            self.num_step_failures += 1
            groups = sorted({s.request.group_id for s in sched.scheduled})
            return CoreStep(failures=self._abort_groups({gid: (e, "step_error") for gid in groups}))
        seconds = time.perf_counter() - started
        self.costs.record_step(seconds, sched.num_batched_tokens)
        if rows is not None:
            self.scheduler.spec_stats.record_step(rows, seconds)
        return step

    def _run(self, sched: SchedulerOutput) -> CoreStep:
        forked = [child for s in sched.scheduled for child in s.forks]
        plan = sched.plan()
        if self.grammars is not None:
            with phase(self.timer, "grammar"):
                plan = self.grammars.attach_bitmasks(plan, self.scheduler.requests)
        result, failures = self._execute(plan)
        sampled: dict[str, list[int]] = {}
        held, rows = [], {}
        if result.sampled is not None:
            errors = result.sampled.errors or {}
            for i, (rid, token) in enumerate(zip(result.request_ids, result.sampled.token_ids)):
                seq = self.scheduler.requests[rid]
                if i in errors:
                    failures.setdefault(seq.group_id, (RuntimeError(ROW_ERRORS[errors[i]]), errors[i]))
                    continue
                # The mask allows only what the grammar accepts; tokens a verification kept past the
                # grammar's end are not the output's (the scheduler stops the sequence at the end).
                if seq.grammar is not None and seq.grammar.end is None and not seq.grammar.accept(token):
                    failures.setdefault(seq.group_id, (RuntimeError(f"the structured-output grammar rejected "
                                                                    f"token {token}"), "grammar_error"))
                    continue
                rows.setdefault(rid, []).append(i)
                if seq.caller_appends:
                    held.append(rid)
                else:
                    sampled.setdefault(rid, []).append(token)
        if failures:  # set the failed requests' sequences aside, then abort them
            sched = replace(sched, scheduled=[s for s in sched.scheduled if s.request.group_id not in failures])
            forked = [r for r in forked if r.group_id not in failures]
            keep = {rid for rid in rows if self.scheduler.requests[rid].group_id not in failures}
            sampled = {rid: t for rid, t in sampled.items() if rid in keep}
            held = [rid for rid in held if rid in keep]
            rows = {rid: i for rid, i in rows.items() if rid in keep}
            self._abort_groups(failures)
        for rid, scored in result.prompt_logprobs.items():
            seq = self.scheduler.requests.get(rid)
            if seq is None or seq.group_id in failures:
                continue
            # A recomputation after preemption scores positions already kept: take only new ones.
            skip = len(seq.prompt_logprobs) - scored.start
            if skip >= 0:
                seq.prompt_logprobs.extend(list(zip(scored.token_ids, scored.logprobs, scored.ranks, scored.top))[skip:])
        planned = {seq.request_id: seq for seq in plan.seqs}
        for rid, rows_pooled in result.pooled.items():
            if rid in self.scheduler.requests:  # not a sequence that failed this step (aborted above)
                self.pooled.add(planned[rid], rows_pooled)
        for s in sched.scheduled:
            self.num_prompt_tokens_computed += max(0, min(s.start + s.num_new_tokens, s.request.num_prompt_tokens)
                                                   - s.start)
            self.num_tokens_computed += s.num_new_tokens
        before = {rid: len(self.scheduler.requests[rid].output_token_ids) for rid in sampled}
        updated = self.scheduler.update_after_step(sched, sampled, result.drafts)
        for seq in updated:  # the rows of the tokens it took (a stop ends a speculating sequence's early)
            rows[seq.request_id] = rows[seq.request_id][:len(seq.output_token_ids) - before[seq.request_id]]
            self.num_generation_tokens += len(rows[seq.request_id])
        pooled = {s.request.request_id: (s.request, self.pooled.pop(s.request.request_id)) for s in sched.scheduled
                  if s.request.pooling_params is not None and s.request.is_finished}
        return CoreStep(result.sampled, rows, updated, held, forked, failures, pooled)

    def _abort_groups(self, failures: dict[str, Failure]) -> dict[str, Failure]:
        for seq in [r for r in self.scheduler.requests.values() if r.group_id in failures]:
            self.finish(seq.request_id, RequestStatus.FINISHED_ABORTED)
        return failures

    def _execute(self, plan: StepPlan) -> tuple[StepResult, dict[str, Failure]]:
        """Run the step; if it raises, find by bisection the requests that fail on their own.

        Returns what the sequences that ran clean sampled, and the culprits: request (group)
        id -> (the error it raised alone, cause). Re-running part of a step is safe: the K/V
        a sequence writes depends only on its own tokens, so a retry writes the same values,
        and a seeded request's draws depend only on its seed and token index (StepPlan.subset
        keeps each part's copy-on-write copies to its own blocks).
        """
        eos = set(self.eos_token_ids)
        try:
            return self.executor.execute(plan, eos), {}
        except EngineFatalError:
            raise
        except Exception as error:
            self.num_step_failures += 1
            logger.warning("a step of %d sequences raised %s: %s; looking for the request that caused it",
                           len(plan.seqs), type(error).__name__, error)
            first = error
        culprits: dict[str, Failure] = {}
        clean: list[StepResult] = []

        def bisect(part: list[PlannedSeq], error: Exception) -> None:
            if len(part) == 1:
                culprits[part[0].user_request_id] = (error, "step_error")
                return
            mid = len(part) // 2
            for half in (part[:mid], part[mid:]):
                try:
                    clean.append(self.executor.execute(plan.subset(half), eos))
                except EngineFatalError:
                    raise
                except Exception as e:
                    bisect(half, e)

        bisect(plan.seqs, first)
        for gid, (e, _) in culprits.items():
            logger.error("request %s failed on its own and is dropped: %s: %s", gid, type(e).__name__, e)
        return StepResult.concat(clean), culprits

    def stats(self) -> EngineStats:
        kv, sched = self.kv, self.scheduler
        spec = sched.spec_stats
        return EngineStats(
            kv=KVCacheStats(kv.num_blocks, kv.num_free_blocks, kv.num_used_blocks, kv.block_size, kv.usage(),
                            kv.group_stats()),
            scheduler=SchedulerStats(len(sched.running), len(sched.waiting), sched.num_preemptions, sched.num_swaps),
            prefix_cache=PrefixCacheStats(kv.num_cached_free_blocks, kv.prefix_queries, kv.prefix_hits),
            prompt_tokens_computed=self.num_prompt_tokens_computed,
            tokens_computed=self.num_tokens_computed,
            generation_tokens=self.num_generation_tokens,
            num_step_failures=self.num_step_failures,
            spec_decode=None if sched.speculative is None else
            replace(spec, accepted_per_position=list(spec.accepted_per_position),
                    decode_steps_by_rows=dict(spec.decode_steps_by_rows),
                    decode_seconds_by_rows=dict(spec.decode_seconds_by_rows)),
            kv_offload=None if self.kv_tier is None else KVOffloadStats(self.kv_tier.stats(), kv.tier_stats()))

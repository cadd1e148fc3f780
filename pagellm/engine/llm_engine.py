"""The engine: add requests, step, abort. One step = schedule, run the model, sample,
update the requests, detokenize and emit outputs.

A request can only fail itself: a step whose batch raises is retried on halves of the
batch until the requests that fail alone are found (see `LLMEngine.step`).
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import replace

import numpy as np
import torch

from pagellm import envs
from pagellm.beam_search import Beam, BeamSearchParams, BeamState
from pagellm.config import EngineConfig
from pagellm.core.kv import make_kv_manager
from pagellm.core.request import Request, RequestStatus
from pagellm.core.scheduler import Scheduler, SchedulerOutput
from pagellm.core.step_plan import PlannedSeq, StepPlan
from pagellm.engine.groups import BeamGroup, Group, SampleGroup
from pagellm.engine.input_processor import InputProcessor, PromptType, resolve_max_model_len
from pagellm.engine.output_processor import OutputProcessor
from pagellm.errors import EngineFatalError
from pagellm.model.loader import load_model_source
from pagellm.model.tokenizer import Tokenizer
from pagellm.outputs import RequestOutput
from pagellm.sampling_params import SamplingParams
from pagellm.timing import PhaseTimer, phase
from pagellm.worker.model_runner import ModelRunner, StepResult, resolve_device, resolve_dtype
from pagellm.worker.sampler import ROW_ERRORS

logger = logging.getLogger("pagellm.engine")


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        source = load_model_source(config.model, config.load_format)
        self.model_path = source.path
        self.tokenizer: Tokenizer = source.tokenizer
        self.arch = source.arch
        self.max_model_len = resolve_max_model_len(config.max_model_len, self.arch.max_position_embeddings)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        torch.manual_seed(config.seed)
        if config.tensor_parallel_size > 1:
            from pagellm.distributed.driver import start_tensor_parallel

            self.runner = start_tensor_parallel(config, source, self.device, self.dtype, self.max_model_len)
        else:
            self.runner = ModelRunner(self.arch, self.device, self.dtype, self.max_model_len, seed=config.seed)
        try:
            if source.weights is None:
                self.runner.init_dummy_weights(config.seed)
            else:
                self.runner.load_weights(source.weights())
            num_blocks = config.num_kv_blocks or self.runner.num_blocks_for_budget(
                config.block_size, config.kv_cache_memory)
            self.runner.allocate_kv_cache(num_blocks, config.block_size)
            if not config.enforce_eager:
                self.runner.capture_cuda_graphs(config.max_num_seqs)
        except BaseException:
            self.runner.shutdown()  # tensor-parallel workers must not outlive a failed start
            raise
        self.kv = make_kv_manager(config.kv_policy, num_blocks, config.block_size, self.max_model_len,
                                  enable_prefix_caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        eos = set(self.arch.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.outputs = OutputProcessor(self.tokenizer, self.eos_token_ids)
        self.inputs = InputProcessor(self.tokenizer, self.arch.vocab_size, self.max_model_len, config.max_num_seqs,
                                     self.kv, self.eos_token_ids)
        self.num_prompt_tokens_computed = 0  # prompt tokens that went through a forward pass
        self.num_generation_tokens = 0
        self._check_invariants = envs.check_invariants()  # PAGELLM_CHECK_INVARIANTS=1: after every step
        self.timer: PhaseTimer | None = None  # see attach_timer
        self.num_step_failures = 0  # steps whose batch raised (and was bisected)
        self.request_failures: Counter[str] = Counter()  # failed requests, by cause
        self._groups: dict[str, Group] = {}
        self._seq_group: dict[str, Group] = {}  # every sequence id in use -> its group

    # ---- requests ----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None, cache_salt: str | None = None) -> Request:
        """Validate, tokenize and queue a request. Raises ValueError, changing nothing, on bad input."""
        params = params or SamplingParams()
        self._check_request_id(request_id)
        num_seqs = params.best_of or params.n
        self.inputs.check_num_seqs(num_seqs)
        group = SampleGroup(request_id, num_seqs, params, {})
        taken = next((sid for sid in group.seq_ids() if sid in self._seq_group), None)
        if taken is not None:
            raise ValueError(f"request_id {taken!r} is already in use")
        text, ids = self.inputs.tokenize(prompt)
        self.inputs.validate(ids, params)
        req = Request(
            request_id=request_id,
            prompt_token_ids=ids,
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            prompt=text,
            arrival_time=arrival_time or time.time(),
            max_model_len=self.max_model_len,
            cache_salt=cache_salt,
            pending_forks=num_seqs - 1,
        )
        self.outputs.track(group, req)
        self._groups[request_id] = group
        for sid in group.seq_ids():
            self._seq_group[sid] = group
        self.scheduler.add_request(req)
        return req

    def _check_request_id(self, request_id: str) -> None:
        self.inputs.check_request_id(request_id)
        if request_id in self._seq_group:
            raise ValueError(f"request_id {request_id!r} is already in use")

    def add_beam_request(self, request_id: str, prompt: PromptType, params: BeamSearchParams,
                         arrival_time: float | None = None) -> Request:
        """Queue a beam search. Its beams are sequences like any other; between rounds
        the engine forks the chosen ones and drops the rest."""
        self._check_request_id(request_id)
        text, ids = self.inputs.tokenize(prompt)
        w = params.beam_width
        # Each beam reads the top 2W continuations of its last position, greedily "sampled".
        seq_params = SamplingParams(temperature=0.0, max_tokens=params.max_tokens, ignore_eos=True, logprobs=2 * w)
        # A round waits for every beam, so all W must be able to hold their blocks at once.
        self.inputs.validate(ids, seq_params, num_seqs=w, seqs_at_once=w)
        req = Request(request_id=request_id, prompt_token_ids=ids, sampling_params=seq_params,
                      eos_token_ids=self.eos_token_ids, prompt=text, arrival_time=arrival_time or time.time(),
                      max_model_len=self.max_model_len)
        group = BeamGroup(request_id, BeamState(params, self.eos_token_ids, [Beam(request_id, [], np.float32(0))]),
                           {request_id: req}, root=req)
        self._groups[request_id] = group
        self._seq_group[request_id] = group
        self.scheduler.add_request(req)
        return req

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Stop requests wherever they are; their blocks return to the pool at once."""
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            group = self._groups.get(rid)
            if group is not None:
                for sid in group.seq_ids():
                    self.scheduler.finish_request(sid, RequestStatus.FINISHED_ABORTED)
                self._drop(group)

    def _drop(self, group: Group) -> None:
        del self._groups[group.request_id]
        for sid in group.seq_ids():
            self._seq_group.pop(sid, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ---- the loop ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample, and return an output for every request
        that received tokens or failed (`RequestOutput.error` set, its blocks freed).

        A failure stays with the request that caused it. If the batch's forward pass or
        sampling raises, the step is retried on halves of the batch until the requests that
        fail alone are found: they fail, and the others keep the results of the halves that
        ran clean. A row whose logits cannot be sampled fails its own request. Only an
        `EngineFatalError` (the engine cannot step at all) propagates.
        """
        with phase(self.timer, "step"):
            outputs = self._step()
        if self._check_invariants:
            self.kv.check_integrity()
        return outputs

    def attach_timer(self, timer: PhaseTimer | None) -> None:
        """Time each phase of every step into `timer` (pagellm.timing); None detaches it."""
        self.timer = timer
        self.runner.attach_timer(timer)

    def _step(self) -> list[RequestOutput]:
        with phase(self.timer, "schedule"):
            sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        try:
            return self._run_step(sched)
        except EngineFatalError:
            raise
        except Exception as e:  # a bug after the model ran: these requests' state is unknown
            logger.exception("engine step failed outside the model; failing its %d sequences", len(sched.scheduled))
            self.num_step_failures += 1
            groups = {s.request.group_id for s in sched.scheduled} & self._groups.keys()
            return [self._fail(self._groups[gid], e, "step_error") for gid in sorted(groups)]

    def _run_step(self, sched: SchedulerOutput) -> list[RequestOutput]:
        for s in sched.scheduled:
            for child in s.forks:
                self.outputs.track(self._seq_group[child.request_id], child)
        result, failures = self._execute(sched.plan())
        sampled, beam_rows = {}, []
        if result.sampled is not None:
            errors = result.sampled.errors or {}
            for i, (rid, token) in enumerate(zip(result.request_ids, result.sampled.token_ids)):
                group = self._seq_group[rid]
                if i in errors:
                    failures.setdefault(group.request_id, (RuntimeError(ROW_ERRORS[errors[i]]), errors[i]))
                elif isinstance(group, BeamGroup):
                    beam_rows.append((rid, i))
                else:
                    sampled[rid] = token
        if failures:  # set the failed requests' sequences aside before _fail forgets them
            sched = replace(sched, scheduled=[s for s in sched.scheduled if s.request.group_id not in failures])
            sampled = {rid: t for rid, t in sampled.items() if self._seq_group[rid].request_id not in failures}
            beam_rows = [(rid, i) for rid, i in beam_rows if self._seq_group[rid].request_id not in failures]
        outputs = [self._fail(self._groups[gid], error, cause) for gid, (error, cause) in failures.items()
                   if gid in self._groups]
        for s in sched.scheduled:
            self.num_prompt_tokens_computed += max(0, min(s.start + s.num_new_tokens, s.request.num_prompt_tokens)
                                                   - s.start)
        updated = self.scheduler.update_after_step(sched, sampled)
        self.num_generation_tokens += len(sampled)
        rows = {rid: i for i, rid in enumerate(result.request_ids)}
        touched: dict[str, Group] = {}
        failed: dict[str, Exception] = {}
        for rid, row in beam_rows:
            group = self._seq_group[rid]
            if group.request_id in failed:
                continue
            group.pending[rid] = result.sampled.top_logprobs[row]
            if len(group.pending) == len(group.state.live):
                try:
                    self._advance_beams(group)
                except Exception as e:  # one request's failure must not take down the others
                    failed[group.request_id] = e
                    touched[group.request_id] = group
                if group.finished:
                    touched[group.request_id] = group
        for req in updated:
            group = self._seq_group.get(req.request_id)
            if group is None or group.request_id in failed:
                continue
            try:
                seq = group.seqs[req.index]
                if self.outputs.append(seq, result.sampled, rows[req.request_id]) and not req.is_finished:
                    self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
                self.outputs.release_text(seq)
            except Exception as e:  # one request's failure must not take down the others
                failed[group.request_id] = e
            touched[group.request_id] = group
        for group in touched.values():
            try:
                if group.request_id in failed:
                    raise failed[group.request_id]
                out = self.outputs.output(group)
            except Exception as e:
                outputs.append(self._fail(group, e, "output_error"))
                continue
            if out is not None:
                outputs.append(out)
            if group.finished:
                self._drop(group)
        return outputs

    def _execute(self, plan: StepPlan) -> tuple[StepResult, dict[str, tuple[Exception, str]]]:
        """Run the step; if it raises, find by bisection the requests that fail on their own.

        Returns what the requests that ran clean sampled, and the culprits: user request id ->
        (the error it raised alone, cause). Re-running part of a step is safe: the K/V a
        sequence writes depends only on its own tokens, so a retry writes the same values, and
        a seeded request's draws depend only on its seed and token index (StepPlan.subset keeps
        each part's copy-on-write copies to its own blocks).
        """
        eos = set(self.eos_token_ids)
        try:
            return self.runner.execute(plan, eos), {}
        except EngineFatalError:
            raise
        except Exception as error:
            self.num_step_failures += 1
            logger.warning("a step of %d sequences raised %s: %s; looking for the request that caused it",
                           len(plan.seqs), type(error).__name__, error)
            first = error
        culprits: dict[str, tuple[Exception, str]] = {}
        clean: list[StepResult] = []

        def bisect(part: list[PlannedSeq], error: Exception) -> None:
            if len(part) == 1:
                culprits[part[0].user_request_id] = (error, "step_error")
                return
            mid = len(part) // 2
            for half in (part[:mid], part[mid:]):
                try:
                    clean.append(self.runner.execute(plan.subset(half), eos))
                except EngineFatalError:
                    raise
                except Exception as e:
                    bisect(half, e)

        bisect(plan.seqs, first)
        for gid, (e, _) in culprits.items():
            logger.error("request %s failed on its own and is dropped: %s: %s", gid, type(e).__name__, e)
        return StepResult.concat(clean), culprits

    def _fail(self, group: Group, error: Exception, cause: str) -> RequestOutput:
        """Abort a request that failed (counted under `cause`); its blocks go back at once."""
        self.request_failures[cause] += 1
        self.abort_request(group.request_id)
        return self.outputs.failure(group, error)

    def _advance_beams(self, group: BeamGroup) -> None:
        """Every live beam has reported: choose the next beams, then fork the ones chosen
        more than once (sharing blocks) and drop the ones not chosen (releasing them)."""
        state = group.state
        old = {b.seq_id: b for b in state.live}
        selections = state.select(group.pending)
        group.pending = {}
        self.num_generation_tokens += len(selections)
        chosen = {sel.parent for sel in selections}
        for sid in old:
            if state.done or sid not in chosen:
                self.scheduler.finish_request(sid, RequestStatus.FINISHED_STOPPED)
                del group.requests[sid]
                self._seq_group.pop(sid, None)
        if state.done:
            return
        reused: set[str] = set()
        appends = []
        live = []
        for sel in selections:
            parent = old[sel.parent]
            if sel.parent in reused:
                sid = f"{group.request_id}#{group.next_seq}"
                group.next_seq += 1
                parent_req = group.requests[sel.parent]
                req = self.scheduler.fork_request(parent_req, sid, group.next_seq, parent_req.sampling_params)
                group.requests[sid] = req
                self._seq_group[sid] = group
            else:
                reused.add(sel.parent)
                sid = sel.parent
            appends.append((group.requests[sid], sel.token))
            live.append(Beam(sid, parent.tokens + [sel.token], sel.score))
        # Tokens go in only after every fork, so each child starts from its parent's state.
        for req, token in appends:
            req.append_token(token)
        state.live = live

    def memory_report(self) -> list[dict]:
        """Per rank (one entry without tensor parallelism): bytes of weights and of KV cache it
        holds, its KV heads, and its peak memory so far."""
        return self.runner.memory_report()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any; the engine cannot step afterwards. Also
        done at garbage collection and interpreter exit."""
        self.runner.shutdown()

    def kv_snapshot(self) -> dict:
        """Who holds which physical block right now: the data behind a block map."""
        snapshot = self.kv.snapshot()
        # Sequence id -> the user request it belongs to (n > 1 forks several).
        snapshot["sequence_groups"] = {rid: self.scheduler.requests[rid].group_id
                                       for rid in snapshot["tables"] if rid in self.scheduler.requests}
        return snapshot

    def stats(self) -> dict:
        kv = self.kv
        return {
            "total_blocks": kv.num_blocks,
            "free_blocks": kv.num_free_blocks,
            "used_blocks": kv.num_used_blocks,
            "block_size": self.kv.block_size,
            "kv_cache_usage": self.kv.usage(),
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_preemptions": self.scheduler.num_preemptions,
            "cached_blocks": kv.num_cached_free_blocks,
            "prefix_cache_queries": self.kv.prefix_queries,
            "prefix_cache_hits": self.kv.prefix_hits,
            "prompt_tokens_computed": self.num_prompt_tokens_computed,
            "generation_tokens": self.num_generation_tokens,
            "num_step_failures": self.num_step_failures,
            "request_failures": dict(self.request_failures),
            "max_model_len": self.max_model_len,
        }

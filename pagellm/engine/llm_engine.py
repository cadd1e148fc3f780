"""The engine: add requests, step, abort. One step = schedule, run the model, sample,
update the requests, detokenize and emit outputs.

A request can only fail itself: a step whose batch raises is retried on halves of the
batch until the requests that fail alone are found (see `LLMEngine.step`).
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from pagellm import envs
from pagellm.beam_search import Beam, BeamSearchParams, BeamState
from pagellm.config import EngineConfig
from pagellm.core.kv import make_kv_manager
from pagellm.core.request import Request, RequestStatus
from pagellm.core.scheduler import Scheduler
from pagellm.core.scheduler import SchedulerOutput
from pagellm.core.step_plan import PlannedSeq, StepPlan
from pagellm.engine.detokenizer import IncrementalDetokenizer
from pagellm.errors import EngineFatalError
from pagellm.model.loader import load_model_source
from pagellm.model.tokenizer import Tokenizer
from pagellm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagellm.sampling_params import SamplingParams, check_text
from pagellm.timing import PhaseTimer, phase
from pagellm.worker.model_runner import ModelRunner, StepResult, resolve_device, resolve_dtype
from pagellm.worker.sampler import ROW_ERRORS

PromptType = str | list[int] | dict
logger = logging.getLogger("pagellm.engine")


@dataclass
class _Seq:
    """Engine-side state of one sequence that the scheduler need not know."""

    request: Request
    detokenizer: IncrementalDetokenizer
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None


@dataclass
class _Group:
    """One user request: its n (or best_of) sequences."""

    request_id: str
    num_seqs: int
    params: SamplingParams
    seqs: dict[int, _Seq]

    def seq_ids(self) -> list[str]:
        return [self.request_id] + [f"{self.request_id}#{i}" for i in range(1, self.num_seqs)]

    @property
    def finished(self) -> bool:
        return len(self.seqs) == self.num_seqs and all(s.request.is_finished for s in self.seqs.values())


@dataclass
class _BeamGroup:
    """One beam-search request: its live beams (each a sequence in the scheduler) and
    the candidates they have reported this round."""

    request_id: str
    state: BeamState
    requests: dict[str, Request]
    root: Request
    pending: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    next_seq: int = 1

    @property
    def finished(self) -> bool:
        return self.state.done


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        source = load_model_source(config.model, config.load_format)
        self.model_path = source.path
        self.tokenizer: Tokenizer = source.tokenizer
        self.arch = source.arch
        self.max_model_len = self._resolve_max_model_len(config.max_model_len, self.arch.max_position_embeddings)
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
        self.num_prompt_tokens_computed = 0  # prompt tokens that went through a forward pass
        self.num_generation_tokens = 0
        self._check_invariants = envs.check_invariants()  # PAGELLM_CHECK_INVARIANTS=1: after every step
        self.timer: PhaseTimer | None = None  # see attach_timer
        self.num_step_failures = 0  # steps whose batch raised (and was bisected)
        self.request_failures: Counter[str] = Counter()  # failed requests, by cause
        self._groups: dict[str, _Group | _BeamGroup] = {}
        self._seq_group: dict[str, _Group | _BeamGroup] = {}  # every sequence id in use -> its group

    @staticmethod
    def _resolve_max_model_len(asked: int | None, model_max: int) -> int:
        if asked is None:
            return model_max
        if asked > model_max:
            raise ValueError(f"max_model_len must be <= the model's context length ({model_max}), got {asked}")
        return asked

    # ---- requests ----------------------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            check_text("prompt", prompt)
            return prompt, self.tokenizer.encode(prompt) if prompt else []
        if isinstance(prompt, list):
            return None, list(prompt)
        raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None, cache_salt: str | None = None) -> Request:
        """Validate, tokenize and queue a request. Raises ValueError, changing nothing, on bad input."""
        params = params or SamplingParams()
        self._check_request_id(request_id)
        num_seqs = params.best_of or params.n
        self._check_num_seqs(num_seqs)  # before anything is built per sequence
        group = _Group(request_id, num_seqs, params, {})
        taken = next((sid for sid in group.seq_ids() if sid in self._seq_group), None)
        if taken is not None:
            raise ValueError(f"request_id {taken!r} is already in use")
        text, ids = self.tokenize_prompt(prompt)
        self._validate(ids, params)
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
        self._track(group, req)
        self._groups[request_id] = group
        for sid in group.seq_ids():
            self._seq_group[sid] = group
        self.scheduler.add_request(req)
        return req

    def _check_request_id(self, request_id: str) -> None:
        if not isinstance(request_id, str) or not request_id or "#" in request_id:
            raise ValueError(f"request_id must be a non-empty string without '#' (kept for sibling sequences), "
                             f"got {request_id!r}")
        if request_id in self._seq_group:
            raise ValueError(f"request_id {request_id!r} is already in use")

    def add_beam_request(self, request_id: str, prompt: PromptType, params: BeamSearchParams,
                         arrival_time: float | None = None) -> Request:
        """Queue a beam search. Its beams are sequences like any other; between rounds
        the engine forks the chosen ones and drops the rest."""
        self._check_request_id(request_id)
        text, ids = self.tokenize_prompt(prompt)
        w = params.beam_width
        # Each beam reads the top 2W continuations of its last position, greedily "sampled".
        seq_params = SamplingParams(temperature=0.0, max_tokens=params.max_tokens, ignore_eos=True, logprobs=2 * w)
        # A round waits for every beam, so all W must be able to hold their blocks at once.
        self._validate(ids, seq_params, num_seqs=w, seqs_at_once=w)
        req = Request(request_id=request_id, prompt_token_ids=ids, sampling_params=seq_params,
                      eos_token_ids=self.eos_token_ids, prompt=text, arrival_time=arrival_time or time.time(),
                      max_model_len=self.max_model_len)
        group = _BeamGroup(request_id, BeamState(params, self.eos_token_ids, [Beam(request_id, [], np.float32(0))]),
                           {request_id: req}, root=req)
        self._groups[request_id] = group
        self._seq_group[request_id] = group
        self.scheduler.add_request(req)
        return req

    def _track(self, group: _Group, req: Request) -> None:
        params = req.sampling_params
        group.seqs[req.index] = _Seq(req, IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, params),
                                     logprobs=[] if params.logprobs is not None else None)

    def _validate(self, ids: list[int], params: SamplingParams, num_seqs: int | None = None,
                  seqs_at_once: int = 1) -> None:
        if not ids:
            raise ValueError("prompt must not be empty")
        vocab = self.arch.vocab_size
        bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids contains {bad!r}, outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}, "
                             f"which must hold the prompt plus at least one generated token")
        params.check_vocab(vocab)
        if params.allowed_token_ids and params.min_tokens:
            if params.min_tokens_held_off(self.eos_token_ids).issuperset(params.allowed_token_ids):
                raise ValueError(f"allowed_token_ids {params.allowed_token_ids} are all stop or end-of-sequence "
                                 f"tokens, which min_tokens ({params.min_tokens}) holds off: nothing could be picked")
        if params.logprobs is not None and params.logprobs > vocab:
            raise ValueError(f"logprobs must be <= the vocabulary size ({vocab}), got {params.logprobs}")
        self._check_num_seqs(num_seqs or params.best_of or params.n)
        longest = min(len(ids) + (params.max_tokens or self.max_model_len), self.max_model_len)
        need = self.kv.blocks_for(longest) * seqs_at_once
        if need > self.kv.num_blocks:
            raise ValueError(
                f"the request needs up to {need} KV blocks ({seqs_at_once} x {longest} tokens at block_size "
                f"{self.kv.block_size}) "
                f"but the whole KV pool has {self.kv.num_blocks}; lower max_tokens or enlarge the pool")

    def _check_num_seqs(self, num_seqs: int) -> None:
        if num_seqs > self.config.max_num_seqs:
            raise ValueError(f"n, best_of and beam_width must be <= max_num_seqs ({self.config.max_num_seqs}), "
                             f"got {num_seqs}")

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Stop requests wherever they are; their blocks return to the pool at once."""
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            group = self._groups.get(rid)
            if group is not None:
                for sid in self._seq_ids(group):
                    self.scheduler.finish_request(sid, RequestStatus.FINISHED_ABORTED)
                self._drop(group)

    @staticmethod
    def _seq_ids(group: _Group | _BeamGroup) -> list[str]:
        return list(group.requests) if isinstance(group, _BeamGroup) else group.seq_ids()

    def _drop(self, group: _Group | _BeamGroup) -> None:
        del self._groups[group.request_id]
        for sid in self._seq_ids(group):
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
                self._track(self._seq_group[child.request_id], child)
        result, failures = self._execute(sched.plan())
        sampled, beam_rows = {}, []
        if result.sampled is not None:
            errors = result.sampled.errors or {}
            for i, (rid, token) in enumerate(zip(result.request_ids, result.sampled.token_ids)):
                group = self._seq_group[rid]
                if i in errors:
                    failures.setdefault(group.request_id, (RuntimeError(ROW_ERRORS[errors[i]]), errors[i]))
                elif isinstance(group, _BeamGroup):
                    beam_rows.append((rid, i))
                else:
                    sampled[rid] = token
        outputs = [self._fail(self._groups[gid], error, cause) for gid, (error, cause) in failures.items()
                   if gid in self._groups]
        if failures:
            sched = replace(sched, scheduled=[s for s in sched.scheduled if s.request.group_id not in failures])
            sampled = {rid: t for rid, t in sampled.items() if self._seq_group[rid].request_id not in failures}
            beam_rows = [(rid, i) for rid, i in beam_rows if self._seq_group[rid].request_id not in failures]
        for s in sched.scheduled:
            self.num_prompt_tokens_computed += max(0, min(s.start + s.num_new_tokens, s.request.num_prompt_tokens)
                                                   - s.start)
        updated = self.scheduler.update_after_step(sched, sampled)
        self.num_generation_tokens += len(sampled)
        rows = {rid: i for i, rid in enumerate(result.request_ids)}
        touched: dict[str, _Group | _BeamGroup] = {}
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
                self._update_seq(group.seqs[req.index], result.sampled, rows[req.request_id])
            except Exception as e:  # one request's failure must not take down the others
                failed[group.request_id] = e
            touched[group.request_id] = group
        for group in touched.values():
            try:
                if group.request_id in failed:
                    raise failed[group.request_id]
                out = self._output(group)
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

    def _fail(self, group: _Group | _BeamGroup, error: Exception, cause: str) -> RequestOutput:
        """Abort a request that failed (counted under `cause`); its blocks go back at once."""
        first = group.root if isinstance(group, _BeamGroup) else group.seqs[0].request
        self.request_failures[cause] += 1
        self.abort_request(group.request_id)
        return RequestOutput(group.request_id, first.prompt, first.prompt_token_ids, [], True,
                             RequestMetrics(first.arrival_time, first.first_token_time, time.time(),
                                            first.num_preemptions),
                             error=f"{type(error).__name__}: {error}")

    def _advance_beams(self, group: _BeamGroup) -> None:
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

    def _update_seq(self, seq: _Seq, sampled, row: int) -> None:
        req = seq.request
        token = req.output_token_ids[-1]
        req.cumulative_logprob += sampled.logprobs[row]
        if seq.logprobs is not None:
            seq.logprobs.append(self._logprob_entry(token, sampled, row))
        if seq.detokenizer.update([token]) is not None and not req.is_finished:
            self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
        seq.text += seq.detokenizer.get_delta(finished=req.is_finished)
        # A stop string that cut the text is why the sequence stopped: also when it was found on the
        # token that reached max_tokens, or only in the tail released at the finish (a partial
        # character decoded as U+FFFD).
        stop = seq.detokenizer.stop_str
        if stop is not None and req.stop_reason != stop:
            req.finish(RequestStatus.FINISHED_STOPPED, stop_reason=stop)

    def _logprob_entry(self, token: int, sampled, row: int) -> dict[int, Logprob]:
        entry = {}
        for tid, lp in (sampled.top_logprobs[row] if sampled.top_logprobs else []):
            entry[tid] = Logprob(lp, None, self.tokenizer.decode([tid], skip_special_tokens=False))
        for rank, tid in enumerate(entry, start=1):
            entry[tid].rank = rank
        if token not in entry:
            rank = sampled.ranks[row] if sampled.ranks else None
            entry[token] = Logprob(sampled.logprobs[row], rank, self.tokenizer.decode([token], skip_special_tokens=False))
        return entry

    def _beam_output(self, group: _BeamGroup) -> RequestOutput:
        results = group.state.results(self.tokenizer.decode)
        completions = [
            CompletionOutput(index=i, text=seq.text, token_ids=seq.token_ids,
                             cumulative_logprob=seq.cumulative_logprob, logprobs=None,
                             finish_reason="stop" if seq.token_ids and seq.token_ids[-1] in self.eos_token_ids
                             and not group.state.params.ignore_eos else "length")
            for i, seq in enumerate(results.sequences)
        ]
        first = group.root
        now = time.time()
        return RequestOutput(group.request_id, first.prompt, first.prompt_token_ids, completions, True,
                             RequestMetrics(first.arrival_time, first.first_token_time, now, first.num_preemptions))

    def _output(self, group: _Group | _BeamGroup) -> RequestOutput | None:
        if isinstance(group, _BeamGroup):
            return self._beam_output(group)
        seqs = [group.seqs[i] for i in sorted(group.seqs)]
        if group.num_seqs > group.params.n:
            # best_of: only the final answer, the n most likely sequences.
            if not group.finished:
                return None
            seqs = sorted(seqs, key=lambda s: -s.request.cumulative_logprob)[:group.params.n]
        completions = [
            CompletionOutput(
                index=i, text=s.text, token_ids=list(s.request.output_token_ids),
                cumulative_logprob=s.request.cumulative_logprob, logprobs=s.logprobs,
                finish_reason=s.request.status.value if s.request.is_finished else None,
                stop_reason=s.request.stop_reason,
            )
            for i, s in enumerate(seqs)
        ]
        first = group.seqs[0].request
        times = [s.request.first_token_time for s in group.seqs.values() if s.request.first_token_time]
        finished_times = [s.request.finished_time for s in group.seqs.values() if s.request.finished_time]
        metrics = RequestMetrics(first.arrival_time, min(times) if times else None,
                                 max(finished_times) if group.finished else None,
                                 sum(s.request.num_preemptions for s in group.seqs.values()))
        return RequestOutput(group.request_id, first.prompt, first.prompt_token_ids, completions, group.finished,
                             metrics, num_cached_tokens=first.num_cached_tokens)

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

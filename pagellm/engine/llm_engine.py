"""The engine: add requests, step, abort. Built from its parts (engine/builder.py: the model,
the executor that runs it, the KV cache, the scheduler and the core), it puts together the three
jobs of a step: input processing (prompts and parameters -> sequences, all validation), the
engine core (schedule -> execute -> update) and output processing (text, logprobs,
`RequestOutput`), with beam search driven between core steps (`engine/beams.py`).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections import Counter

import numpy as np

from pagellm import envs
from pagellm.beam_search import BeamSearchParams
from pagellm.config import EngineConfig, structured_outputs_backend
from pagellm.core.request import Request, RequestStatus
from pagellm.core.stats import EngineStats
from pagellm.engine.beams import Beam, BeamRound, BeamState
from pagellm.engine.builder import build_engine_parts
from pagellm.engine.core import CoreStep
from pagellm.engine.groups import SequenceGroup
from pagellm.engine.input_processor import InputProcessor, PromptType
from pagellm.engine.output_processor import OutputProcessor
from pagellm.engine.structured_outputs import GrammarCompiler, xgrammar_available
from pagellm.loader.tokenizer import Tokenizer
from pagellm.outputs import RequestOutput
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import SamplingParams
from pagellm.timing import PhaseTimer, phase

logger = logging.getLogger("pagellm.engine")
# The block map shows the start of each prompt: this much of it.
PROMPT_HEAD_TOKENS, PROMPT_HEAD_CHARS = 24, 80


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        parts = build_engine_parts(config)
        self.model_path = parts.model_path
        self.tokenizer: Tokenizer = parts.tokenizer
        self.arch = parts.arch
        self.pooler_config = parts.pooler_config
        self.max_model_len = parts.max_model_len
        self.device = parts.device
        self.dtype = parts.dtype
        self.activation_quantization = parts.activation_quantization
        self.executor = parts.executor
        self.runner = parts.executor.driver  # rank 0's: the model, KV groups and format every rank shares
        self.kv = parts.kv
        self.kv_tier = parts.kv_tier
        self.scheduler = parts.scheduler
        self.core = parts.core
        self.eos_token_ids = parts.eos_token_ids
        self.outputs = OutputProcessor(self.tokenizer, self.eos_token_ids)
        self.inputs = InputProcessor(self.tokenizer, self.arch.vocab_size, self.max_model_len, config.max_num_seqs,
                                     self.kv, self.eos_token_ids)
        self._check_invariants = envs.check_invariants()  # PAGELLM_CHECK_INVARIANTS=1: after every step
        self.timer: PhaseTimer | None = None  # see attach_timer
        self.request_failures: Counter[str] = Counter()  # failed requests, by cause
        self._groups: dict[str, SequenceGroup] = {}
        self._seq_group: dict[str, SequenceGroup] = {}  # every sequence id in use -> its group
        self._grammars_lock = threading.Lock()

    # ---- requests ----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None, cache_salt: str | None = None) -> Request:
        """Validate, tokenize and queue a request. Raises ValueError, changing nothing, on bad input."""
        params = params or SamplingParams()
        self._check_request_id(request_id)
        self._check_generates()
        num_seqs = params.best_of or params.n
        self.inputs.check_num_seqs(num_seqs)
        taken = next((f"{request_id}#{i}" for i in range(1, num_seqs) if f"{request_id}#{i}" in self._seq_group),
                     None)
        if taken is not None:
            raise ValueError(f"request_id {taken!r} is already in use")
        text, ids = self.inputs.tokenize(prompt)
        self.inputs.validate(ids, params)
        grammar = None if params.structured_outputs is None else \
            self.grammars.grammar(params.structured_outputs, params.reasoning_section, params.reasoning_budget)
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
            grammar=grammar,
        )
        group = SequenceGroup(request_id, req, params, num_seqs)
        self.outputs.track(group, req)
        self._start(group)
        return req

    def add_pooling_request(self, request_id: str, prompt: PromptType, params: PoolingParams | None = None,
                            arrival_time: float | None = None) -> Request:
        """Validate, tokenize and queue an embedding request: its prompt is prefilled (in chunks,
        batched with the other requests), its final hidden states pooled (`self.pooler_config`,
        where `params` leaves a field None), nothing sampled. Its one output carries `embedding`.
        Raises ValueError, changing nothing, on bad input."""
        self._check_request_id(request_id)
        params = (params or PoolingParams()).resolve(self.pooler_config, self.arch.hidden_size,
                                                     os.path.basename(self.model_path))
        text, ids = self.inputs.tokenize(prompt)
        self.inputs.validate_pooling(ids)
        req = Request(request_id=request_id, prompt_token_ids=ids, sampling_params=SamplingParams(),
                      eos_token_ids=self.eos_token_ids, prompt=text, arrival_time=arrival_time or time.time(),
                      max_model_len=self.max_model_len, pooling_params=params)
        self._start(SequenceGroup(request_id, req, req.sampling_params, 1))
        return req

    def _check_generates(self) -> None:
        if not self.arch.has_lm_head:
            name = self.arch.hf_config.get('architectures', ['?'])[0]
            what = "scores (rerank, score) and embeddings" if name.endswith("ForSequenceClassification") \
                else "embeddings"
            raise ValueError(f"{os.path.basename(self.model_path)} has no language-model head (its config.json "
                             f"names {name}, a decoder without one): it serves {what} only")

    @property
    def grammars(self) -> GrammarCompiler:
        """Structured outputs' compiler, built on first use (it reads the whole vocabulary once).
        Thread-safe: the server compiles a request's grammar with it before handing the request over."""
        if self.core.grammars is None:
            with self._grammars_lock:
                if self.core.grammars is None:
                    if not xgrammar_available():
                        raise ValueError("structured outputs need the xgrammar package: pip install xgrammar")
                    self.core.grammars = GrammarCompiler(self.tokenizer, self.arch.vocab_size, self.eos_token_ids,
                                                         structured_outputs_backend(self.config.structured_outputs_config))
        return self.core.grammars

    def _check_request_id(self, request_id: str) -> None:
        self.inputs.check_request_id(request_id)
        if request_id in self._seq_group:
            raise ValueError(f"request_id {request_id!r} is already in use")

    def add_beam_request(self, request_id: str, prompt: PromptType, params: BeamSearchParams,
                         arrival_time: float | None = None) -> Request:
        """Queue a beam search. Its beams are sequences like any other; between core steps
        `BeamRound.advance` forks the chosen ones and drops the rest."""
        self._check_request_id(request_id)
        self._check_generates()
        text, ids = self.inputs.tokenize(prompt)
        w = params.beam_width
        # Each beam reads the top 2W continuations of its last position, greedily "sampled".
        seq_params = SamplingParams(temperature=0.0, max_tokens=params.max_tokens, ignore_eos=True, logprobs=2 * w)
        # A round waits for every beam, so all W must be able to hold their blocks at once.
        self.inputs.validate(ids, seq_params, num_seqs=w, seqs_at_once=w)
        req = Request(request_id=request_id, prompt_token_ids=ids, sampling_params=seq_params,
                      eos_token_ids=self.eos_token_ids, prompt=text, arrival_time=arrival_time or time.time(),
                      max_model_len=self.max_model_len, caller_appends=True)
        state = BeamState(params, self.eos_token_ids, [Beam(request_id, [], np.float32(0))])
        self._start(SequenceGroup(request_id, req, seq_params, 1, beams=BeamRound(request_id, state, {request_id: req})))
        return req

    def _start(self, group: SequenceGroup) -> None:
        self._groups[group.request_id] = group
        self._seq_group.update(dict.fromkeys(group.seq_ids(), group))
        self.core.add(group.root)

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Stop requests wherever they are; their blocks return to the pool at once."""
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            group = self._groups.get(rid)
            if group is not None:
                self._abort_group(group)

    def abort_with_outputs(self, request_ids: list[str], reason: str) -> list[RequestOutput]:
        """Stop requests as `abort_request` does and return each one's final output: what it has
        generated so far, finish_reason "abort" (the server's answer to requests still running when
        it shuts down). A best_of or beam-search request, ranked only at its end, has nothing to
        show yet: its output carries `reason` as its error."""
        outputs = []
        for rid in request_ids:
            group = self._groups.get(rid)
            if group is None:
                continue
            self._abort_group(group)
            unranked = group.beams is not None or group.num_seqs > group.params.n
            out = None if unranked or group.root.pooling_params is not None else self.outputs.output(group)
            if out is None:
                out = self.outputs.failure(group, RuntimeError(reason))
            else:  # samples not forked yet have no text to show: the request still ends here
                out = dataclasses.replace(out, finished=True)
            outputs.append(out)
        return outputs

    def _abort_group(self, group: SequenceGroup) -> None:
        for sid in group.seq_ids():
            self.core.finish(sid, RequestStatus.FINISHED_ABORTED)
        self._drop(group)

    def _drop(self, group: SequenceGroup) -> None:
        del self._groups[group.request_id]
        for sid in group.seq_ids():
            self._seq_group.pop(sid, None)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished()

    # ---- the loop ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine-core step (schedule, run the model, sample, update) and return an
        output for every request that received tokens or failed (`RequestOutput.error` set,
        its blocks freed).

        A failure stays with the request that caused it: the core finds by bisection the
        requests whose part of a batch raises (`EngineCore._execute`), a row whose logits
        cannot be sampled fails its own request, and so does an error while formatting one
        request's output here. Only an `EngineFatalError` (the engine cannot step at all)
        propagates.
        """
        with phase(self.timer, "step"):
            outputs = self._process(self.core.step())
        if self._check_invariants:
            self.kv.check_integrity()
        return outputs

    def attach_timer(self, timer: PhaseTimer | None) -> None:
        """Time each phase of every step into `timer` (pagellm.timing); None detaches it."""
        self.timer = self.core.timer = timer
        self.executor.attach_timer(timer)

    def _process(self, out: CoreStep) -> list[RequestOutput]:
        """From what the core did to outputs: fail what failed, drive the beams, detokenize."""
        outputs = [self._fail(self._groups[gid], error, cause) for gid, (error, cause) in out.failures.items()
                   if gid in self._groups]
        for child in out.forked:
            self.outputs.track(self._groups[child.group_id], child)
        for req, pooled in out.pooled.values():
            group = self._groups.get(req.group_id)
            if group is None:
                continue
            try:
                outputs.append(self.outputs.embedding_output(group, pooled))
            except Exception as e:  # one request's failure must not take down the others
                outputs.append(self._fail(group, e, "output_error"))
                continue
            self._drop(group)
        touched: dict[str, SequenceGroup] = {}
        failed: dict[str, Exception] = {}
        for sid in out.held:
            group = self._groups[self.scheduler.requests[sid].group_id]
            if group.request_id in failed or not group.beams.report(sid, out.sampled.top_logprobs[out.rows[sid][0]]):
                continue
            touched[group.request_id] = group
            try:
                created, dropped = group.beams.advance(self.core)
            except Exception as e:  # one request's failure must not take down the others
                failed[group.request_id] = e
                continue
            self._seq_group.update(dict.fromkeys(created, group))
            for sid_ in dropped:
                self._seq_group.pop(sid_, None)
        for req in out.updated:
            group = self._groups.get(req.group_id)
            if group is None or group.request_id in failed:
                continue
            try:
                seq = group.texts[req.index]
                if self.outputs.append(seq, out.sampled, out.rows[req.request_id]) and not req.is_finished:
                    self.core.finish(req.request_id, RequestStatus.FINISHED_STOPPED)
                self.outputs.release_text(seq)
            except Exception as e:  # one request's failure must not take down the others
                failed[group.request_id] = e
            touched[group.request_id] = group
        for group in touched.values():
            try:
                if group.request_id in failed:
                    raise failed[group.request_id]
                output = self.outputs.output(group)
            except Exception as e:
                outputs.append(self._fail(group, e, "output_error"))
                continue
            if output is not None:
                outputs.append(output)
            if group.finished:
                self._drop(group)
        return outputs

    def _fail(self, group: SequenceGroup, error: Exception, cause: str) -> RequestOutput:
        """Abort a request that failed (counted under `cause`); its blocks go back at once."""
        self.request_failures[cause] += 1
        self.abort_request(group.request_id)
        return self.outputs.failure(group, error)

    def memory_report(self) -> list[dict]:
        """Per rank (one entry without tensor parallelism): bytes of weights and of KV cache it
        holds, its KV heads, and its peak memory so far."""
        return self.executor.memory_report()

    def cache_config(self) -> dict:
        """The KV cache's settings as vLLM's cache config names them (the labels of the server's
        pagellm:cache_config_info)."""
        cfg = self.config
        return {"block_size": cfg.block_size, "num_gpu_blocks": self.kv.num_blocks,
                "cache_dtype": self.runner.kv_format.name, "enable_prefix_caching": cfg.enable_prefix_caching,
                "kv_policy": cfg.kv_policy}

    def model_cost(self) -> dict:
        """The model's FLOPs per computed token and weight bytes streamed per step, all ranks
        together (CausalLM.compute_cost): what a roofline divides by time."""
        ranks = self.memory_report()
        cost = {k: sum(r[k] for r in ranks) for k in ("flops_per_token", "weight_bytes_per_step")}
        if "expert_weight_bytes" in ranks[0]:  # a mixture of experts (compute_cost)
            cost.update(expert_weight_bytes=sum(r["expert_weight_bytes"] for r in ranks),
                        expert_share=ranks[0]["expert_share"])
        return cost

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any, and close the KV tier (writing what it has
        queued); the engine cannot step afterwards. Also done at garbage collection and
        interpreter exit."""
        try:
            if self.kv_tier is not None and self.kv_tier.is_open:
                self.executor.close_kv_tier(self.kv.cached_blocks())
        finally:
            self.executor.shutdown()

    def kv_snapshot(self) -> dict:
        """Who holds which physical block right now: the data behind a block map."""
        snapshot = self.kv.snapshot()
        # Sequence id -> the user request it belongs to (n > 1 forks several).
        snapshot["sequence_groups"] = {rid: self.scheduler.requests[rid].group_id
                                       for rid in snapshot["tables"] if rid in self.scheduler.requests}
        # Every unfinished sequence, running ones in admission order, then the waiting queue in order.
        snapshot["sequences"] = ([self._describe(r, "running") for r in self.scheduler.running] +
                                 [self._describe(r, "preempted" if r.num_preemptions else "waiting")
                                  for r in self.scheduler.waiting])
        snapshot["recent_preemptions"] = [{"time": t, "id": rid} for t, rid in self.scheduler.recent_preemptions]
        return snapshot

    def _describe(self, req: Request, state: str) -> dict:
        """One sequence for the block map: where it stands and how its prompt starts."""
        if state == "running" and req.num_computed_tokens < req.num_prompt_tokens:
            state = "prefill"
        head = req.prompt if req.prompt is not None else self.tokenizer.decode(req.prompt_token_ids[:PROMPT_HEAD_TOKENS])
        return {"id": req.request_id, "group": req.group_id or req.request_id, "state": state,
                "prompt_tokens": req.num_prompt_tokens, "output_tokens": len(req.output_token_ids),
                "computed_tokens": req.num_computed_tokens, "preemptions": req.num_preemptions,
                "arrival_time": req.arrival_time, "prompt_head": head[:PROMPT_HEAD_CHARS]}

    def stats(self) -> EngineStats:
        return dataclasses.replace(self.core.stats(), request_failures=dict(self.request_failures),
                                   max_model_len=self.max_model_len)


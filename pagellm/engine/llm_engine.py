"""The engine: add requests, step, abort. One step = schedule, run the model, sample,
update the requests, detokenize and emit outputs."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from pagellm.config import EngineConfig
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.request import Request, RequestStatus
from pagellm.core.scheduler import Scheduler
from pagellm.engine.detokenizer import IncrementalDetokenizer
from pagellm.model.loader import load_model_source
from pagellm.model.tokenizer import Tokenizer
from pagellm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagellm.sampling_params import SamplingParams
from pagellm.worker.model_runner import ModelRunner, resolve_device, resolve_dtype

PromptType = str | list[int] | dict


@dataclass
class _Tracked:
    """Engine-side state of a request that the scheduler need not know."""

    request: Request
    detokenizer: IncrementalDetokenizer
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None


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
        self.runner = ModelRunner(self.arch, self.device, self.dtype, self.max_model_len, seed=config.seed)
        if source.weights is None:
            self.runner.init_dummy_weights(config.seed)
        else:
            self.runner.load_weights(source.weights())
        num_blocks = config.num_kv_blocks or self.runner.num_blocks_for_budget(
            config.block_size, config.kv_cache_memory)
        self.runner.allocate_kv_cache(num_blocks, config.block_size)
        self.kv = KVCacheManager(num_blocks, config.block_size)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        eos = set(self.arch.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self._tracked: dict[str, _Tracked] = {}

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
            return prompt, self.tokenizer.encode(prompt) if prompt else []
        if isinstance(prompt, list):
            return None, list(prompt)
        raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> Request:
        params = params or SamplingParams()
        if request_id in self._tracked:
            raise ValueError(f"request_id {request_id!r} is already in use")
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
        )
        if params.seed is not None:
            req.generator = torch.Generator(device=self.device).manual_seed(params.seed)
        self._tracked[request_id] = _Tracked(req, IncrementalDetokenizer(self.tokenizer, ids, params),
                                             logprobs=[] if params.logprobs is not None else None)
        self.scheduler.add_request(req)
        return req

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise ValueError("prompt must not be empty")
        vocab = self.arch.vocab_size
        bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids contains {bad!r}, outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}, "
                             f"which must hold the prompt plus at least one generated token")
        if params.logprobs is not None and params.logprobs > vocab:
            raise ValueError(f"logprobs must be <= the vocabulary size ({vocab}), got {params.logprobs}")
        if params.n > 1 or (params.best_of or 1) > 1:
            raise ValueError("n > 1 and best_of > 1 are not supported yet (parallel sampling comes with KV sharing)")
        longest = min(len(ids) + (params.max_tokens or self.max_model_len), self.max_model_len)
        need = self.kv.blocks_for(longest)
        if need > self.kv.num_blocks:
            raise ValueError(
                f"the request needs up to {need} KV blocks ({longest} tokens at block_size {self.kv.block_size}) "
                f"but the whole KV pool has {self.kv.num_blocks}; lower max_tokens or enlarge the pool")

    def abort_request(self, request_ids: str | list[str]) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            self.scheduler.finish_request(rid, RequestStatus.FINISHED_ABORTED)
            self._tracked.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ---- the loop ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        result = self.runner.execute(sched, set(self.eos_token_ids))
        sampled = {}
        if result.sampled is not None:
            sampled = dict(zip(result.request_ids, result.sampled.token_ids))
        updated = self.scheduler.update_after_step(sched, sampled)
        rows = {rid: i for i, rid in enumerate(result.request_ids)}
        return [self._emit(req, result.sampled, rows[req.request_id]) for req in updated]

    def _emit(self, req: Request, sampled, row: int) -> RequestOutput:
        tr = self._tracked[req.request_id]
        token = req.output_token_ids[-1]
        req.cumulative_logprob += sampled.logprobs[row]
        if tr.logprobs is not None:
            tr.logprobs.append(self._logprob_entry(token, sampled, row))
        stop = tr.detokenizer.update([token])
        if stop is not None and not req.is_finished:
            self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
            req.stop_reason = stop
        delta = tr.detokenizer.get_delta(finished=req.is_finished)
        tr.text += delta
        if req.is_finished:
            del self._tracked[req.request_id]
        return self._output(req, tr, delta)

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

    def _output(self, req: Request, tr: _Tracked, delta: str) -> RequestOutput:
        finish = req.status.value if req.is_finished else None
        completion = CompletionOutput(
            index=0, text=tr.text, token_ids=list(req.output_token_ids),
            cumulative_logprob=req.cumulative_logprob, logprobs=tr.logprobs,
            finish_reason=finish, stop_reason=req.stop_reason,
        )
        metrics = RequestMetrics(req.arrival_time, req.first_token_time, req.finished_time, req.num_preemptions)
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [completion],
                             req.is_finished, metrics, delta_text=delta)

    def kv_snapshot(self) -> dict:
        """Who holds which physical block right now: the data behind a block map."""
        pool = self.kv.pool
        return {
            "block_size": self.kv.block_size,
            "num_blocks": pool.num_blocks,
            "ref_cnt": list(pool.ref_cnt),
            "tables": {rid: list(t) for rid, t in self.kv.block_tables.items()},
        }

    def stats(self) -> dict:
        pool = self.kv.pool
        return {
            "total_blocks": pool.num_blocks,
            "free_blocks": pool.num_free_blocks,
            "used_blocks": pool.num_used_blocks,
            "block_size": self.kv.block_size,
            "kv_cache_usage": self.kv.usage(),
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_preemptions": self.scheduler.num_preemptions,
            "max_model_len": self.max_model_len,
        }

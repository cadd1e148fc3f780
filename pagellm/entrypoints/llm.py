"""The offline API: `LLM(...).generate(prompts, sampling_params)`, shaped like vLLM's."""
from __future__ import annotations

import itertools
from typing import Any, Sequence

from pagellm.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from pagellm.config import make_config, signature_with_options
from pagellm.engine.llm_engine import LLMEngine, PromptType
from pagellm.entrypoints.scoring import (HEAD_POOLING, classifier_params, classifier_score, classifier_token_ids,
                                         cosine, pair_token_ids, pair_up)
from pagellm.loader.score_head import read_score_head
from pagellm.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput, ScoringOutput, ScoringRequestOutput
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import SamplingParams

Conversation = list[dict]


class LLM:
    """Loads a model once and runs batches of prompts through the paged engine."""

    def __init__(self, model: str | None = None, **options: Any) -> None:
        """`model` and any engine option (`pagellm.config.EngineConfig`: dtype, block_size,
        num_kv_blocks, kv_cache_memory, max_num_seqs, ...), as keywords."""
        config = make_config(model=model, **options)
        self.engine = LLMEngine(config)
        self._ids = itertools.count()
        # A cross-encoder's score head (None for any other model): what LLM.score applies.
        self.score_head = read_score_head(self.engine.model_path)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order.

        All prompts are validated before any runs, so one bad prompt harms no other.
        """
        prompts = _as_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        ids = self._add_all(lambda rid, i: self.engine.add_request(rid, prompts[i], params[i]), len(prompts))
        return self._run(ids, use_tqdm)

    def embed(self, prompts: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """The embedding of every prompt (`.outputs.embedding`), in input order: each prompt is
        prefilled, batched with the others, and its final hidden states pooled as the model's
        sentence-transformers files say (or `pooler_config`; `pooling_params` per prompt)."""
        prompts = _as_list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params = [pooling_params] * len(prompts)
        else:
            params = list(pooling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} pooling_params for {len(prompts)} prompts")
        ids = self._add_all(lambda rid, i: self.engine.add_pooling_request(rid, prompts[i], params[i]), len(prompts))
        return [EmbeddingRequestOutput(out.request_id, EmbeddingOutput(out.embedding), out.prompt_token_ids)
                for out in self._run(ids, use_tqdm)]

    def score(self, text_1: str | Sequence[str], text_2: str | Sequence[str],
              use_tqdm: bool = True) -> list[ScoringRequestOutput]:
        """Each pair's score (`.outputs.score`), paired as vLLM's `LLM.score` pairs them: 1:1, one
        against each of N, or N:N in order. The cosine of the texts' embeddings (each distinct
        text embedded once, by the model's own pooling); with the classifier_from_token option,
        the yes/no reranker's probability after the pair's tokens (entrypoints/scoring.py); for a
        cross-encoder, its score head's output after the pair (loader/score_head.py)."""
        side_1, side_2 = ([t] if isinstance(t, str) else list(t) for t in (text_1, text_2))
        pairs = [(side_1[i], side_2[j]) for i, j in pair_up(len(side_1), len(side_2)) or ()]
        if not pairs:
            raise ValueError(f"text_1 and text_2 must pair 1:1, 1:N or N:N, got {len(side_1)}:{len(side_2)}")
        words = self.engine.config.classifier_from_token
        head = self.score_head
        if head is not None:
            head.check_scores()
            tok = self.engine.tokenizer
            prompts = [head.pair_ids(tok, a, b) for a, b in pairs]
            outs = self.embed([{"prompt_token_ids": ids} for ids in prompts], HEAD_POOLING, use_tqdm=use_tqdm)
            scores = [head.score(o.outputs.embedding) for o in outs]
        elif words is not None:
            tok = self.engine.tokenizer
            token_ids = classifier_token_ids(words, lambda w: tok.encode(w, add_special_tokens=False))
            prompts = [pair_token_ids(tok, a, b) for a, b in pairs]
            outs = self.generate([{"prompt_token_ids": ids} for ids in prompts for _ in range(2)],
                                 classifier_params(token_ids) * len(pairs), use_tqdm=use_tqdm)
            scores = [classifier_score(outs[2 * k:2 * k + 2], token_ids) for k in range(len(pairs))]
        else:
            distinct = list(dict.fromkeys(side_1 + side_2))
            of = dict(zip(distinct, self.embed(distinct, use_tqdm=use_tqdm)))
            scores = [cosine(of[a].outputs.embedding, of[b].outputs.embedding) for a, b in pairs]
            prompts = [of[a].prompt_token_ids + of[b].prompt_token_ids for a, b in pairs]
        return [ScoringRequestOutput(str(next(self._ids)), ScoringOutput(score), ids)
                for score, ids in zip(scores, prompts)]

    def _add_all(self, add, count: int) -> list[str]:
        """Add every request or none: one that fails validation withdraws the others."""
        ids: list[str] = []
        try:
            for i in range(count):
                rid = str(next(self._ids))
                add(rid, i)
                ids.append(rid)
        except Exception:
            self.engine.abort_request(ids)
            raise
        return ids

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Render each conversation with the model's chat template, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.engine.tokenizer
        prompts = [{"prompt_token_ids": tok.encode(tok.apply_chat_template(c, add_generation_prompt=add_generation_prompt),
                                                   add_special_tokens=False)} for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search for each prompt; all prompts' beams run in the same batches.

        Each result's `.sequences` are sorted best first (by cumulative logprob over
        generated_length ** length_penalty, as in Hugging Face transformers).
        """
        prompts = _as_list(prompts)
        ids = self._add_all(lambda rid, i: self.engine.add_beam_request(rid, prompts[i], params), len(prompts))
        results = []
        for out in self._run(ids, use_tqdm):
            seqs = [BeamSearchSequence(c.token_ids, c.text, c.cumulative_logprob,
                                       c.cumulative_logprob / max(1, len(c.token_ids)) ** params.length_penalty)
                    for c in out.outputs]
            results.append(BeamSearchOutput(seqs))
        return results

    def stats(self) -> dict:
        """The engine's counters as a plain dict (docs/python.md lists the keys); the typed form
        is `self.engine.stats()`."""
        return self.engine.stats().to_dict()

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes, if any (also done at exit)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(ids), desc="Processed prompts", unit="req")
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.error is not None:
                        raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                    if out.finished:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            self.engine.abort_request([i for i in ids if i not in done])
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[i] for i in ids]


LLM.__init__.__signature__ = signature_with_options(LLM.__init__)


def _as_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    # A flat list of ints is one tokenized prompt, not many.
    if prompts and isinstance(prompts[0], int):
        return [prompts]
    return prompts

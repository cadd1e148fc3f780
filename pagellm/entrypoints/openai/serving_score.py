"""POST /score and /rerank (vLLM's shapes; /rerank is also Jina's and Cohere's): text pairs scored
by the cosine of their embeddings, made by the embeddings endpoint's pooling requests, each
distinct text embedded once (a rerank's query once for all its documents); for a cross-encoder
(a *ForSequenceClassification checkpoint), by its score head after each pair (loader/score_head.py);
or, with --classifier-from-token, by a causal LM's yes/no logits after each pair (entrypoints/scoring.py)."""
from __future__ import annotations

from starlette.requests import Request

from pagellm.entrypoints.openai.errors import bad_request, check_request_text
from pagellm.entrypoints.openai.protocol import RerankRequest, ScoreRequest
from pagellm.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from pagellm.entrypoints.openai.serving_engine import random_id
from pagellm.entrypoints.scoring import (HEAD_POOLING, MAX_SCORE_DOCUMENTS, classifier_params, classifier_score,
                                         classifier_token_ids, cosine, pair_token_ids, pair_up)
from pagellm.loader.score_head import read_score_head


class OpenAIServingScore:
    def __init__(self, embeddings: OpenAIServingEmbedding, classifier_from_token: list[str] | None = None) -> None:
        self.embeddings = embeddings
        tokenizer = embeddings.tokenizer
        # --classifier-from-token's words as token ids (None: pairs are scored by cosine).
        self.classifier = None if classifier_from_token is None else \
            classifier_token_ids(classifier_from_token, lambda w: tokenizer.encode(w, add_special_tokens=False))
        # A cross-encoder's score head (None for any other model).
        self.head = read_score_head(embeddings.engine.model_path)

    async def create_score(self, req: ScoreRequest, raw_request: Request) -> dict:
        self._check(req)
        side_1, side_2 = (_texts(t, name) for t, name in ((req.text_1, "text_1"), (req.text_2, "text_2")))
        pairs = pair_up(len(side_1), len(side_2))
        if pairs is None:
            raise bad_request(f"text_1 and text_2 must pair 1:1, 1:N or N:N (as vLLM's /score), got "
                              f"{len(side_1)}:{len(side_2)}", param="text_2")
        request_id = random_id("score")
        scores, tokens = await self._scores(request_id, [(side_1[i], side_2[j]) for i, j in pairs],
                                            req.truncate_prompt_tokens, raw_request, "text_2")
        return {"id": request_id, "object": "list", "created": self.embeddings.now(),
                "model": self.embeddings.model_name,
                "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}}

    async def create_rerank(self, req: RerankRequest, raw_request: Request) -> dict:
        self._check(req)
        documents = [_document(d, i) for i, d in enumerate(req.documents)]
        _texts(documents, "documents")
        top_n = req.top_n or len(documents)
        if isinstance(top_n, bool) or top_n < 0:
            raise bad_request(f"top_n must be an integer >= 0 (0: every document), got {req.top_n!r}", param="top_n")
        request_id = random_id("rerank")
        scores, tokens = await self._scores(request_id, [(req.query, d) for d in documents],
                                            req.truncate_prompt_tokens, raw_request, "documents")
        ranked = sorted(range(len(documents)), key=lambda i: -scores[i])[:top_n]
        return {"id": request_id, "model": self.embeddings.model_name, "usage": {"total_tokens": tokens},
                "results": [{"index": i, "relevance_score": scores[i],
                             **({"document": {"text": documents[i]}} if req.return_documents else {})}
                            for i in ranked]}

    def _check(self, req: ScoreRequest | RerankRequest) -> None:
        self.embeddings.check_model(req.model)
        for name, why in req.unsupported_fields():  # never silently ignored
            raise bad_request(f"{name} is not supported: {why}", param=name)

    async def _scores(self, request_id: str, pairs: list[tuple[str, str]], truncate_prompt_tokens: int | None,
                      raw_request: Request, field: str) -> tuple[list[float], int]:
        """Each pair's score, and the prompt tokens it took (`field`: the texts' name, for errors)."""
        if self.head is not None:
            return await self._headed(request_id, pairs, truncate_prompt_tokens, raw_request, field)
        if self.classifier is not None:
            return await self._classified(request_id, pairs, truncate_prompt_tokens, raw_request, field)
        distinct = list(dict.fromkeys(t for pair in pairs for t in pair))
        prompts = self.embeddings.parse_prompts(distinct, field)
        vectors, tokens = await self.embeddings.embed(request_id, prompts, raw_request, field,
                                                      truncate_prompt_tokens)
        of = dict(zip(distinct, vectors))
        return [cosine(of[a], of[b]) for a, b in pairs], tokens

    async def _headed(self, request_id: str, pairs: list[tuple[str, str]], truncate_prompt_tokens: int | None,
                      raw_request: Request, field: str) -> tuple[list[float], int]:
        """Each pair's cross-encoder score: its score head on the pair's last hidden state."""
        try:
            self.head.check_scores()
        except ValueError as e:
            raise bad_request(f"{self.embeddings.model_name}: {e}", param="model") from None
        serving = self.embeddings
        prompts = []
        for query, document in pairs:
            check_request_text(field, query + document)
            prompts.append((None, self.head.pair_ids(serving.tokenizer, query, document)))
        vectors, tokens = await serving.embed(request_id, prompts, raw_request, field, truncate_prompt_tokens,
                                              pooling=HEAD_POOLING)
        return [self.head.score(v) for v in vectors], tokens

    async def _classified(self, request_id: str, pairs: list[tuple[str, str]], truncate_prompt_tokens: int | None,
                          raw_request: Request, field: str) -> tuple[list[float], int]:
        """Each pair's yes/no score: two one-token requests after its query's tokens then its document's."""
        serving, limit = self.embeddings, self.embeddings.max_model_len
        prompts = []
        for i, (query, document) in enumerate(pairs):
            check_request_text(field, query + document)
            ids = serving.truncate(pair_token_ids(serving.tokenizer, query, document), truncate_prompt_tokens)
            if len(ids) >= limit:
                raise bad_request(f"This model's maximum context length is {limit} tokens. However, pair {i} (the "
                                  f"query's and {field} {i}'s tokens) has {len(ids)}, which leaves no room to score "
                                  f"it. Send shorter texts, or truncate_prompt_tokens.", param=field,
                                  code="context_length_exceeded")
            prompts += [(None, ids)] * 2
        streams = await serving.add_requests(request_id, prompts, classifier_params(self.classifier) * len(pairs))
        finals = await serving.collect(raw_request, streams)
        scores = [classifier_score(finals[2 * k:2 * k + 2], self.classifier) for k in range(len(pairs))]
        return scores, sum(len(ids) for _, ids in prompts[::2])


def _texts(value: str | list[str], field: str) -> list[str]:
    """One side of the pairs as a list, within MAX_SCORE_DOCUMENTS."""
    texts = [value] if isinstance(value, str) else value
    if not texts:
        raise bad_request(f"{field} must not be empty", param=field)
    if len(texts) > MAX_SCORE_DOCUMENTS:
        raise bad_request(f"{field} holds {len(texts)} texts; this server scores at most {MAX_SCORE_DOCUMENTS} in "
                          f"one request", param=field)
    return texts


def _document(doc: str | dict, i: int) -> str:
    """A rerank document: a text, or {"text": ...}."""
    if isinstance(doc, str):
        return doc
    if set(doc) != {"text"} or not isinstance(doc["text"], str):
        raise bad_request(f"documents[{i}] must be a string or {{\"text\": string}}, got keys {sorted(doc)}",
                          param=f"documents[{i}]")
    return doc["text"]

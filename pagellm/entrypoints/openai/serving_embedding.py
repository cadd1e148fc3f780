"""POST /v1/embeddings: one or many inputs (text or token ids) made embedding vectors by the
engine's pooling requests, as floats or base64 (little-endian float32, what the openai client
asks for by default)."""
from __future__ import annotations

import base64
import struct

from starlette.requests import Request

from pagellm.entrypoints.openai.errors import OpenAIError, bad_request
from pagellm.entrypoints.openai.protocol import EmbeddingRequest
from pagellm.entrypoints.openai.serving_engine import OpenAIServing, random_id
from pagellm.pooling_params import PoolingParams

ENCODING_FORMATS = ("float", "base64")


class OpenAIServingEmbedding(OpenAIServing):
    async def create_embedding(self, req: EmbeddingRequest, raw_request: Request) -> dict:
        self.check_model(req.model)
        for name, why in req.unsupported_fields():  # never silently ignored
            raise bad_request(f"{name} is not supported: {why}", param=name)
        if req.encoding_format not in ENCODING_FORMATS:
            raise bad_request(f"encoding_format must be one of {', '.join(ENCODING_FORMATS)}, got "
                              f"{req.encoding_format!r}", param="encoding_format")
        prompts = self.parse_prompts(req.input, "input", req.add_special_tokens)
        request_id = random_id("embd")
        vectors, num_tokens = await self.embed(request_id, prompts, raw_request, "input", req.truncate_prompt_tokens,
                                               req.dimensions)
        encode = _base64 if req.encoding_format == "base64" else list
        return {"id": request_id, "object": "list", "created": self.now(), "model": self.model_name,
                "data": [{"object": "embedding", "index": i, "embedding": encode(v)} for i, v in enumerate(vectors)],
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}

    async def embed(self, request_id: str, prompts: list[tuple[str | None, list[int]]], raw_request: Request,
                    field: str, truncate_prompt_tokens: int | None = None,
                    dimensions: int | None = None,
                    pooling: PoolingParams | None = None) -> tuple[list[list[float]], int]:
        """The embedding of each prompt (text, token ids), and the tokens they took; a 400 names
        `field` (the API's name for its inputs) for a prompt too long or refused. `pooling`: the
        request's params in place of the model's default (and of `dimensions`)."""
        prompts = [(text, self.truncate(ids, truncate_prompt_tokens)) for text, ids in prompts]
        for i, (_, ids) in enumerate(prompts):
            if len(ids) > self.max_model_len:
                raise bad_request(f"This model's maximum context length is {self.max_model_len} tokens. However, "
                                  f"{field} {i} has {len(ids)} tokens. Please reduce its length, or send "
                                  f"truncate_prompt_tokens to keep its last tokens.", param=field,
                                  code="context_length_exceeded")
        try:
            params = pooling or PoolingParams(dimensions=dimensions)
        except ValueError as e:
            raise bad_request(str(e), param="dimensions") from None
        try:
            streams = await self.add_requests(request_id, prompts, [params] * len(prompts))
        except OpenAIError as e:
            if e.param in ("prompt", "prompt_token_ids"):  # what the engine calls this API's input
                e.param = field
            raise
        finals = await self.collect(raw_request, streams)
        return [out.embedding for out in finals], sum(len(ids) for _, ids in prompts)


def _base64(vector: list[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")

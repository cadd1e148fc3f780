"""Request bodies of the OpenAI API, as pydantic models; field names and defaults follow
OpenAI, plus vLLM's extra sampling fields (top_k, min_p, repetition_penalty, ignore_eos, ...).

No field is silently ignored: a request field that is neither declared here nor listed in
ACCEPTED_WITHOUT_EFFECT (with the reason it has no effect) is a 400 that names it. Types are strict, as OpenAI's own API is: no string or boolean where a number is due
("2", true), no NaN or Infinity; an int is accepted where a float is due. Range checks live
in `SamplingParams`, which names the field it rejects.
"""
from __future__ import annotations

import dataclasses
import typing
from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field, create_model

from pagellm.sampling_params import OPENAI_FIELDS, SamplingParams

# OpenAI allows 5 for completions and 20 for chat; vLLM's default cap is 20 for both.
MAX_LOGPROBS = 20

# OpenAI request fields pagellm takes and does nothing with, and why (docs/serving.md lists them).
ACCEPTED_WITHOUT_EFFECT = {
    "user": "an end-user id for OpenAI's abuse monitoring; pagellm keeps no per-user records",
    "store": "OpenAI keeps completions for its dashboard when true; pagellm stores nothing",
    "metadata": "tags for completions OpenAI stores (see store)",
    "service_tier": "OpenAI's processing tiers; pagellm has one",
}

# Fields clients send that pagellm does not implement yet, and what to say about them.
NOT_YET = {
    "json_schema": 'a JSON schema goes in response_format: {"type": "json_schema", "json_schema": {"schema": ...}}',
    **dict.fromkeys(("guided_whitespace_pattern", "structural_tag"),
                    "structured outputs here take a JSON schema, any JSON object, a regex, a choice or a grammar"),
    **dict.fromkeys(("functions", "function_call"),
                    "OpenAI's deprecated function calling; send tools and tool_choice instead"),
}


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    def unsupported_fields(self) -> list[tuple[str, str]]:
        """(field, why) for every field sent that this server would otherwise ignore."""
        sent = (self.model_extra or {}).keys() - ACCEPTED_WITHOUT_EFFECT.keys()
        return [(name, NOT_YET.get(name, "it is not a parameter this server knows")) for name in sorted(sent)]


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _RequestFields(OpenAIModel):
    model: str | None = None
    n: int = 1
    logit_bias: dict[str, float] | None = None  # token id (as a string, OpenAI's shape) -> bias
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted without effect: see ACCEPTED_WITHOUT_EFFECT
    # vLLM's extras: beam search over n beams (returned best first), ranked by cumulative logprob
    # over length ** length_penalty.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # Structured outputs, in every spelling clients use (entrypoints/openai/structured.py).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None


def _sampling_fields() -> dict[str, Any]:
    """SamplingParams' OPENAI_FIELDS as request fields: the same type (null allowed, meaning the
    default) and the same default."""
    hints = typing.get_type_hints(SamplingParams)
    defaults = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
    return {name: (hints[name] | None, defaults[name]) for name in OPENAI_FIELDS}


# The fields both endpoints share: the sampling ones declared once, in SamplingParams.
SamplingFields = create_model("SamplingFields", __base__=_RequestFields, **_sampling_fields())


PromptField = Union[str, list[int], list[str], list[list[int]]]


class CompletionRequest(SamplingFields):
    prompt: PromptField
    best_of: int | None = None
    echo: bool = False
    logprobs: int | None = None
    max_tokens: int | None = 16  # 0: with echo, score the prompt and generate nothing (lm-eval)
    suffix: str | None = None
    prompt_logprobs: int | None = None  # vLLM's extra: choices[i].prompt_logprobs
    return_token_ids: bool = False      # vLLM's extra: prompt_token_ids and token_ids in each choice
    truncate_prompt_tokens: int | None = None  # vLLM's extra: keep only the prompt's last k tokens


class ContentPart(OpenAIModel):
    type: str
    text: str | None = None


class ChatMessage(OpenAIModel):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls, sent back in an agent loop
    tool_call_id: str | None = None  # a tool message: the call it answers
    reasoning_content: str | None = None  # an assistant's reasoning, sent back (templates that show it read it)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    prompt_logprobs: int | None = None  # vLLM's extra: the response's prompt_logprobs
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the reply continues the last message (vLLM's extra)
    echo: bool = False  # the last message's text, when it is the assistant's, starts the reply's
    return_token_ids: bool = False
    truncate_prompt_tokens: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: the most tokens the reasoning may spend before its close is forced (needs --reasoning-parser).
    thinking_token_budget: int | None = None
    # OpenAI's: none, minimal, low, medium or high, as the model's chat template reads it (reasoning.effort_switch).
    reasoning_effort: str | None = None


class EmbeddingRequest(OpenAIModel):
    input: PromptField
    model: str | None = None
    encoding_format: str = "float"  # or "base64": little-endian float32 bytes (what the openai client asks for)
    dimensions: int | None = None   # Matryoshka models only
    user: str | None = None  # accepted without effect: see ACCEPTED_WITHOUT_EFFECT
    truncate_prompt_tokens: int | None = None  # vLLM's extra: keep only each input's last k tokens
    add_special_tokens: bool = True  # vLLM's extra


class ScoreRequest(OpenAIModel):
    """vLLM's /score: text_1 against text_2, 1:1, 1:N or N:N."""
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = None


class RerankRequest(OpenAIModel):
    """/rerank as vLLM serves it (Jina's and Cohere's shape): documents ranked by relevance to query."""
    model: str | None = None
    query: str
    documents: list[str | dict[str, Any]]  # a text, or {"text": ...} (Cohere's v1 and Jina's objects)
    top_n: int | None = None  # None or 0: all of them
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None


class TokenizeRequest(OpenAIModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False  # the tokens' own strings (the vocabulary's spelling), as vLLM


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]



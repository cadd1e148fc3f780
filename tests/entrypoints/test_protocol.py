"""The OpenAI request models take the sampling fields SamplingParams declares (one table:
OPENAI_FIELDS), with the same defaults, and hand them over unchanged."""
from __future__ import annotations

import dataclasses

import pytest

from pagellm.entrypoints.openai.errors import OpenAIError
from pagellm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagellm.entrypoints.openai.serving_engine import OpenAIServing
from pagellm.sampling_params import OPENAI_FIELDS, SamplingParams

DEFAULTS = {f.name: f.default for f in dataclasses.fields(SamplingParams)}


@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest])
def test_every_shared_sampling_field_is_a_request_field_with_the_same_default(model):
    for name in OPENAI_FIELDS:
        assert name in model.model_fields, name
        assert model.model_fields[name].default == DEFAULTS[name], name


def test_fields_reach_sampling_params_and_null_means_default():
    sent = {"temperature": 0.3, "top_k": 7, "min_p": 0.1, "repetition_penalty": 1.2, "seed": 9, "stop": ["x"],
            "stop_token_ids": [4], "ignore_eos": True, "min_tokens": 2, "allowed_token_ids": [4, 5],
            "include_stop_str_in_output": True, "skip_special_tokens": False, "top_p": None}
    req = CompletionRequest.model_validate({"prompt": "hi", "n": 2, "logit_bias": {"3": 5}, **sent})
    params = OpenAIServing.sampling_params(req, max_tokens=8, logprobs=1)
    for name, value in sent.items():
        assert getattr(params, name) == (DEFAULTS[name] if value is None else value), name
    assert (params.n, params.max_tokens, params.logprobs, params.logit_bias) == (2, 8, 1, {3: 5})


def test_a_bad_value_is_refused_naming_the_field():
    req = CompletionRequest.model_validate({"prompt": "hi", "top_k": 0})
    with pytest.raises(OpenAIError) as e:
        OpenAIServing.sampling_params(req, max_tokens=8, logprobs=None)
    assert e.value.status == 400 and e.value.param == "top_k"

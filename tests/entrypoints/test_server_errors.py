"""Every error class the server answers, in OpenAI's JSON error shape, never a 500 for bad input.

The server here serves a tiny random Llama (context 512) with an API key, one running sequence
and one waiting request at most, through a launcher that can make an engine step fail.
"""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import fastapi  # noqa: F401  (required test dependencies: missing, these tests must fail, not skip)
import httpx
import openai
import pytest

from pagellm.entrypoints.openai.cli_args import DEFAULT_MAX_REQUEST_BODY_BYTES
from server_utils import RemoteServer, metric_value

KEY = "test-key-0123456789"
NAME = "tiny-llama"


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    s = RemoteServer(["--model", tiny_llama_dir, "--served-model-name", NAME, "--num-kv-blocks", "64",
                      "--max-num-seqs", "1", "--max-waiting-requests", "1"],
                     launcher=str(Path(__file__).with_name("fault_server.py")), api_key=KEY,
                     env={"PAGELLM_TEST_STEP_DELAY": "0.01"})
    yield s
    s.close()


def post(server, path: str, body=None, *, key: str | None = KEY, **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60, **kwargs)


def assert_error(r: httpx.Response, status: int, *, param: str | None = None, code: str | None = None,
                 contains: tuple[str, ...] = ()) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    for text in contains:
        assert text in error["message"], error
    return error


def completion(**fields) -> dict:
    return {"model": NAME, "prompt": "hello", "max_tokens": 2, **fields}


# ---- 401 ----------------------------------------------------------------------------------
def test_api_key(server):
    assert_error(post(server, "/v1/completions", completion(), key=None), 401, code="invalid_api_key")
    assert_error(post(server, "/v1/completions", completion(), key="wrong"), 401, code="invalid_api_key")
    assert_error(post(server, "/v1/chat/completions", {"messages": []}, key=KEY[:-1]), 401)
    r = httpx.get(server.url + "/v1/models")
    assert_error(r, 401)
    assert r.headers["www-authenticate"] == "Bearer"
    assert post(server, "/v1/completions", completion()).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()
    # Health, metrics and the dashboard stay open.
    for path in ("/health", "/metrics", "/dashboard", "/dashboard/state"):
        assert httpx.get(server.url + path).status_code == 200, path


# ---- 404 ----------------------------------------------------------------------------------
def test_unknown_model(server):
    assert_error(post(server, "/v1/completions", completion(model="gpt-4")), 404, param="model",
                 code="model_not_found", contains=("gpt-4",))
    assert_error(post(server, "/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}),
                 404, param="model")
    with pytest.raises(openai.NotFoundError):
        server.client().completions.create(model="other", prompt="hi", max_tokens=1)


def test_unknown_route_and_method(server):
    assert_error(post(server, "/v1/nothing", {}), 404)
    assert_error(httpx.get(server.url + "/v1/completions", headers=server.headers()), 405)


# ---- 400 ----------------------------------------------------------------------------------
@pytest.mark.parametrize("fields,param", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"logprobs": 50}, "logprobs"),
    ({"temperature": "hot"}, "temperature"),
    ({"prompt": None}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, 100000]}, None),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"logit_bias": {"five": 1.0}}, "logit_bias"),
    ({"logit_bias": {"5": 150}}, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
])
def test_invalid_completion_params(server, fields, param):
    assert_error(post(server, "/v1/completions", completion(**fields)), 400, param=param)


@pytest.mark.parametrize("fields,param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"content": "no role"}]}, "messages"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"max_completion_tokens": -3}, "max_tokens"),
])
def test_invalid_chat_params(server, fields, param):
    body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}
    assert_error(post(server, "/v1/chat/completions", body), 400, param=param)


def test_image_content_part_is_refused(server):
    """The text model of an image-text checkpoint is served alone: an image part is refused by name."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    body = {"model": NAME, "max_tokens": 2,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, image]}]}
    assert_error(post(server, "/v1/chat/completions", body), 400, param="messages",
                 contains=("'image_url'", "messages[0].content[1]", "not served"))


def test_malformed_json(server):
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "hi",', timeout=30,
                   headers={**server.headers(), "Content-Type": "application/json"})
    assert_error(r, 400)


def test_prompt_over_context_length(server):
    long = "a" * 600  # the byte-level tokenizer gives one token a byte
    error = assert_error(post(server, "/v1/completions", completion(prompt=long)), 400, param="prompt",
                         code="context_length_exceeded", contains=("512", "600"))
    assert "maximum context length" in error["message"]
    error = assert_error(post(server, "/v1/completions", completion(prompt="a" * 500, max_tokens=100)), 400,
                         code="context_length_exceeded", contains=("512", "600", "100"))
    chat = {"model": NAME, "messages": [{"role": "user", "content": long}]}
    assert_error(post(server, "/v1/chat/completions", chat), 400, param="messages", contains=("512",))
    with pytest.raises(openai.BadRequestError, match="512"):
        server.client().completions.create(model=NAME, prompt=long, max_tokens=1)


# ---- 413 ----------------------------------------------------------------------------------
def test_body_too_large(server):
    big = completion(prompt="a" * (DEFAULT_MAX_REQUEST_BODY_BYTES + 10))
    assert_error(post(server, "/v1/completions", big), 413, code="request_too_large")

    def chunked():  # no Content-Length: the limit is enforced on the bytes as they come
        data = json.dumps(big).encode()
        for i in range(0, len(data), 1 << 16):
            yield data[i:i + (1 << 16)]

    r = httpx.post(server.url + "/v1/completions", content=chunked(), timeout=60,
                   headers={**server.headers(), "Content-Type": "application/json"})
    assert_error(r, 413)
    assert post(server, "/v1/completions", completion()).status_code == 200


# ---- 503 ----------------------------------------------------------------------------------
def test_queue_full(server):
    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers(), timeout=60) as http:
            long = completion(max_tokens=400, ignore_eos=True, stream=True)
            async with http.stream("POST", "/v1/completions", json=long) as running:
                lines = running.aiter_lines()
                while not (await lines.__anext__()).startswith("data: {"):
                    pass
                # The one sequence slot is taken: the next request waits...
                waiting = asyncio.ensure_future(http.post("/v1/completions", json=completion()))
                for _ in range(200):
                    text = (await http.get("/metrics")).text
                    if metric_value(text, "pagellm:num_requests_waiting") == 1:
                        break
                    await asyncio.sleep(0.05)
                else:
                    raise AssertionError("the second request never waited")
                # ...and with one waiting, the queue is full.
                full = await http.post("/v1/completions", json=completion())
                assert (await http.get("/health")).status_code == 200
            # Leaving the long stream aborts it; the waiting request then runs.
            return full, await waiting

    full, waited = asyncio.run(scenario())
    assert_error(full, 503, code="server_overloaded")
    assert int(full.headers["retry-after"]) >= 1
    assert waited.status_code == 200 and waited.json()["usage"]["completion_tokens"] == 2
    server.wait_all_blocks_free()


# ---- 500 ----------------------------------------------------------------------------------
def test_step_failure_fails_the_request_and_server_keeps_serving(server):
    r = post(server, "/v1/completions", completion(prompt="please INJECT_FAULT now"))
    assert_error(r, 500, code="internal_error", contains=("injected fault",))
    assert httpx.get(server.url + "/health").status_code == 200
    assert post(server, "/v1/completions", completion()).status_code == 200

    # Streaming: the 200 has gone out, so the error comes as an event, then [DONE].
    with pytest.raises(openai.APIError, match="injected fault"):
        for _ in server.client().completions.create(model=NAME, prompt="INJECT_FAULT", max_tokens=2, stream=True):
            pass
    ok = server.client().chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=2)
    assert ok.usage.completion_tokens == 2
    text = httpx.get(server.url + "/metrics").text
    assert metric_value(text, "pagellm:engine_step_failures_total") == 2
    assert metric_value(text, "pagellm:request_failures_total", cause="step_error") == 2
    assert metric_value(text, "pagellm:request_success_total", finished_reason="error") == 2
    server.wait_all_blocks_free()


@pytest.mark.parametrize("path, fields, param, words", [
    ("/v1/chat/completions", {"structural_tag": {"type": "x"}}, "structural_tag", "structured outputs"),
    ("/v1/completions", {"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "structured outputs"),
    ("/v1/chat/completions", {"function_call": "auto"}, "function_call", "tools and tool_choice"),
    ("/v1/completions", {"temprature": 0.5}, "temprature", "not a parameter"),
])
def test_no_field_is_silently_ignored(server, path, fields, param, words):
    body = {"model": NAME, "max_tokens": 2, **fields,
            **({"prompt": "hi"} if "chat" not in path else {"messages": [{"role": "user", "content": "hi"}]})}
    error = assert_error(post(server, path, body), 400, param=param)
    assert words in error["message"] and param in error["message"]


def test_fields_accepted_without_effect(server):
    from pagellm.entrypoints.openai.protocol import ACCEPTED_WITHOUT_EFFECT

    body = completion(user="u-1", store=False, metadata={"k": "v"}, service_tier="auto")
    assert set(body) - {"model", "prompt", "max_tokens"} == set(ACCEPTED_WITHOUT_EFFECT)
    assert post(server, "/v1/completions", body).status_code == 200

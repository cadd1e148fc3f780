"""Ollama's API with the official `ollama` client against the bundled SmolLM2 (the shared server,
with --enable-auto-tool-choice --tool-call-parser hermes): chat and generate, whole and streamed
as NDJSON, the same replies as the OpenAI endpoints, options mapped onto sampling, format as a
JSON schema, tool calls and their results, the model listing endpoints, and errors in Ollama's shape."""
from __future__ import annotations

import json

import httpx
import jsonschema
import ollama
import pytest

from server_utils import MODEL_NAME

ASK = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0, "num_predict": 8}


@pytest.fixture(scope="module")
def client(smollm2_server):
    return ollama.Client(host=smollm2_server.url, timeout=300)


def test_chat_and_generate_give_the_openai_endpoints_replies(client, smollm2_server):
    openai_client = smollm2_server.client(timeout=300)
    chat = openai_client.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=8, temperature=0)
    r = client.chat(model=MODEL_NAME, messages=ASK, options=GREEDY)
    assert r.message.role == "assistant" and r.message.content == chat.choices[0].message.content
    assert r.done and r.done_reason == chat.choices[0].finish_reason
    assert r.prompt_eval_count == chat.usage.prompt_tokens and r.eval_count == chat.usage.completion_tokens
    assert r.total_duration >= r.eval_duration > 0
    parts = list(client.chat(model=MODEL_NAME + ":latest", messages=ASK, options=GREEDY, stream=True))
    assert "".join(p.message.content for p in parts) == r.message.content and len(parts) > 2
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True] and parts[-1].eval_count == r.eval_count

    # generate: the prompt as the user's message (system before it); raw: as it is, a completion.
    g = client.generate(model=MODEL_NAME, prompt=ASK[0]["content"], options=GREEDY)
    assert g.response == r.message.content and g.done_reason == r.done_reason
    completion = openai_client.completions.create(model=MODEL_NAME, prompt="The capital of France is", max_tokens=4,
                                                  temperature=0)
    raw = client.generate(model=MODEL_NAME, prompt="The capital of France is", raw=True,
                          options={"temperature": 0, "num_predict": 4})
    assert raw.response == completion.choices[0].text and raw.done_reason == "length"
    streamed = "".join(p.response for p in client.generate(model=MODEL_NAME, prompt="The capital of France is",
                                                           raw=True, options={"temperature": 0, "num_predict": 4},
                                                           stream=True))
    assert streamed == raw.response

    # An empty request loads the model, as in Ollama.
    assert client.generate(model=MODEL_NAME).done_reason == "load"


def test_options_map_onto_sampling(client):
    text = client.generate(model=MODEL_NAME, prompt="Tell me a story.", options=GREEDY).response
    word = text.split()[1]
    stopped = client.generate(model=MODEL_NAME, prompt="Tell me a story.", options={**GREEDY, "stop": [word]})
    assert stopped.response == text[:text.index(word)] and stopped.done_reason == "stop"
    sampled = [client.generate(model=MODEL_NAME, prompt="Tell me a story.",
                               options={"seed": 7, "temperature": 1.0, "top_k": 40, "top_p": 0.9, "min_p": 0.05,
                                        "repeat_penalty": 1.1, "num_predict": 6, "num_ctx": 2048}).response
               for _ in range(2)]
    assert sampled[0] == sampled[1]


def test_format_json_schema_and_json(client):
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 12}},
              "required": ["capital"]}
    r = client.chat(model=MODEL_NAME, messages=ASK, format=schema, options={"temperature": 0, "num_predict": 40})
    jsonschema.validate(json.loads(r.message.content), schema)
    g = client.generate(model=MODEL_NAME, prompt='Repeat exactly: {"capital": "Paris"}', format="json",
                        options={"temperature": 0, "num_predict": 24})
    assert isinstance(json.loads(g.response), dict)


def test_a_tool_call_round_trip(client):
    """The model writes a call in its own (hermes) format, which comes back parsed, its arguments an
    object; the call and its result sent back render through the template and the chat goes on."""
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    # This small model copies what it is asked to repeat: a call in the hermes format.
    ask = [{"role": "user", "content": 'Repeat exactly: <tool_call>{"name": "get_weather", "arguments": '
                                      '{"city": "Paris"}}</tool_call>'}]
    r = client.chat(model=MODEL_NAME, messages=ask, tools=tools, options={"temperature": 0, "num_predict": 30})
    (call,) = r.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Paris"}
    assert "<tool_call>" not in r.message.content
    parts = list(client.chat(model=MODEL_NAME, messages=ask, tools=tools, stream=True,
                             options={"temperature": 0, "num_predict": 30}))
    streamed = [c for p in parts for c in (p.message.tool_calls or [])]
    assert [(c.function.name, c.function.arguments) for c in streamed] == [("get_weather", {"city": "Paris"})]
    history = ask + [r.message, {"role": "tool", "content": "18 degrees", "tool_name": "get_weather"}]
    follow = client.chat(model=MODEL_NAME, messages=history, tools=tools, options={"temperature": 0, "num_predict": 4})
    assert follow.message.content and follow.done


def test_the_model_listing(client, smollm2_server):
    (listed,) = client.list().models
    assert listed.model == MODEL_NAME and listed.size > 0
    assert listed.details.format == "gguf" and listed.details.family == "llama"
    shown = client.show(MODEL_NAME)
    assert shown.modelinfo["llama.context_length"] == 2048 and shown.capabilities == ["completion", "tools"]
    assert "<|im_start|>" in shown.template
    (running,) = client.ps().models
    assert running.model == MODEL_NAME and running.context_length == 2048 and running.size_vram == 0
    assert httpx.get(smollm2_server.url + "/api/version").json()["version"]


@pytest.mark.parametrize("path, extra, status, words", [
    ("/api/chat", {"options": {"mirostat": 1}}, 400, "options.mirostat is not supported"),
    ("/api/chat", {"options": {"frobnicity": 1}}, 400, "options.frobnicity is not supported"),
    ("/api/chat", {"options": {"temperature": "hot"}}, 400, "options.temperature"),
    ("/api/chat", {"options": {"repeat_penalty": 0}}, 400, "options.repeat_penalty must be"),
    ("/api/chat", {"options": {"num_predict": 0}}, 400, "options.num_predict must be >= 1"),
    ("/api/chat", {"options": {"num_ctx": 100000}}, 400, "options.num_ctx must be an integer <= 2048"),
    ("/api/chat", {"think": True}, 400, "think True needs the server started with --reasoning-parser"),
    ("/api/chat", {"format": "yaml"}, 400, 'format must be "json" or a JSON schema'),
    ("/api/chat", {"format": {"type": "object", "properties": {"a": {"type": "frob"}}}}, 400, "format"),
    ("/api/chat", {"frobnicate": 1}, 400, "frobnicate is not supported"),
    ("/api/chat", {"messages": [{"role": "user", "content": "hi", "images": ["AAAA"]}]}, 400,
     "messages[0].images is not supported: this server serves a text-only model"),
    ("/api/chat", {"model": "llama3.2:latest"}, 404, "llama3.2"),
    ("/api/generate", {"template": "{{ .Prompt }}"}, 400, "template is not supported"),
    ("/api/generate", {"raw": True, "system": "Be brief."}, 400, "system cannot be combined with raw"),
    ("/api/generate", {"context": [1, 2, 3]}, 400, "context is not supported"),
    ("/api/embed", {"input": "hi", "options": {"mirostat": 1}}, 400, "options.mirostat is not supported"),
    ("/api/embed", {"input": "hi", "options": {"temperature": 0.5}}, 400,
     "options.temperature is not supported on an embedding: nothing is sampled"),
    ("/api/embed", {"input": "hi", "options": {"num_ctx": 100000}}, 400, "options.num_ctx must be an integer <= 2048"),
    ("/api/embed", {"input": "hi " * 3000, "truncate": False}, 400, "maximum context length is 2048"),
    ("/api/embeddings", {"prompt": "hi", "frobnicate": 1}, 400, "frobnicate is not supported"),
    ("/api/pull", {}, 501, "pulls, creates and deletes no models"),
    ("/api/show", {"verbose": True}, 400, "verbose is not supported"),
    ("/api/show", {"frobnicate": 1}, 400, "frobnicate is not supported"),
])
def test_errors_in_ollamas_shape(smollm2_server, path, extra, status, words):
    prompt = {"/api/chat": {"messages": ASK, "stream": False}, "/api/generate": {"prompt": "hi", "stream": False}}
    body = {"model": MODEL_NAME, **prompt.get(path, {}), **extra}
    r = httpx.post(smollm2_server.url + path, json=body, timeout=60)
    assert r.status_code == status, r.text
    assert list(r.json()) == ["error"] and words in r.json()["error"], r.text


def _cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b)) / (sum(x * x for x in a) * sum(y * y for y in b)) ** 0.5


def test_embeddings_equal_the_openai_endpoints(client, smollm2_server):
    texts = ["The capital of France is Paris.", "def fibonacci(n):"]
    ours = client.embed(model=MODEL_NAME, input=texts)
    reference = httpx.post(smollm2_server.url + "/v1/embeddings", json={"input": texts}, timeout=60).json()
    # The same vectors, up to the default int8x2 products' dependence on how many rows a step has
    # (the two calls may share their steps with other requests): cosine, not bit equality.
    want = [d["embedding"] for d in reference["data"]]
    assert [round(_cosine(a, b), 4) for a, b in zip(ours.embeddings, want)] == [1.0, 1.0]
    assert _cosine(*ours.embeddings) < 0.99  # two texts, two directions
    assert ours.prompt_eval_count == reference["usage"]["prompt_tokens"]
    legacy = client.embeddings(model=MODEL_NAME, prompt=texts[1])
    assert round(_cosine(legacy.embedding, want[1]), 4) == 1.0


def test_the_client_reads_the_errors(client):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="nope", messages=ASK)
    assert e.value.status_code == 404 and "nope" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:  # a streamed request refused before its first line
        list(client.chat(model=MODEL_NAME, messages=ASK, options={"tfs_z": 0.9}, stream=True))
    assert e.value.status_code == 400 and "options.tfs_z" in e.value.error

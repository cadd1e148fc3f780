"""The OpenAI-compatible server driven by the official `openai` client, against the bundled SmolLM2."""
from __future__ import annotations

import math

import fastapi  # noqa: F401  (required test dependencies: missing, these tests must fail, not skip)
import httpx
import openai  # noqa: F401
import pytest

from server_utils import MODEL_NAME, metric_value

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
COUNT = "Count from one to ten: 1, 2, 3,"


@pytest.fixture(scope="module")
def server(smollm2_server):
    return smollm2_server


@pytest.fixture(scope="module")
def client(server):
    c = server.client(timeout=120)
    yield c
    c.close()


def test_models_health_version(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert models.data[0].owned_by == "pagellm"
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]


def test_completion(client):
    r = client.completions.create(model=MODEL_NAME, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.model == MODEL_NAME
    (choice,) = r.choices
    assert "Paris" in choice.text
    assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == 8
    assert r.usage.prompt_tokens == 5
    assert r.usage.total_tokens == 13


def test_completion_stream_matches_non_stream(client):
    kwargs = dict(model=MODEL_NAME, prompt=COUNT, max_tokens=12, temperature=0)
    full = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_is_server_sent_events(server):
    body = {"model": MODEL_NAME, "prompt": COUNT, "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-2])


def test_chat(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=40, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    (choice,) = r.choices
    assert choice.message.role == "assistant"
    assert "Paris" in choice.message.content
    assert choice.finish_reason == "stop"
    assert r.usage.completion_tokens > 0
    assert isinstance(r.usage.prompt_tokens_details.cached_tokens, int)


def test_chat_max_completion_tokens_and_cached_tokens(client):
    messages = [{"role": "system", "content": "You are a helpful geography teacher who answers briefly."}] + CHAT
    first = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_completion_tokens=3,
                                           temperature=0)
    assert first.choices[0].finish_reason == "length" and first.usage.completion_tokens == 3
    again = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_completion_tokens=3,
                                           temperature=0)
    # The same prompt again: its full blocks come from the prefix cache.
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < again.usage.prompt_tokens and cached % 16 == 0


def test_chat_stream(client):
    full = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=20, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=20, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].object == "chat.completion.chunk"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_completion_n(client):
    r = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=10, n=3,
                                  temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 30
    assert len({c.text for c in r.choices}) > 1


def test_completion_best_of(client):
    """best_of=3 with seed 3 samples what seeds 3, 4 and 5 sample alone, and returns the one
    with the highest cumulative logprob."""
    kw = dict(model=MODEL_NAME, prompt="Once upon a time", max_tokens=6, temperature=1.0)
    r = client.completions.create(n=1, best_of=3, seed=3, **kw)
    assert len(r.choices) == 1
    solos = [client.completions.create(seed=3 + i, logprobs=0, **kw).choices[0] for i in range(3)]
    scores = [sum(c.logprobs.token_logprobs) for c in solos]
    assert len({c.text for c in solos}) > 1, "three seeds should sample different texts"
    assert r.choices[0].text == solos[scores.index(max(scores))].text


def test_chat_n_stream(client):
    stream = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=8, n=2, temperature=1.0,
                                            seed=11, stream=True)
    texts, finished = {0: "", 1: ""}, {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished[c.index] = c.finish_reason
    assert set(finished) == {0, 1}
    assert all(texts.values())


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_each_choice_finishes_once_when_siblings_end_apart(client, endpoint):
    """n = 2 samples that stop at different steps (a stop string one meets first): the one that
    ends first gets one chunk with its finish_reason, not one more with every later output."""
    def create(**kw):
        if endpoint == "chat":
            return client.chat.completions.create(model=MODEL_NAME, messages=CHAT, **kw)
        return client.completions.create(model=MODEL_NAME, prompt="Once upon a time", **kw)

    params = dict(max_tokens=24, n=2, temperature=1.0, stop=[" the", "."])
    for seed in range(20):  # a seed whose two samples end at different lengths
        whole = create(seed=seed, **params)
        texts = [c.message.content if endpoint == "chat" else c.text for c in whole.choices]
        if len({len(t) for t in texts}) == 2:
            break
    else:
        pytest.fail("no seed made the samples end apart")
    ends = []
    for chunk in create(seed=seed, stream=True, **params):
        ends += [c.index for c in chunk.choices if c.finish_reason]
    assert sorted(ends) == [0, 1]


def test_several_prompts_and_token_ids(client, server):
    ids = httpx.post(server.url + "/tokenize", json={"prompt": "The capital of France is"}).json()["tokens"]
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=4, temperature=0)
    r = client.completions.create(model=MODEL_NAME, prompt=["The capital of France is", "The capital of Germany is"],
                                  max_tokens=4, temperature=0, n=1)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].text == by_ids.choices[0].text
    assert "Paris" in r.choices[0].text and "Berlin" in r.choices[1].text
    assert r.usage.prompt_tokens == 10 and r.usage.completion_tokens == 8


def test_several_prompts_stream(client):
    stream = client.completions.create(model=MODEL_NAME, prompt=["The capital of France is", "The capital of Germany is"],
                                       max_tokens=4, temperature=0, stream=True)
    texts = {0: "", 1: ""}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert "Paris" in texts[0] and "Berlin" in texts[1]


def test_stop_strings(client):
    r = client.completions.create(model=MODEL_NAME, prompt=COUNT, max_tokens=16, temperature=0, stop=[" 7", "zzz"])
    (c,) = r.choices
    assert c.text == " 4, 5, 6,"
    assert c.finish_reason == "stop"
    assert c.model_extra["stop_reason"] == " 7"
    kept = client.completions.create(model=MODEL_NAME, prompt=COUNT, max_tokens=16, temperature=0, stop=" 7",
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == " 4, 5, 6, 7"
    streamed = client.completions.create(model=MODEL_NAME, prompt=COUNT, max_tokens=16, temperature=0, stop=[" 7"],
                                         stream=True)
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == " 4, 5, 6,"


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL_NAME, prompt="The capital of France is", max_tokens=5, temperature=0,
                                  logprobs=3)
    (c,) = r.choices
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == c.text
    assert lp.text_offset[0] == 0
    assert all(b - a == len(t) for a, b, t in zip(lp.text_offset, lp.text_offset[1:], lp.tokens))
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0
        assert 3 <= len(top) <= 4
        # Greedy: the chosen token is the most likely one.
        assert top[token] == pytest.approx(value) and value == pytest.approx(max(top.values()))
    streamed = client.completions.create(model=MODEL_NAME, prompt="The capital of France is", max_tokens=5,
                                         temperature=0, logprobs=3, stream=True)
    tokens, offsets = [], []
    for ch in streamed:
        if ch.choices and ch.choices[0].logprobs:
            tokens += ch.choices[0].logprobs.tokens
            offsets += ch.choices[0].logprobs.text_offset
    assert tokens == lp.tokens and offsets == lp.text_offset


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 2
        assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == pytest.approx(t.logprob)
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert t.bytes == list(t.token.encode())
    plain = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_echo(client):
    r = client.completions.create(model=MODEL_NAME, prompt="The capital of France is", max_tokens=3, temperature=0,
                                  echo=True)
    assert r.choices[0].text.startswith("The capital of France is Paris")
    streamed = client.completions.create(model=MODEL_NAME, prompt="The capital of France is", max_tokens=3,
                                         temperature=0, echo=True, stream=True)
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == r.choices[0].text


def test_seed_reproducible(client):
    kwargs = dict(model=MODEL_NAME, prompt="My favourite animal is", max_tokens=10, temperature=1.0, seed=1234)
    assert client.completions.create(**kwargs).choices[0].text == client.completions.create(**kwargs).choices[0].text


def test_sampling_extras(client):
    """Each of vLLM's extra sampling fields reaches the sampler: each changes what comes back in
    a way that can be predicted."""
    def chat(temperature: float, seed: int | None = None, **extra):
        return client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=30,
                                              temperature=temperature, seed=seed, extra_body=extra)

    greedy = chat(temperature=0)
    assert greedy.choices[0].finish_reason == "stop" and greedy.usage.completion_tokens < 20
    # top_k=1 and min_p=1 keep only the most likely token: greedy text at any temperature.
    hot = [chat(temperature=3.0, seed=s) for s in (1, 2)]
    assert any(h.choices[0].message.content != greedy.choices[0].message.content for h in hot)
    for extra in ({"top_k": 1}, {"min_p": 1.0}):
        assert chat(temperature=3.0, seed=1, **extra).choices[0].message.content == greedy.choices[0].message.content
    # ignore_eos runs to max_tokens; min_tokens holds EOS off that long.
    assert chat(temperature=0, ignore_eos=True).usage.completion_tokens == 30
    held = chat(temperature=0, min_tokens=25)
    assert held.usage.completion_tokens >= 25
    # A repetition penalty of 100 makes every token already in the conversation unlikely.
    penalized = chat(temperature=0, repetition_penalty=100.0)
    assert penalized.choices[0].message.content != greedy.choices[0].message.content


def test_logit_bias_and_allowed_token_ids(server, client):
    # Force " Paris" out of a prompt that would not start with it, in both endpoints, OpenAI's way.
    paris = httpx.post(server.url + "/tokenize", json={"prompt": " Paris"}).json()["tokens"]
    assert len(paris) == 1
    r = client.completions.create(model=MODEL_NAME, prompt="My favourite animal is", max_tokens=3, temperature=0,
                                  logit_bias={str(paris[0]): 100})
    assert r.choices[0].text == " Paris" * 3
    r = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=2, temperature=0.8, seed=3,
                                       logit_bias={str(paris[0]): 100})
    assert r.choices[0].message.content == " Paris" * 2
    # vLLM's allowed_token_ids: only these can come out, however the model leans.
    yes_no = [httpx.post(server.url + "/tokenize", json={"prompt": w}).json()["tokens"][0] for w in (" yes", " no")]
    r = client.completions.create(model=MODEL_NAME, prompt="Is Paris in France? Answer:", max_tokens=4,
                                  temperature=1.0, seed=0, logprobs=1, extra_body={"allowed_token_ids": yes_no})
    assert set(r.choices[0].logprobs.tokens) <= {" yes", " no"} and r.usage.completion_tokens == 4


def test_tokenize_detokenize(server):
    r = httpx.post(server.url + "/tokenize", json={"model": MODEL_NAME, "prompt": "Hello world"}).json()
    assert r["count"] == len(r["tokens"]) > 0 and r["max_model_len"] == 2048
    back = httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert back["prompt"] == "Hello world"
    chat = httpx.post(server.url + "/tokenize", json={"messages": CHAT}).json()
    assert chat["count"] > r["count"]


def test_metrics_count_exactly(server, client):
    """One request of known size moves each counter by exactly its share (the tests in this module
    run one at a time, so nothing else moves them meanwhile)."""
    labels = {"model_name": MODEL_NAME}
    names = ["pagellm:prompt_tokens_total", "pagellm:generation_tokens_total",
             "pagellm:time_to_first_token_seconds_count", "pagellm:inter_token_latency_seconds_count",
             "pagellm:e2e_request_latency_seconds_count", "pagellm:request_prompt_tokens_sum",
             "pagellm:request_generation_tokens_sum", "pagellm:request_max_num_generation_tokens_sum",
             "pagellm:request_prefill_kv_computed_tokens_sum", "pagellm:request_params_n_sum",
             "pagellm:request_params_max_tokens_sum", "pagellm:iteration_tokens_total_sum",
             "pagellm:request_queue_time_seconds_count", "pagellm:request_inference_time_seconds_count",
             "pagellm:request_prefill_time_seconds_count", "pagellm:request_decode_time_seconds_count",
             "pagellm:request_time_per_output_token_seconds_count"]

    def read() -> dict:
        text = httpx.get(server.url + "/metrics").text
        values = {n: metric_value(text, n, **labels) or 0.0 for n in names}
        values["length"] = metric_value(text, "pagellm:request_success_total", finished_reason="length",
                                        **labels) or 0.0
        return values

    before = read()
    prompt = httpx.post(server.url + "/tokenize", json={"prompt": COUNT}).json()["count"]
    r = client.completions.create(model=MODEL_NAME, prompt=COUNT, max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == prompt and r.usage.completion_tokens == 5
    after = read()
    delta = {k: after[k] - before[k] for k in after}
    cached = r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else 0
    assert delta == {"pagellm:prompt_tokens_total": prompt, "pagellm:generation_tokens_total": 5,
                     "pagellm:time_to_first_token_seconds_count": 1,
                     "pagellm:inter_token_latency_seconds_count": 4,  # between 5 tokens, one step each
                     "pagellm:e2e_request_latency_seconds_count": 1, "length": 1,
                     "pagellm:request_prompt_tokens_sum": prompt, "pagellm:request_generation_tokens_sum": 5,
                     "pagellm:request_max_num_generation_tokens_sum": 5,
                     "pagellm:request_prefill_kv_computed_tokens_sum": prompt - (cached or 0),
                     "pagellm:request_params_n_sum": 1, "pagellm:request_params_max_tokens_sum": 5,
                     # every token through the model: the prompt's uncached ones, then 5 generated
                     "pagellm:iteration_tokens_total_sum": prompt - (cached or 0) + 5,
                     "pagellm:request_queue_time_seconds_count": 1, "pagellm:request_inference_time_seconds_count": 1,
                     "pagellm:request_prefill_time_seconds_count": 1, "pagellm:request_decode_time_seconds_count": 1,
                     "pagellm:request_time_per_output_token_seconds_count": 1}
    stats = httpx.get(server.url + "/dashboard/state").json()["stats"]
    text = httpx.get(server.url + "/metrics").text
    assert metric_value(text, "pagellm:kv_cache_total_blocks", **labels) == stats["total_blocks"]
    assert metric_value(text, "pagellm:kv_cache_free_blocks", **labels) == stats["free_blocks"]
    # One KV group (no sliding-window layers): it holds every used block.
    assert stats["kv_groups"] == [{"kind": "full", "window": None, "used_blocks": stats["used_blocks"]}]
    assert metric_value(text, "pagellm:kv_cache_group_used_blocks", group="0", kind="full", window="none",
                        **labels) == stats["used_blocks"]
    assert metric_value(text, "pagellm:cache_config_info", block_size="16",
                        num_gpu_blocks=str(stats["total_blocks"]), enable_prefix_caching="True") == 1
    # The model's cost, for a roofline from the outside: 2 FLOPs a weight, and (Q4_1 blocks, a Q8_0
    # head) between half a byte and a float32's 4 bytes per weight.
    flops = metric_value(text, "pagellm:model_flops_per_token", **labels)
    weight_bytes = metric_value(text, "pagellm:model_weight_bytes_per_step", **labels)
    assert flops / 2 * 0.5 < weight_bytes < flops / 2 * 4


def test_metrics(server, client):
    client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    labels = {"model_name": MODEL_NAME}
    for name in ("pagellm:num_requests_running", "pagellm:num_requests_waiting", "pagellm:kv_cache_usage_perc",
                 "pagellm:prefix_cache_queries_total", "pagellm:prefix_cache_hits_total",
                 "pagellm:num_preemptions_total", "pagellm:prompt_tokens_total", "pagellm:generation_tokens_total",
                 "pagellm:time_to_first_token_seconds_count", "pagellm:inter_token_latency_seconds_count",
                 "pagellm:e2e_request_latency_seconds_count"):
        assert metric_value(text, name, **labels) is not None, name
    assert 0 <= metric_value(text, "pagellm:kv_cache_usage_perc", **labels) <= 1
    assert metric_value(text, "pagellm:generation_tokens_total", **labels) >= 2
    assert metric_value(text, "pagellm:request_success_total", finished_reason="length", **labels) >= 1
    assert metric_value(text, "pagellm:e2e_request_latency_seconds_count", **labels) >= 1
    assert "_created" not in text


@pytest.mark.slow  # 8 requests; the fast one is tests/engine/test_embeddings.py's, against transformers
def test_rerank_as_a_yes_no_reranker(server):
    """--classifier-from-token ["no", "yes"]: a pair's score is P(yes) / (P(yes) + P(no)) after the
    query's tokens then the document's, as the model's own prompt logprobs of each word there say."""
    url = server.url
    query = "Question: is Paris the capital of France? Answer yes or no. "
    docs = ["Paris is the capital of France.", "Bananas are yellow."]
    ranked = httpx.post(url + "/v1/rerank", json={"query": query, "documents": docs}, timeout=120).json()["results"]
    pair = httpx.post(url + "/tokenize", json={"prompt": query}).json()["tokens"]
    words = [httpx.post(url + "/tokenize", json={"prompt": w, "add_special_tokens": False}).json()["tokens"][0]
             for w in ("no", "yes")]
    want = []
    for doc in docs:
        ids = pair + httpx.post(url + "/tokenize", json={"prompt": doc, "add_special_tokens": False}).json()["tokens"]
        lp = [httpx.post(url + "/v1/completions", timeout=120, json={
                  "prompt": ids + [w], "max_tokens": 1, "prompt_logprobs": 0}).json()["choices"][0]
              ["prompt_logprobs"][-1][str(w)]["logprob"] for w in words]
        want.append(1 / (1 + math.exp(lp[0] - lp[1])))
    # Within 2e-3, not 1e-5 (as transformers' on dense weights, tests/engine/test_embeddings.py): this
    # GGUF model's int8x2 activations make a logit depend a little on the batch it is computed in.
    assert [x["relevance_score"] for x in sorted(ranked, key=lambda x: x["index"])] == pytest.approx(want, abs=2e-3)
    assert [x["index"] for x in ranked] == sorted(range(2), key=lambda i: -want[i])


def test_requests_are_counted_per_api(server, client):
    """pagellm:api_requests_total{api, status}: each client API's requests by the status answered;
    routes of no client API (health, metrics) are not counted. (One request generates, the rest are
    answered before the engine: the label is the route's, whatever it costs.)"""
    apis = [("openai_completions", "200"), ("openai_chat", "400"), ("responses", "404"),
            ("anthropic_count_tokens", "200"), ("ollama_chat", "400"), ("ollama_models", "200"), ("tokenize", "200")]

    def read() -> dict:
        text = httpx.get(server.url + "/metrics").text
        return {key: metric_value(text, "pagellm:api_requests_total", model_name=MODEL_NAME, api=key[0],
                                  status=key[1]) or 0.0 for key in apis}

    before = read()
    client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=1, temperature=0)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=1, top_p=7)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_unknown")
    url = server.url
    assert httpx.post(url + "/v1/messages/count_tokens", json={"model": MODEL_NAME, "messages": CHAT}).status_code \
        == 200
    assert httpx.post(url + "/api/chat", json={"model": MODEL_NAME, "messages": CHAT,
                                               "options": {"colour": 1}}).status_code == 400
    assert httpx.get(url + "/api/tags").status_code == 200 and httpx.get(url + "/health").status_code == 200
    assert httpx.post(url + "/tokenize", json={"prompt": "Hi"}).status_code == 200
    after = read()
    assert {key: after[key] - before[key] for key in apis} == dict.fromkeys(apis, 1.0)
    assert 'api="health"' not in httpx.get(url + "/metrics").text


def test_speculative_decoding_metrics(server, client):
    """The shared server runs prompt lookup: a reply that copies its prompt accepts proposals, and the
    counters say so under vLLM's names."""
    words = "apple, river, garden, window, letter, morning, island, forest, market, question"
    client.completions.create(model=MODEL_NAME, prompt=f"Copy the list exactly.\nList: {words}\nCopy: apple, river,",
                              max_tokens=16, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    labels = {"model_name": MODEL_NAME}
    proposed = metric_value(text, "pagellm:spec_decode_num_draft_tokens_total", **labels)
    accepted = metric_value(text, "pagellm:spec_decode_num_accepted_tokens_total", **labels)
    assert 0 < accepted <= proposed
    assert metric_value(text, "pagellm:spec_decode_num_drafts_total", **labels) > 0
    assert metric_value(text, "pagellm:spec_decode_num_accepted_tokens_per_pos_total", position="0",
                        **labels) > 0
    # steps that only decoded, by their rows (every sequence's token and proposals in the step: other
    # tests' requests share this server): plain 1-row steps and verifications beside them, timed
    steps = {rows: metric_value(text, "pagellm:spec_decode_step_seconds_count", rows=str(rows), **labels) or 0
             for rows in range(1, 33)}
    assert steps[1] > 0 and sum(steps.values()) > steps[1]
    assert metric_value(text, "pagellm:spec_decode_step_seconds_sum", rows="1", **labels) > 0


def test_dashboard_state_is_the_block_map(server, client):
    """GET /dashboard/state while an n=3 request runs: every block's reference count is the number
    of sequences whose table holds it, the three sequences are one group and share their prompt
    blocks, cached flags mark only free blocks, and the counts agree with each other."""
    stream = client.completions.create(model=MODEL_NAME, prompt=COUNT * 4, max_tokens=200, n=3, temperature=1.0,
                                       seed=5, stream=True, extra_body={"ignore_eos": True})
    try:
        for _ in stream:
            state = server.state()
            if len(state["tables"]) == 3:
                break
        else:
            raise AssertionError("the three sequences never ran together")
    finally:
        stream.close()
    tables, ref = state["tables"], state["ref_cnt"]
    held = [b for t in tables.values() for b in t]
    assert ref == [held.count(b) for b in range(state["num_blocks"])]
    assert len(set(state["groups"][rid] for rid in tables)) == 1
    prompt_blocks = httpx.post(server.url + "/tokenize", json={"prompt": COUNT * 4}).json()["count"] // 16
    first = next(iter(tables.values()))
    assert all(t[:prompt_blocks] == first[:prompt_blocks] for t in tables.values())
    assert all(not c or r == 0 for c, r in zip(state["cached"], ref))
    s = state["stats"]
    assert s["used_blocks"] == len(set(held)) and s["free_blocks"] == s["total_blocks"] - s["used_blocks"]
    assert s["shared_blocks"] == sum(1 for r in ref if r > 1) >= prompt_blocks
    assert s["num_running"] == 3
    server.wait_all_blocks_free()


def test_echo_scores_the_prompt_as_lm_eval_asks(client):
    """lm-eval's loglikelihood request: echo, logprobs, max_tokens 0. The prompt's last token
    scored in prefill has the logprob the same model gives it when it generates it."""
    asked = client.completions.create(model=MODEL_NAME, prompt="The capital of France is", max_tokens=1,
                                      temperature=0, logprobs=1)
    answer = asked.choices[0].logprobs.tokens[0]
    generated_lp = asked.choices[0].logprobs.token_logprobs[0]
    prompt = "The capital of France is" + answer
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=1,
                                  temperature=0)
    choice = r.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length" and r.usage.completion_tokens == 0
    lp = choice.logprobs
    assert "".join(lp.tokens) == prompt and lp.tokens[-1] == answer
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    # 1e-3: scored in a prefill, the token's logits come through torch's attention; generated,
    # through the paged decode kernel, which sums in another order (1.2e-4 apart on an AVX2-only
    # CPU, whose attention kernel takes the portable loops). A token or position off by one moves
    # it far more.
    assert lp.token_logprobs[-1] == pytest.approx(generated_lp, abs=1e-3)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    # With tokens generated too, the echoed logprobs are the prompt's, then the completion's.
    more = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, echo=True, logprobs=0,
                                     temperature=0)
    assert more.choices[0].logprobs.token_logprobs[:len(lp.tokens)] == pytest.approx(lp.token_logprobs)
    assert len(more.choices[0].logprobs.tokens) == len(lp.tokens) + 2


def test_prompt_logprobs_field(server):
    body = {"model": MODEL_NAME, "prompt": "one two three", "max_tokens": 1, "prompt_logprobs": 2}
    choice = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    echoed = httpx.post(server.url + "/v1/completions", timeout=60,
                        json={**body, "prompt_logprobs": None, "echo": True, "logprobs": 0, "max_tokens": 0}).json()
    scored = choice["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(echoed["choices"][0]["logprobs"]["tokens"])
    for entry, want in zip(scored[1:], echoed["choices"][0]["logprobs"]["token_logprobs"][1:]):
        assert 2 <= len(entry) <= 3 and all(k.isdigit() for k in entry)
        assert want in [v["logprob"] for v in entry.values()]
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                      json={"model": MODEL_NAME, "messages": CHAT, "max_tokens": 1, "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "a", "stream": True, "prompt_logprobs": 1}, "stream"),
    ("/v1/completions", {"prompt": "a", "stream": True, "echo": True, "logprobs": 1}, "stream"),
    ("/v1/completions", {"prompt": "a", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "stream": True, "prompt_logprobs": 0}, "stream"),
])
def test_prompt_logprobs_refusals_name_the_field(server, path, body, param):
    r = httpx.post(server.url + path, json={"model": MODEL_NAME, **body}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_tokenize_token_strs_and_detokenize_round_trip(server):
    rendered = httpx.post(server.url + "/tokenize", json={"messages": CHAT, "return_token_strs": True}).json()
    strs = rendered["token_strs"]
    assert len(strs) == rendered["count"] == len(rendered["tokens"]) and "<|im_start|>" in strs
    text = httpx.post(server.url + "/detokenize", json={"tokens": rendered["tokens"]}).json()["prompt"]
    assert text.startswith("<|im_start|>")  # special tokens are kept
    again = httpx.post(server.url + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert again["tokens"] == rendered["tokens"] and again["token_strs"] is None


def test_streamed_text_offsets_survive_held_back_text(client):
    """A stop string's possible start is held back from the text; the offsets of the tokens after
    it must still count the held text (as the unstreamed answer's do)."""
    kw = dict(model=MODEL_NAME, prompt=COUNT, max_tokens=12, temperature=0, logprobs=0, stop=["5, 7"])
    whole = client.completions.create(**kw).choices[0]
    assert "5, 6" in whole.text  # the stop string's start appeared and was released
    offsets, tokens = [], []
    for chunk in client.completions.create(**kw, stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            offsets += chunk.choices[0].logprobs.text_offset
            tokens += chunk.choices[0].logprobs.tokens
    assert tokens == whole.logprobs.tokens
    assert offsets == whole.logprobs.text_offset


def test_return_token_ids_and_truncate_prompt_tokens(server):
    body = {"model": MODEL_NAME, "prompt": COUNT, "max_tokens": 4, "temperature": 0, "return_token_ids": True}
    full = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    ids = httpx.post(server.url + "/tokenize", json={"prompt": COUNT}).json()["tokens"]
    choice = full["choices"][0]
    assert choice["prompt_token_ids"] == ids and len(choice["token_ids"]) == 4
    assert httpx.post(server.url + "/detokenize", json={"tokens": choice["token_ids"]}).json()["prompt"] == choice["text"]
    cut = httpx.post(server.url + "/v1/completions", timeout=60,
                     json={**body, "truncate_prompt_tokens": 5, "echo": True}).json()
    assert cut["choices"][0]["prompt_token_ids"] == ids[-5:] and cut["usage"]["prompt_tokens"] == 5
    tail = httpx.post(server.url + "/detokenize", json={"tokens": ids[-5:]}).json()["prompt"]
    assert cut["choices"][0]["text"].startswith(tail)
    bad = httpx.post(server.url + "/v1/completions", json={**body, "truncate_prompt_tokens": 0}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "truncate_prompt_tokens"
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                      json={"model": MODEL_NAME, "messages": CHAT, "max_tokens": 3, "return_token_ids": True}).json()
    assert len(chat["choices"][0]["token_ids"]) == chat["usage"]["completion_tokens"]
    assert len(chat["prompt_token_ids"]) == chat["usage"]["prompt_tokens"]


def test_chat_continue_final_message_and_echo(client, server):
    start = "The capital of France is"
    messages = CHAT + [{"role": "assistant", "content": start}]
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=3, temperature=0,
                                       extra_body={"continue_final_message": True, "add_generation_prompt": False,
                                                   "echo": True})
    assert r.choices[0].message.content.startswith(start + " Paris")
    rendered = httpx.post(server.url + "/tokenize", json={"messages": messages, "continue_final_message": True,
                                                          "add_generation_prompt": False}).json()["tokens"]
    text = httpx.post(server.url + "/detokenize", json={"tokens": rendered}).json()["prompt"]
    assert text.endswith(start)  # the assistant's turn is left open
    streamed = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=3, temperature=0,
                                              stream=True, extra_body={"continue_final_message": True,
                                                                       "add_generation_prompt": False, "echo": True})
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices) == r.choices[0].message.content
    both = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                      json={"model": MODEL_NAME, "messages": messages, "continue_final_message": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"


def test_streams_send_no_empty_chunks(client):
    """Text held back for a possible stop string makes no chunk of its own: every chunk before the
    last carries text."""
    kw = dict(model=MODEL_NAME, prompt=COUNT, max_tokens=12, temperature=0, stop=["5, 7"])
    chunks = [ch for ch in client.completions.create(**kw, stream=True) if ch.choices]
    assert all(ch.choices[0].text for ch in chunks[:-1]), [ch.choices[0].text for ch in chunks]
    assert "".join(ch.choices[0].text for ch in chunks) == client.completions.create(**kw).choices[0].text
    chat = [ch for ch in client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=12, temperature=0,
                                                        stop=["Paris is"], stream=True) if ch.choices]
    assert all(ch.choices[0].delta.content for ch in chat[1:-1])  # after the role chunk, before the end


def test_beam_search_over_http_is_the_engines(client):
    """use_beam_search returns the n beams best first, as LLM.beam_search finds them."""
    from pagellm import LLM, BeamSearchParams

    r = client.completions.create(model=MODEL_NAME, prompt="The capital of France is", n=3, max_tokens=8,
                                  extra_body={"use_beam_search": True, "length_penalty": 0.5})
    with LLM(max_num_seqs=8, kv_cache_memory=64 << 20) as llm:
        (expected,) = llm.beam_search(["The capital of France is"],
                                      BeamSearchParams(beam_width=3, max_tokens=8, length_penalty=0.5))
    assert [c.text for c in r.choices] == [s.text for s in expected.sequences]
    assert [c.index for c in r.choices] == [0, 1, 2]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, n=2, max_tokens=6,
                                          extra_body={"use_beam_search": True})
    assert len(chat.choices) == 2 and chat.choices[0].message.content != chat.choices[1].message.content


@pytest.mark.parametrize("extra, param", [
    ({"temperature": 0.5}, "temperature"), ({"logprobs": 2}, "logprobs"), ({"stop": ["x"]}, "stop"),
    ({"seed": 1}, "seed"), ({"stream": True}, "use_beam_search"),
])
def test_beam_search_refuses_what_it_would_ignore(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt="Hi", n=2, max_tokens=4,
                                  extra_body={"use_beam_search": True, **extra})
    assert e.value.body["param"] == param

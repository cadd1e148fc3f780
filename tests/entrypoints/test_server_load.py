"""Many concurrent streaming clients on loopback, some leaving mid-stream: the rest get every token
they asked for, the server stays healthy, and afterwards every KV block is back in the pool."""
from __future__ import annotations

import asyncio
import json

import fastapi  # noqa: F401  (a required test dependency: missing, these tests must fail, not skip)
import httpx
import pytest

from server_utils import MODEL_NAME, metric_value

NUM_CLIENTS = 128
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def server(smollm2_server):
    smollm2_server.wait_all_blocks_free()
    return smollm2_server


async def stream_one(http: httpx.AsyncClient, i: int, leave_after: int | None) -> dict:
    """One streaming completion; with `leave_after`, hang up after that many chunks."""
    body = {"model": MODEL_NAME, "prompt": f"Request number {i} says: once upon a time", "max_tokens": MAX_TOKENS,
            "temperature": 0.8, "seed": i, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    chunks, text, finish, usage = 0, "", None, None
    async with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: ")
            data = line[len("data: "):]
            if data == "[DONE]":
                break
            event = json.loads(data)
            assert "error" not in event, event
            if event["choices"]:
                chunks += 1
                text += event["choices"][0]["text"]
                finish = event["choices"][0]["finish_reason"] or finish
            if event.get("usage"):
                usage = event["usage"]
            if leave_after is not None and chunks >= leave_after:
                return {"left": True}  # closing the response drops the connection
    return {"left": False, "text": text, "finish": finish, "usage": usage}


async def watch_health(http: httpx.AsyncClient, stop: asyncio.Event) -> list[int]:
    codes = []
    while not stop.is_set():
        codes.append((await http.get("/health")).status_code)
        await asyncio.sleep(0.5)
    return codes


async def run_load(url: str) -> tuple[list[dict], list[int]]:
    limits = httpx.Limits(max_connections=NUM_CLIENTS + 8, max_keepalive_connections=NUM_CLIENTS + 8)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=120) as http:
        stop = asyncio.Event()
        health = asyncio.ensure_future(watch_health(http, stop))
        # Every tenth client leaves after its second chunk.
        results = await asyncio.gather(*(stream_one(http, i, 2 if i % 10 == 0 else None)
                                         for i in range(NUM_CLIENTS)))
        stop.set()
        return results, await health


@pytest.mark.slow  # a long sweep: `make test-slow`
def test_concurrent_streams_with_disconnects(server):
    before = httpx.get(server.url + "/metrics").text
    aborted_before = metric_value(before, "pagellm:request_success_total", model_name=MODEL_NAME,
                                  finished_reason="abort") or 0
    results, health = asyncio.run(run_load(server.url))

    left = [r for r in results if r["left"]]
    done = [r for r in results if not r["left"]]
    assert len(left) == NUM_CLIENTS // 10 + 1
    assert len(done) == NUM_CLIENTS - len(left)
    for r in done:
        assert r["finish"] == "length"
        assert r["usage"]["completion_tokens"] == MAX_TOKENS
        assert r["text"]
    assert health and set(health) == {200}

    state = server.wait_all_blocks_free()
    assert state["stats"]["free_blocks"] == state["stats"]["total_blocks"]
    text = httpx.get(server.url + "/metrics").text
    assert metric_value(text, "pagellm:kv_cache_usage_perc", model_name=MODEL_NAME) == 0
    assert metric_value(text, "pagellm:num_requests_running", model_name=MODEL_NAME) == 0
    aborted = metric_value(text, "pagellm:request_success_total", model_name=MODEL_NAME, finished_reason="abort")
    assert aborted - aborted_before == len(left)


@pytest.mark.slow  # a long sweep: `make test-slow`
def test_non_streaming_client_timeout_aborts(server):
    """A client that gives up on a non-streaming request frees its blocks too."""
    def aborted() -> float:
        text = httpx.get(server.url + "/metrics").text
        return metric_value(text, "pagellm:request_success_total", model_name=MODEL_NAME, finished_reason="abort") or 0

    before = aborted()
    body = {"model": MODEL_NAME, "prompt": "Tell me a long story.", "max_tokens": 1000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(10, read=1.5))
    server.wait_all_blocks_free(timeout=15)
    assert aborted() == before + 1

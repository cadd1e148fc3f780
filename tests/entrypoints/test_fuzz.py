"""No request can harm another: every field of both endpoints fuzzed beside a steady load of
well-formed requests (pagellm.bench.fuzz, a few hundred requests here; `pagellm bench fuzz`
runs more), and each extreme the isolation work found answered with a 400 naming its field."""
from __future__ import annotations

import asyncio
import re
from pathlib import Path

import httpx
import pytest

from pagellm.bench.fuzz import NAN, FuzzConfig, encode, run_fuzz
from server_utils import RemoteServer, metric_value

NAME = "tiny-llama"


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    # A small pool (preemptions happen) and room for n > 1 (at most 8 sequences a request); the
    # launcher makes any batch holding a prompt with INJECT_FAULT raise in the model runner.
    # Prompts are prefilled 32 tokens a step, so long ones take several steps.
    s = RemoteServer(["--model", tiny_llama_dir, "--served-model-name", NAME, "--num-kv-blocks", "96",
                      "--max-num-seqs", "16", "--max-num-batched-tokens", "32"],
                     launcher=str(Path(__file__).with_name("fault_server.py")),
                     env={"PAGELLM_TEST_STEP_DELAY": "0.01"})
    yield s
    s.close()


@pytest.mark.slow  # a long sweep: `make test-slow`
def test_fuzzed_fields_under_load_harm_no_one(server):
    report = run_fuzz(server.url, FuzzConfig(num_requests=500, background_clients=3, seed=0))
    fuzz, background = report["fuzz"], report["background"]
    assert fuzz["harmful"] == [], fuzz["harmful"][:5]
    assert background["failed"] == [], background["failed"][:5]
    assert report["blocks_after"] == {"tables": {}, "held_blocks": 0}
    # The fuzz reached both the refusals and the engine, and the load really ran beside it.
    assert fuzz["by_status"].get("400", 0) >= 150 and fuzz["by_status"].get("200", 0) >= 100, fuzz["by_status"]
    assert background["ok"] >= 30
    # Every refusal names the field it refuses.
    assert fuzz["refused_without_param"] == []


def post(server, path: str, body: dict | bytes) -> httpx.Response:
    content = body if isinstance(body, bytes) else encode(body)
    return httpx.post(server.url + path, content=content, headers={"Content-Type": "application/json"},
                      timeout=60)


CMPL, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.mark.parametrize("path, fields, param, words", [
    (CMPL, {"temperature": NAN}, "temperature", ["finite", "NaN"]),
    (CMPL, {"temperature": NAN, "top_k": 5}, "temperature", ["finite"]),
    (CHAT, {"temperature": "NaN", "top_p": 0.5}, "temperature", ["number", '"NaN"']),
    (CMPL, {"temperature": 1e39, "min_tokens": 2}, "temperature", ["1e+39", "3.403e+38"]),
    (CMPL, {"temperature": 1e39}, "temperature", ["1e+39"]),
    (CMPL, {"temperature": float("inf"), "allowed_token_ids": [5]}, "temperature", ["finite"]),
    (CMPL, {"temperature": 1.0, "repetition_penalty": NAN}, "repetition_penalty", ["finite"]),
    (CMPL, {"temperature": 1.0, "repetition_penalty": 1e-45}, "repetition_penalty", ["1e-45", "[0.01, 100]"]),
    (CMPL, {"repetition_penalty": 1e9}, "repetition_penalty", ["1000000000.0", "[0.01, 100]"]),
    (CMPL, {"temperature": 0, "presence_penalty": NAN}, "presence_penalty", ["finite"]),
    (CMPL, {"seed": 2 ** 64 - 1, "n": 2, "temperature": 1.0}, "seed", ["18446744073709551615", "64 bits"]),
    (CMPL, {"seed": 2 ** 63 - 1, "best_of": 3, "temperature": 1.0}, "seed", ["seed + 2", "9223372036854775805"]),
    (CMPL, {"seed": 2 ** 64}, "seed", ["18446744073709551616"]),
    (CMPL, {"stop_token_ids": [10 ** 9]}, "stop_token_ids", ["1000000000", "[0, 320)"]),
    (CMPL, {"top_k": 10 ** 9}, "top_k", ["1000000000", "[1, 320]"]),
    (CMPL, {"seed": True}, "seed", ["integer", "true"]),
    (CMPL, {"logprobs": True}, "logprobs", ["integer", "true"]),
    (CMPL, {"n": "2"}, "n", ["integer", '"2"']),
    (CMPL, {"max_tokens": "8"}, "max_tokens", ["integer", '"8"']),
    (CMPL, {"echo": "yes"}, "echo", ["boolean", '"yes"']),
    (CHAT, {"stream": "true"}, "stream", ["boolean", '"true"']),
    (CMPL, {"n": 9}, "n", ["<= 8", "max-seqs-per-request", "9"]),
    (CMPL, {"best_of": 12}, "best_of", ["<= 8"]),
    (CMPL, {"prompt": "\ud800"}, "prompt", ["UTF-8", "surrogate"]),
    (CMPL, {"prompt": ["ok", "a\udfffb"]}, "prompt", ["UTF-8"]),
    (CMPL, {"stop": ["\ud800"]}, "stop", ["UTF-8"]),
    (CHAT, {"messages": [{"role": "user", "content": "hi \ud800"}]}, "messages", ["UTF-8"]),
    (CHAT, {"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", ["messages", "may not set"]),
    (CHAT, {"chat_template_kwargs": {"add_generation_prompt": False, "tools": []}}, "chat_template_kwargs",
     ["add_generation_prompt, tools"]),
    (CMPL, {"prompt": None}, "prompt", ["prompt must be a string", "got null"]),
])
def test_each_extreme_is_a_400_naming_field_and_value(server, path, fields, param, words):
    base = {"model": NAME, "max_tokens": 2, **({"prompt": "hello"} if path == CMPL else
                                              {"messages": [{"role": "user", "content": "hi"}]})}
    r = post(server, path, {**base, **fields})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    for w in words:
        assert w in error["message"], error


@pytest.mark.parametrize("body, words", [
    (b'{"model": "tiny-llama", "prompt": "hi",', ["not valid JSON", "character 39"]),
    (b"", ["empty", "JSON object"]),
    (b"[1, 2]", ["must be a JSON object", "[1, 2]"]),
])
def test_malformed_bodies_say_what_is_wrong(server, body, words):
    r = post(server, CMPL, body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] is None
    for w in words:
        assert w in error["message"], error


def test_a_request_that_breaks_its_batch_fails_alone(server):
    """The poisoned request makes every batch it is in raise; the engine finds it by bisecting the
    batch, fails it alone (500), and the requests that shared its steps finish with all their tokens."""
    def body(prompt: str, stream: bool) -> dict:
        return {"model": NAME, "prompt": prompt, "max_tokens": 40, "ignore_eos": True, "n": 2,
                "temperature": 0.8, "seed": 3, "stream": stream}

    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            async def ok(i: int) -> int:
                if i % 2:
                    async with http.stream("POST", CMPL, json=body(f"neighbour {i}", True)) as r:
                        events = [line async for line in r.aiter_lines() if line.startswith("data: ")]
                    assert r.status_code == 200 and events[-1] == "data: [DONE]"
                    assert not any('"error"' in e for e in events), events
                    return sum(1 for e in events if '"finish_reason":"length"' in e)
                r = await http.post(CMPL, json=body(f"neighbour {i}", False))
                assert r.status_code == 200, r.text
                return r.json()["usage"]["completion_tokens"]

            async def poisoned():
                await asyncio.sleep(0.05)  # lands in batches the others are already running in
                return await http.post(CMPL, json=body("please INJECT_FAULT now", False))

            return await asyncio.gather(poisoned(), *(ok(i) for i in range(6)))

    text = httpx.get(server.url + "/metrics").text
    before = metric_value(text, "pagellm:request_failures_total", cause="step_error") or 0
    bad, *good = asyncio.run(scenario())
    assert bad.status_code == 500 and "injected fault" in bad.json()["error"]["message"]
    assert good == [80, 2, 80, 2, 80, 2]  # 2 x 40 tokens, or 2 finished choices when streamed
    shared = re.findall(r"a step of (\d+) sequences raised", server.log_tail(200_000))
    assert shared and max(map(int, shared)) > 1, shared  # it really shared its steps with the others
    text = httpx.get(server.url + "/metrics").text
    assert metric_value(text, "pagellm:request_failures_total", cause="step_error") == before + 1
    server.wait_all_blocks_free()


def test_client_leaving_in_the_middle_of_a_chunked_prefill(server):
    """A 400-token prompt takes 13 steps to prefill; the client hangs up while it is half done:
    the request is aborted there and its blocks are back in the pool."""
    body = {"model": NAME, "prompt": "a" * 400, "max_tokens": 50, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        with http.stream("POST", CMPL, json=body) as r:
            assert r.status_code == 200
            for _ in range(200):
                tables = server.state()["tables"]
                if tables:
                    break
            (table,) = tables.values()
            assert 0 < len(table) < 400 // 16, table  # it holds blocks, but not yet the whole prompt's
    state = server.wait_all_blocks_free()
    assert state["stats"]["num_running"] == 0

"""`pagellm serve --data-parallel-size 2`: two engine replicas on a local Ray instance behind the
cache-aware router, through the official client. Completions equal one engine's; a system
prompt's later users reach its replica's prefix cache; /health and /metrics report each replica;
a replica killed mid-run leaves the rotation and the server keeps serving; SIGTERM ends a stream in
flight with finish_reason "abort" and the server exits 0, leaving no Ray process behind."""
from __future__ import annotations

import os
import signal
import time

import httpx
import psutil
import pytest

from pagellm import LLM, SamplingParams
from tests.entrypoints.server_utils import RemoteServer, Stream, metric_value

ENGINE = ["--block-size", "4", "--num-kv-blocks", "128"]
SYSTEMS = ["You answer questions about rivers and mountains. ", "You write short letters to friends. ",
           "You describe gardens in the morning light. ", "You list facts about islands and the sea. "]


def _ray_processes() -> list[str]:
    names = []
    for p in psutil.process_iter(["name", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "raylet" in cmd or "gcs_server" in cmd or cmd.startswith("ray::"):
            names.append(cmd[:80])
    return names


# The served form of tests/serving/test_replicas.py (whose fast tests keep the routing, the outputs and a
# replica's death): Ray and two replica servers behind the HTTP front take about half a minute on 2 cores.
@pytest.mark.slow
def test_replicas_serve_route_report_and_survive_a_death(tiny_llama_dir):
    prompts = [s + q for q in ("one?", "two?", "three?") for s in SYSTEMS]  # 4 system prompts x 3 users
    want = [o.outputs[0].text for o in LLM(tiny_llama_dir, block_size=4, num_kv_blocks=128).generate(
        prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)]
    server = RemoteServer(["--model", tiny_llama_dir, "--served-model-name", "m", *ENGINE,
                           "--data-parallel-size", "2", "--router-policy", "cache_aware", "--shutdown-timeout", "0"])
    try:
        client = server.client()

        def ask(p: str) -> str:
            return client.completions.create(model="m", prompt=p, max_tokens=8, temperature=0).choices[0].text

        assert [ask(p) for p in prompts] == want
        health = httpx.get(server.url + "/health", timeout=10).json()["replicas"]
        assert [r["alive"] for r in health] == [True, True]
        time.sleep(1.5)  # the replicas' stats are polled each second
        text = httpx.get(server.url + "/metrics", timeout=10).text
        for r in (0, 1):
            assert metric_value(text, "pagellm:replica_up", model_name="m", replica=str(r)) == 1
        hits = sum(metric_value(text, "pagellm:replica_prefix_cache_hits", model_name="m", replica=str(r))
                   for r in (0, 1))
        assert hits >= 8 * 36  # the 8 later users each found their system prompt's blocks cached
        routed = [metric_value(text, "pagellm:replica_requests_routed_total", model_name="m", replica=str(r))
                  for r in (0, 1)]
        # Each system prompt's 3 users on one replica, and both replicas used. How the 4 system prompts
        # split depends on when each replica's KV usage was last polled (equal loads go to the one
        # with more free KV): 2 + 2 or 1 + 3.
        assert sum(routed) == 12 and min(routed) >= 3 and all(r % 3 == 0 for r in routed)
        assert metric_value(text, "pagellm:router_prefix_routed_total", model_name="m") == 8
        # A replica dies: the server notices, takes it out of rotation, and keeps answering.
        os.kill(health[0]["pid"], signal.SIGKILL)
        assert [ask(p) for p in prompts] == want
        health = httpx.get(server.url + "/health", timeout=10).json()["replicas"]
        assert [r["alive"] for r in health] == [False, True]
        text = httpx.get(server.url + "/metrics", timeout=10).text
        assert metric_value(text, "pagellm:replica_up", model_name="m", replica="0") == 0
        # SIGTERM with a stream in flight (--shutdown-timeout 0): it ends with finish_reason "abort"
        # and [DONE], and the server exits 0.
        stream = Stream(server, 400, model="m")
        stream.start()
        stream.first.wait(60)
        server.proc.send_signal(signal.SIGTERM)
        stream.join(60)
        assert stream.error is None and stream.events[-1] == "[DONE]" and stream.finish_reason() == "abort"
        assert server.proc.wait(timeout=60) == 0, server.log_tail()
    finally:
        server.close()
    deadline = time.monotonic() + 20
    while _ray_processes() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _ray_processes(), _ray_processes()

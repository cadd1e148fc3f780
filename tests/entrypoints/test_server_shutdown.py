"""Graceful shutdown of a real `pagellm serve` process: on SIGTERM it refuses new work (503 with
Retry-After, /health says draining), lets requests in flight finish for up to --shutdown-timeout,
ends the rest with finish_reason "abort" (a stream gets its last chunk and [DONE]), and exits 0
with no child process left; a second signal exits at once."""
from __future__ import annotations

import signal
import threading
import time

import httpx
import psutil
import pytest

from server_utils import MODEL_NAME, RemoteServer, Stream

LONG = 1500  # tokens: many seconds of decoding on the bundled model, so the drain must cut it


def start(timeout: float, *args: str) -> tuple[RemoteServer, list[psutil.Process]]:
    """A server (the bundled model unless `args` say otherwise) and its child processes."""
    server = RemoteServer([*(args or ("--kv-cache-memory", "256M", "--max-model-len", "2048")),
                           "--shutdown-timeout", str(timeout)])
    return server, psutil.Process(server.proc.pid).children(recursive=True)


class Completion(threading.Thread):
    def __init__(self, server: RemoteServer, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.server, self.max_tokens = server, max_tokens
        self.response: httpx.Response | None = None

    def run(self) -> None:
        body = {"model": MODEL_NAME, "prompt": "The history of", "max_tokens": self.max_tokens, "temperature": 0,
                "ignore_eos": True}
        self.response = httpx.post(self.server.url + "/v1/completions", json=body, timeout=120)


def wait_running(server: RemoteServer, n: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while server.state()["stats"]["num_running"] < n:
        assert time.monotonic() < deadline, f"{n} requests did not start in {timeout} s"
        time.sleep(0.05)


def assert_gone(server: RemoteServer, children: list[psutil.Process], code: int, within: float = 30) -> None:
    assert server.proc.wait(timeout=within) == code, server.log_tail()
    deadline = time.monotonic() + 10
    while any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children):
        assert time.monotonic() < deadline, f"children left 10 s after the server exited: {children}"
        time.sleep(0.2)


def test_sigterm_refuses_new_work_then_aborts_what_is_left_and_exits_0():
    server, children = start(1.0)
    try:
        stream, plain = Stream(server, LONG), Completion(server, LONG)
        stream.start()
        plain.start()
        stream.first.wait(60)
        wait_running(server, 2)
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        refused = httpx.post(server.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "hi"}, timeout=10)
        assert refused.status_code == 503 and refused.headers["retry-after"]
        assert refused.json()["error"]["code"] == "server_shutting_down"
        health = httpx.get(server.url + "/health", timeout=10)
        assert health.status_code == 503 and health.json() == {"status": "draining"}
        stream.join(30)
        plain.join(30)
        assert stream.error is None and stream.events[-1] == "[DONE]"
        assert stream.finish_reason() == "abort" and len(stream.events) > 2
        choice = plain.response.json()["choices"][0]
        assert plain.response.status_code == 200 and choice["finish_reason"] == "abort" and choice["text"]
        assert plain.response.json()["usage"]["completion_tokens"] < LONG
        assert_gone(server, children, 0)
        assert "aborting 2 requests still in flight" in server.log_tail(20000)
    finally:
        server.close()


def test_requests_that_end_within_the_timeout_finish_and_the_exit_does_not_wait_for_it():
    server, children = start(60.0)
    try:
        plain = Completion(server, 40)
        plain.start()
        wait_running(server, 1)
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        plain.join(60)
        assert plain.response.status_code == 200
        assert plain.response.json()["choices"][0]["finish_reason"] == "length"
        assert_gone(server, children, 0)
        assert time.monotonic() - t0 < 30  # drained as soon as nothing was in flight
    finally:
        server.close()


def test_a_second_signal_exits_at_once():
    server, children = start(120.0)
    try:
        stream = Stream(server, LONG)
        stream.start()
        stream.first.wait(60)
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert server.proc.poll() is None  # still draining: the request has two minutes
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGINT)
        assert_gone(server, children, 1, within=20)
        assert time.monotonic() - t0 < 20
    finally:
        server.close()


@pytest.mark.slow
def test_tensor_parallel_ranks_go_with_the_server(tiny_llama_dir):
    # --shutdown-timeout 0: what is in flight is aborted at once.
    server, children = start(0, "--model", tiny_llama_dir, "--served-model-name", MODEL_NAME, "--num-kv-blocks", "96",
                             "--tensor-parallel-size", "2")
    try:
        assert children, "a tensor-parallel server has rank processes"
        stream = Stream(server, 480)
        stream.start()
        stream.first.wait(120)
        server.proc.send_signal(signal.SIGTERM)
        stream.join(60)
        assert stream.finish_reason() == "abort" and stream.events[-1] == "[DONE]"
        assert_gone(server, children, 0, within=60)
    finally:
        server.close()


@pytest.mark.slow
def test_a_dead_engine_answers_503_then_exits_1(tiny_llama_dir):
    """A tensor-parallel rank dies: the request that finds it fails with 503 (engine_unavailable),
    /health says 503, the log names the cause once, and the process exits 1 for a supervisor."""
    server, children = start(5, "--model", tiny_llama_dir, "--served-model-name", MODEL_NAME, "--num-kv-blocks", "96",
                             "--tensor-parallel-size", "2")
    try:
        [rank] = [c for c in children if "resource_tracker" not in " ".join(c.cmdline())]
        rank.kill()
        r = httpx.post(server.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4},
                       timeout=60)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable", r.text
        assert "died" in r.json()["error"]["message"]
        health = httpx.get(server.url + "/health", timeout=10)
        assert health.status_code == 503
        assert_gone(server, children, 1, within=30)
        log = server.log_tail(50000)
        assert log.count("exiting with status 1") == 1, log
    finally:
        server.close()

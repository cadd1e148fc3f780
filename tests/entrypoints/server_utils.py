"""Helpers for the server tests: a real `pagellm serve` process on a free loopback port."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

MODEL_NAME = "SmolLM2-135M-Instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteServer:
    """`python -m pagellm serve ...` (or a launcher script), up until `close()`."""

    def __init__(self, args: list[str], *, launcher: str | None = None, env: dict | None = None,
                 api_key: str | None = None, startup_timeout: float = 240.0) -> None:
        self.port = free_port()
        self.api_key = api_key
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, launcher] if launcher else [sys.executable, "-m", "pagellm"]
        cmd += ["serve", "--port", str(self.port), "--disable-access-log", *args]
        if api_key:
            cmd += ["--api-key", api_key]
        self.log = tempfile.NamedTemporaryFile("w+", prefix="pagellm-server-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
        deadline = time.monotonic() + startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"server did not become healthy in {startup_timeout} s:\n{self.log_tail()}")
            time.sleep(0.25)

    def log_tail(self, n: int = 4000) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-n:]

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none", max_retries=0, **kwargs)

    def async_client(self, **kwargs):
        import openai

        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none", max_retries=0, **kwargs)

    def state(self) -> dict:
        r = httpx.get(self.url + "/dashboard/state", timeout=30)
        r.raise_for_status()
        return r.json()

    def wait_all_blocks_free(self, timeout: float = 30.0) -> dict:
        """Poll the block map until no request holds a block; returns that state. (A hybrid pool's
        null block stays held by the manager: used_blocks does not count it.)"""
        deadline = time.monotonic() + timeout
        while True:
            s = self.state()
            if not s["tables"] and s["stats"]["used_blocks"] == 0 and s["stats"]["num_running"] == 0 \
                    and s["stats"]["num_waiting"] == 0:
                return s
            if time.monotonic() > deadline:
                raise AssertionError(f"blocks still held after {timeout} s: tables={s['tables']} "
                                     f"stats={s['stats']}")
            time.sleep(0.2)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)


class Stream(threading.Thread):
    """A streaming completion read as raw server-sent events."""

    def __init__(self, server: RemoteServer, max_tokens: int, model: str = MODEL_NAME) -> None:
        super().__init__(daemon=True)
        self.server, self.max_tokens, self.model = server, max_tokens, model
        self.events: list[str] = []
        self.first = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {"model": self.model, "prompt": "Once upon a time", "max_tokens": self.max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", self.server.url + "/v1/completions", json=body, timeout=120) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line.removeprefix("data: "))
                        self.first.set()
        except BaseException as e:  # the test reads it
            self.error = e
        finally:
            self.first.set()

    def finish_reason(self) -> str | None:
        chunks = [json.loads(e) for e in self.events if e != "[DONE]"]
        return next((c["choices"][0]["finish_reason"] for c in reversed(chunks)
                     if c["choices"] and c["choices"][0]["finish_reason"]), None)


def metric_value(text: str, name: str, **labels: str) -> float | None:
    """One sample from Prometheus text exposition, by name and (a subset of) labels."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        series, value = line.rsplit(" ", 1)
        metric, _, rest = series.partition("{")
        if metric != name:
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            return float(value)
    return None


def check_rerank(url: str, model: str, query: str, docs: list[str], want: list[float], top_n: int,
                 atol: float) -> list[dict]:
    """POST /v1/rerank and check its top_n results against the reference scores `want`: the order
    of the highest, and each score within atol. Returns the results."""
    order = sorted(range(len(docs)), key=lambda i: -want[i])
    r = httpx.post(url + "/v1/rerank", json={"model": model, "query": query, "documents": docs, "top_n": top_n},
                   timeout=60)
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["index"] for x in results] == order[:top_n]
    assert all(abs(x["relevance_score"] - want[x["index"]]) <= atol for x in results)
    return results

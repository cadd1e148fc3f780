"""A server with an 8-bit KV cache and a persisted second tier, driven by the official client:
contexts evicted from its small pool come back from the tier (its metrics and dashboard say so),
and after a restart the warm prefixes are still there, with the same completions; so they are
after a kill -9 in the middle of heavy tier writes."""
from __future__ import annotations

import random
import signal
import threading
import time

import httpx
import pytest

from tests.entrypoints.server_utils import RemoteServer, metric_value


def _docs() -> list[str]:
    rng = random.Random(0)
    words = "river garden window letter market island winter morning forest village".split()
    return [" ".join(rng.choice(words) for _ in range(14)) for _ in range(6)]  # ~90 bytes: 23 blocks of 4


def _ask(server: RemoteServer, docs: list[str], question: str) -> list[str]:
    client = server.client()
    return [client.completions.create(model="m", prompt=d + question, max_tokens=6, temperature=0).choices[0].text
            for d in docs]


def _metrics(server: RemoteServer) -> str:
    return httpx.get(server.url + "/metrics", timeout=10).text


def test_tier_serves_evicted_prefixes_and_survives_a_restart(tiny_llama_dir, tmp_path):
    args = ["--model", tiny_llama_dir, "--served-model-name", "m", "--block-size", "4", "--num-kv-blocks", "48",
            "--kv-cache-dtype", "int8", "--kv-offload-dir", str(tmp_path), "--kv-offload-size", "16M",
            "--kv-offload-persist"]
    docs = _docs()
    server = RemoteServer(args)
    try:
        first = _ask(server, docs, " one?")
        second = _ask(server, docs, " two?")
        text = _metrics(server)
        assert metric_value(text, "pagellm:kv_offload_demoted_blocks_total", model_name="m") > 0
        assert metric_value(text, "pagellm:kv_offload_promoted_blocks_total", model_name="m") >= 4 * 20
        assert metric_value(text, "pagellm:kv_offload_corrupt_entries_total", model_name="m") == 0
        state = server.state()["stats"]["kv_offload"]
        assert state["blocks"] > 0 and state["promoted_blocks"] > 0
    finally:
        server.close()
    assert list(tmp_path.glob("pagellm-kv-*.bin")), "--kv-offload-persist keeps the file"
    server = RemoteServer(args)
    try:
        again = _ask(server, docs, " two?")
        text = _metrics(server)
        # Every document's prefix comes back from disk in the new process.
        assert metric_value(text, "pagellm:kv_offload_promoted_blocks_total", model_name="m") >= 6 * 20
        assert again == second and first != second
    finally:
        server.close()


@pytest.mark.slow
def test_a_kill_during_tier_writes_keeps_the_intact_entries(tiny_llama_dir, tmp_path):
    """kill -9 while blocks are on their way to the disk: the next start takes the file as it is,
    refuses what was cut short by its checksums, and serves the intact entries with the answers
    of the killed process."""
    args = ["--model", tiny_llama_dir, "--served-model-name", "m", "--block-size", "4", "--num-kv-blocks", "48",
            "--kv-offload-dir", str(tmp_path), "--kv-offload-size", "16M", "--kv-offload-persist"]
    docs = _docs()
    server = RemoteServer(args)
    try:
        _ask(server, docs, " one?")
        want = _ask(server, docs, " two?")  # every context came back from the tier
        _kill_during_writes(server)
    finally:
        server.close()
    server = RemoteServer(args)
    try:
        assert _ask(server, docs, " two?") == want
        text = _metrics(server)
        assert metric_value(text, "pagellm:kv_offload_promoted_blocks_total", model_name="m") >= 6 * 20
    finally:
        server.close()


def _kill_during_writes(server: RemoteServer) -> None:
    """Many new contexts at once, each pushing older blocks out to the tier; kill -9 once the
    writes are under way."""
    rng = random.Random(1)
    words = "amber basket candle dragon ember falcon glacier harbor ivory jungle".split()
    prompts = [" ".join(rng.choice(words) for _ in range(14)) for _ in range(12)]
    client = server.client()

    def ask(prompt: str) -> None:
        try:
            client.completions.create(model="m", prompt=prompt, max_tokens=6, temperature=0)
        except Exception:  # the server is killed under it
            pass

    written = server.state()["stats"]["kv_offload"]["bytes_written"]
    threads = [threading.Thread(target=ask, args=(p,), daemon=True) for p in prompts]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while server.state()["stats"]["kv_offload"]["bytes_written"] < written + 20 * 4096:
        assert time.monotonic() < deadline, "no tier writes"
        time.sleep(0.02)
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait(timeout=30)
    for t in threads:
        t.join(timeout=30)

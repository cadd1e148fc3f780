"""A streaming client that stops reading, against a real server: what waits for it is bounded
(--max-stream-buffer outputs beyond what the sockets hold); then its request is aborted, its KV
blocks go back, and the engine never waits for it: another client's requests complete meanwhile.
If the stalled client reads again, it gets every token up to the abort, finish_reason "abort"
and [DONE]."""
from __future__ import annotations

import json
import socket
import time

import httpx

from server_utils import RemoteServer, metric_value

MAX_TOKENS = 460  # within the tiny model's 512 positions
# Choices of the stalled request, each chunk ~2 KB (20 top logprobs): 4 x 460 chunks are ~3.5 MB,
# well past what the sockets absorb first (the server caps its send buffers at 512 KiB).
N = 4
MESSAGES = [{"role": "user", "content": "Tell me a long story."}]


def _metrics(server: RemoteServer) -> str:
    return httpx.get(server.url + "/metrics", timeout=10).text


def _stalled_request(server: RemoteServer) -> socket.socket:
    """A raw HTTP/1.0 streaming request (the body ends when the server closes) on a socket with a
    small receive buffer, sent and then never read."""
    body = json.dumps({"model": "m", "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0, "n": N,
                       "ignore_eos": True, "stream": True, "logprobs": True, "top_logprobs": 20,
                       "return_token_ids": True}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", server.port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    return sock


def _read_to_the_end(sock: socket.socket) -> list[dict | str]:
    sock.settimeout(30)
    data = b""
    while chunk := sock.recv(1 << 16):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    events = [e.removeprefix("data: ") for e in body.decode().split("\n\n") if e.startswith("data: ")]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def test_a_client_that_never_reads_is_aborted_and_the_others_are_served(tiny_llama_dir):
    # Batch-invariant: the stalled stream's tokens (decoded beside the others) are compared with a
    # greedy run of its own, which a random model's near-ties would otherwise make flaky.
    server = RemoteServer(["--model", tiny_llama_dir, "--served-model-name", "m", "--num-kv-blocks", "256",
                           "--max-stream-buffer", "16", "--batch-invariant"])
    sock = None
    try:
        sock = _stalled_request(server)
        client = server.client()
        # 12 outputs each: fewer than the bound, so they cannot be taken for stalled ones.
        others = [client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"Question {i}"}],
                                                 max_tokens=12, temperature=0) for i in range(2)]
        assert all(o.choices[0].finish_reason == "length" and o.usage.completion_tokens == 12 for o in others)
        deadline = time.monotonic() + 60
        while metric_value(_metrics(server), "pagellm:stalled_streams_total", model_name="m") != 1:
            assert time.monotonic() < deadline, "the stalled stream was not aborted"
            time.sleep(0.1)
        server.wait_all_blocks_free()
        text = _metrics(server)
        assert metric_value(text, "pagellm:request_success_total", model_name="m", finished_reason="abort") == 1
        assert metric_value(text, "pagellm:request_success_total", model_name="m", finished_reason="length") == 2

        # Reading again, the client gets what was generated up to the abort, in order, then its end.
        events = _read_to_the_end(sock)
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        streamed: dict[int, list[int]] = {i: [] for i in range(N)}
        ends = {}
        for c in chunks:
            for choice in c["choices"]:
                streamed[choice["index"]] += choice.get("token_ids") or []
                if choice["finish_reason"]:
                    ends[choice["index"]] = choice["finish_reason"]
        assert ends == {i: "abort" for i in range(N)}
        k = len(streamed[0])
        assert 0 < k < MAX_TOKENS and all(t == streamed[0] for t in streamed.values())
        whole = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=k, temperature=0,
                                               extra_body={"ignore_eos": True, "return_token_ids": True})
        assert whole.choices[0].token_ids == streamed[0]
        assert "read none of its last 16 outputs" in server.log_tail(20000)
    finally:
        if sock is not None:
            sock.close()
        server.close()

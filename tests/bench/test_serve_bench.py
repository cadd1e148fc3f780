"""`pagellm bench serve` against a stand-in OpenAI-compatible streaming server on loopback."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pagellm.bench.serve import ServeConfig, check_loopback, make_requests
from pagellm.cli import main


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen: list[dict] = []

    def log_message(self, *args):
        pass

    def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/v1/models":
            self._send(200, json.dumps({"object": "list", "data": [{"id": "stand-in", "object": "model"}]}).encode())
        else:
            self._send(404, b"{}")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        n = body["max_tokens"]
        for i in range(n):
            time.sleep(0.001)
            chunk = {"id": "c", "object": "text_completion", "model": "stand-in",
                     "choices": [{"index": 0, "text": f" t{i}", "finish_reason": "length" if i == n - 1 else None}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        usage = {"id": "c", "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": n + 7}}
        self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        self.wfile.flush()
        self.close_connection = True


@pytest.fixture
def stand_in_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_serve_bench_tiny(tmp_path, stand_in_server):
    stem = tmp_path / "serve"
    rc = main(["bench", "serve", "--url", f"fake={stand_in_server}", "--rates", "20", "50", "--num-requests", "6",
               "--max-output", "5", "--out", str(stem), "--no-progress"])
    assert rc == 0
    data = json.loads(stem.with_suffix(".json").read_text())
    assert data["benchmark"] == "serve" and data["versions"]["python"]
    rows = data["targets"]["fake"]["rates"]
    assert [r["rate"] for r in rows] == [20.0, 50.0]
    for r in rows:
        assert r["completed"] == 6 and r["failed"] == 0
        assert 0 < r["ttft_s"]["p50"] <= r["e2e_s"]["p50"]
        assert r["tpot_s"]["p50"] > 0 and r["normalized_latency_s"]["mean"] > 0
        assert r["output_tokens"] == sum(min(5, b["max_tokens"]) for b in _Handler.seen[1:7])
        assert r["throughput_tok_s"] > 0
        assert r["roofline"] is None  # the stand-in reports no counters
    assert data["machine_limits"]["memory_gbps"] > 0
    # One warm-up request goes first and is not counted; then 6 per rate.
    assert len(_Handler.seen) == 1 + 2 * 6 and _Handler.seen[0]["max_tokens"] == 2
    body = _Handler.seen[1]
    assert body["stream"] is True and body["ignore_eos"] is True and body["model"] == "stand-in"
    assert stem.with_suffix(".png").stat().st_size > 1000


def test_a_closed_loop_writes_its_figures_but_no_plot_against_rate(tmp_path, stand_in_server):
    # `--rates inf` has no rate to place a point at: a plot of it would be empty axes
    stem = tmp_path / "serve"
    rc = main(["bench", "serve", "--url", f"fake={stand_in_server}", "--rates", "inf", "--max-concurrency", "2",
               "--num-requests", "3", "--max-output", "5", "--out", str(stem), "--no-progress"])
    assert rc == 0
    (row,) = json.loads(stem.with_suffix(".json").read_text())["targets"]["fake"]["rates"]
    assert row["rate"] == float("inf") and row["completed"] == 3 and row["throughput_tok_s"] > 0
    assert not stem.with_suffix(".png").exists()


def test_only_loopback_targets():
    check_loopback("http://127.0.0.1:8000")
    check_loopback("http://localhost:1")
    check_loopback("http://[::1]:8000")
    with pytest.raises(ValueError, match="this machine"):
        check_loopback("http://10.0.0.1:8000")


@pytest.mark.slow
def test_serve_bench_launches_real_servers_per_policy(tmp_path, tiny_llama_dir):
    """`--launch POLICY` starts `pagellm serve --kv-policy POLICY` for each policy in turn."""
    stem = tmp_path / "serve"
    engine_args = f"--model {tiny_llama_dir} --block-size 4 --num-kv-blocks 128 --max-model-len 256"
    rc = main(["bench", "serve", "--launch", "paged", "--launch", "contiguous-max", "--engine-args", engine_args,
               "--rates", "50", "--num-requests", "4", "--max-prompt", "16", "--max-output", "4",
               "--out", str(stem), "--no-progress"])
    assert rc == 0
    data = json.loads(stem.with_suffix(".json").read_text())
    expected_tokens = sum(n for _, n in make_requests(ServeConfig(num_requests=4, max_prompt=16, max_output=4)))
    assert data["skipped"] == {}
    for policy in ("paged", "contiguous-max"):
        target = data["targets"][policy]
        assert target["launched"] is True
        (row,) = target["rates"]
        assert row["completed"] == 4 and row["failed"] == 0 and row["output_tokens"] == expected_tokens
        # The server's counters: every output token but each request's last was computed, and the prompts.
        roof = row["roofline"]
        assert roof["steps"] >= 4 and roof["tokens_computed"] >= expected_tokens
        assert roof["gflops"] > 0 and roof["weight_gbps"] > 0 and 0 < roof["share_of_memory_bandwidth"]


def test_shared_prefix_workload_shares_k_system_prompts_per_rate():
    cfg = ServeConfig(workload="shared-prefix", num_requests=40, num_systems=3, system_prompt_len=64, max_output=8)
    first, second = make_requests(cfg, 0), make_requests(cfg, 1)
    systems = {p.split("\n\nQ: ")[0] for p, _ in first}
    assert len(systems) == 3 and all(len(s.split()) >= 40 for s in systems)
    assert len({p for p, _ in first}) == 40  # each user asks their own question
    assert all(n == 8 for _, n in first)
    # A new rate starts with new system prompts, so it cannot hit the previous rate's cache.
    assert systems.isdisjoint({p.split("\n\nQ: ")[0] for p, _ in second})
    assert make_requests(cfg, 0) == first


@pytest.mark.parametrize("flag", ["--num-systems", "--system-prompt-len"])
def test_shared_prefix_options_are_refused_for_other_workloads(flag, capsys):
    assert main(["bench", "serve", "--url", "http://127.0.0.1:1", flag, "2"]) == 2
    assert f"{flag} shapes the shared-prefix workload; --workload is 'alpaca'" in capsys.readouterr().err
    assert main(["bench", "serve", "--url", "http://127.0.0.1:1", "--workload", "shared-prefix", flag, "0"]) == 2
    assert f"{flag} must be >= 1, got 0" in capsys.readouterr().err

"""`pagellm bench soak` for two seconds against the shared SmolLM2 server (--url): the traffic
mix runs, every interval is sampled (the server's process found by its port), no well-formed
request fails and no block is held once idle. Prompts and outputs are short here (a few seconds
of CPU); the long prompts that preempt are the launched soak's. The verdict's arithmetic is
tests/bench/test_soak_bench.py."""
from __future__ import annotations

import json

from pagellm.cli import main


def test_a_short_soak_is_clean(smollm2_server, tmp_path):
    stem = tmp_path / "soak"
    rc = main(["bench", "soak", "--url", smollm2_server.url, "--duration", "2s", "--interval", "1",
               "--concurrency", "3", "--max-tokens", "4", "--system-prompt-tokens", "48", "--long-prompt-tokens", "96",
               "--seed", "0", "--out", str(stem), "--no-progress"])
    data = json.loads(stem.with_suffix(".json").read_text())
    totals = data["totals"]
    assert rc == 0, (data["verdict"], data["failures"])
    assert totals["failed"] == 0 and totals["fuzz_harm"] == 0, data["failures"]
    assert data["idle_end"]["held_blocks"] == 0 and data["idle_end"]["tables"] == {}
    assert totals["sent"] >= 3 and sum(totals["by_kind"].values()) == totals["sent"]
    assert data["samples"], data
    for s in data["samples"]:
        # The process behind the port is the server's own: its RSS holds the model.
        assert s["rss_bytes"] > 100 * 2**20 and s["fds"] > 3 and s["threads"] >= 2
        assert set(s["requests"]) >= {"ok", "failed", "disconnected", "timed_out"}
    assert data["server"]["pid"] == smollm2_server.proc.pid
    assert data["machine"]["cpu_flags"] is not None and data["load"]["loadavg_start"]
    assert stem.with_suffix(".png").stat().st_size > 1000

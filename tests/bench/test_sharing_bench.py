"""`pagellm bench sharing` on a tiny case writes well-formed results."""
from __future__ import annotations

import json

from pagellm.cli import main


def test_sharing_bench_tiny(tmp_path, tiny_llama_dir):
    stem = tmp_path / "sharing"
    rc = main(["bench", "sharing", "--workload", "alpaca", "--widths", "2", "3", "--num-requests", "3",
               "--model", tiny_llama_dir, "--prefix-len", "64", "--prefix-requests", "4", "--suffix-len", "3",
               "--out", str(stem), "--no-progress"])
    assert rc == 0
    data = json.loads(stem.with_suffix(".json").read_text())
    assert data["benchmark"] == "sharing" and data["git"]["commit"]
    rows = data["results"]["sharing"]
    assert {(r["mode"], r["width"]) for r in rows} == {("parallel", 2), ("parallel", 3), ("beam", 2), ("beam", 3)}
    for r in rows:
        assert 0 < r["saving_pct"] < 100
        assert r["mean_used_blocks"] < r["mean_unshared_blocks"]
    pc = data["results"]["prefix_cache"]
    assert pc["on"]["hit_rate"] > 0.9  # 4 full blocks of 67 tokens and pc["off"]["hit_rate"] == 0
    assert pc["on"]["prompt_tokens_computed"] < pc["off"]["prompt_tokens_computed"]
    assert pc["same_outputs"] is True
    assert stem.with_suffix(".png").stat().st_size > 1000

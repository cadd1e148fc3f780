"""`pagellm bench kv-offload` on a tiny model: the tier pass matches the first pass token for token
and recomputes less; the restarted engine's last turns come from the persisted tier."""
from __future__ import annotations

import json

from pagellm.cli import main


def test_kv_offload_bench_tiny(tmp_path, tiny_llama_dir):
    stem = tmp_path / "kvo"
    rc = main(["bench", "kv-offload", "--model", tiny_llama_dir, "--conversations", "4", "--min-turns", "2",
               "--max-turns", "3", "--user-words", "8", "--max-tokens", "4", "--block-size", "4",
               "--num-kv-blocks", "64", "--max-model-len", "256", "--kv-offload-dir", str(tmp_path / "tier"),
               "--kv-offload-size", str(16 << 20), "--swap-block-sizes", "4", "16", "--swap-context", "64", "--out", str(stem)])
    assert rc == 0
    data = json.loads(stem.with_suffix(".json").read_text())
    p = data["passes"]
    assert all(data["outputs_equal_no_tier"].values())
    assert p["tier"]["prompt_tokens"] == p["no_tier"]["prompt_tokens"]
    assert p["tier"]["prompt_tokens_computed"] < p["no_tier"]["prompt_tokens_computed"]
    assert p["tier"]["kv_offload"]["promoted_blocks"] > 0
    warm, cold = p["restart_tier_last_turns"], p["restart_cold_last_turns"]
    assert warm["prompt_tokens"] == cold["prompt_tokens"] == data["final_context_tokens"]
    assert warm["prompt_tokens_computed"] < cold["prompt_tokens_computed"] / 4
    swap = data["swap_vs_recompute"]["block_sizes"]
    assert swap["4"]["blocks"] == 16 and swap["16"]["blocks"] == 4  # 64 tokens
    assert swap["4"]["block_bytes"] * 4 == swap["16"]["block_bytes"]
    assert all(r["swap_s"] > 0 and r["recompute_s"] > 0 for r in swap.values())
    assert data["final_contexts_over_pool"] > 1 and data["targets"][0]["met"] == (data["final_contexts_over_pool"] >= 3)

"""`pagellm bench kv-cache` on a tiny model, and the KV-format capacity rows of `bench memory`."""
from __future__ import annotations

import json

import pytest

from pagellm.bench.memory import MemoryBenchConfig, kv_format_rows
from pagellm.cli import main


def test_kv_cache_bench_tiny(tmp_path, tiny_llama_dir):
    stem = tmp_path / "kv"
    rc = main(["bench", "kv-cache", "--model", tiny_llama_dir, "--kv-cache-dtype", "bfloat16", "--kv-cache-dtype",
               "int8", "--kv-cache-memory", str(1 << 20), "--max-tokens", "6", "--batch", "2", "--context", "40",
               "--rounds", "2", "--out", str(stem)])
    assert rc == 0
    data = json.loads(stem.with_suffix(".json").read_text())
    acc = data["models"]["bundled"]["accuracy_and_room"]
    assert acc["reference"] == "float32" and set(acc["formats"]) == {"bfloat16", "int8"}
    bf16, int8 = acc["formats"]["bfloat16"], acc["formats"]["int8"]
    # tiny Llama: 2 layers, 2 KV heads of 16: bfloat16 rows of 32 bytes, int8 rows of 16 + 2.
    assert bf16["kv_bytes_per_token"] == 2 * 2 * 2 * 32 and int8["kv_bytes_per_token"] == 2 * 2 * 2 * 18
    assert int8["blocks_vs_bfloat16"] == pytest.approx(int8["num_kv_blocks"] / bf16["num_kv_blocks"])
    assert int8["num_kv_blocks"] > 1.7 * bf16["num_kv_blocks"]
    for r in (bf16, int8):
        assert 0 < r["teacher_forced_top1_agreement"] <= 1 and 0 < r["greedy_tokens_equal"] <= 1
        assert r["perplexity"] > 1 and r["passage_tokens"] > 500
    att = next(iter(data["attention"].values()))
    assert att["formats"]["int8"]["kv_bytes_read"] == 2 * 2 * 40 * att["kv_heads"] * (att["head_dim"] + 2)
    assert att["formats"]["bfloat16"]["speed_vs_bfloat16"] == 1.0
    assert {t["target"].split(":")[0] for t in data["targets"]} >= {"bundled int8", "decode attention 2x40 int8"}


def test_capacity_rows_follow_the_real_row_bytes():
    cfg = MemoryBenchConfig(budget_slots=4096, num_requests={"sharegpt": 60, "alpaca": 60})
    rows = kv_format_rows(cfg)
    smol = rows["shapes"]["smollm2-135m"]["formats"]
    assert smol["bfloat16"]["kv_bytes_per_token"] == 2 * 30 * 3 * 128
    assert smol["int8"]["kv_bytes_per_token"] == 2 * 30 * 3 * 66
    assert smol["bfloat16"]["token_slots"] == 4096 and smol["float32"]["token_slots"] == 2048
    assert smol["int8"]["token_slots"] == 4096 * 128 // 66 // 16 * 16
    peaks = [smol[n]["peak_requests"] for n in ("float32", "bfloat16", "int8")]
    assert peaks == sorted(peaks) and peaks[0] < peaks[2]
    assert len(rows["targets"]) == 6

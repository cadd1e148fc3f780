"""`pagellm bench throughput` on a tiny random model writes well-formed results."""
from __future__ import annotations

import json

import pytest

from pagellm.bench import throughput
from pagellm.cli import main


def test_throughput_bench_tiny(tmp_path, tiny_llama_dir):
    stem = tmp_path / "throughput"
    rc = main(["bench", "throughput", "--model", tiny_llama_dir, "--num-requests", "5", "--min-prompt", "4",
               "--max-prompt", "20", "--min-output", "2", "--max-output", "8", "--num-kv-blocks", "24",
               "--block-size", "4",
               "--systems", "pagellm-paged,pagellm-contiguous-max,pagellm-paged-bf16,hf-static-2,llama-cpp",
               "--check-samples", "2", "--out", str(stem), "--no-progress"])
    assert rc == 0
    data = json.loads(stem.with_suffix(".json").read_text())
    assert data["benchmark"] == "throughput" and data["versions"]["transformers"] and data["command"]
    assert data["workload"]["num_requests"] == 5
    # bfloat16 runs where the CPU has its instructions; elsewhere the bench skips it and says why
    bf16_refused = throughput.system_unavailable({"dtype": "bfloat16"})
    ran = {"pagellm-paged", "pagellm-contiguous-max", "hf-static-2"} | (set() if bf16_refused else {"pagellm-paged-bf16"})
    assert set(data["systems"]) == ran
    if bf16_refused:
        assert "bfloat16" in data["skipped"]["pagellm-paged-bf16"]
    else:
        assert data["systems"]["pagellm-paged-bf16"]["dtype"] == "bfloat16"
    assert data["systems"]["pagellm-paged"]["dtype"] == "float32"
    assert data["skipped"]["llama-cpp"]  # a safetensors directory, not a GGUF
    total = data["workload"]["total_output_tokens"]
    for name, r in data["systems"].items():
        assert r["generated_tokens"] == total
        assert r["tokens_per_s"] > 0 and r["wall_s"] > 0
        assert set(r["greedy_matches_transformers"]) == {"0", "1"}
        for i, same in r["greedy_matches_transformers"].items():  # agreement 1.0 exactly when equal
            assert (r["greedy_agreement"][i] == 1.0) == same and 0 <= r["greedy_agreement"][i] <= 1
    # pagellm's greedy tokens are transformers' whatever the KV layout (in fp32; bf16 is not held to it).
    assert data["greedy_check"]["pagellm_all_match"] is True
    paged = data["systems"]["pagellm-paged"]
    assert paged["peak_batch"] >= 1 and paged["phases"]["steps"] > 0
    assert abs(sum(paged["phases"]["share"].values()) - 1) < 1e-6
    # 24 blocks of 4 tokens: max-length reservations (28 tokens = 7 blocks) fit 3 at a time.
    assert data["systems"]["pagellm-contiguous-max"]["peak_batch"] <= 3
    assert {t["target"].split(" (")[0] for t in data["targets"]} == {"pagellm >= 3x transformers static batching"}
    assert stem.with_suffix(".png").stat().st_size > 1000
    # The roofline: the machine's limits measured in the run, every system's achieved rates.
    assert data["load"]["machine_limits"]["memory_gbps"] > 0
    flops = paged["roofline"]["flops_per_token"]
    for name, r in data["systems"].items():
        assert r["roofline"]["gflops"] > 0 and r["roofline"]["flops_per_token"] == flops
        assert ("weight_gbps" in r["roofline"]) == name.startswith("pagellm-")
    assert paged["roofline"]["weight_gbps"] == pytest.approx(
        paged["roofline"]["weight_bytes_per_step"] * paged["phases"]["steps"] / paged["wall_s"] / 1e9, rel=0.02)


def test_system_suffixes_set_engine_options():
    from pagellm.bench.throughput import pagellm_system

    assert pagellm_system("pagellm-contiguous-max") == ("contiguous-max", {"dtype": "float32"})
    assert pagellm_system("pagellm-paged-dense") == ("paged", {"dtype": "float32", "quantization": "none"})
    assert pagellm_system("pagellm-paged-bf16-invariant") == ("paged", {"dtype": "bfloat16", "batch_invariant": True})

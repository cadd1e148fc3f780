"""`pagellm bench memory` on a tiny case writes well-formed results."""
from __future__ import annotations

import json

from pagellm.bench.memory import WORKLOADS, poisson_arrivals, sample_lengths, simulate
from pagellm.cli import main


def test_memory_bench_tiny(tmp_path):
    stem = tmp_path / "memory"
    rc = main(["bench", "memory", "--workload", "sharegpt", "--policy", "paged-16", "--policy", "contiguous-max",
               "--policy", "contiguous-oracle", "--num-requests", "30", "--budget-slots", "4096",
               "--sweep", "0.5", "4", "--refine-steps", "1", "--out", str(stem), "--no-progress"])
    assert rc == 0
    data = json.loads(stem.with_suffix(".json").read_text())
    assert data["benchmark"] == "memory" and data["git"]["commit"]
    assert data["machine"]["cores"] >= 1 and data["versions"]["python"]
    w = data["workloads"]["sharegpt"]
    assert set(w["policies"]) == {"paged-16", "contiguous-max", "contiguous-oracle"}
    for name, r in w["policies"].items():
        assert 0 < r["token_share_of_reserved"] <= 1
        assert 0 < r["token_share_of_pool"] <= r["token_share_of_reserved"] + 1e-9
        assert abs(sum(r["breakdown"].values()) - 1) < 1e-6
        assert 1 <= r["mean_batch"] <= r["peak_batch"]
        assert [s["rate"] for s in r["sweep"]] == sorted(s["rate"] for s in r["sweep"])
    p = w["policies"]
    # Reserving max_model_len per request wastes most of what it reserves; paging wastes little.
    assert p["contiguous-max"]["token_share_of_reserved"] < p["contiguous-oracle"]["token_share_of_reserved"]
    assert p["paged-16"]["token_share_of_reserved"] > 0.9
    assert {t["target"].split(":")[0] for t in data["targets"]} >= {"contiguous-max"}
    assert stem.with_suffix(".png").stat().st_size > 1000
    # Sliding windows: a window's request holds about its window, full caching its whole context.
    win = data["windows"]
    for name, by_context in win["shapes"].items():
        for context, r in by_context.items():
            hybrid, full = r["hybrid"], r["full"]
            assert full["blocks_held"] == -(-(int(context) + 1) // win["block_size"])
            assert hybrid["bytes_per_request"] < full["bytes_per_request"]
            assert hybrid["requests_in_budget"] >= full["requests_in_budget"]
            assert full["requests_in_budget"] == win["budget_bytes"] // full["bytes_per_request"]
    mistral = win["shapes"]["mistral-like"]
    # All layers slide by 4,096: what one request holds does not grow with its context.
    assert mistral["8192"]["hybrid"]["blocks_held"] == mistral["32768"]["hybrid"]["blocks_held"] == 4096 // 16 + 1


def test_workloads_match_the_paper_means():
    for name, (mi, mo) in {"sharegpt": (161, 338), "alpaca": (19, 58)}.items():
        lengths = sample_lengths(WORKLOADS[name], 2000, 0, 2048)
        assert abs(sum(i for i, _ in lengths) / 2000 - mi) < 0.05 * mi
        assert abs(sum(o for _, o in lengths) / 2000 - mo) < 0.05 * mo
        assert all(i >= 1 and o >= 1 and i + o <= 2048 for i, o in lengths)


def test_simulation_frees_everything_and_counts_every_request():
    lengths = [(10, 5), (3, 20), (40, 1)]
    r = simulate("contiguous-pow2", 1, lengths, poisson_arrivals(3, 2.0, 0), budget_slots=128, max_model_len=64)
    assert r.num_requests == 3 and r.peak_batch >= 1 and r.sim_time_s > 0

"""`pagellm bench spec-decode`: both systems measured on both workloads, outputs compared."""
from __future__ import annotations

import json

from pagellm.cli import main


def test_spec_decode_bench_tiny(tmp_path, tiny_llama_dir):
    stem = tmp_path / "spec"
    rc = main(["bench", "spec-decode", "--model", tiny_llama_dir, "--code-lines", "2", "--max-tokens", "6",
               "--repeat", "2", "--out", str(stem)])
    assert rc == 0
    data = json.loads(stem.with_suffix(".json").read_text())
    assert data["benchmark"] == "spec-decode" and data["machine"]["cpu"] and len(data["load"]["loadavg_start"]) == 3
    assert set(data["workloads"]) == {"code-edit", "chat"}
    for entry in data["workloads"].values():
        assert entry["outputs_equal"] is True
        for system in ("plain", "speculative"):
            runs = entry[system]["runs"]
            assert len(runs) == 2 and all(r["tokens"] == entry["output_tokens"] and r["loadavg"] for r in runs)
            assert entry[system]["decode_tokens_per_s"] > 0
        assert entry["speedup"] > 0


def test_the_llama_server_peer_is_refused_where_it_cannot_run(tmp_path, tiny_llama_dir, capsys):
    """An unknown --spec-type is named before anything loads; an HF folder has no file for llama-server."""
    assert main(["bench", "spec-decode", "--model", tiny_llama_dir, "--peer", "none,ngram-fancy",
                 "--out", str(tmp_path / "a")]) != 0
    assert "unknown llama-server --spec-type ngram-fancy" in capsys.readouterr().err
    assert main(["bench", "spec-decode", "--model", tiny_llama_dir, "--peer", "--code-lines", "2", "--max-tokens", "4",
                 "--repeat", "1", "--out", str(tmp_path / "b")]) != 0
    assert "llama-server serves GGUF files" in capsys.readouterr().err


def test_spec_decode_bench_with_a_draft_model(tmp_path, tiny_llama_dir):
    """--method draft_model with the target as its own draft: every proposal accepted, same output."""
    stem = tmp_path / "spec"
    rc = main(["bench", "spec-decode", "--model", tiny_llama_dir, "--method", "draft_model", "--draft-model",
               tiny_llama_dir, "--workloads", "chat", "--max-tokens", "6", "--repeat", "1", "--out", str(stem)])
    assert rc == 0
    data = json.loads(stem.with_suffix(".json").read_text())
    assert data["config"]["speculative_config"]["method"] == "draft_model"
    assert data["config"]["quantization"] == "auto"
    entry = data["workloads"]["chat"]
    assert entry["outputs_equal"] is True and entry["speculative"]["acceptance_rate"] == 1.0

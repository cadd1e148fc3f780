"""`pagellm bench grammar` on a tiny case writes well-formed results."""
from __future__ import annotations

import json

from pagellm.cli import main


def test_grammar_bench_tiny(tmp_path, tiny_llama_dir):
    stem = tmp_path / "grammar"
    rc = main(["bench", "grammar", "--model", tiny_llama_dir, "--batch", "4", "--max-tokens", "12", "--rounds", "1",
               "--out", str(stem)])
    assert rc == 0
    data = json.loads(stem.with_suffix(".json").read_text())
    assert data["benchmark"] == "grammar" and data["versions"]["xgrammar"]
    modes = data["results"]["modes"]
    for mode in ("none", "json_schema"):
        assert modes[mode]["requests"] == 4 and modes[mode]["failed"] == 0
        assert modes[mode]["steps"] >= 5  # decode steps of the whole batch were timed
        assert modes[mode]["tokens_per_request"] == 12  # the schema's shortest output is longer
    assert modes["json_schema"]["grammar_ms_median"] > 0 and modes["none"]["grammar_ms_median"] == 0
    assert data["results"]["overhead"] == modes["json_schema"]["step_ms_median"] / modes["none"]["step_ms_median"] - 1

"""docs/gpu.md's tables are the GPU check's committed JSON, rendered: none is edited by hand."""
from __future__ import annotations

import copy
import json
from pathlib import Path

from pagellm.bench import doc_sections, gpu_tables

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_runs_are_committed():
    # The page's equality with the files: tests/bench/test_doc_tables.py.
    assert gpu_tables.load_runs(ROOT / gpu_tables.RESULTS), "no GPU run committed under benchmarks/results"


def test_a_changed_figure_changes_the_tables(tmp_path):
    runs = gpu_tables.load_runs(ROOT / gpu_tables.RESULTS)
    name, doc = next((n, d) for n, d in runs if "e2e_8b" in d["parts"])
    changed = copy.deepcopy(doc)
    changed["parts"]["e2e_8b"]["pagellm"]["tok_per_s"] += 1000.0
    assert gpu_tables.render([(name, changed)]) != gpu_tables.render([(name, doc)])


def test_update_page_rewrites_only_the_generated_section(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    src = next((ROOT / gpu_tables.RESULTS).glob("gpu_check-*nvidia*.json"))
    (results / src.name).write_text(src.read_text())
    smoke = json.loads(src.read_text())
    smoke["meta"]["mode"] = "cpu-smoke"  # not a GPU figure: left out
    (results / "gpu_check-2000-01-01-cpu-smoke.json").write_text(json.dumps(smoke))
    page = tmp_path / "gpu.md"
    page.write_text(f"before\n{doc_sections.wrap(gpu_tables.NAME, gpu_tables.SOURCE, 'stale')}\nafter\n")
    assert gpu_tables.update_page(page, results)
    text = page.read_text()
    assert text.startswith("before\n") and text.endswith("\nafter\n") and "stale" not in text
    assert src.name in text and "cpu-smoke" not in text
    assert not gpu_tables.update_page(page, results)

"""docs/quantization.md's single-stream table is drawn from the committed latency results."""
import json
import shutil
from pathlib import Path

from pagellm.bench import cpu_tables, doc_sections

ROOT = Path(__file__).resolve().parents[2]


def test_latency_runs_against_llama_bench_are_committed():
    # The page's equality with the files: tests/bench/test_doc_tables.py.
    assert len(cpu_tables.load_runs(ROOT / cpu_tables.RESULTS)) >= 3


def test_a_system_counts_under_the_mode_it_ran(tmp_path):
    src = ROOT / cpu_tables.RESULTS / "latency-llama-1b-Q8_0-2026-12-04-intel.json"
    doc = json.loads(src.read_text())
    doc["systems"] = {"pagellm-paged": {**doc["systems"]["pagellm-paged-int8x2act"], "options": {"dtype": "float32"},
                                        "activation_quantization": "int8x2"},
                      "pagellm-paged-dense": {**doc["systems"]["pagellm-paged"], "options": {"quantization": "none"}},
                      "llama-bench": doc["systems"]["llama-bench"]}
    cells = cpu_tables.row("run.json", doc)
    assert cells[4] == "-" and cells[5] == f"{doc['systems']['pagellm-paged']['tg_tokens_per_s']:.3g}"
    ratio = doc["systems"]["pagellm-paged"]["tg_tokens_per_s"] / doc["systems"]["llama-bench"]["tg_tokens_per_s"]
    assert cells[8] == f"- / {ratio:.2f} / -"  # the dense system is not a mode of the blocks' products
    results = tmp_path / "results"
    results.mkdir()
    shutil.copy(src, results / src.name)
    page = tmp_path / "page.md"
    page.write_text(f"before\n{doc_sections.wrap(cpu_tables.NAME, cpu_tables.SOURCE, 'stale')}\nafter\n")
    assert cpu_tables.update_page(page, results)
    assert "latency-llama-1b-Q8_0-2026-12-04-intel.json" in page.read_text()
    assert not cpu_tables.update_page(page, results)

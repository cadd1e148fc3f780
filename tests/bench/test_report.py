"""Result files: a rerun on the same day never overwrites a committed result."""
from __future__ import annotations

import datetime

from pagellm.bench import report


def test_default_paths_never_overwrite(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "RESULTS_DIR", tmp_path)
    today = datetime.date.today().isoformat()
    first, _ = report.output_paths("serve", None)
    assert first == tmp_path / f"serve-{today}.json"
    first.write_text("{}")
    second, png = report.output_paths("serve", None)
    assert second == tmp_path / f"serve-{today}-2.json" and png == tmp_path / f"serve-{today}-2.png"
    png.write_bytes(b"")  # a plot alone also claims its name
    assert report.output_paths("serve", None)[0] == tmp_path / f"serve-{today}-3.json"
    # An explicit --out is taken as given, even over an existing file.
    assert report.output_paths("serve", str(first))[0] == first


def test_a_dot_in_the_name_is_kept(tmp_path):
    """`--out results/latency-qwen3.5-4b` names latency-qwen3.5-4b.json, not latency-qwen3.json."""
    json_path, png = report.output_paths("latency", str(tmp_path / "latency-qwen3.5-4b"))
    assert json_path.name == "latency-qwen3.5-4b.json" and png.name == "latency-qwen3.5-4b.png"
    assert report.output_paths("latency", str(tmp_path / "run-1.5.json"))[0].name == "run-1.5.json"


def test_a_run_with_torch_held_to_avx2_says_so(monkeypatch):
    """An AVX2 measurement on an AVX-512 CPU holds torch's kernels with environment variables: the
    result file and the tables' label must name them, or the run reads as the CPU's own."""
    from pagellm.bench import cpu_tables

    for name in report.ISA_LIMITS:
        monkeypatch.delenv(name, raising=False)
    assert "isa_limits" not in report.machine_info()
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    machine = report.machine_info()
    assert machine["isa_limits"] == {"ATEN_CPU_CAPABILITY": "avx2"}
    assert cpu_tables.cpu_label({"machine": machine}).endswith(", ATEN_CPU_CAPABILITY=avx2")

"""The import graph drawn by scripts/import_graph.py: no folder edge runs back up the stack it
finds, no file-level circle, and a one-process engine does not import the tensor-parallel machinery."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "import_graph.py"
_spec = importlib.util.spec_from_file_location("import_graph", _SCRIPT)
import_graph = importlib.util.module_from_spec(_spec)
sys.modules["import_graph"] = import_graph
_spec.loader.exec_module(import_graph)


@pytest.fixture(scope="module")
def measured():
    return import_graph.measure()


def test_no_folder_edge_runs_back_up(measured):
    order, back, _ = measured
    assert not back, f"edges against the stack {order}: {back}"


def test_no_import_circle(measured):
    _, _, circles = measured
    assert not circles, f"import circles: {circles}"


def test_one_process_engine_does_not_import_distributed():
    loaded = import_graph.imported_at_start("pagellm.engine.llm_engine")
    assert "pagellm.executor.uniproc" in loaded
    assert not {m for m in loaded if m.startswith("pagellm.distributed")}

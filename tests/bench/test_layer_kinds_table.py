"""The layer-kinds rows still say what the managers do (a recomputed row equals the committed one);
that docs/kv-cache.md's table is the newest of them, rendered: tests/bench/test_doc_tables.py."""
from __future__ import annotations

import json
from pathlib import Path

from pagellm.bench import windows

ROOT = Path(__file__).resolve().parents[2]


def test_the_committed_rows_are_what_the_managers_give_now():
    doc = json.loads(windows.newest(ROOT / windows.RESULTS).read_text())
    now = windows.window_rows(contexts=(8192,))
    for name, rows in now["shapes"].items():
        assert rows["8192"] == doc["shapes"][name]["8192"], name

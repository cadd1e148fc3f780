"""docs/kv-cache.md's layer-kinds table is the newest committed layer-kinds JSON, rendered; and the
rows still say what the managers do (a recomputed row equals the committed one)."""
from __future__ import annotations

import json
from pathlib import Path

from pagellm.bench import windows

ROOT = Path(__file__).resolve().parents[2]


def test_page_holds_the_table_the_newest_result_gives():
    path = windows.newest(ROOT / windows.RESULTS)
    page = (ROOT / windows.PAGE).read_text()
    section = page[page.index(windows.BEGIN):page.index(windows.END) + len(windows.END)]
    assert section == windows.render(json.loads(path.read_text()), path.name), \
        "run `python -m pagellm.bench.windows` after changing the rows"


def test_the_committed_rows_are_what_the_managers_give_now():
    doc = json.loads(windows.newest(ROOT / windows.RESULTS).read_text())
    now = windows.window_rows(contexts=(8192,))
    for name, rows in now["shapes"].items():
        assert rows["8192"] == doc["shapes"][name]["8192"], name

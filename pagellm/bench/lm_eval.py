"""lm-evaluation-harness's results of `benchmarks/lm_eval_run.sh` (the harness as a client of
`pagellm serve`), as docs/benchmarks.md shows them."""
from __future__ import annotations

from pagellm.bench import doc_sections

# The committed run the page shows, under benchmarks/results/.
RUN = "lm-eval-2026-12-01/results_2026-12-01T04-37-07.715921.json"


def doc_table(doc: dict) -> str:
    """One row per task and metric: its value and, for a mean over samples, how many were right."""
    rows = []
    for task, result in doc["results"].items():
        kind = doc["configs"][task]["output_type"]
        n = doc["n-samples"][task]["effective"]
        for key, value in result.items():
            metric, _, _filter = key.partition(",")
            if not _filter or metric.endswith("_stderr"):
                continue
            rows.append([f"{task} ({kind})", metric, f"{value:.2f} ({round(value * n)}/{n})"])
    return doc_sections.markdown_table(["task", "metric", "value"], rows)

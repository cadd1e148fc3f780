"""The single-stream table of docs/quantization.md, drawn from the committed results of `pagellm
bench latency` against llama-bench (benchmarks/results/latency-*.json), so that no CPU figure is
copied by hand. `python -m pagellm.bench.doc_tables` (or `python -m pagellm.bench.cpu_tables`, this
table alone) rewrites the table in the page; tests/bench/test_doc_tables.py checks that the page
holds what the files give.

One row per run, in file-name order: runs are not averaged, since each measured its own commit on
its own machine (the JSON's git.commit and machine). A system's activation mode is the one it ran:
recorded as resolved since the default became "auto"; before that, the option it set, or "none"."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from pagellm.bench import doc_sections

RESULTS = doc_sections.RESULTS
PAGE = Path("docs") / "quantization.md"
NAME = "cpu-latency-table"
SOURCE = "benchmarks/results/latency-*.json"
MODES = ("none", "int8x2", "int8")
LLAMA_BENCH = "llama-bench"


def load_runs(results: Path = RESULTS) -> list[tuple[str, dict]]:
    """(file name, document) of every latency run that measured llama-bench beside pagellm."""
    runs = []
    for path in sorted(results.glob("latency-*.json")):
        doc = json.loads(path.read_text())
        if LLAMA_BENCH in doc.get("systems", {}):
            runs.append((path.name, doc))
    return runs


def system_mode(result: dict) -> str | None:
    """The activation mode a pagellm system ran, or None for systems outside the table (dense
    weights, bfloat16)."""
    options = result.get("options", {})
    if options.get("quantization") == "none" or options.get("dtype", "float32") != "float32":
        return None
    return result.get("activation_quantization") or options.get("activation_quantization", "none")


def cpu_label(doc: dict) -> str:
    """The machine a result file was measured on, as the tables name it: the CPU, its instruction
    sets and, where pagellm's kernels were built for another target than this CPU, that target (and
    torch's held to fewer instructions, where they were)."""
    m = doc.get("machine", {})
    isa = m.get("isa")
    if isa is None:
        return f"{m.get('cpu', '?')} (flags not recorded)"
    build = "" if m.get("kernels_march") in (None, "native") else f", kernels -march={m['kernels_march']}"
    held = "".join(f", {k}={v}" for k, v in m.get("isa_limits", {}).items())
    return f"{m.get('cpu', '?')}, {isa}{build}{held}"


def _load(doc: dict) -> str:
    start = doc.get("load", {}).get("loadavg_start")
    return f"{start[0]:.1f}" if start else "-"


def _model(doc: dict) -> str:
    return Path(doc.get("model") or "bundled").name.removesuffix(".gguf")


def row(name: str, doc: dict) -> list[str]:
    tg: dict[str, float] = {}
    pp: dict[str, float] = {}
    for system, result in doc["systems"].items():
        mode = LLAMA_BENCH if system == LLAMA_BENCH else system_mode(result)
        if mode is not None and mode not in tg:
            tg[mode], pp[mode] = result["tg_tokens_per_s"], result["pp_tokens_per_s"]
    ref = tg[LLAMA_BENCH]
    cells = [f"{tg[m]:.3g}" if m in tg else "-" for m in (*MODES, LLAMA_BENCH)]
    ratios = " / ".join(f"{tg[m] / ref:.2f}" if m in tg else "-" for m in MODES)
    pp_ratio = f"{pp['int8x2'] / pp[LLAMA_BENCH]:.2f}" if "int8x2" in pp else "-"
    return [f"`{name}`", _model(doc), cpu_label(doc), _load(doc), *cells, ratios, pp_ratio]


def render(runs: list[tuple[str, dict]]) -> str:
    header = ["run", "model", "CPU", "load", "`none` tg", "`int8x2` tg", "`int8` tg", "llama-bench tg",
              "tg / llama-bench: none / int8x2 / int8", "pp: int8x2 / llama-bench"]
    return doc_sections.wrap(NAME, SOURCE, doc_sections.markdown_table(header, [row(name, doc) for name, doc in runs]))


def update_page(page: Path = PAGE, results: Path = RESULTS) -> bool:
    """Rewrite the table in `page`; True when it changed."""
    return doc_sections.update_page(page, NAME, render(load_runs(results)))


if __name__ == "__main__":
    print("updated" if update_page() else "unchanged", PAGE, file=sys.stderr)

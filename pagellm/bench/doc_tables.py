"""Every benchmark table in docs/ is drawn from the committed JSON in benchmarks/results/, never
copied by hand (and the table of GGUF block types from layers/quant/gguf_types.py). This module lists every such table; `python -m pagellm.bench.doc_tables` rewrites
them all, and tests/bench/test_doc_tables.py checks that each page holds what its files give.

A generated section is marked in the page (doc_sections.py) so that the prose around it stays the
author's.

Each table is rendered by the bench module that writes its results (its `doc_table`, beside the
`print_tables` that shows the same figures on the terminal), so a change of a result's shape
changes one module; results written by scripts under benchmarks/ are rendered by quant_tables and
lm_eval here."""
from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from pagellm.bench import cpu_tables, gpu_tables, grammar, grammar_corpus, kv_cache, lm_eval, memory, offload, \
    quant_tables, serve, sharing, spec_decode, throughput, windows
from pagellm.bench.doc_sections import RESULTS, update_page, wrap


def load(results: Path, name: str) -> dict:
    return json.loads((results / name).read_text())


@dataclass(frozen=True)
class DocTable:
    name: str  # the section's marker name
    page: Path
    render: Callable[[Path], str]  # the results folder -> the section, markers included


def json_table(name: str, page: str, source: str, body: Callable[[dict], str]) -> DocTable:
    """A section drawn from one committed result file (`source`, under the results folder)."""
    return DocTable(name, Path("docs") / page,
                    lambda results: wrap(name, f"{RESULTS.as_posix()}/{source}", body(load(results, source))))


def json_runs_table(name: str, page: str, pattern: str, body: Callable[[list[dict]], str],
                    keep: re.Pattern | None = None) -> DocTable:
    """A section drawn from every committed result file matching the glob `pattern` (and the
    regular expression `keep`, when given), in run order: by name without the extension, so that
    a rerun's `-2` follows the first run."""
    def render(results: Path) -> str:
        paths = [p for p in sorted(results.glob(pattern), key=lambda p: p.stem)
                 if keep is None or keep.fullmatch(p.name)]
        return wrap(name, f"{RESULTS.as_posix()}/{pattern}", body([json.loads(p.read_text()) for p in paths]))

    return DocTable(name, Path("docs") / page, render)


def tables() -> list[DocTable]:
    """Every generated section in docs/, page by page."""
    return [
        json_table("kv-memory-table", "benchmarks.md", "memory-2026-12-01.json", memory.doc_table),
        json_table("sharing-table", "benchmarks.md", "sharing-2026-11-30.json",
                   lambda doc: sharing.doc_table(doc["results"])),
        json_table("throughput-table", "benchmarks.md", "throughput-2026-11-30.json", throughput.doc_table),
        json_table("serve-table", "benchmarks.md", "serve-2026-11-30.json", serve.doc_table),
        json_table("grammar-table", "benchmarks.md", "grammar-2026-12-01.json",
                   lambda doc: grammar.doc_table(doc["results"])),
        json_table("grammar-corpus-table", "benchmarks.md", "grammar-corpus-2026-12-05.json",
                   lambda doc: grammar_corpus.doc_table(doc["results"])),
        json_table("lm-eval-table", "benchmarks.md", lm_eval.RUN, lm_eval.doc_table),
        DocTable(windows.NAME, windows.PAGE, windows.section),
        json_table("kv-formats-table", "kv-cache.md", "kv-cache-2026-12-07-zen3.json", kv_cache.doc_table),
        json_table("kv-offload-table", "kv-cache.md", "kv-offload-2026-12-01.json", offload.doc_table),
        json_table("swap-table", "kv-cache.md", "kv-offload-2026-12-01.json", offload.swap_doc_table),
        json_runs_table("router-table", "scaling.md", "serve-router-*M-2026-12-01.json", serve.router_doc_table),
        json_table("activation-products-table", "quantization.md", "quant-matmul-2026-12-02.json",
                   quant_tables.activation_table),
        json_table("weight-formats-table", "quantization.md", "quant-matmul-2026-12-01.json",
                   quant_tables.weight_format_table),
        DocTable("gguf-types-table", Path("docs") / "quantization.md",
                 lambda results: wrap("gguf-types-table", quant_tables.BLOCK_TYPES_SOURCE,
                                      quant_tables.block_types_table())),
        DocTable(cpu_tables.NAME, cpu_tables.PAGE, lambda results: cpu_tables.render(cpu_tables.load_runs(results))),
        json_runs_table("streams-table", "quantization.md", "serve-16-streams-*-vs-llama-server-2026-12-04*.json",
                        quant_tables.streams_table, quant_tables.STREAMS_RUNS),
        json_runs_table("streams-default-table", "quantization.md", "serve-16-streams-*default-vs-llama-server-*.json",
                        quant_tables.streams_table),
        json_runs_table("streams-amx-table", "quantization.md", "serve-16-streams-*amx-vs-llama-server-*.json",
                        quant_tables.streams_table),
        json_table("batch-invariant-table", "python.md", "batch-invariant-2026-12-01.json",
                   throughput.invariant_doc_table),
        DocTable(gpu_tables.NAME, gpu_tables.PAGE, lambda results: gpu_tables.render(gpu_tables.load_runs(results))),
        json_table("spec-decode-table", "speculative-decoding.md", "spec-decode-smollm2-2026-12-06-intel-amx.json",
                   spec_decode.doc_table),
        json_table("verify-phases-table", "speculative-decoding.md", "verify-phases-smollm2-k8-2026-12-08-zen4.json",
                   spec_decode.verify_phases_doc_table),
        json_runs_table("lookup-vouched-table", "speculative-decoding.md", "lookup-vouched-ab-*.json",
                        spec_decode.vouched_doc_table),
    ]


def main(root: Path = Path(".")) -> int:
    for t in tables():
        changed = update_page(root / t.page, t.name, t.render(root / RESULTS))
        print(f"{t.page} {t.name}: {'rewritten' if changed else 'up to date'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

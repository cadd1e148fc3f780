"""docs/quantization.md's tables of products and served streams, drawn from the committed results
of benchmarks/quant_matmul.py (quant-matmul-*.json) and of `pagellm bench serve` against
llama-server (serve-16-streams-*.json), and its table of GGUF block types, drawn from
layers/quant/gguf_types.py. Rendered by `python -m pagellm.bench.doc_tables`."""
from __future__ import annotations

import math
import re
from pathlib import Path

from pagellm.bench import doc_sections
from pagellm.bench.cpu_tables import cpu_label
from pagellm.layers.quant.gguf_types import BLOCK_TYPES, KERNEL_SOURCES

BLOCK_TYPES_SOURCE = "pagellm/layers/quant/gguf_types.py"


def ms(x: float) -> str:
    """Three significant figures, at most three decimals, never an exponent (0.070, 1.92, 15.1,
    386, 1822)."""
    if x <= 0:
        return f"{x:g}"
    return f"{x:.{min(3, max(0, 2 - math.floor(math.log10(x))))}f}"


def block_types_table() -> str:
    """The GGUF block types multiplied in their blocks: layout, bits per value, kernels."""
    rows = [[t.name, t.id, t.values, t.bytes, f"{8 * t.bytes / t.values:g}", "yes" if t.k_quant else "no",
             f"`{KERNEL_SOURCES[t.kernels]}`"] for t in BLOCK_TYPES.values()]
    return doc_sections.markdown_table(["type", "GGML id", "values / block", "bytes / block", "bits / value",
                                        "K-quant", "kernels"], rows, "lrrrrll")


def _rows_by(doc: dict) -> dict:
    return {(r["shape"], r["type"], r["dtype"], r["batch"]): r for r in doc["rows"]}


def activation_table(doc: dict, batches: tuple[int, ...] = (1, 2, 16)) -> str:
    """Per shape, the float32 products' median ms with float32 activations (the fused kernel) and
    with activations rounded to two int8 codes or one, at a few batch sizes."""
    by = _rows_by(doc)
    shapes = dict.fromkeys((r["shape"], r["type"], r["rows"], r["cols"]) for r in doc["rows"]
                           if r["dtype"] == "float32")
    rows = []
    for shape, qtype, n, k in shapes:
        got = [by.get((shape, qtype, "float32", b)) for b in batches]
        rows.append([f"{shape}, {qtype} {n} x {k}",
                     *(" / ".join(ms(r[key]) if r else "-" for r in got)
                       for key in ("fused_ms", "q8x2act_ms", "q8act_ms"))])
    return doc_sections.markdown_table([f"product, batch {' / '.join(map(str, batches))}", "float32 activations",
                                      "`int8x2`", "`int8`"], rows, "lrrr")


# (label, activations dtype, the JSON's timing) of the weight-format comparison's rows.
WEIGHT_FORMATS = [
    ("dense float32", "float32", "dense_ms"),
    ("GGUF fused kernel, float32", "float32", "fused_ms"),
    ("GGUF widened tiles, float32", "float32", "tiled_ms"),
    ("int8, float32 (batch 1: torch's kernel; 8, 32: widened tiles)", "float32", "int8_ms"),
    ("int4, float32 (torch's kernel)", "float32", "int4_ms"),
    ("dense bfloat16", "bfloat16", "dense_ms"),
    ("int8, bfloat16 (torch's kernel)", "bfloat16", "int8_ms"),
    ("int4, bfloat16 (torch's kernel)", "bfloat16", "int4_ms"),
]


def weight_format_table(doc: dict, shape: str = "llama-1b gate_up", qtype: str = "Q4_0",
                        batches: tuple[int, ...] = (1, 8, 32)) -> str:
    """One shape's median ms per weight format and activation dtype, at a few batch sizes."""
    by = _rows_by(doc)
    first = next(r for r in doc["rows"] if (r["shape"], r["type"]) == (shape, qtype))
    rows = [[label.replace("GGUF", f"GGUF {qtype}"),
             *(ms(by[(shape, qtype, dtype, b)][key]) for b in batches)] for label, dtype, key in WEIGHT_FORMATS]
    return doc_sections.markdown_table([f"{shape} ({first['rows']} x {first['cols']})",
                                      *(f"batch {b}" for b in batches)], rows, "l" + "r" * len(batches))


def _option(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


def streams_table(runs: list[dict]) -> str:
    """Per model file and activation mode, every run's output tok/s of pagellm and llama-server
    (`--parallel 16`), their ratio, and the range of median time per output token."""
    groups: dict[tuple[str, str, str], list[tuple[dict, dict]]] = {}
    for doc in runs:
        targets = doc["targets"]
        ours, theirs = targets["paged"], targets["llama-server"]
        # --model: the file every launched server serves; llama-server's command line names it.
        model = Path(_option(theirs.get("engine_args", []), "-m") or "?").stem
        mode = _option(ours.get("engine_args", []), "--activation-quantization") or "default"
        cpu = cpu_label(doc)
        groups.setdefault((model, mode, cpu), []).append((ours["rates"][0], theirs["rates"][0]))
    rows = []
    for (model, mode, cpu), pairs in groups.items():
        def span(rates: list[dict]) -> str:
            lo, hi = (f"{1e3 * min(r['tpot_s']['p50'] for r in rates):.0f}",
                      f"{1e3 * max(r['tpot_s']['p50'] for r in rates):.0f}")
            return lo if lo == hi else f"{lo}-{hi}"

        rows.append([f"{model}, `{mode}`", cpu, ", ".join(ms(a["throughput_tok_s"]) for a, _ in pairs),
                     ", ".join(ms(b["throughput_tok_s"]) for _, b in pairs),
                     ", ".join(f"{a['throughput_tok_s'] / b['throughput_tok_s']:.2f}x" for a, b in pairs),
                     f"{span([a for a, _ in pairs])} / {span([b for _, b in pairs])} ms"])
    return doc_sections.markdown_table(["file, mode", "CPU", "pagellm output tok/s", "llama-server `--parallel 16`",
                                      "ratio", "TPOT p50, pagellm / llama-server"], rows, "llrrrr")


# The native runs of 2026-12-04 (three of each), not the AVX2 build's nor those before a change.
STREAMS_RUNS = re.compile(r"serve-16-streams-.*-vs-llama-server-2026-12-04(-[23])?\.json")

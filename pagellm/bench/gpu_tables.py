"""The tables of docs/gpu.md, drawn from the GPU check's committed results
(benchmarks/results/gpu_check-*.json, written by benchmarks/gpu_check.py), so that no GPU figure
is copied by hand. `python -m pagellm.bench.doc_tables` (or `python -m pagellm.bench.gpu_tables`, this
page alone) rewrites the tables in docs/gpu.md; tests/bench/test_doc_tables.py checks that the page
holds what the files give.

One row per run and part, run order by file name: runs are not averaged, since each measured the
code of its own commit (the JSON's meta.commit)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from pagellm.bench import doc_sections
from pagellm.bench.doc_sections import markdown_table

RESULTS = doc_sections.RESULTS
PAGE = Path("docs") / "gpu.md"
NAME = "gpu-tables"
SOURCE = "benchmarks/results/gpu_check-*.json"


def load_runs(results: Path = RESULTS) -> list[tuple[str, dict]]:
    """(file name, document) of every GPU run (CPU smoke runs are not GPU figures)."""
    runs = []
    for path in sorted(results.glob("gpu_check-*.json")):
        doc = json.loads(path.read_text())
        if doc.get("meta", {}).get("mode") == "gpu":
            runs.append((path.name, doc))
    return runs


def _ok(doc: dict, part: str) -> dict | None:
    p = doc["parts"].get(part)
    return p if p and p.get("status") == "ok" else None


def _run_label(name: str, doc: dict) -> str:
    return f"`{name}` ({doc['meta']['commit'][:8]})"


def correctness_rows(runs: list[tuple[str, dict]]) -> list[list[str]]:
    rows = []
    for name, doc in runs:
        for part, what in (("kernel_tests", "Triton attention kernels and CUDA graphs, compiled"),
                           ("gguf_kernel_tests", "Triton GGUF product against gguf-py")):
            p = doc["parts"].get(part)
            if p and p.get("status") != "skipped":
                counts = p.get("counts") or {}
                got = ", ".join(f"{n} {k}" for k, n in counts.items()) or p.get("error", "")[:100]
                rows.append([_run_label(name, doc), what, f"{p['status']}: {got}".replace("|", "/")])
        g = _ok(doc, "graphs_vs_eager")
        if g:
            for key, what in (("float32_graphs_vs_eager", "CUDA-graph decode against eager, float32"),
                              ("bfloat16_graphs_vs_eager", "CUDA-graph decode against eager, bfloat16"),
                              ("float32_graphs_vs_transformers_fp32", "pagellm (graphs, float32) against transformers"),
                              ("bfloat16_graphs_vs_transformers_fp32",
                               "pagellm (graphs, bfloat16) against transformers float32")):
                a = g[key]
                rows.append([_run_label(name, doc), what,
                             f"{a['identical_sequences']} identical greedy sequences, "
                             f"{a['tokens_before_first_difference']} tokens before the first difference, "
                             f"logprobs within {a['max_abs_logprob_diff']:g}"])
    return rows


def decode_rows(runs: list[tuple[str, dict]]) -> list[list[str]]:
    rows = []
    for name, doc in runs:
        d = _ok(doc, "decode_bandwidth")
        if not d:
            continue
        for key in sorted(k for k in d if k.startswith("paged_block_")):
            e = d[key]
            dflt = e["default"]
            alternating = "rounds" in dflt
            sdpa = dflt["sdpa_gb_per_s"] if alternating else d["sdpa_contiguous"]["gb_per_s"]
            best = e.get("best") or {}
            best_cfg = "default tiles" if best.get("config") is None else "x".join(map(str, best["config"]))
            rows.append([_run_label(name, doc), key.removeprefix("paged_block_"), f"{sdpa:,.0f}",
                         f"{dflt['gb_per_s']:,.0f}", f"{dflt['vs_sdpa']:.3f}",
                         f"{e['auto_num_splits']}", f"{best.get('gb_per_s', 0):,.0f} ({best_cfg}, "
                                                    f"{best.get('num_splits')} split)",
                         "alternating rounds" if alternating else "once, SDPA timed first"])
    return rows


def kv8_rows(runs: list[tuple[str, dict]]) -> list[list[str]]:
    rows = []
    for name, doc in runs:
        d = _ok(doc, "decode_bandwidth")
        if not d or "kv_8bit" not in d:
            continue
        kv = d["kv_8bit"]
        plain_bytes = d["kv_bytes"]
        for fmt in ("int8", "fp8_e4m3", "fp8_e5m2"):
            r = kv[fmt]
            plain_ms = r.get("plain_median_ms", kv.get("plain_ms"))
            bytes_ratio = r["kv_bytes"] / plain_bytes
            bandwidth_ratio = (r["kv_bytes"] / r["median_ms"]) / (plain_bytes / plain_ms)
            rows.append([_run_label(name, doc), fmt, f"{bytes_ratio:.3f}", f"{r['median_ms']:.3f}",
                         f"{plain_ms:.3f}", f"{plain_ms / r['median_ms']:.3f}", f"{bandwidth_ratio:.3f}"])
    return rows


def e2e_rows(runs: list[tuple[str, dict]]) -> list[list[str]]:
    rows = []
    for name, doc in runs:
        for part in ("e2e_8b", "e2e_1b"):
            e = _ok(doc, part)
            if not e:
                continue
            p, hf = e.get("pagellm", {}), e.get("hf_generate", {})
            if "tok_per_s" not in p:
                continue
            fp8 = e.get("pagellm_kv_fp8", {}).get("tok_per_s")
            roof = p.get("roofline", {})
            busy = p.get("profile", {}).get("decode_256x16", {}).get("gpu_busy_fraction")
            ratio = f"{p['tok_per_s'] / hf['tok_per_s']:.2f}x" if hf.get("tok_per_s") else "not run"
            rows.append([_run_label(name, doc), part.removeprefix("e2e_").upper(), f"{p['tok_per_s']:,.0f}",
                         f"{hf['tok_per_s']:,.0f}" if hf.get("tok_per_s") else "not run", ratio,
                         f"{fp8:,.0f}" if fp8 else "not run",
                         f"{roof.get('median_step_ms', 0):.1f} / {roof.get('median_roofline_ms', 0):.1f}",
                         "not measured" if busy is None else f"{busy:.2f}"])
    return rows


def render(runs: list[tuple[str, dict]]) -> str:
    env = runs[-1][1]["meta"]["environment"] if runs else {}
    parts = [
        f"Machine of the latest run: {env.get('gpu', '?')} ({env.get('sms', '?')} SMs, {env.get('memory_gib', '?')} "
        f"GiB), torch {env.get('torch', '?')}, Triton {env.get('triton', '?')}, transformers "
        f"{env.get('transformers', '?')}.",
        "",
        "**Correctness, compiled on the GPU**",
        "",
        markdown_table(["run", "check", "result"], correctness_rows(runs)),
        "",
        "**Paged decode against SDPA on contiguous K/V** (B=64, context 4096, 32/8 heads, head dim 128, bf16; "
        "K/V bytes read per second, GB/s)",
        "",
        markdown_table(["run", "block size", "SDPA", "paged (defaults)", "ratio", "splits chosen", "best of the sweep",
                "timing"], decode_rows(runs)),
        "",
        "**8-bit KV decode** (same shape, block size 32; time in ms; bandwidth = bytes read per second, "
        "against bf16's in the same rounds)",
        "",
        markdown_table(["run", "format", "bytes vs bf16", "8-bit ms", "bf16 ms", "speed vs bf16", "bandwidth vs bf16"],
               kv8_rows(runs)),
        "",
        "**Offline throughput** (random weights; 256 requests, prompts uniform in 64-512 tokens, 128 output "
        "tokens, ignore_eos; output tokens per second; first timed run after a short warm-up)",
        "",
        markdown_table(["run", "shape", "pagellm", "transformers generate (static batch)", "pagellm / transformers",
                "pagellm, fp8 KV", "decode step / roofline (ms)", "GPU busy in decode"], e2e_rows(runs)),
    ]
    return doc_sections.wrap(NAME, SOURCE, "\n".join(parts))


def update_page(page: Path = PAGE, results: Path = RESULTS) -> bool:
    """Rewrite the generated section of `page`; True if it changed."""
    return doc_sections.update_page(page, NAME, render(load_runs(results)))


if __name__ == "__main__":
    changed = update_page()
    print(f"{PAGE}: {'rewritten' if changed else 'already up to date'}")
    sys.exit(0)

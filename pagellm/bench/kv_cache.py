"""`pagellm bench kv-cache`: what each KV cache format costs in accuracy and buys in room and speed.

Per format (--kv-cache-dtype), on one model computing in float32:
- **Accuracy against the reference format** (float32 KV by default). Teacher-forced: a fixed
  English passage (bench/data/passage.txt) goes in as one prompt with prompt logprobs; at each
  position the format's top-1 next token is compared with the reference's, and the passage's
  perplexity is reported. Every position reads its whole context from the cache as the format
  stores it (prompts attend to the stored values, kv_format.py), which is what decoding
  does. Free-running: greedy continuations of a set of prompts, compared position by position
  with the reference's (a single early flip changes everything after it, so this share is lower
  than the teacher-forced one; both are reported).
- **Room**: KV blocks the engine allocates for one byte budget, and tokens per GiB.
- **Decode attention speed**: the CPU paged-attention kernel alone on one batch of decodes over
  random caches of the model's KV shape, every format interleaved round by round in one process
  (this machine's timings drift), with the bytes it reads per call.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time
from importlib import resources

from pagellm.bench import doc_sections, report

FORMATS = ("float32", "bfloat16", "float16", "int8", "fp8_e4m3", "fp8_e5m2")
# Prompts for the free-running comparison: openings of ordinary sentences.
PROMPTS = (
    "The history of the printing press", "In the morning the market", "A simple way to bake bread is",
    "The river ran past the old mill and", "Scientists studying the ocean found", "My favourite season is winter because",
    "The train left the station at", "To plant a garden in spring, first", "The letter arrived on a rainy day",
    "Mountains are formed when", "The museum opened a new exhibition about", "Every evening the lighthouse keeper",
    "The recipe calls for two cups of", "When the children came home from school", "The city council voted to",
    "An island in the middle of the lake",
)


# The random model: head size 64 as in most real models (the scale's 2 bytes per row weigh more
# in smaller heads); weights of std 0.15, the tests' sharpness (0.3 at hidden size 64) scaled
# by 1/sqrt(width) so activations keep their size.
RANDOM_SHAPE = dict(hidden_size=256, intermediate_size=640, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=320)
RANDOM_STD = 0.15


def passage() -> str:
    return resources.files("pagellm.bench").joinpath("data/passage.txt").read_text()


def _engine(model: str | None, kv_cache_dtype: str, kv_cache_memory: int, load_format: str):
    from pagellm import LLM

    return LLM(model, dtype="float32", kv_cache_dtype=kv_cache_dtype, kv_cache_memory=kv_cache_memory,
               load_format=load_format, seed=0)


def accuracy_and_room(model: str | None, formats: tuple[str, ...], reference: str, kv_cache_memory: int,
                      max_tokens: int, load_format: str = "auto") -> dict:
    """Per format: teacher-forced top-1 tokens and log-likelihood of the passage, greedy
    continuations, KV blocks in the budget; then agreement with `reference`."""
    from pagellm import SamplingParams

    runs: dict = {}
    for name in dict.fromkeys((reference, *formats)):
        llm = _engine(model, name, kv_cache_memory, load_format)
        engine = llm.engine
        ids = engine.tokenizer.encode(passage())[: engine.max_model_len - 1]
        out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=1),
                           use_tqdm=False)[0]
        entries = out.prompt_logprobs[1:]
        logprobs = [e[t].logprob for t, e in zip(ids[1:], entries)]
        top1 = [next(t for t, lp in e.items() if lp.rank == 1) for e in entries]
        greedy = llm.generate(list(PROMPTS), SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                              use_tqdm=False)
        runs[name] = {
            "kv_format": engine.runner.kv_format.name,
            # K and V of every layer: 2 x layers x KV heads x one row.
            "kv_bytes_per_token": 2 * engine.arch.num_hidden_layers * engine.arch.num_key_value_heads
            * engine.runner.kv_format.bytes_per_row(engine.arch.head_dim),
            "num_kv_blocks": engine.kv.num_blocks,
            "block_size": engine.config.block_size,
            "passage_tokens": len(ids),
            "perplexity": math.exp(-sum(logprobs) / len(logprobs)),
            "_top1": top1,
            "_greedy": [list(o.outputs[0].token_ids) for o in greedy],
        }
        llm.shutdown()
    ref = runs[reference]
    rows = {}
    for name in formats:
        r = runs[name]
        pairs = [(a, b) for x, y in zip(r["_greedy"], ref["_greedy"]) for a, b in zip(x, y)]
        first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(y))
                 for x, y in zip(r["_greedy"], ref["_greedy"])]
        rows[name] = {k: v for k, v in r.items() if not k.startswith("_")}
        rows[name].update({
            "teacher_forced_top1_agreement": sum(a == b for a, b in zip(r["_top1"], ref["_top1"])) / len(ref["_top1"]),
            "perplexity_change": r["perplexity"] / ref["perplexity"] - 1,
            "greedy_tokens_equal": sum(a == b for a, b in pairs) / len(pairs),
            "greedy_mean_first_difference": statistics.mean(first),
            "blocks_vs_bfloat16": None,
        })
    if "bfloat16" in runs:
        for name in formats:
            rows[name]["blocks_vs_bfloat16"] = runs[name]["num_kv_blocks"] / runs["bfloat16"]["num_kv_blocks"]
    return {"reference": reference, "kv_cache_memory": kv_cache_memory, "max_tokens": max_tokens,
            "num_prompts": len(PROMPTS), "formats": rows}


def attention_speed(shape: tuple[int, int, int], formats: tuple[str, ...], batch: int, context: int,
                    rounds: int, block_size: int = 16) -> dict:
    """Median time of one call of the CPU decode kernel per format: `batch` decodes of `context`
    keys each, heads (query heads, KV heads, head size) = `shape`."""
    import torch

    from pagellm.kv_format import resolve_kv_format
    from pagellm.kernels import cpu

    h, kvh, d = shape
    gen = torch.Generator().manual_seed(0)
    blocks = batch * (-(-context // block_size))
    tables = (torch.randperm(blocks, generator=gen) + 1).view(batch, -1)
    q = torch.randn(batch, h, d, generator=gen)
    lens = torch.full((batch,), context)
    caches = {}
    for name in formats:
        fmt = resolve_kv_format(name, torch.float32)
        k, v = (fmt.encode(torch.randn(blocks + 1, block_size, kvh, d, generator=gen)) for _ in range(2))
        caches[name] = (fmt, k, v)
    times: dict[str, list[float]] = {n: [] for n in formats}
    for _ in range(rounds):
        for name, (fmt, k, v) in caches.items():
            start = time.perf_counter()
            cpu.paged_attention(q, k, v, tables, lens, d ** -0.5, kv_format=fmt)
            times[name].append(time.perf_counter() - start)
    rows = {}
    for name, (fmt, _, _) in caches.items():
        med = statistics.median(times[name])
        read = 2 * batch * context * kvh * fmt.bytes_per_row(d)
        rows[name] = {"median_ms": med * 1e3, "kv_bytes_read": read, "gb_per_s": read / med / 1e9}
    if "bfloat16" in rows:
        for r in rows.values():
            r["speed_vs_bfloat16"] = rows["bfloat16"]["median_ms"] / r["median_ms"]
    return {"heads": h, "kv_heads": kvh, "head_dim": d, "batch": batch, "context": context, "rounds": rounds,
            "threads": torch.get_num_threads(), "formats": rows}


# Model shapes for the capacity rows of `pagellm bench memory`: (layers, KV heads, head size).
CAPACITY_SHAPES = {"smollm2-135m": (30, 3, 64), "llama-3-8b": (32, 8, 128)}


def capacity_rows(simulate_peak, budget_slots_bf16: int, formats: tuple[str, ...] = FORMATS,
                  block_size: int = 16) -> dict:
    """Per model shape and format: KV bytes per token, the token slots of one byte budget (the
    bytes `budget_slots_bf16` tokens take in bfloat16), and `simulate_peak(slots)`'s peak number
    of concurrent requests in that many slots (the memory bench's scheduler replay)."""
    import torch

    from pagellm.kv_format import resolve_kv_format

    out: dict = {"block_size": block_size, "shapes": {}}
    for shape, (layers, kvh, d) in CAPACITY_SHAPES.items():
        per_token = {n: 2 * layers * kvh * resolve_kv_format(n, torch.float32).bytes_per_row(d) for n in formats}
        budget = budget_slots_bf16 * 2 * layers * kvh * 2 * d
        rows = {}
        for name in formats:
            slots = budget // per_token[name] // block_size * block_size
            rows[name] = {"kv_bytes_per_token": per_token[name], "token_slots": slots, **simulate_peak(slots)}
        if "bfloat16" in rows:
            for r in rows.values():
                r["peak_vs_bfloat16"] = r["peak_requests"] / rows["bfloat16"]["peak_requests"]
        out["shapes"][shape] = {"layers": layers, "kv_heads": kvh, "head_dim": d, "budget_bytes": budget,
                                "formats": rows}
    out["targets"] = [
        {"target": f"{shape} {name}: peak concurrent requests >= 1.9x bfloat16's in the same bytes",
         "value": r["peak_vs_bfloat16"], "met": r["peak_vs_bfloat16"] >= 1.9}
        for shape, sh in out["shapes"].items() for name, r in sh["formats"].items()
        if name in ("int8", "fp8_e4m3", "fp8_e5m2") and "peak_vs_bfloat16" in r]
    return out


def print_capacity_rows(rows: dict) -> None:
    for shape, sh in rows["shapes"].items():
        print(f"\nKV formats, {shape} shape ({sh['layers']} layers x {sh['kv_heads']} KV heads x {sh['head_dim']}), "
              f"{sh['budget_bytes'] / (1 << 30):.2f} GiB of KV:")
        table = [(n, r["kv_bytes_per_token"], r["token_slots"], r["peak_requests"], f"{r['mean_batch']:.1f}",
                  f"{r.get('peak_vs_bfloat16', 0):.2f}x") for n, r in sh["formats"].items()]
        print(report.format_table(["format", "bytes/token", "token slots", "peak requests", "mean batch",
                                   "vs bfloat16"], table))


def _arch_heads(model: str | None, load_format: str) -> tuple[int, int, int]:
    from pagellm.loader.source import load_model_source

    arch = load_model_source(model, load_format, "none").arch
    return arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim


def run(args: argparse.Namespace) -> dict:
    formats = tuple(args.kv_cache_dtype or FORMATS)
    models: dict[str, tuple[str | None, str]] = {"bundled": (args.model, "auto")}
    tmp = None
    if args.random_model:
        from pagellm.loader.synthetic import write_random_model_dir

        tmp = tempfile.TemporaryDirectory()
        models["random-llama"] = (write_random_model_dir(os.path.join(tmp.name, "random-llama"), RANDOM_SHAPE,
                                                         std=RANDOM_STD), "auto")
    load = {"loadavg_start": os.getloadavg()}
    out: dict = {"models": {}}
    for label, (model, fmt) in models.items():
        out["models"][label] = {
            "model": model or "bundled SmolLM2-135M-Instruct",
            "accuracy_and_room": accuracy_and_room(model, formats, args.reference, args.kv_cache_memory,
                                                   args.max_tokens, fmt),
        }
    shape = _arch_heads(args.model, "auto")
    out["attention"] = {f"{args.batch}x{args.context}": attention_speed(shape, formats, args.batch, args.context,
                                                                         args.rounds)}
    load["loadavg_end"] = os.getloadavg()
    out["load"] = load
    out["targets"] = targets(out)
    if tmp is not None:
        tmp.cleanup()
    return out


def targets(out: dict) -> list[dict]:
    rows = []
    for label, m in out["models"].items():
        for name, r in m["accuracy_and_room"]["formats"].items():
            if name in ("int8", "fp8_e4m3", "fp8_e5m2"):
                v = r["teacher_forced_top1_agreement"]
                rows.append({"target": f"{label} {name}: teacher-forced top-1 agreement with float32 KV >= 98%",
                             "value": v, "met": v >= 0.98})
                if r["blocks_vs_bfloat16"] is not None:
                    v = r["blocks_vs_bfloat16"]
                    rows.append({"target": f"{label} {name}: KV blocks in the same bytes >= 1.9x bfloat16's",
                                 "value": v, "met": v >= 1.9})
    for key, a in out["attention"].items():
        for name, r in a["formats"].items():
            if name in ("int8", "fp8_e4m3", "fp8_e5m2") and "speed_vs_bfloat16" in r:
                v = r["speed_vs_bfloat16"]
                rows.append({"target": f"decode attention {key} {name}: at least as fast as bfloat16",
                             "value": v, "met": v >= 1.0})
    return rows


def print_tables(out: dict) -> None:
    for label, m in out["models"].items():
        a = m["accuracy_and_room"]
        print(f"\n{label} ({m['model']}), reference {a['reference']} KV:")
        rows = [(n, r["kv_bytes_per_token"], r["num_kv_blocks"], f"{r['teacher_forced_top1_agreement']:.2%}",
                 f"{r['perplexity']:.3f}", f"{r['perplexity_change']:+.2%}", f"{r['greedy_tokens_equal']:.1%}",
                 f"{r['greedy_mean_first_difference']:.1f}") for n, r in a["formats"].items()]
        print(report.format_table(["format", "KV bytes/token", "blocks", "top-1 agree", "perplexity", "change",
                                   "greedy equal", "first diff"], rows))
    for key, a in out["attention"].items():
        print(f"\ndecode attention, batch x context {key}, heads {a['heads']}/{a['kv_heads']} x {a['head_dim']}:")
        rows = [(n, f"{r['median_ms']:.2f}", f"{r['gb_per_s']:.1f}", f"{r.get('speed_vs_bfloat16', 0):.2f}x")
                for n, r in a["formats"].items()]
        print(report.format_table(["format", "ms", "GB/s", "vs bfloat16"], rows))
    report.print_targets(out["targets"])


def doc_table(out: dict, model: str = "bundled") -> str:
    """docs/kv-cache.md's table: per format, one model's bytes, room, accuracy against the
    reference, and the decode kernel's speed against bfloat16's."""
    m = out["models"][model]["accuracy_and_room"]
    speed = next(iter(out["attention"].values()))["formats"]
    rows = [[name, f"{r['kv_bytes_per_token']:,}", f"{r['num_kv_blocks']:,} ({r['blocks_vs_bfloat16']:.2f}x)",
             f"{r['teacher_forced_top1_agreement']:.2%}", f"{r['perplexity_change']:+.2%}",
             f"{speed[name]['speed_vs_bfloat16']:.2f}x" if name in speed else "-"] for name, r in m["formats"].items()]
    return doc_sections.markdown_table(
        [out["models"][model]["model"], "KV bytes / token", f"blocks in {m['kv_cache_memory'] >> 20} MiB (vs bfloat16)",
         f"top-1 agreement with {m['reference']}", "perplexity change", "decode attention vs bfloat16"], rows, "lrrrrr")


def add_parser(sub) -> None:
    p = sub.add_parser("kv-cache", help="KV cache formats (float32, bfloat16, int8, fp8): accuracy against float32 "
                                        "KV, blocks per byte budget, decode attention speed")
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: the bundled SmolLM2)")
    p.add_argument("--random-model", action="store_true",
                   help="also measure a small random Llama (head size 64, weights of std 0.15: attention "
                        "depends on context)")
    p.add_argument("--kv-cache-dtype", action="append", choices=FORMATS, help="repeat; default: all")
    p.add_argument("--reference", default="float32", choices=FORMATS)
    p.add_argument("--kv-cache-memory", type=int, default=256 << 20, help="KV budget in bytes for the room column")
    p.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per prompt")
    p.add_argument("--batch", type=int, default=16, help="decodes per attention call")
    p.add_argument("--context", type=int, default=1024, help="keys per decode in the attention timing")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--out", default=None, help="output path stem (default benchmarks/results/kv-cache-<date>)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    out = {**report.metadata("kv-cache"), **run(args)}
    json_path, _ = report.output_paths("kv-cache", args.out)
    report.write_json(json_path, out)
    print_tables(out)
    print(f"\nwrote {json_path}")
    return 0

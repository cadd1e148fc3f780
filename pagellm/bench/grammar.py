"""`pagellm bench grammar`: what a structured-output grammar costs a decode step.

A batch of `--batch` sampled requests decodes with a JSON-schema grammar and without one, on
two engines stepped in turn (so drift in the machine's load hits both alike). Only
steps that decode the whole batch count (no prefill, no request finishing mid-step), and
every request runs to `--max-tokens` (without a grammar: ignore_eos; with one: a schema whose
shortest output is longer than that). Reported per mode: the median step time, the time in the
grammar phase (filling the batch's bitmask with xgrammar) and in the sampler (masking included).
Outputs stop at --max-tokens, mid-object: their validity is the tests' job
(tests/entrypoints/test_structured_outputs.py validates complete ones with jsonschema).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

from pagellm.bench import doc_sections, report

# Long by construction: at least 64 strings, so no output completes within --max-tokens.
SCHEMA = {
    "type": "object",
    "properties": {"title": {"type": "string", "maxLength": 40},
                   "items": {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 64}},
    "required": ["title", "items"],
}
PROMPT = "Write a JSON object with a title and a long list of items for a shopping trip number {i}:"


def _whole_batch_decode(engine, batch: int, max_tokens: int) -> bool:
    """Whether the next step decodes all `batch` sequences and none of them finishes in it."""
    running = engine.scheduler.running
    return (len(running) == batch and not engine.scheduler.waiting
            and all(q.num_tokens_to_compute == 1 and len(q.output_token_ids) + 1 < max_tokens for q in running))


def run(args: argparse.Namespace) -> dict:
    from pagellm import LLM, SamplingParams, StructuredOutputsParams
    from pagellm.timing import PhaseTimer

    spec = StructuredOutputsParams(json=SCHEMA)
    modes = {"none": None, "json_schema": spec}
    # One engine per mode, stepped in turn: the machine's drifting load hits both alike.
    engines = {m: LLM(args.model, dtype=args.dtype, max_num_seqs=args.batch,
                      max_num_batched_tokens=max(2048, args.batch * 32), seed=args.seed).engine for m in modes}
    engines["json_schema"].grammars.compile(spec)  # compiled once, as a server's cache would hold it
    results = {m: {"step_ms": [], "grammar_ms": [], "sampler_ms": [], "outputs": []} for m in modes}
    timers = {m: PhaseTimer() for m in modes}
    load = {"loadavg_start": os.getloadavg()}
    for r in range(args.rounds):
        for mode, so in modes.items():
            engines[mode].attach_timer(timers[mode])
            for i in range(args.batch):
                engines[mode].add_request(f"{mode}-{r}-{i}", PROMPT.format(i=i), SamplingParams(
                    temperature=0.8, seed=args.seed + i, max_tokens=args.max_tokens, ignore_eos=so is None,
                    structured_outputs=so))
        while any(e.has_unfinished_requests() for e in engines.values()):
            for mode, engine in engines.items():
                if not engine.has_unfinished_requests():
                    continue
                res, timer = results[mode], timers[mode]
                whole = _whole_batch_decode(engine, args.batch, args.max_tokens)
                before = {k: timer.seconds.get(k, 0.0) for k in ("grammar", "sampler")}
                start = time.perf_counter()
                outs = engine.step()
                took = time.perf_counter() - start
                if whole:
                    res["step_ms"].append(took * 1e3)
                    res["grammar_ms"].append((timer.seconds.get("grammar", 0.0) - before["grammar"]) * 1e3)
                    res["sampler_ms"].append((timer.seconds.get("sampler", 0.0) - before["sampler"]) * 1e3)
                res["outputs"] += [o for o in outs if o.finished]
    load["loadavg_end"] = os.getloadavg()
    summary = {}
    for mode, res in results.items():
        summary[mode] = {
            "steps": len(res["step_ms"]),
            "step_ms_median": statistics.median(res["step_ms"]),
            "step_ms_mean": statistics.fmean(res["step_ms"]),
            "grammar_ms_median": statistics.median(res["grammar_ms"]),
            "sampler_ms_median": statistics.median(res["sampler_ms"]),
            "requests": len(res["outputs"]),
            "failed": sum(o.error is not None for o in res["outputs"]),
            "tokens_per_request": statistics.fmean(len(o.outputs[0].token_ids) for o in res["outputs"]),
        }
    overhead = summary["json_schema"]["step_ms_median"] / summary["none"]["step_ms_median"] - 1
    return {"config": {k: v for k, v in vars(args).items() if k != "func"}, "schema": SCHEMA, "load": load,
            "modes": summary, "overhead": overhead, "target_overhead": 0.10}


MODE_LABELS = {"none": "no grammar", "json_schema": "JSON schema"}


def doc_table(result: dict) -> str:
    """docs/benchmarks.md's table: per mode, the whole-batch decode steps timed and their medians."""
    rows = [[MODE_LABELS.get(mode, mode), s["steps"],
             *(f"{s[key]:.1f} ms" for key in ("step_ms_median", "grammar_ms_median", "sampler_ms_median"))]
            for mode, s in result["modes"].items()]
    return doc_sections.markdown_table(["mode", "steps timed", "step (median)", "filling the bitmask (xgrammar)",
                                      "sampler"], rows, "lrrrr")


def add_parser(sub) -> None:
    p = sub.add_parser("grammar", help="decode step time with a JSON-schema grammar vs without")
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: the bundled SmolLM2)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=None, help="tokens per request (default 64; 256 with --corpus)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of each mode")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corpus", action="store_true",
                   help="instead: compile and sample bench/schema_corpus.py's schemas with each grammar backend "
                        "and validate the outputs (bench/grammar_corpus.py)")
    p.add_argument("--samples", type=int, default=2, help="--corpus: outputs sampled per schema")
    p.add_argument("--out", default=None, help="output path stem (default benchmarks/results/grammar-<date>)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if args.max_tokens is None:
        args.max_tokens = 256 if args.corpus else 64
    if args.corpus:
        return corpus_main(args)
    result = run(args)
    data = {**report.metadata("grammar", extra_versions=("xgrammar",)), "results": result}
    json_path, _ = report.output_paths("grammar", args.out)
    report.write_json(json_path, data)
    rows = [(mode, s["steps"], f"{s['step_ms_median']:.1f}", f"{s['grammar_ms_median']:.2f}",
             f"{s['sampler_ms_median']:.2f}", s["failed"]) for mode, s in result["modes"].items()]
    print(report.format_table(["mode", "steps", "step ms (median)", "grammar ms", "sampler ms", "failed"], rows))
    print(f"grammar overhead per decode step: {result['overhead']:+.1%} (target <= +10%)")
    print(f"wrote {json_path}")
    return 0


def corpus_main(args: argparse.Namespace) -> int:
    from pagellm.bench import grammar_corpus

    result = grammar_corpus.run(args)
    data = {**report.metadata("grammar-corpus", extra_versions=("xgrammar", "llguidance")), "results": result}
    json_path, _ = report.output_paths("grammar-corpus", args.out)
    report.write_json(json_path, data)
    print(grammar_corpus.doc_table(result))
    for system, s in result["systems"].items():
        for name, why in s["invalid_schemas"].items():
            print(f"{system}: invalid output for {name}: {why}")
    print(f"wrote {json_path}")
    return 0

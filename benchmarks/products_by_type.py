"""Where a GGUF model's decode step goes, per weight type: every quantized product timed as it
runs (wall clock around gguf_matmul, which returns when its threads are done) and summed by type,
against the whole step. The LM head is its own row (its rows number the vocabulary). The machine's
memory bandwidth is measured before and after (bench/roofline.py's streaming sum), and each type's
rate is given as a share of their mean (`share_of_bandwidth`): at one stream, what a decode product
reaches of what this machine can stream. Decode plans are off (PAGELLM_DECODE_PLANS=0): their direct kernel
calls would bypass the timed wrapper; the kernels and their arguments are the same, so each type's
rate is the plans' own, while `step_ms` counts the modules' Python as well.

    python benchmarks/products_by_type.py --model FILE --streams 1 16 --out RESULTS/products-by-type.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("PAGELLM_DECODE_PLANS", "0")  # every product through gguf.gguf_matmul, timed below

from pagellm import LLM, SamplingParams  # noqa: E402
from pagellm.bench.report import metadata, write_json  # noqa: E402
from pagellm.bench.roofline import machine_limits  # noqa: E402
from pagellm.layers.quant import gguf  # noqa: E402


def type_name(qtype: int) -> str:
    """A product's weight type by name; a layout the kernels repacked at load by its GGUF type's."""
    base = gguf._repacked_bases().get(qtype)
    return gguf.NATIVE_TYPES[qtype] if base is None else f"{gguf.NATIVE_TYPES[base]} repacked"


def measure(llm: LLM, streams: int, tokens: int, rounds: int, head_rows: int) -> dict:
    """The round with the fastest step: ms per step, and per type ms, MB and GB/s per step."""
    prompts = [{"prompt_token_ids": [1 + i, 2, 3, 4]} for i in range(streams)]
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0)
    llm.generate(prompts, params, use_tqdm=False)
    product = gguf.gguf_matmul
    best = None
    for _ in range(rounds):
        seconds, nbytes, calls = defaultdict(float), defaultdict(int), defaultdict(int)

        def timed(x, data, qtype, cols, batch_invariant=False, activations="none"):
            start = time.perf_counter()
            y = product(x, data, qtype, cols, batch_invariant, activations)
            key = type_name(qtype) + (" head" if data.shape[0] == head_rows else "")
            seconds[key] += time.perf_counter() - start
            nbytes[key] += data.numel()
            calls[key] += 1
            return y

        gguf.gguf_matmul = timed
        try:
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            step_ms = 1000 * (time.perf_counter() - start) / tokens
        finally:
            gguf.gguf_matmul = product
        if best is None or step_ms < best["step_ms"]:
            best = {"step_ms": round(step_ms, 2), "products_ms": round(1000 * sum(seconds.values()) / tokens, 2),
                    "types": {k: {"ms_per_step": round(1000 * seconds[k] / tokens, 2),
                                  "mb_per_step": round(nbytes[k] / tokens / 1e6, 1),
                                  "gbps": round(nbytes[k] / seconds[k] / 1e9, 1),
                                  "calls_per_step": calls[k] // tokens} for k in sorted(seconds)}}
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a GGUF file")
    ap.add_argument("--activation-quantization", default="auto", help="as `pagellm serve`'s (auto: the default mode; int8 before "
                    "2026-12-07: every result file records the mode it ran)")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--int8-max-rows", type=int, nargs="+", default=None,
                    help="measure the integer mode with each of these row bounds (gguf.INT8_MAX_ROWS), in turn, "
                         "twice: which bound serves a step of --streams fastest")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    llm = LLM(args.model, activation_quantization=args.activation_quantization, max_model_len=512,
              num_kv_blocks=64 * max(args.streams), max_num_seqs=max(args.streams))
    head_rows = llm.engine.runner.model.cfg.vocab_size
    load = os.getloadavg()
    limits_before = machine_limits()
    if args.int8_max_rows:
        results = {}
        for repeat in (1, 2):  # alternating, so drift hits every bound alike
            for bound in args.int8_max_rows:
                gguf.INT8_MAX_ROWS[args.activation_quantization] = bound
                for b in args.streams:
                    results[f"{b} streams, bound {bound}, run {repeat}"] = measure(llm, b, args.tokens, args.rounds,
                                                                                    head_rows)
    else:
        results = {str(b): measure(llm, b, args.tokens, args.rounds, head_rows) for b in args.streams}
    limits_after = machine_limits()
    bandwidth = (limits_before["memory_gbps"] + limits_after["memory_gbps"]) / 2
    for r in results.values():
        for entry in r["types"].values():
            entry["share_of_bandwidth"] = round(entry["gbps"] / bandwidth, 2)
    for b, r in results.items():
        print(b, json.dumps(r), flush=True)
    print(f"memory bandwidth: {limits_before['memory_gbps']} GB/s before, {limits_after['memory_gbps']} after",
          flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, {**metadata("products_by_type"), "model": args.model,
                     "activation_quantization": args.activation_quantization, "tokens": args.tokens,
                     "rounds": args.rounds, "int8_max_rows": args.int8_max_rows,
                     "load_avg_before_after": [load, os.getloadavg()],
                     "machine_limits_before_after": [limits_before, limits_after], "streams": results})


if __name__ == "__main__":
    main()

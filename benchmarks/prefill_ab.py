"""Prompt processing of a GGUF file with its prefill products in the integer kernel (csrc x8_prefill,
gguf.prefill_types: "new") against float32 tiles of the weights for torch's GEMM ("old": the same
model with gguf.prefill_types emptied), in one process, turn about, each prompt a fresh one (no
prefix-cache hits): the end-to-end effect of the prefill kernels, in the default mode.

    python benchmarks/prefill_ab.py --model FILE --tokens 64 256 --rounds 3 --threads 1 --out RESULTS/prefill-ab.json

`--types Q5_K` empties only those GGUF types' place in gguf.prefill_types for "old", in blocks and
repacked (the file's other types keep their integer prefill on both sides; Q4_0 and Q4_1 share
their repacked layout, so either takes both's): one type's share of the gain.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from pagellm import LLM, SamplingParams  # noqa: E402
from pagellm.bench.report import metadata, write_json  # noqa: E402
from pagellm.kernels import cpu  # noqa: E402
from pagellm.layers.quant import gguf  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a GGUF file")
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 256], help="prompt lengths")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--types", nargs="+", choices=sorted(gguf.NATIVE_TYPES.values()),
                    help="GGUF type names whose integer prefill 'old' goes without (default: every type's)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    longest = max(args.tokens)
    llm = LLM(args.model, max_model_len=longest + 16, max_num_batched_tokens=longest, enable_prefix_caching=False)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1, temperature=0)
    new = gguf.prefill_types
    if args.types:  # those types' ids, in GGUF's blocks and in the layout a load repacks them into
        types = {t for t, name in gguf.NATIVE_TYPES.items() if name in args.types}
        repacked = getattr(cpu.quant_kernels(), "repacked_types", {})
        ids = types | {repacked[t] for t in types if t in repacked}
        paths = {"new": new, "old": lambda activations: new(activations) - ids}
    else:
        paths = {"new": new, "old": lambda activations: frozenset()}
    vocab = llm.engine.runner.model.cfg.vocab_size

    def seconds(path: str, tokens: int) -> float:
        gguf.prefill_types = paths[path]
        prompt = [rng.randrange(10, vocab) for _ in range(tokens)]
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        return time.perf_counter() - start

    load = os.getloadavg()
    results = {}
    try:
        for tokens in args.tokens:
            seconds("new", tokens), seconds("old", tokens)  # warm-up
            times: dict[str, list[float]] = {"new": [], "old": []}
            for r in range(args.rounds):
                for path in (("new", "old") if r % 2 == 0 else ("old", "new")):
                    times[path].append(seconds(path, tokens))
            med = {p: statistics.median(t) for p, t in times.items()}
            results[f"pp{tokens}"] = {"new_tok_s": round(tokens / med["new"], 2),
                                      "old_tok_s": round(tokens / med["old"], 2),
                                      "speedup": round(med["old"] / med["new"], 3), "seconds": times}
            print(f"pp{tokens}", json.dumps({k: v for k, v in results[f'pp{tokens}'].items() if k != "seconds"}),
                  flush=True)
    finally:
        gguf.prefill_types = paths["new"]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, {**metadata("prefill_ab"), "model": args.model, "old_without": args.types or "all",
                     "threads": args.threads, "rounds": args.rounds,
                     "load_avg_before_after": [load, os.getloadavg()], "prompts": results})


if __name__ == "__main__":
    main()

"""Load a GGUF file as pagellm serves it, generate a few tokens, and record what it holds: the
resident weight bytes against the file's tensor bytes, the KV cache, the peak RSS, the times.

    python benchmarks/load_gguf.py /data/shapes/llama-3-8b-random-Q4_K_M.gguf --kv-cache-memory 2G \\
        --out benchmarks/results/llama-3-8b-q4_k_m-load-DATE.json
"""
from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

from pagellm import LLM, SamplingParams
from pagellm.bench.report import metadata, write_json
from pagellm.config import bytes_or_fraction
from pagellm.loader.gguf_file import GGUFFile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--kv-cache-memory", default="2G")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    tensor_bytes = sum(t.n_bytes for t in GGUFFile(args.model).tensors)
    start = time.perf_counter()
    llm = LLM(args.model, kv_cache_memory=bytes_or_fraction(args.kv_cache_memory), max_model_len=args.max_model_len)
    load_s = time.perf_counter() - start
    report = llm.engine.memory_report()[0]
    start = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": list(range(1000, 1064))}],
                       SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    result = {**metadata("load_gguf"), "file": args.model, "file_tensor_bytes": tensor_bytes,
              "weight_bytes": report["weight_bytes"], "weight_over_file": report["weight_bytes"] / tensor_bytes,
              "kv_cache_bytes": report["kv_cache_bytes"], "kv_blocks": llm.engine.kv.num_blocks,
              "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "load_s": load_s,
              "generate_64_prompt_8_new_s": time.perf_counter() - start, "tokens": out[0].outputs[0].token_ids}
    print(json.dumps({k: v for k, v in result.items() if k != "tokens"}, indent=1))
    write_json(Path(args.out), result)


if __name__ == "__main__":
    main()

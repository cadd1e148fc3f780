"""How far each way of multiplying a GGUF model's blocks moves it from the same model
dequantized to float32: greedy agreement and the largest logprob difference, teacher-forced (the
reference's greedy continuation fed back with prompt_logprobs, so every position is compared on
the same context), per `--activation-quantization` mode; `--kv-cache-dtype F [F ...]` measures
each mode with each of these KV caches (the reference keeps float32), `--modes` some modes only.

    python benchmarks/quant_agreement.py --out benchmarks/results/quant-agreement-DATE.json

Defaults: the bundled Q4_1 SmolLM2, 64 prompts x 64 tokens (the quantized-weights issue's size).
Each mode's integer kernel is used for every product here (its row bound raised to the 16-row
steps), so the figures are the arithmetic's, whatever batch sizes a server would see; then mode
int8 once more with whole prefills, whose products of more than 16 rows (32 against the K-quants:
gguf.int8_max_rows) round the activations to bfloat16 for bfloat16 tiles (gguf.BF16_TILES).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagellm import LLM  # noqa: E402
from pagellm.bench.report import metadata, write_json  # noqa: E402
from pagellm.config import ACTIVATION_QUANTIZATIONS, KV_CACHE_DTYPES  # noqa: E402
from pagellm.layers.quant import gguf  # noqa: E402
from tests.models.test_gguf_quantized import Comparison, Reference, word_prompts  # noqa: E402


def _entry(c: Comparison) -> dict:
    return {"greedy_agreement": c.agreement, "max_logprob_diff": c.worst,
            "disagreements": len(c.disagreement_margins),
            # the reference's lead of its token over the runner-up where this mode chose another
            "reference_margins_at_disagreements": sorted(round(m, 6) for m in c.disagreement_margins)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a GGUF file (default: the bundled SmolLM2)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--modes", nargs="+", choices=ACTIVATION_QUANTIZATIONS, default=None,
                    help="the modes to measure (default: all)")
    ap.add_argument("--kv-cache-dtype", nargs="+", choices=KV_CACHE_DTYPES, default=["auto"],
                    help="the measured engines' KV caches, each mode with each (the reference's stays float32)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    started = time.time()
    reference = LLM(args.model, quantization="none", max_model_len=256)
    ref = Reference(reference, word_prompts(reference.get_tokenizer(), args.prompts), args.tokens)
    reference.shutdown()
    modes = {}
    for mode in args.modes or ACTIVATION_QUANTIZATIONS:
        if mode != "none":
            gguf.INT8_MAX_ROWS[mode] = 16
        for kv in args.kv_cache_dtype:
            llm = LLM(args.model, max_model_len=256, activation_quantization=mode, kv_cache_dtype=kv,
                      max_num_batched_tokens=16, max_num_seqs=16)
            c = ref.compare_detail(llm)
            llm.shutdown()
            label = mode if kv == "auto" else f"{mode}, {kv} KV"
            modes[label] = _entry(c)
            print(label, json.dumps(modes[label]), flush=True)
    # mode int8 past its integer rows: the teacher-forced prefills in bfloat16 tiles
    if gguf.BF16_TILES and "int8" in (args.modes or ["int8"]):
        gguf.INT8_MAX_ROWS["int8"] = 16
        llm = LLM(args.model, max_model_len=256, activation_quantization="int8")
        c = ref.compare_detail(llm)
        llm.shutdown()
        label = f"int8 past 16 rows (bfloat16 tiles; K-quants past {gguf.int8_max_rows('int8', min(gguf.K_QUANTS))})"
        modes[label] = _entry(c)
        print("int8 bfloat16 tiles", json.dumps(modes[label]), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, {**metadata("quant_agreement"), "model": args.model or "bundled SmolLM2-135M-Instruct Q4_1",
                     "prompts": args.prompts, "tokens": args.tokens, "positions": sum(len(r) for r in ref.rows),
                     "seconds": round(time.time() - started, 1), "modes": modes,
                     # how often the reference nearly ties: the floor under any rounding's agreement
                     "reference_margins_below": {str(t): sum(m < t for r in ref.rows for _, _, m in r)
                                                 for t in (1e-4, 1e-3, 2e-3, 5e-3, 1e-2)}})


if __name__ == "__main__":
    main()

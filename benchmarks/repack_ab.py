"""A GGUF file served with its weights repacked as a load repacks them (layers/quant/gguf.py,
REPACKED: "tiles") against the same file with the `--blocks` types kept in GGUF's blocks
("blocks"), two engines in one process, round by round in turn, default mode: single-stream decode
(`--tokens` greedy tokens after a one-token prompt: tok/s over the steps after the first) and
prompt processing (`--prompt` tokens, a fresh prompt each time: tok/s). One type's layout, end to
end, with the machine's drift reaching both sides alike.

    python benchmarks/repack_ab.py --model FILE --blocks Q5_K --out RESULTS/repack-ab.json
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from pagellm import LLM, SamplingParams  # noqa: E402
from pagellm.bench.report import metadata, write_json  # noqa: E402
from pagellm.layers.quant import gguf  # noqa: E402


def engine(model: str, blocks: frozenset[int]) -> LLM:
    """An engine on `model` whose load keeps the `blocks` types in GGUF's blocks."""
    kept = gguf.REPACKED
    gguf.REPACKED = kept - blocks
    try:
        return LLM(model, max_model_len=1024, enable_prefix_caching=False)
    finally:
        gguf.REPACKED = kept


def decode_rate(llm: LLM, tokens: int) -> float:
    """Tokens per second of one stream's decode steps after its first (the prefill)."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": [1]}], first, use_tqdm=False)
    one = time.perf_counter() - start
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": [1]}], params, use_tqdm=False)
    return (tokens - 1) / (time.perf_counter() - start - one)


def prefill_rate(llm: LLM, length: int, rng: random.Random) -> float:
    vocab = llm.get_tokenizer().vocab_size
    prompt = [rng.randrange(10, vocab) for _ in range(length)]
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1), use_tqdm=False)
    return length / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a GGUF file")
    ap.add_argument("--blocks", nargs="+", required=True, choices=sorted(gguf.NATIVE_TYPES.values()),
                    help="the types the 'blocks' side keeps in GGUF's blocks")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    names = {v: k for k, v in gguf.NATIVE_TYPES.items()}
    blocks = frozenset(names[t] for t in args.blocks)
    sides = {"tiles": engine(args.model, frozenset()), "blocks": engine(args.model, blocks)}
    rng = random.Random(0)
    runs = {name: {"decode_tok_s": [], "prefill_tok_s": []} for name in sides}
    for r in range(args.rounds):
        for name in (sides if r % 2 == 0 else reversed(list(sides))):
            runs[name]["decode_tok_s"].append(decode_rate(sides[name], args.tokens))
            runs[name]["prefill_tok_s"].append(prefill_rate(sides[name], args.prompt, rng))
        print(r, {n: {k: round(v[-1], 1) for k, v in d.items()} for n, d in runs.items()}, flush=True)
    medians = {n: {k: statistics.median(v) for k, v in d.items()} for n, d in runs.items()}
    ratios = {k: medians["tiles"][k] / medians["blocks"][k] for k in ("decode_tok_s", "prefill_tok_s")}
    # each round's two sides ran minutes apart at most: the median of their ratios cancels a drift
    # that the ratio of the medians keeps
    paired = {k: statistics.median(a / b for a, b in zip(runs["tiles"][k], runs["blocks"][k]))
              for k in ("decode_tok_s", "prefill_tok_s")}
    print("tiles / blocks:", {k: round(v, 3) for k, v in ratios.items()}, "paired:", {k: round(v, 3) for k, v in paired.items()})
    write_json(Path(args.out), {**metadata("repack_ab"), "model": args.model, "blocks": args.blocks,
                                "tokens": args.tokens, "prompt": args.prompt, "threads": args.threads,
                                "runs": runs, "medians": medians, "tiles_over_blocks": ratios,
                                "tiles_over_blocks_paired": paired})


if __name__ == "__main__":
    main()

"""Decode steps with the layers' decode plans (layers/decode_plan.py) against the same steps through
their modules (PAGELLM_DECODE_PLANS=0), in one engine, round by round in turn: `--streams`
sequences of one-token prompts decoded `--tokens` tokens, greedy; each round's ms per step is the
mean of its steps after the first (the prefill). The two sides' outputs must be the same tokens.

    python benchmarks/decode_plan_ab.py --out benchmarks/results/decode-plan-ab-DATE.json
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagellm import LLM, SamplingParams  # noqa: E402
from pagellm.bench.report import metadata, write_json  # noqa: E402
from pagellm.loader.bundled import default_model_path  # noqa: E402
from pagellm.models.llama import LlamaDecoderLayer  # noqa: E402


def timed_round(llm: LLM, plans: bool, prompts: list[list[int]], tokens: int) -> tuple[float, list]:
    """(ms per decode step, the outputs' tokens) with the layers' plans remade on or off."""
    os.environ["PAGELLM_DECODE_PLANS"] = "1" if plans else "0"
    for layer in llm.engine.runner.model.modules():
        if isinstance(layer, LlamaDecoderLayer):
            layer.decode_plan = None
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=tokens + 1, ignore_eos=True)
    ids = [f"ab-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, {"prompt_token_ids": p}, params)
    steps, outputs = [], {}
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        steps.append(time.perf_counter() - start)
    return 1e3 * sum(steps[1:]) / (len(steps) - 1), [outputs[r] for r in ids]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF file or HF directory (default: the bundled SmolLM2)")
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    model = args.model or default_model_path()
    llm = LLM(model, max_model_len=args.tokens + 16, max_num_seqs=args.streams, enable_prefix_caching=False)
    vocab = llm.engine.runner.model.cfg.vocab_size
    rng = random.Random(0)
    load = os.getloadavg()
    timed_round(llm, True, [[300]], 8)
    ms: dict[str, list[float]] = {"plans": [], "modules": []}
    for _ in range(args.rounds):
        prompts = [[rng.randrange(256, vocab)] for _ in range(args.streams)]
        got = {}
        for side in ("plans", "modules"):
            step_ms, got[side] = timed_round(llm, side == "plans", prompts, args.tokens)
            ms[side].append(step_ms)
        if got["plans"] != got["modules"]:
            raise SystemExit("the plans' tokens differ from the modules'")
    medians = {side: statistics.median(v) for side, v in ms.items()}
    result = {**metadata("decode_plan_ab"), "model": model, "streams": args.streams, "tokens": args.tokens,
              "rounds": args.rounds, "threads": torch.get_num_threads(),
              "activation_quantization": llm.engine.activation_quantization,
              "loadavg_before_after": [load, os.getloadavg()], "ms_per_step": ms, "median_ms_per_step": medians,
              "speedup": medians["modules"] / medians["plans"]}
    write_json(Path(args.out), result)
    print(f"{model}: {args.streams} stream(s), median ms per decode step: plans {medians['plans']:.2f}, "
          f"modules {medians['modules']:.2f} ({result['speedup']:.2f}x)")


if __name__ == "__main__":
    main()

"""Prompt lookup with each match proposing what its length vouches for (`ngram.vouched`: "new")
against every match proposing all the tokens asked for ("old"), in one process on the bundled
model, turn about per prompt: greedy decode time of each workload's prompts of `pagellm bench
spec-decode` (their blocks cached by a first short run, so the timings are decode steps), and the
outputs checked equal.

    python benchmarks/lookup_vouched_ab.py --speculative-config '{"method": "ngram", "num_speculative_tokens": 8,
        "prompt_lookup_min": 1, "prompt_lookup_max": 8}' --out benchmarks/results/lookup-vouched-ab-DATE.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagellm import LLM, SamplingParams  # noqa: E402
from pagellm.bench import spec_decode  # noqa: E402
from pagellm.bench.report import metadata, write_json  # noqa: E402
from pagellm.loader.bundled import default_model_path  # noqa: E402
from pagellm.worker.proposers import ngram  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 4}')
    ap.add_argument("--workloads", default="code-edit,summary,chat")
    ap.add_argument("--prompts", type=int, default=5, help="per workload")
    ap.add_argument("--rounds", type=int, default=2, help="per prompt and side")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    spec = json.loads(args.speculative_config)
    sides = {"new": ngram.vouched, "old": lambda n, max_n, num_tokens: num_tokens}
    llm = LLM(default_model_path(), max_model_len=8192, speculative_config=spec)
    cfg = spec_decode.SpecBenchConfig()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    load = os.getloadavg()
    results = {}
    try:
        for workload in args.workloads.split(","):
            seconds: dict[str, list[float]] = {"new": [], "old": []}
            for source in spec_decode.round_sources(workload, args.prompts):
                message = spec_decode.user_message(workload, source, cfg)
                prompt = spec_decode.render_prompt(llm.engine.tokenizer, message, source)
                ids = {"prompt_token_ids": prompt.token_ids}
                llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
                outputs = {}
                for r in range(args.rounds):
                    for side in (("new", "old") if r % 2 == 0 else ("old", "new")):
                        ngram.vouched = sides[side]
                        start = time.perf_counter()
                        out = llm.generate(ids, params, use_tqdm=False)[0]
                        seconds[side].append(time.perf_counter() - start)
                        outputs.setdefault(side, list(out.outputs[0].token_ids))
                if outputs["new"] != outputs["old"]:
                    raise SystemExit(f"{workload} {source}: the outputs differ")
            total = {side: sum(s) for side, s in seconds.items()}
            pairs = [o / n for o, n in zip(seconds["old"], seconds["new"])]
            results[workload] = {"speedup_total_time": round(total["old"] / total["new"], 4),
                                 "speedup_pair_median": round(statistics.median(pairs), 4),
                                 "outputs_equal": True, "seconds": seconds}
            print(workload, {k: v for k, v in results[workload].items() if k != "seconds"}, flush=True)
    finally:
        ngram.vouched = sides["new"]
    write_json(Path(args.out), {**metadata("lookup_vouched_ab"), "speculative_config": spec, "prompts": args.prompts,
                                "rounds": args.rounds, "max_tokens": args.max_tokens,
                                "loadavg_before_after": [load, os.getloadavg()], "workloads": results})


if __name__ == "__main__":
    main()

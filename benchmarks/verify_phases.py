"""Where a speculative verification's time goes, by the rows of its step: the engine's phase timers
(step, model_forward, attention, logits, sampler, propose) read at every decode step of one greedy
stream on the code edit of `pagellm bench spec-decode` (a file of this repository, to be returned
with one change), summed by the step's rows (its token and the proposals it verifies).

    python benchmarks/verify_phases.py --out benchmarks/results/verify-phases-DATE.json
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from pagellm import LLM, SamplingParams  # noqa: E402
from pagellm.bench import spec_decode  # noqa: E402
from pagellm.bench.report import metadata, write_json  # noqa: E402
from pagellm.core.spec_decode import SpecDecodeStats  # noqa: E402
from pagellm.loader.bundled import default_model_path  # noqa: E402
from pagellm.timing import PhaseTimer  # noqa: E402

PHASES = ("model_forward", "attention", "logits", "sampler", "propose")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a GGUF file or HF folder (default: the bundled one)")
    ap.add_argument("--speculative-config",
                    default='{"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 1, '
                            '"prompt_lookup_max": 8}')
    ap.add_argument("--code-file", default=spec_decode.CODE_FILES[0], help="under pagellm/")
    ap.add_argument("--code-lines", type=int, default=300)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    llm = LLM(args.model or default_model_path(), max_model_len=8192,
              speculative_config=json.loads(args.speculative_config))
    content = spec_decode.code_edit_prompt(spec_decode.REPOSITORY / "pagellm" / args.code_file, args.code_lines)
    prompt = spec_decode.render_prompt(llm.engine.tokenizer, content, args.code_file)
    llm.generate({"prompt_token_ids": prompt.token_ids}, SamplingParams(temperature=0.0, max_tokens=8),
                 use_tqdm=False)  # warm-up, and the prompt's blocks cached: only decode steps below

    timer = PhaseTimer()
    seconds: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    steps: collections.Counter = collections.Counter()
    before = dict(timer.seconds)
    record_step = SpecDecodeStats.record_step

    def record(stats: SpecDecodeStats, rows: int, step_seconds: float) -> None:
        # called once per decode step, after its forward pass: the phases since the last one are its
        nonlocal before
        record_step(stats, rows, step_seconds)
        now = dict(timer.seconds)
        seconds[rows].update({k: now[k] - before.get(k, 0.0) for k in PHASES if k in now})
        seconds[rows]["step"] += step_seconds
        steps[rows] += 1
        before = now

    SpecDecodeStats.record_step = record
    load = os.getloadavg()
    llm.engine.attach_timer(timer)
    try:
        for _ in range(args.rounds):
            llm.generate({"prompt_token_ids": prompt.token_ids},
                         SamplingParams(temperature=0.0, max_tokens=args.tokens), use_tqdm=False)
    finally:
        llm.engine.attach_timer(None)
        SpecDecodeStats.record_step = record_step
    by_rows = {rows: {"steps": steps[rows], **{f"{k}_ms": 1000 * v / steps[rows] for k, v in seconds[rows].items()}}
               for rows in sorted(steps)}
    write_json(Path(args.out), {**metadata("verify_phases"), "model": args.model or default_model_path(),
                                "speculative_config": json.loads(args.speculative_config),
                                "code_file": args.code_file, "prompt_tokens": len(prompt.token_ids),
                                "tokens": args.tokens, "rounds": args.rounds, "threads": torch.get_num_threads(),
                                "loadavg_before_after": [load, os.getloadavg()], "by_rows": by_rows})
    print(spec_decode.verify_phases_doc_table({"by_rows": by_rows}, rows=None))


if __name__ == "__main__":
    main()

"""A GGUF file's decode of 16 streams and one prompt with AMX tiles off and on (the kernels'
`set_amx`), in one process, turn about: the end-to-end effect of the AMX products (csrc
amx_product) in the default mode, on a CPU that has AMX.

    python benchmarks/amx_ab.py --model FILE --out RESULTS/amx-ab-NAME.json

Decode: 16 prompts x 64 greedy tokens (their short prefill included); prompt: one of 256 token ids,
1 token out; prefix caching off. Also how many of the 16 greedy continuations are identical with
and without the tiles (the same integer sums, another float32 summation order: near-ties of a
random model may flip).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from pagellm import LLM, SamplingParams  # noqa: E402
from pagellm.bench.report import metadata  # noqa: E402
from pagellm.kernels import cpu  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a GGUF file")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kernels = cpu.quant_kernels()
    if kernels is None or not getattr(kernels, "amx_min_rows", {}):
        sys.exit("no AMX tiles in this CPU, build or process: nothing to compare")
    llm = LLM(args.model, enable_prefix_caching=False)
    prompts = [f"Story {i}: once upon a time in a land far away there lived" for i in range(16)]
    decode = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    prompt_ids = list(range(1000, 1256))
    res: dict = {"decode_16_streams_tok_s": {"off": [], "on": []}, "prefill_256_tok_s": {"off": [], "on": []}}
    outputs = {}
    load = os.getloadavg()
    try:
        for r in range(args.rounds):
            for on in ((False, True) if r % 2 == 0 else (True, False)):
                key = "on" if on else "off"
                kernels.set_amx(on)
                start = time.perf_counter()
                out = llm.generate(prompts, decode, use_tqdm=False)
                res["decode_16_streams_tok_s"][key].append(round(16 * 64 / (time.perf_counter() - start), 2))
                outputs[on] = [o.outputs[0].token_ids for o in out]
                start = time.perf_counter()
                llm.generate({"prompt_token_ids": prompt_ids}, SamplingParams(max_tokens=1), use_tqdm=False)
                res["prefill_256_tok_s"][key].append(round(256 / (time.perf_counter() - start), 2))
    finally:
        kernels.set_amx(True)
    res["identical_outputs"] = sum(a == b for a, b in zip(outputs[True], outputs[False]))
    res.update(model=args.model, threads=args.threads, load_before=[round(x, 2) for x in load], **metadata("amx_ab"))
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k in ("decode_16_streams_tok_s", "prefill_256_tok_s",
                                                            "identical_outputs")}))


if __name__ == "__main__":
    main()

"""How much of a single-stream decode step is not the quantized products: the step timed as it
is, then with every GGUF product replaced by a no-op returning a zero tensor of its shape (the
rest of the step, attention, norms, activations, sampling and the Python between them, runs as
before on those zeros).

    python benchmarks/step_glue.py --model FILE --out benchmarks/results/step-glue-DATE.json
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagellm import LLM, SamplingParams  # noqa: E402
from pagellm.bench.report import metadata, write_json  # noqa: E402
from pagellm.layers.quant import gguf  # noqa: E402
from pagellm.timing import PhaseTimer  # noqa: E402

PHASES = ("model_forward", "logits", "sampler", "execute", "step")


def per_step_ms(llm: LLM, params: SamplingParams, rounds: int) -> dict[str, float]:
    """Each phase's mean ms per step over `rounds` generations (the best round by step time)."""
    prompt = [{"prompt_token_ids": [1, 2, 3, 4]}]
    llm.generate(prompt, params, use_tqdm=False)
    best: dict[str, float] | None = None
    for _ in range(rounds):
        timer = PhaseTimer()
        llm.engine.attach_timer(timer)
        llm.generate(prompt, params, use_tqdm=False)
        llm.engine.attach_timer(None)
        got = {k: 1000 * timer.seconds[k] / timer.calls[k] for k in PHASES if k in timer.seconds}
        if best is None or got["step"] < best["step"]:
            best = got
    return best


def forget_plans(llm: LLM) -> None:
    """Every decoder layer remakes its decode plan on its next step (from the products as they are
    then)."""
    for module in llm.engine.runner.model.modules():
        if hasattr(module, "decode_plan"):
            module.decode_plan = None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a GGUF file")
    ap.add_argument("--activation-quantization", default="int8")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    llm = LLM(args.model, activation_quantization=args.activation_quantization, max_model_len=512, num_kv_blocks=64)
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=0)
    load = os.getloadavg()
    real = per_step_ms(llm, params, args.rounds)
    zeros: dict[tuple[int, int], torch.Tensor] = {}

    def zeros_for(x: torch.Tensor, rows: int) -> torch.Tensor:
        """A product's output of x times `rows` rows of W, as zeros (made once per shape)."""
        key = (x.shape[0], rows)
        if key not in zeros:
            zeros[key] = torch.zeros(key, dtype=x.dtype)
        return zeros[key]

    def no_product(x, data, qtype, cols, batch_invariant=False, activations="none"):
        return zeros_for(x, data.shape[0])

    def no_direct_product(method, layer):
        # A decoder layer's plan calls its products' kernels directly (layers/decode_plan.py):
        # the same no-op in their place, the plan's other calls kept.
        call = direct(method, layer)
        if call is None:
            return None
        rows = layer.gguf_shape[0]
        return call._replace(fn=lambda x, *_: zeros_for(x, rows))

    product, gguf.gguf_matmul = gguf.gguf_matmul, no_product
    direct, gguf.GGUFLinearMethod.direct_product = gguf.GGUFLinearMethod.direct_product, no_direct_product
    forget_plans(llm)
    try:
        without = per_step_ms(llm, params, args.rounds)
    finally:
        gguf.gguf_matmul = product
        gguf.GGUFLinearMethod.direct_product = direct
        forget_plans(llm)
    again = per_step_ms(llm, params, args.rounds)
    result = {**metadata("step_glue"), "model": args.model, "activation_quantization": args.activation_quantization,
              "tokens": args.tokens, "rounds": args.rounds, "threads": torch.get_num_threads(),
              "loadavg_before_after": [load, os.getloadavg()],
              "ms_per_step": {"with_products": real, "products_as_no_ops": without, "with_products_again": again}}
    write_json(Path(args.out), result)
    for name, ms in result["ms_per_step"].items():
        print(f"{name:22s} " + "  ".join(f"{k} {v:.2f}" for k, v in ms.items()))


if __name__ == "__main__":
    main()

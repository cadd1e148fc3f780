"""Per batch size, which product serves a GGUF-quantized weight fastest on this CPU: the fused
kernel (blocks streamed once, float32 FMA), widened tiles through torch's GEMM, or (for scale)
the dense weight. Its results set FUSED_MAX_ROWS in pagellm/layers/quant/gguf.py.

    python benchmarks/quant_matmul.py --out benchmarks/results/quant-matmul-DATE.json

Shapes: the bundled SmolLM2-135M (gate/up, down, the 49152-row Q8_0 head) and a Llama-3.2-1B
layer (gate/up, down). Weights are random, quantized with gguf-py; times are the median of
`--repeat` calls, in milliseconds, with the load average recorded beside them.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize

from pagellm.layers.quant import gguf as q

SHAPES = [  # (name, type, rows N, cols K)
    ("smollm2 gate_up", T.Q4_1, 3072, 576),
    ("smollm2 down", T.Q4_1, 576, 1536),
    ("smollm2 head", T.Q8_0, 49152, 576),
    ("llama-1b gate_up", T.Q4_0, 16384, 2048),
    ("llama-1b down", T.Q8_0, 2048, 8192),
]
BATCHES = (1, 2, 4, 8, 16, 32, 64)


def timed(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    kernels = q.cpu.quant_kernels()
    assert kernels is not None, "the quantized-matmul kernels did not build"
    rows = []
    for name, qtype, n, k in SHAPES:
        dense = torch.randn(n, k) * 0.05
        blocks = torch.from_numpy(quantize(dense.numpy(), qtype))
        for dtype in (torch.float32, torch.bfloat16):
            w = dense.to(dtype)
            for m in BATCHES:
                x = torch.randn(m, k, dtype=dtype)
                fused = timed(lambda: kernels.gguf_matmul(x, blocks, int(qtype), k), args.repeat)
                saved = q.FUSED_MAX_ROWS
                q.FUSED_MAX_ROWS = {}  # force the tiled path
                try:
                    tiled = timed(lambda: q.gguf_matmul(x, blocks, int(qtype), k), args.repeat)
                finally:
                    q.FUSED_MAX_ROWS = saved
                dense_ms = timed(lambda: F.linear(x, w), args.repeat)
                rows.append({"shape": name, "type": qtype.name, "rows": n, "cols": k, "dtype": str(dtype)[6:],
                             "batch": m, "fused_ms": round(fused, 4), "tiled_ms": round(tiled, 4),
                             "dense_ms": round(dense_ms, 4), "weight_bytes": blocks.numel()})
                print(json.dumps(rows[-1]), flush=True)
    result = {"benchmark": "quant_matmul", "threads": torch.get_num_threads(), "cpu": platform.processor(),
              "load_avg_before_after": [os.getloadavg()], "torch": torch.__version__,
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True).stdout.strip(), "rows": rows}
    result["load_avg_before_after"].append(os.getloadavg())
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    np.random.seed(0)
    torch.manual_seed(0)
    main()

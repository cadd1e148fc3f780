"""Per batch size, which product serves a quantized weight fastest on this CPU: for GGUF blocks
the fused kernel (blocks streamed once, float32 FMA), widened tiles through torch's GEMM (its
results set FUSED_MAX_ROWS in pagellm/layers/quant/gguf.py), or the integer kernel
(`q8act` / `q8x2act`: activations rounded to one / two int8 codes, VNNI dot products; sets
INT8_MAX_ROWS), or bfloat16 tiles (`tiled_bf16`: activations rounded to bfloat16, what mode int8
does past INT8_MAX_ROWS); for `--quantization int8 | int4`
torch's packed kernels; and the dense weight for scale. Each product's weight bytes over its
time give its achieved GB/s, next to the memory bandwidth (a streaming sum) and the dense GEMM
rate measured in the same run: how far from the limit is a number.

    python benchmarks/quant_matmul.py --out benchmarks/results/quant-matmul-DATE.json
    python benchmarks/quant_matmul.py --dtypes float32 --batches 1 2 4 8 16 32 --skip-int-weights --out ...

Shapes: the bundled SmolLM2-135M (gate/up, down, the 49152-row Q8_0 head) and a Llama-3.2-1B
layer (gate/up, down; and as a Q4_K_M file has them, Q4_K gate/up and Q6_K down). Weights are
random, quantized with gguf-py (the K-quants: random valid blocks, which gguf-py cannot make); times are the median of
`--repeat` calls, in milliseconds, with the load average recorded beside them.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize

from pagellm.bench.report import metadata, write_json
from pagellm.bench.roofline import machine_limits, median_seconds
from pagellm.layers.quant import gguf as q
from pagellm.layers.quant.int_weights import Int4LinearMethod, Int8LinearMethod

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.kernels.gguf_blocks import random_blocks  # noqa: E402

SHAPES = [  # (name, type, rows N, cols K)
    ("smollm2 gate_up", T.Q4_1, 3072, 576),
    ("smollm2 down", T.Q4_1, 576, 1536),
    ("smollm2 head", T.Q8_0, 49152, 576),
    ("llama-1b gate_up", T.Q4_0, 16384, 2048),
    ("llama-1b down", T.Q8_0, 2048, 8192),
    ("llama-1b gate_up", T.Q4_K, 16384, 2048),
    ("llama-1b down", T.Q6_K, 2048, 8192),
]
# Types gguf-py cannot quantize: random valid blocks instead (the kernel tests' own generator).
K_QUANTS = (T.Q4_K, T.Q6_K)
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)


def timed(fn, repeat: int) -> float:
    """Median milliseconds."""
    return median_seconds(fn, repeat) * 1e3


def blocks_of(dense: torch.Tensor, qtype: T) -> torch.Tensor:
    """`dense` quantized by gguf-py, or for a K-quant random valid blocks of its shape."""
    if qtype not in K_QUANTS:
        return torch.from_numpy(quantize(dense.numpy(), qtype))
    return torch.from_numpy(random_blocks(qtype, dense.shape[0], dense.shape[1]))


def int_layer(method, dense: torch.Tensor) -> torch.nn.Module:
    layer = torch.nn.Module()
    method.create_weights(layer, dense.shape[1], dense.shape[0])
    layer.weight.data.copy_(dense)
    method.finish(layer)
    return layer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--skip-int-weights", action="store_true",
                    help="leave out torch's int8/int4 products (--quantization int8 | int4): slow past a few rows")
    args = ap.parse_args()
    kernels = q.cpu.quant_kernels()
    assert kernels is not None, "the quantized-matmul kernels did not build"
    rows = []
    load_before = os.getloadavg()
    limits_before = machine_limits(gemm_n=4096)
    print(json.dumps(limits_before), flush=True)
    for name, qtype, n, k in SHAPES:
        dense = torch.randn(n, k) * 0.05
        blocks = blocks_of(dense, qtype)
        for dtype in (getattr(torch, d) for d in args.dtypes):
            w = dense.to(dtype)
            int8_method, int4_method = Int8LinearMethod(dtype), Int4LinearMethod(dtype)
            if not args.skip_int_weights:
                int8_layer, int4_layer = int_layer(int8_method, w), int_layer(int4_method, w)
            for m in args.batches:
                x = torch.randn(m, k, dtype=dtype)
                fused = timed(lambda: kernels.gguf_matmul(x, blocks, int(qtype), k), args.repeat)
                saved = q.FUSED_MAX_ROWS
                q.FUSED_MAX_ROWS = {}  # force the tiled path
                try:
                    tiled = timed(lambda: q.gguf_matmul(x, blocks, int(qtype), k), args.repeat)
                finally:
                    q.FUSED_MAX_ROWS = saved
                # mode int8 past its integer rows: x rounded to bfloat16, bfloat16 tiles (BF16_TILES)
                xb = x.to(torch.bfloat16)
                tiled_bf16 = timed(lambda: q.widened_product(xb, blocks, int(qtype), k).float(), args.repeat)
                q8act = timed(lambda: kernels.gguf_matmul_int8(x, blocks, int(qtype), k), args.repeat)
                q8x2act = timed(lambda: kernels.gguf_matmul_int8(x, blocks, int(qtype), k, True), args.repeat)
                dense_ms = timed(lambda: F.linear(x, w), args.repeat)
                gbps = {  # weight bytes streamed per product / its time
                    "fused_gbps": blocks.numel() / fused / 1e6, "q8act_gbps": blocks.numel() / q8act / 1e6,
                    "q8x2act_gbps": blocks.numel() / q8x2act / 1e6,
                    "dense_gbps": n * k * w.element_size() / dense_ms / 1e6}
                ints = {}
                if not args.skip_int_weights:
                    int8 = timed(lambda: int8_method.apply(int8_layer, x), args.repeat)
                    int4 = timed(lambda: int4_method.apply(int4_layer, x), args.repeat)
                    ints = {"int8_ms": round(int8, 4), "int4_ms": round(int4, 4)}
                    gbps.update(int8_gbps=n * k / int8 / 1e6, int4_gbps=n * k / 2 / int4 / 1e6)
                rows.append({"shape": name, "type": qtype.name, "rows": n, "cols": k, "dtype": str(dtype)[6:],
                             "batch": m, "fused_ms": round(fused, 4), "tiled_ms": round(tiled, 4),
                             "tiled_bf16_ms": round(tiled_bf16, 4),
                             "q8act_ms": round(q8act, 4), "q8x2act_ms": round(q8x2act, 4), **ints,
                             "dense_ms": round(dense_ms, 4), "weight_bytes": blocks.numel(),
                             **{key: round(v, 2) for key, v in gbps.items()},
                             "dense_gflops": round(2 * m * n * k / dense_ms / 1e6, 2)})
                print(json.dumps(rows[-1]), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, {**metadata("quant_matmul"), "args": vars(args), "threads": torch.get_num_threads(),
                     "load_avg_before_after": [load_before, os.getloadavg()], "limits_before": limits_before,
                     "limits_after": machine_limits(gemm_n=4096), "rows": rows})


if __name__ == "__main__":
    np.random.seed(0)
    torch.manual_seed(0)
    main()

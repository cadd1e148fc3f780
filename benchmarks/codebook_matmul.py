"""The MXFP4 / IQ4_NL / IQ4_XS products (csrc/quant_codebook_ops.cpp) against the dense float32
product of the same weight dequantized, per batch size: the float32 kernel, the integer kernel in
both activation modes (int8, int8x2), and widened tiles through torch's GEMM (what batches past
the kernels' bounds take). Their results set layers/quant/codebook.py's bounds.

    python benchmarks/codebook_matmul.py --out benchmarks/results/codebook-matmul-DATE.json

Shapes: a Llama-3.2-1B layer's gate (8192 x 2048) and down (2048 x 8192) projections, random
valid blocks. Every product of one shape and batch runs once per round, the rounds repeated
(`--repeat`): interleaved, so load from other processes falls on all alike; times are medians (and minima) in
milliseconds, with the load average recorded beside them (metadata() has the CPU's flags).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T

from pagellm.bench.report import metadata, write_json
from pagellm.kernels import cpu
from pagellm.layers.quant import gguf as q

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.kernels.gguf_blocks import random_blocks, reference  # noqa: E402

SHAPES = [("llama-1b gate", 8192, 2048), ("llama-1b down", 2048, 8192)]  # (name, rows N, cols K)
TYPES = (T.MXFP4, T.IQ4_NL, T.IQ4_XS)
BATCHES = (1, 16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    ap.add_argument("--threads", type=int, default=0, help="torch's threads (0: its default); on shared cores, "
                    "1 keeps a product from waiting for a second thread's turn")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kernels = cpu.codebook_kernels()
    rows = []
    load_before = os.getloadavg()
    for name, n, k in SHAPES:
        for qtype in TYPES:
            raw = torch.from_numpy(random_blocks(qtype, n, k, seed=0))
            dense = reference(raw.numpy(), qtype, k)
            for m in args.batches:
                x = torch.randn(m, k)
                products = {
                    "dense_f32": lambda: F.linear(x, dense),
                    "kernel_f32": lambda: kernels.codebook_matmul(x, raw, int(qtype), k),
                    "tiles_f32": lambda: q.widened_product(x, raw, int(qtype), k),
                }
                if kernels.has_int8_activations:
                    products["kernel_int8"] = lambda: kernels.codebook_matmul_int8(x, raw, int(qtype), k, False)
                    products["kernel_int8x2"] = lambda: kernels.codebook_matmul_int8(x, raw, int(qtype), k, True)
                times: dict[str, list[float]] = {key: [] for key in products}
                for fn in products.values():
                    fn()  # warm
                for _ in range(args.repeat):
                    for key, fn in products.items():
                        start = time.perf_counter()
                        fn()
                        times[key].append((time.perf_counter() - start) * 1e3)
                ms = {key: sorted(v)[len(v) // 2] for key, v in times.items()}
                best = {key: min(v) for key, v in times.items()}  # the least disturbed by other processes
                rows.append({"shape": name, "type": qtype.name, "N": n, "K": k, "batch": m, "ms": ms, "min_ms": best})
                print(f"{name:14s} {qtype.name:6s} M={m:3d} " + "  ".join(f"{key} {v:7.3f} ({best[key]:.3f})" for key, v in ms.items()),
                      flush=True)
    write_json(Path(args.out), {**metadata("codebook_matmul"), "threads": torch.get_num_threads(),
                          "load_before": load_before, "load_after": os.getloadavg(), "results": rows})


if __name__ == "__main__":
    main()

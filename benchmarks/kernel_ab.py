"""The integer GGUF kernels of two versions of csrc/quant_ops.cpp in one process, timed turn
about (A, B, then B, A), so that other load on shared cores hits both alike: per product of the
1B shapes, GB/s of weights at the median and at the fastest call. Each product's weights rotate
over copies totalling > 128 MB, so every call reads them from memory as a decode step does.

    python benchmarks/kernel_ab.py --base main --types Q8_0,Q4_K,Q6_K --rows 1 --threads 1
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gguf import GGMLQuantizationType as T  # noqa: E402

from pagellm.kernels import cpu  # noqa: E402
from tests.kernels.gguf_blocks import random_blocks  # noqa: E402

SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)}


def base_module(rev: str):
    """quant_ops.cpp as of git revision `rev`, built under its own name. The source keeps one path,
    which torch's build keys on: a new path would rebuild it every run."""
    text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:pagellm/kernels/csrc/quant_ops.cpp"],
                          check=True, capture_output=True, text=True).stdout
    source = Path(tempfile.gettempdir()) / "pagellm-kernel-ab" / "quant_ops_base.cpp"
    source.parent.mkdir(exist_ok=True)
    if not source.exists() or source.read_text() != text:
        source.write_text(text)
    return cpu._build(source, f"quantized-matmul kernels of {rev}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="main", help="git revision of the A side; B is the working tree")
    ap.add_argument("--types", default="Q8_0,Q4_K,Q6_K")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--rows", default="1", help="rows of x, comma-separated")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--activations", default="int8x2", choices=["int8", "int8x2"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    two = args.activations == "int8x2"
    sides = {"base": base_module(args.base), "new": cpu.quant_kernels()}
    for name in args.types.split(","):
        qtype = int(T[name])
        for shape in args.shapes.split(","):
            n, k = SHAPES[shape]
            w = torch.from_numpy(random_blocks(T[name], n, k, seed=1))
            copies = [w.clone() for _ in range(int(128e6 // w.numel()) + 1)]
            for m in map(int, args.rows.split(",")):
                x = torch.randn(m, k)
                times: dict[str, list[float]] = {side: [] for side in sides}
                turn = 0
                for rep in range(args.reps):
                    for side in (list(sides) if rep % 2 == 0 else list(sides)[::-1]):
                        turn = (turn + 1) % len(copies)
                        start = time.perf_counter()
                        sides[side].gguf_matmul_int8(x, copies[turn], qtype, k, two)
                        times[side].append(time.perf_counter() - start)
                gb = w.numel() / 1e9
                row = " | ".join(f"{side} {gb / statistics.median(t):5.1f} / {gb / min(t):5.1f}"
                                 for side, t in times.items())
                print(f"{name:5} {shape:8} rows {m} threads {args.threads}: GB/s median / fastest: {row}",
                      flush=True)


if __name__ == "__main__":
    main()

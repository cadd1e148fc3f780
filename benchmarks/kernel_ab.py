"""The integer GGUF kernels of two versions of csrc/quant_ops.cpp in one process, timed turn
about (A, B, then B, A), so that other load on shared cores hits both alike: per product of the
1B shapes, GB/s of weights at the median and at the fastest call. Each product's weights rotate
over copies totalling > 128 MB, so every call reads them from memory as a decode step does.

    python benchmarks/kernel_ab.py --base main --types Q8_0,Q4_K,Q6_K --rows 1 --threads 1

A side whose build repacks weights at load (tiles of 8 rows: layers/quant/gguf.py, REPACKED)
multiplies them repacked, as a model load gives them; --repack all repacks every type its kernels
can (Q6_K too), --repack none keeps GGUF's blocks on both sides; --base-repack gives the A side
its own (a layout against another in one build: --base HEAD --base-repack none --repack all).
PAGELLM_CPU_MARCH=x86-64-v3 builds both sides for AVX2 (the AVX2 kernels on an AVX-512 machine);
--base-march builds the A side alone for another instruction set, e.g. this machine's AVX-512
kernels against its AVX2 ones, same source: --base HEAD --base-march x86-64-v3.
--base-product widened times the A side as a prompt's products ran before they took the integer
kernels: float32 tiles of W widened by the A side's kernels for torch's GEMM (gguf.widened_product),
e.g. prefill-sized batches against main:

    python benchmarks/kernel_ab.py --base main --base-product widened --rows 16,64,256 --threads 1
"""
from __future__ import annotations

import argparse
import os
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
from pagellm.layers.quant import gguf  # noqa: E402
from pagellm.layers.quant.tiled import tiled_product  # noqa: E402
from tests.kernels.gguf_blocks import random_blocks  # noqa: E402

SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate": (8192, 2048), "gate_up": (16384, 2048), "down": (2048, 8192),
          "lm_head": (128256, 2048),
          # the bundled SmolLM2-135M's (--shapes s_qkv,s_o,s_gate_up,s_down,s_head)
          "s_qkv": (960, 576), "s_o": (576, 576), "s_gate_up": (3072, 576), "s_down": (576, 1536),
          "s_head": (49152, 576)}


def base_module(rev: str, march: str | None = None, source: str = "quant_ops.cpp",
                what: str = "quantized-matmul kernels"):
    """kernels/csrc/`source` as of git revision `rev`, built under its own name (for `march`,
    default the build's). The source keeps one path, which torch's build keys on: a new path would
    rebuild it every run."""
    text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:pagellm/kernels/csrc/{source}"],
                          check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.gettempdir()) / "pagellm-kernel-ab" / source.replace(".cpp", "_base.cpp")
    path.parent.mkdir(exist_ok=True)
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    if march is None:
        return cpu._build(path, f"{what} of {rev}")
    before = os.environ.get("PAGELLM_CPU_MARCH")
    os.environ["PAGELLM_CPU_MARCH"] = march  # read by cpu._build's name and flags
    try:
        return cpu._build(path, f"{what} of {rev} for {march}")
    finally:
        if before is None:
            del os.environ["PAGELLM_CPU_MARCH"]
        else:
            os.environ["PAGELLM_CPU_MARCH"] = before


def weight_form(module, w: torch.Tensor, qtype: int, k: int, repack: str) -> tuple[torch.Tensor, int]:
    """(weight, type id) for a side's kernels: repacked into tiles of 8 rows where that build can
    repack the type and `repack` asks ("load": the types a model load repacks, gguf.REPACKED; "all"),
    else GGUF's blocks."""
    packed = getattr(module, "repacked_types", {}).get(qtype)
    wanted = repack == "all" or (repack == "load" and qtype in gguf.REPACKED)
    if not wanted or packed is None or w.shape[0] % 8:
        return w, qtype
    return module.gguf_repack(w, qtype, k), packed


def widened(module, x: torch.Tensor, w: torch.Tensor, kind: int, k: int) -> torch.Tensor:
    """x @ W^T as gguf.widened_product multiplies: float32 tiles of W, widened by `module`, through torch's GEMM."""
    return tiled_product(x, w.shape[0], k, lambda start, end: module.gguf_dequantize_rows(
        w, kind, k, torch.arange(start, end), torch.float32))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="main", help="git revision of the A side; B is the working tree")
    ap.add_argument("--types", default="Q8_0,Q4_K,Q6_K")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--rows", default="1", help="rows of x, comma-separated")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--activations", default="int8x2", choices=["int8", "int8x2"])
    ap.add_argument("--repack", default="load", choices=["load", "all", "none"],
                    help="weights in tiles of 8 rows where a side's build repacks them: as a model load does, "
                         "every type the kernels can (Q6_K too), or none")
    ap.add_argument("--base-march", help="the A side's -march (default: the build's, PAGELLM_CPU_MARCH or native)")
    ap.add_argument("--base-repack", choices=["load", "all", "none"], help="the A side's --repack (default: the same)")
    ap.add_argument("--base-product", default="kernel", choices=["kernel", "widened"],
                    help="the A side's product: its integer kernel, or float32 tiles widened for torch's GEMM")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    two = args.activations == "int8x2"
    sides = {"base": base_module(args.base, args.base_march), "new": cpu.quant_kernels()}
    for name in args.types.split(","):
        qtype = int(T[name])
        for shape in args.shapes.split(","):
            n, k = SHAPES[shape]
            w = torch.from_numpy(random_blocks(T[name], n, k, seed=1))
            # each side's weights in the form its load would give them (repacked where it repacks the type)
            repack = {"base": args.base_repack or args.repack, "new": args.repack}
            weights = {side: weight_form(module, w, qtype, k, repack[side]) for side, module in sides.items()}
            copies = {side: [form[0].clone() for _ in range(int(128e6 // w.numel()) + 1)]
                      for side, form in weights.items()}
            for m in map(int, args.rows.split(",")):
                x = torch.randn(m, k)
                times: dict[str, list[float]] = {side: [] for side in sides}
                turn = 0
                for rep in range(args.reps):
                    for side in (list(sides) if rep % 2 == 0 else list(sides)[::-1]):
                        turn = (turn + 1) % len(copies[side])
                        start = time.perf_counter()
                        if side == "base" and args.base_product == "widened":
                            widened(sides[side], x, copies[side][turn], weights[side][1], k)
                        else:
                            sides[side].gguf_matmul_int8(x, copies[side][turn], weights[side][1], k, two)
                        times[side].append(time.perf_counter() - start)
                gb = w.numel() / 1e9
                row = " | ".join(f"{side} {gb / statistics.median(t):5.1f} / {gb / min(t):5.1f}"
                                 for side, t in times.items())
                speedup = statistics.median(times["base"]) / statistics.median(times["new"])
                print(f"{name:5} {shape:8} rows {m} threads {args.threads}: GB/s median / fastest: {row} | "
                      f"new {speedup:.2f}x base", flush=True)


if __name__ == "__main__":
    main()

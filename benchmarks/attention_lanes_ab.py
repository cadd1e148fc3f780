"""The compiled paged attention's two kernels on the same query tokens, turn about in one process:
attend_run (each query head's scores reduced across a vector, every element widened for each head
that reads it) against attend_run_lanes (the query heads sharing a KV head as one vector's lanes,
each tile's K/V rows widened once), by moving the crossover (cpu.set_attention_lanes_from).

Each case is one sequence of `--context` keys and `--tokens` consecutive query tokens (1: a
decode step; 1 + k: a speculative verification), attended in each of `--layers` layers whose
blocks lie scattered in a pool too large for the caches, as in a model's step. Times are per
layer, the best of `--rounds` rounds of all the layers.

    python benchmarks/attention_lanes_ab.py --out benchmarks/results/attention-lanes-ab-DATE.json

`--kernels default` times the build's own dispatch alone (a build without AVX-512 has one kernel),
for comparing two builds or two versions of csrc/cpu_ops.cpp run one after the other:

    PAGELLM_CPU_MARCH=x86-64-v3 python benchmarks/attention_lanes_ab.py --kernels default --out ...

`--base REV` times csrc/cpu_ops.cpp as of git revision REV (built under its own name) against the
working tree's, each case's calls turn about in one process, and records whether their outputs are
the same bits (`same_output`): an A/B of a change to the kernels.

    python benchmarks/attention_lanes_ab.py --base HEAD --caches float32 --tokens 1 5 9 --out ...
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from pagellm.bench.report import metadata, write_json  # noqa: E402
from pagellm.kernels import cpu  # noqa: E402
from pagellm.kv_format import resolve_kv_format  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from kernel_ab import base_module  # noqa: E402

BLOCK = 16
# (query heads, KV heads, head size): SmolLM2-135M, a GQA group of 4 at 64 (Llama 3.2 1B), at 128
# (Qwen3), a group of 7 (Qwen2.5 7B) and of 8.
SHAPES = ((9, 3, 64), (32, 8, 64), (16, 4, 128), (28, 4, 128), (32, 4, 64))
CACHES = ("float32", "bfloat16", "int8")


def make_cache(kind: str, blocks: int, kvh: int, d: int) -> tuple[torch.Tensor, torch.Tensor, object]:
    """K and V pools of `kind`: normal values, or for int8 codes with a float16 scale per row."""
    if kind == "int8":
        fmt = resolve_kv_format("int8", torch.float32)
        k, v = (torch.randn(blocks, BLOCK, kvh, d) for _ in range(2))
        return fmt.encode(k), fmt.encode(v), fmt
    dtype = getattr(torch, kind)
    return torch.randn(blocks, BLOCK, kvh, d).to(dtype), torch.randn(blocks, BLOCK, kvh, d).to(dtype), None


def make_case(shape: tuple[int, int, int], kind: str, context: int, tokens: int, layers: int):
    """One sequence's `tokens` query tokens at the end of `context` keys, and its K/V blocks for each
    of `layers` layers scattered in one pool: (k_cache, v_cache, kv format, block tables, q, lens,
    token_seq)."""
    h, kvh, d = shape
    per_layer = (context + BLOCK - 1) // BLOCK
    k_cache, v_cache, fmt = make_cache(kind, per_layer * layers + 1, kvh, d)
    order = torch.randperm(per_layer * layers)
    tables = [order[i * per_layer:(i + 1) * per_layer].view(1, -1) for i in range(layers)]
    q = torch.randn(tokens, h, d)
    lens = torch.arange(context - tokens + 1, context + 1)
    return k_cache, v_cache, fmt, tables, q, lens, torch.zeros(tokens, dtype=torch.long)


def layer_ms(shape: tuple[int, int, int], kind: str, context: int, tokens: int, layers: int, rounds: int,
             lanes_from: int | None) -> float:
    """ms per layer (the best round); `lanes_from` the crossover to set (None: the build's own)."""
    d = shape[2]
    k_cache, v_cache, fmt, tables, q, lens, seq = make_case(shape, kind, context, tokens, layers)
    before = None if lanes_from is None else cpu.set_attention_lanes_from(lanes_from)
    try:
        best = float("inf")
        for _ in range(rounds):
            start = time.perf_counter()
            for table in tables:
                cpu.paged_attention(q, k_cache, v_cache, table, lens, d ** -0.5, token_seq=seq, kv_format=fmt)
            best = min(best, (time.perf_counter() - start) / layers)
    finally:
        if before is not None:
            cpu.set_attention_lanes_from(before)
    return 1000 * best


def ab_case(modules: dict, shape: tuple[int, int, int], kind: str, context: int, tokens: int, layers: int,
            rounds: int) -> dict:
    """ms per layer of each module's paged_attention (the best round; the modules turn about within
    each round) and whether their outputs are the same bits."""
    d = shape[2]
    k_cache, v_cache, fmt, tables, q, lens, seq = make_case(shape, kind, context, tokens, layers)
    code = cpu.kernel_code(fmt)

    def attend(module, table):
        return module.paged_attention(q, k_cache, v_cache, table, lens, d ** -0.5, 0, 0, 0.0, None, seq, 0, code)

    outputs = {name: attend(module, tables[0]) for name, module in modules.items()}
    best = {name: float("inf") for name in modules}
    for r in range(rounds):
        for name in (list(modules) if r % 2 == 0 else list(modules)[::-1]):
            start = time.perf_counter()
            for table in tables:
                attend(modules[name], table)
            best[name] = min(best[name], (time.perf_counter() - start) / layers)
    first, *rest = outputs.values()
    return {**{f"{name}_ms": 1000 * t for name, t in best.items()},
            "same_output": all(torch.equal(first, o) for o in rest)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4000])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 3, 5])
    ap.add_argument("--caches", nargs="+", default=list(CACHES), choices=CACHES)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kernels", choices=("both", "default"), default="both",
                    help="both: attend_run against attend_run_lanes; default: the build's dispatch alone")
    ap.add_argument("--base", help="git revision whose csrc/cpu_ops.cpp is timed against the working tree's")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    if args.base:
        measure = builds_measure(base_module(args.base, source="cpu_ops.cpp", what="cpu ops"), cpu._load(), args)
        mode = {"base": args.base}
    else:
        if args.kernels == "both" and cpu.set_attention_lanes_from(0) is None:
            sys.exit("this build has one attention kernel (no AVX-512): nothing to compare (--kernels default times it)")
        measure = kernels_measure(args) if args.kernels == "both" else default_measure(args)
        mode = {"kernels": args.kernels}
    load = os.getloadavg()
    cases = []
    for shape in SHAPES:
        for context in args.contexts:
            for tokens in args.tokens:
                for kind in args.caches:
                    fields, text = measure(shape, kind, context, tokens)
                    cases.append({"heads": shape[0], "kv_heads": shape[1], "head_size": shape[2], "cache": kind,
                                  "context": context, "tokens": tokens, **fields})
                    print(f"{shape} {kind:8s} ctx {context:5d} tokens {tokens}: {text}", flush=True)
    write_json(Path(args.out), {**metadata("attention_lanes_ab"), **mode, "threads": args.threads,
                                "layers": args.layers, "rounds": args.rounds, "block_size": BLOCK,
                                "load_avg_before_after": [load, os.getloadavg()], "cases": cases})


def default_measure(args: argparse.Namespace):
    """The build's own dispatch alone."""
    def measure(shape, kind, context, tokens):
        ms = layer_ms(shape, kind, context, tokens, args.layers, args.rounds, None)
        return {"default_ms": ms}, f"{ms:.3f} ms"
    return measure


def kernels_measure(args: argparse.Namespace):
    """attend_run (lanes_from past any run's lanes) against attend_run_lanes (1: wherever it can)."""
    def measure(shape, kind, context, tokens):
        lanes = tokens * shape[0] // shape[1]
        run, lanes_ms = (layer_ms(shape, kind, context, tokens, args.layers, args.rounds, n) for n in (1 << 30, 1))
        return ({"lanes": lanes, "attend_run_ms": run, "lanes_ms": lanes_ms, "speedup": run / lanes_ms},
                f"lanes {lanes:3d}  {run:.3f} -> {lanes_ms:.3f} ms  {run / lanes_ms:.2f}x")
    return measure


def builds_measure(base, new, args: argparse.Namespace):
    """REV's build against the working tree's, turn about, and whether their outputs are the same bits."""
    def measure(shape, kind, context, tokens):
        got = ab_case({"base": base, "new": new}, shape, kind, context, tokens, args.layers, args.rounds)
        got["speedup"] = got["base_ms"] / got["new_ms"]
        return got, (f"{got['base_ms']:.3f} -> {got['new_ms']:.3f} ms  {got['speedup']:.2f}x"
                     f"{'' if got['same_output'] else '  OUTPUTS DIFFER'}")
    return measure


if __name__ == "__main__":
    main()

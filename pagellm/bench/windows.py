"""The sliding-window rows of `pagellm bench memory`: KV bytes one request holds, and how many
requests fit a fixed budget, for model shapes with sliding-window layers, with the hybrid KV
manager (core/kv/hybrid.py, what slid out given back) against full caching of every layer.

Each request is prefilled in chunks of `chunk` tokens through the real managers and the KV
groups planned for the shape (core/kv/groups.py); the bytes of a block id are the K and V of the
layers one group holds. No model runs: the shapes are configs, the bytes their real sizes.
"""
from __future__ import annotations

from dataclasses import dataclass

from pagellm.core.kv import HybridKVManager, KVCacheManager
from pagellm.core.kv.groups import plan_kv_groups
from pagellm.core.request import Request
from pagellm.sampling_params import SamplingParams


@dataclass(frozen=True)
class WindowShape:
    name: str
    layers: list[int | None]  # per layer: its window (None: full attention)
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2  # bfloat16 KV


SHAPES = {
    # Mistral-7B-v0.1: 32 layers, all with a 4,096-token window; 8 KV heads of 128.
    "mistral-like": WindowShape("mistral-like", [4096] * 32, 8, 128),
    # Gemma-3-12B: 48 layers, five of window 1,024 for each full one; 8 KV heads of 256.
    "gemma3-like": WindowShape("gemma3-like", [None if i % 6 == 5 else 1024 for i in range(48)], 8, 256),
}


def _fill(kv, rid: str, tokens: int, chunk: int) -> bool:
    """Prefill one request of `tokens` tokens in chunks, then make room for its first decode step
    (what a generating request holds); False (and nothing held) if it does not fit."""
    req = Request(rid, [1] * (tokens + 1), SamplingParams())
    done = 0
    while done <= tokens:
        n = min(chunk, tokens - done) or 1
        if not kv.allocate_slots(req, n):
            kv.free(req)
            return False
        done += n
        req.num_computed_tokens = done
    return True


def _manager(shape: WindowShape, hybrid: bool, num_blocks: int, block_size: int, context: int, chunk: int):
    plan = plan_kv_groups(shape.layers if hybrid else [None] * len(shape.layers), context + 1)
    bytes_per_block = plan.bytes_per_block(block_size, shape.kv_heads, shape.head_dim * shape.dtype_bytes)
    if plan.hybrid:
        kv = HybridKVManager(num_blocks, block_size, plan.windows, enable_prefix_caching=False,
                             max_chunk_tokens=chunk)
    else:
        kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
    return kv, bytes_per_block, plan


def window_rows(contexts: tuple[int, ...] = (8192, 32768), budget_bytes: int = 16 << 30, block_size: int = 16,
                chunk: int = 2048) -> dict:
    """Per shape and context length: bytes held by one request, hybrid and full caching, and the
    requests of that length that fit `budget_bytes` at once."""
    out: dict = {"budget_bytes": budget_bytes, "block_size": block_size, "chunk": chunk, "shapes": {}}
    for shape in SHAPES.values():
        rows = {}
        for context in contexts:
            row: dict = {}
            for label, hybrid in (("hybrid", True), ("full", False)):
                need = len(shape.layers) * (context // block_size + 2) + 2  # enough for one request, any plan
                kv, per_block, plan = _manager(shape, hybrid, need, block_size, context, chunk)
                assert _fill(kv, "one", context, chunk)
                held = kv.num_used_blocks
                fits_kv, _, _ = _manager(shape, hybrid, max(2, budget_bytes // per_block), block_size, context, chunk)
                fit = 0
                while _fill(fits_kv, f"r{fit}", context, chunk):
                    fit += 1
                row[label] = {"groups": list(plan.windows), "bytes_per_block": per_block, "blocks_held": held,
                              "bytes_per_request": held * per_block, "requests_in_budget": fit}
            row["hybrid_share_of_full"] = row["hybrid"]["bytes_per_request"] / row["full"]["bytes_per_request"]
            rows[str(context)] = row
        out["shapes"][shape.name] = rows
    gemma = out["shapes"]["gemma3-like"].get("32768")
    out["targets"] = [] if gemma is None else [
        {"target": "gemma3-like at 32k context: hybrid KV <= 30% of full caching",
         "value": gemma["hybrid_share_of_full"], "met": gemma["hybrid_share_of_full"] <= 0.30}]
    return out


def print_window_rows(rows: dict) -> None:
    print(f"\nsliding windows: KV per generating request (bf16, blocks of {rows['block_size']}), and requests that fit "
          f"{rows['budget_bytes'] / (1 << 30):.0f} GiB")
    table = []
    for name, by_context in rows["shapes"].items():
        for context, r in by_context.items():
            table.append([name, context, f"{r['hybrid']['bytes_per_request'] / (1 << 20):.0f} MiB",
                          f"{r['full']['bytes_per_request'] / (1 << 20):.0f} MiB", f"{r['hybrid_share_of_full']:.1%}",
                          r["hybrid"]["requests_in_budget"], r["full"]["requests_in_budget"]])
    from pagellm.bench import report

    print(report.format_table(["shape", "context", "hybrid", "full caching", "share", "fit (hybrid)",
                               "fit (full)"], table))
    report.print_targets(rows["targets"])

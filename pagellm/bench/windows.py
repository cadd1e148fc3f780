"""The layer-kind rows of `pagellm bench memory`: cache bytes one request holds, and how many
requests fit a fixed budget, for model shapes with sliding-window or recurrent layers, with the
KV coordinator (core/kv/coordinator.py: what slid out given back, a fixed-size state for recurrent
layers) against caching every layer as full attention of the same attention shape (what serving
the model takes without those kinds: the same model with a plain per-head cache).

Each request is prefilled in chunks of `chunk` tokens through the real managers and the KV
groups planned for the shape (core/kv/groups.py); the bytes of a block id are the K and V of the
layers one group holds. No model runs: the shapes are configs, the bytes their real sizes.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pagellm.bench import doc_sections
from pagellm.core.kv import KVCoordinator
from pagellm.core.kv.groups import STATE, plan_kv_groups
from pagellm.layers.recurrent import blocks_for_state
from pagellm.core.request import Request
from pagellm.sampling_params import SamplingParams


@dataclass(frozen=True)
class WindowShape:
    name: str
    layers: list[int | None | str]  # per layer: its window (None: full attention), or STATE (recurrent)
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2  # bfloat16 KV
    state_bytes: int = 0  # one sequence's state in one recurrent layer (float32)
    v_head_dim: int | None = None  # V's row per head where it differs from K's
    latent_row: int = 0  # latent attention: one row of this many values per token, read by every head


def _row_bytes(shape: WindowShape, by_kind: bool) -> tuple[int, int, int]:
    """(heads, K bytes per head, V bytes per head) of a block's row: a latent layer's one row in K
    alone (layers/mla.py), else every KV head's K and V."""
    if by_kind and shape.latent_row:
        return 1, shape.latent_row * shape.dtype_bytes, 0
    return shape.kv_heads, shape.head_dim * shape.dtype_bytes, (shape.v_head_dim or shape.head_dim) * shape.dtype_bytes


def _gdn_state_bytes(key_heads: int, value_heads: int, dk: int, dv: int, conv: int) -> int:
    """Gated DeltaNet's state per sequence (layers/gated_delta_net.py): the delta rule's matrix per
    value head and the convolution's last inputs of q, k and v."""
    return 4 * (value_heads * dk * dv + (2 * key_heads * dk + value_heads * dv) * (conv - 1))


SHAPES = {
    # Mistral-7B-v0.1: 32 layers, all with a 4,096-token window; 8 KV heads of 128.
    "mistral-like": WindowShape("mistral-like", [4096] * 32, 8, 128),
    # Gemma-3-12B: 48 layers, five of window 1,024 for each full one; 8 KV heads of 256.
    "gemma3-like": WindowShape("gemma3-like", [None if i % 6 == 5 else 1024 for i in range(48)], 8, 256),
    # gpt-oss-20b: 24 layers alternating a 128-token window and full attention; 8 KV heads of 64.
    "gpt-oss-like": WindowShape("gpt-oss-like", [128 if i % 2 == 0 else None for i in range(24)], 8, 64),
    # Qwen3.5 (transformers' default text config): 32 layers, three Gated DeltaNet layers (16 key and 32
    # value heads of 128, convolution of 4) for each full-attention layer (4 KV heads of 256).
    "qwen3.5-like": WindowShape("qwen3.5-like", [None if i % 4 == 3 else STATE for i in range(32)], 4, 256,
                                state_bytes=_gdn_state_bytes(16, 32, 128, 128, 4)),
    # DeepSeek-V3 (transformers' default config): 61 layers of latent attention, a row of 512 latent and 64 rotary
    # values per token; without it, 128 heads of K (128 + 64) and V (128) per token.
    "mla-like": WindowShape("mla-like", [None] * 61, 128, 192, v_head_dim=128, latent_row=512 + 64),
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
    bytes_per_block = plan.bytes_per_block(block_size, *_row_bytes(shape, hybrid))
    state_blocks = blocks_for_state(shape.state_bytes, bytes_per_block // plan.slots) if plan.has_state else 0
    kv = KVCoordinator(num_blocks, block_size, plan.windows, enable_prefix_caching=False, max_chunk_tokens=chunk,
                       state_blocks=state_blocks)
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
                              "bytes_per_token": held * per_block / context,
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
    print(f"\nlayer kinds: cache per generating request (bf16 K/V, float32 state, blocks of {rows['block_size']}), "
          f"and requests that fit "
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


# docs/kv-cache.md's table of these rows, drawn from the newest committed layer-kinds JSON.
PAGE = Path("docs") / "kv-cache.md"
RESULTS = doc_sections.RESULTS
NAME = "layer-kinds-table"
SOURCE = "benchmarks/results/layer-kinds-*.json"


def render(doc: dict, source: str) -> str:
    """The generated section of one layer-kinds result (`source`: its file name)."""
    gib = doc["budget_bytes"] / (1 << 30)
    header = ["shape", "context", "per request, by kind", "all layers full attention", "share",
              "bytes per token (by kind / full)", f"requests in {gib:.0f} GiB (by kind / full)"]
    rows = []
    for name, by_context in doc["shapes"].items():
        for context, r in by_context.items():
            h, f = r["hybrid"], r["full"]
            rows.append([name, f"{int(context):,}", f"{h['bytes_per_request'] / (1 << 20):,.0f} MiB",
                         f"{f['bytes_per_request'] / (1 << 20):,.0f} MiB", f"{r['hybrid_share_of_full']:.1%}",
                         f"{h['bytes_per_token'] / 1024:,.1f} / {f['bytes_per_token'] / 1024:,.1f} KiB",
                         f"{h['requests_in_budget']} / {f['requests_in_budget']}"])
    note = (f"(`{source}`; bf16 K/V, float32 state, blocks of {doc['block_size']}, prefill in chunks of "
            f"{doc['chunk']:,}.)")
    return doc_sections.wrap(NAME, SOURCE, doc_sections.markdown_table(header, rows, "lrrrrrr") + "\n\n" + note)


def newest(results: Path = RESULTS) -> Path:
    return sorted(results.glob("layer-kinds-*.json"))[-1]


def section(results: Path = RESULTS) -> str:
    """The generated section, from the newest result under `results`."""
    path = newest(results)
    return render(json.loads(path.read_text()), path.name)


def update_page(page: Path = PAGE, results: Path = RESULTS) -> bool:
    """Rewrite the generated table in `page` from the newest result; True when it changed."""
    return doc_sections.update_page(page, NAME, section(results))


def main() -> None:
    """`python -m pagellm.bench.windows`: compute the rows (no model runs: real managers, real
    sizes), write benchmarks/results/layer-kinds-<date>.json, print them and update the page."""
    from pagellm.bench import report

    rows = window_rows()
    print_window_rows(rows)
    json_path, _ = report.output_paths("layer-kinds", None)
    report.write_json(json_path, {**report.metadata("layer-kinds"), **rows})
    update_page()
    print(f"\nwrote {json_path} and the table in {PAGE}")


if __name__ == "__main__":
    main()

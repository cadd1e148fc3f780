"""The roofline, measured: how far a run is from what this machine can do.

Two limits, measured by reference kernels in the same process as the run they judge: memory
bandwidth (a streaming sum over a buffer far larger than the caches, read once) and the dense
GEMM rate in float32 and bfloat16. A run's achieved rates come from the model's own shapes
(`CausalLM.compute_cost`): FLOPs are 2 x the multiply-adds of its linear layers and head per
token computed (attention's score products left out: small next to the weights at these context
lengths); bytes are the weights one step streams (every linear weight and the head, in their
stored form: GGUF blocks count at their block size), once per engine step, KV reads left out; of a
mixture of experts only the experts the step's tokens pick (step_weight_bytes).
"""
from __future__ import annotations

import statistics
import time


def median_seconds(fn, repeat: int) -> float:
    """The median of `repeat` timed calls, after one untimed."""
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def machine_limits(threads: int | None = None, buffer_mib: int = 512, gemm_n: int = 2048, repeat: int = 5) -> dict:
    """{"memory_gbps", "gemm_gflops_float32", "gemm_gflops_bfloat16"} measured now on `threads`
    threads (default: torch's current setting). About 1.5 s. The bfloat16 rate is None on a CPU
    without bfloat16 instructions: torch's emulation would take minutes, and nothing here runs
    bfloat16 there (resolve_dtype refuses it)."""
    import torch

    from pagellm import cpu_features

    prev = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        big = torch.ones(buffer_mib << 18)  # float32: 4 bytes each
        out = {"memory_gbps": big.numel() * 4 / median_seconds(big.sum, repeat) / 1e9}
        del big
        out["gemm_gflops_bfloat16"] = None
        for dtype in (torch.float32, torch.bfloat16) if cpu_features.has_bf16() else (torch.float32,):
            a = torch.randn(gemm_n, gemm_n).to(dtype)
            out[f"gemm_gflops_{str(dtype).removeprefix('torch.')}"] = \
                2 * gemm_n ** 3 / median_seconds(lambda: a @ a, 3) / 1e9
        out["threads"] = torch.get_num_threads()
        return {k: round(v, 1) if isinstance(v, float) else v for k, v in out.items()}
    finally:
        torch.set_num_threads(prev)


def achieved(cost: dict, tokens: int, steps: int | None, seconds: float, limits: dict | None,
             dtype: str = "float32") -> dict:
    """A run's achieved GFLOP/s (tokens computed x FLOPs per token) and weight GB/s (steps x
    weight bytes per step; left out when the steps are unknown) over `seconds`, and each as a
    share of the measured limit."""
    gflops = cost["flops_per_token"] * tokens / seconds / 1e9
    out = {"gflops": _sig(gflops), "flops_per_token": cost["flops_per_token"]}
    gemm = (limits or {}).get(f"gemm_gflops_{dtype}") or (limits or {}).get("gemm_gflops_float32")
    if gemm:
        out["share_of_gemm_rate"] = _sig(gflops / gemm)
    if steps is not None and "weight_bytes_per_step" in cost:
        per_step = step_weight_bytes(cost, tokens / steps)
        gbps = per_step * steps / seconds / 1e9
        out.update(weight_gbps=_sig(gbps), weight_bytes_per_step=per_step)
        if (limits or {}).get("memory_gbps"):
            out["share_of_memory_bandwidth"] = _sig(gbps / limits["memory_gbps"])
    return out


def step_weight_bytes(cost: dict, tokens_per_step: float) -> int:
    """The weight bytes a step of `tokens_per_step` tokens streams. Dense weights once, whatever
    the tokens; of a mixture of experts (cost's `expert_weight_bytes`, `expert_share` = top_k /
    experts) the experts some token picked: with tokens routed independently and evenly, a share
    1 - (1 - share)^tokens of them (one token: its top-k; a prefill of hundreds: all)."""
    per_step = cost["weight_bytes_per_step"]
    share, experts = cost.get("expert_share"), cost.get("expert_weight_bytes")
    if not share or not experts:
        return per_step
    touched = 1.0 - (1.0 - share) ** max(tokens_per_step, 1.0)
    return per_step + round(experts * (touched - share))


def _sig(x: float) -> float:
    """Four significant digits: what the timings support, whatever the model's size."""
    return float(f"{x:.4g}")

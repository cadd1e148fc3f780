"""Every environment variable pagellm reads, in one place.

Each is read when asked for (not at import), so a test or a parent process can set it
for the process it starts.

| variable | default | what it does |
| --- | --- | --- |
| PAGELLM_CPU_KERNELS | 1 | 0 runs the torch code instead of the compiled CPU kernels |
| PAGELLM_DECODE_PLANS | 1 | 0 runs every decode step through the layers' modules instead of their direct kernel calls (layers/decode_plan.py; the same bits, slower) |
| PAGELLM_CPU_MARCH | native | the `-march` the CPU kernels are compiled for: `x86-64-v3` builds the AVX2 code on an AVX-512 machine (to test or measure what an AVX2-only CPU runs) |
| PAGELLM_TP_TIMEOUT | 300 | seconds a tensor-parallel collective waits for a peer before it fails |
| PAGELLM_API_KEY | unset | `pagellm serve`'s default `--api-key` |
| PAGELLM_CHECK_INVARIANTS | 0 | 1 checks the KV manager's integrity after every engine step (slow; for tests) |
| PAGELLM_LLAMA_CPP_BIN | ~/.cache/pagellm-llama.cpp-0.3.36-ISA/build/bin (ISA: this CPU's, e.g. avx2 or avx2-avx512-vnni-bf16) | llama.cpp's binaries for the benchmarks (benchmarks/build_llama_cpp.sh) |
| TRITON_INTERPRET | 0 | Triton's own switch: 1 runs Triton kernels interpreted, on CPU tensors |
| RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK, LOCAL_WORLD_SIZE | unset | set by torchrun |
"""
from __future__ import annotations

import os

DEFAULT_TP_TIMEOUT_S = 300.0
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _flag(name: str, default: str) -> bool:
    return os.environ.get(name, default) not in ("", "0")


def cpu_kernels_enabled() -> bool:
    return _flag("PAGELLM_CPU_KERNELS", "1")


def decode_plans_enabled() -> bool:
    return _flag("PAGELLM_DECODE_PLANS", "1")


def cpu_march() -> str:
    return os.environ.get("PAGELLM_CPU_MARCH", "native")


def tp_timeout_s() -> float:
    return float(os.environ.get("PAGELLM_TP_TIMEOUT", DEFAULT_TP_TIMEOUT_S))


def api_key() -> str | None:
    return os.environ.get("PAGELLM_API_KEY")


def check_invariants() -> bool:
    return _flag("PAGELLM_CHECK_INVARIANTS", "0")


def cpu_isa_tag() -> str:
    """The instruction sets benchmarks/build_llama_cpp.sh builds llama.cpp for, named as its
    cache directory names them (a build for one CPU must not run on another)."""
    from pagellm.cpu_features import cpu_flags

    flags = cpu_flags()
    tag = "avx2"
    for flag, name in (("avx512f", "avx512"), ("avx512_vnni", "vnni"), ("avx512_bf16", "bf16")):
        tag += f"-{name}" if flag in flags else ""
    return tag


def llama_cpp_bin() -> str:
    default = os.path.join(os.path.expanduser("~"), ".cache", f"pagellm-llama.cpp-0.3.36-{cpu_isa_tag()}",
                           "build", "bin")
    return os.environ.get("PAGELLM_LLAMA_CPP_BIN", default)


def triton_interpreting() -> bool:
    return _flag("TRITON_INTERPRET", "0")


def torchrun_env() -> dict[str, int] | None:
    """rank, world_size, local_rank and local_world_size when torchrun (or anything setting
    its variables) started this process; None otherwise."""
    if not all(v in os.environ for v in _TORCHRUN_VARS):
        return None
    world = int(os.environ["WORLD_SIZE"])
    return {"rank": int(os.environ["RANK"]), "world_size": world,
            "local_rank": int(os.environ.get("LOCAL_RANK", os.environ["RANK"])),
            "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", world))}

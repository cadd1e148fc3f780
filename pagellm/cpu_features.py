"""What this CPU can do, read once from /proc/cpuinfo: the instruction sets that decide which
kernels are fast here, and which dtypes are worth computing in."""
from __future__ import annotations

import functools


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (x86 `flags`, Arm `Features`); empty where /proc/cpuinfo is not."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def has_bf16() -> bool:
    """Whether the CPU multiplies bfloat16 in hardware (AVX-512 BF16 or AMX on x86, BF16 on Arm).
    Without it torch computes bfloat16 matrix products hundreds of times slower than float32."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16", "bf16"})

"""What this CPU can do, read once from /proc/cpuinfo: the instruction sets that decide which
kernels are fast here, and which dtypes are worth computing in."""
from __future__ import annotations

import functools


@functools.lru_cache(maxsize=1)
def _first_cpu() -> dict[str, str]:
    """The first processor's `key: value` lines of /proc/cpuinfo; empty where there is none."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    if fields:
                        break
                    continue
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (x86 `flags`, Arm `Features`); empty where /proc/cpuinfo is not."""
    info = _first_cpu()
    return frozenset((info.get("flags") or info.get("Features") or "").split())


def cpu_model() -> str | None:
    """The CPU's model name as /proc/cpuinfo says it, or None where it does not."""
    return _first_cpu().get("model name")


def has_bf16() -> bool:
    """Whether the CPU multiplies bfloat16 in hardware (AVX-512 BF16 or AMX on x86, BF16 on Arm).
    Without it torch computes bfloat16 matrix products hundreds of times slower than float32."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16", "bf16"})

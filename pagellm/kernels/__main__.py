"""`python -m pagellm.kernels`: build the CPU extensions now, side by side, instead of one by one
inside the first requests (or tests) that need them. Each is one C++ file whose compiler runs on
one core, so the three take about as long together as the longest alone on a machine with as
many cores. Builds already in the cache are loaded, not rebuilt."""
from __future__ import annotations

import sys
import time
from concurrent.futures import ProcessPoolExecutor

BUILDERS = ("available", "quant_kernels", "codebook_kernels")


def _build(name: str) -> tuple[str, bool]:
    from pagellm.kernels import cpu

    return name, bool(getattr(cpu, name)())


def main() -> int:
    start = time.monotonic()
    with ProcessPoolExecutor(max_workers=len(BUILDERS)) as pool:
        built = dict(pool.map(_build, BUILDERS))
    print(f"pagellm CPU kernels: {', '.join(f'{n} {ok}' for n, ok in built.items())} in {time.monotonic() - start:.0f} s")
    return 0 if all(built.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

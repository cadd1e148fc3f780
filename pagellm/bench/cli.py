"""`pagellm bench ...`: the benchmark subcommands, registered on the main CLI."""
from __future__ import annotations


def add_bench_parser(sub) -> None:
    from pagellm.bench import (fuzz, grammar, kv_cache, latency, memory, offload, serve, sharing, soak, spec_decode,
                               throughput)

    bench = sub.add_parser("bench", help="benchmarks: memory, throughput, latency, serve, sharing, fuzz, grammar, "
                                         "kv-cache, kv-offload, spec-decode, soak (results in benchmarks/results/)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    for module in (memory, throughput, latency, serve, sharing, fuzz, grammar, kv_cache, offload, spec_decode, soak):
        module.add_parser(bench_sub)

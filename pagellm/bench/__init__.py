"""Benchmarks that test PagedAttention's claims against the alternatives: `pagellm bench
memory | throughput | serve`. Results go to benchmarks/results/ as JSON and PNG."""

"""The package's imports run one way: each folder of pagellm/ (and each top-level module) imports
only what stands below it in LAYERS, save the few upward edges named in UPWARD with their reason.
Every import counts, also those inside functions and under TYPE_CHECKING: a lazy import is still
a dependency."""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "pagellm"

# Top to bottom, in the order a request travels (docs/architecture.md).
LAYERS = [
    "__main__", "cli", "pagellm", "bench", "entrypoints", "serving", "engine", "executor", "distributed", "worker", "loader",
    "models", "layers", "attention", "kernels", "kv_format", "core",
    "beam_search", "outputs", "sampling_params", "config", "pooling_params", "errors", "timing", "envs", "cpu_features", "version",
]
# Upward edges allowed, each with its reason (none at present).
UPWARD: set[tuple[str, str]] = set()


def unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def folder_edges() -> dict[tuple[str, str], set[str]]:
    """(importer, imported) units -> the files that make the edge."""
    edges: dict[tuple[str, str], set[str]] = defaultdict(set)
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        src = unit(module)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            else:
                continue
            for name in names:
                if name.startswith("pagellm.") and unit(name) != src:
                    edges[(src, unit(name))].add(str(path.relative_to(PACKAGE.parent)))
    return edges


def test_every_unit_has_a_place():
    units = {a for a, _ in folder_edges()} | {b for _, b in folder_edges()}
    assert units <= set(LAYERS), f"place {sorted(units - set(LAYERS))} in LAYERS"


def test_imports_run_down_the_layers():
    rank = {name: i for i, name in enumerate(LAYERS)}
    upward = {edge: files for edge, files in folder_edges().items() if rank[edge[0]] > rank[edge[1]]}
    unexplained = {f"{a} -> {b}": sorted(files) for (a, b), files in upward.items() if (a, b) not in UPWARD}
    assert not unexplained, f"imports against the layers: {unexplained}"
    assert set(upward) == UPWARD, f"no longer needed, drop from UPWARD: {UPWARD - set(upward)}"

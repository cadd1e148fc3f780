"""The package's import graph by folder: one node per folder of pagellm/ and per top-level module,
stacked so that each stands above what it imports, with the edges that still run back up and the
file-level import circles.

    python scripts/import_graph.py          # the stack, its back-edges, the circles
    python scripts/import_graph.py --check  # exit 1 on any back-edge or circle

Every import counts (inside functions and under TYPE_CHECKING too): a lazy import is still a
dependency. The stack is found from the graph alone (sources up, sinks down, Eades-Lin-Smyth's
greedy order for what is left in circles), so it measures the code, not a declared intention;
tests/test_layering.py holds the declared order.
"""
from __future__ import annotations

import argparse
import ast
import functools
import sys
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "pagellm"


def module_name(path: Path, package: Path = PACKAGE) -> str:
    return ".".join(path.relative_to(package.parent).with_suffix("").parts).removesuffix(".__init__")


@functools.lru_cache(maxsize=None)
def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _import_time_nodes(body: list[ast.stmt]):
    """The statements that run when a module is imported: its body, into if/try/with blocks, but
    not function bodies nor `if TYPE_CHECKING:` blocks."""
    for node in body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from _import_time_nodes(node.orelse)
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            yield node
            for part in ("body", "orelse", "finalbody", "handlers"):
                yield from _import_time_nodes(getattr(node, part, []))
        elif isinstance(node, ast.ExceptHandler):
            yield from _import_time_nodes(node.body)
        else:
            yield node


def file_imports(package: Path = PACKAGE, eager: bool = False) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (a `from a import b` of a submodule b counts as a.b);
    `eager`: only the imports that run when the module is imported."""
    modules = {module_name(p, package): p for p in package.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        is_pkg = path.name == "__init__.py"
        tree = _parse(path)
        for node in _import_time_nodes(tree.body) if eager else ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: resolve against this module's package
                    base = mod.split(".")[: len(mod.split(".")) - node.level + (1 if is_pkg else 0)]
                    origin = ".".join(base + ([node.module] if node.module else []))
                else:
                    origin = node.module or ""
                targets = [f"{origin}.{a.name}" if f"{origin}.{a.name}" in modules else origin for a in node.names]
            for t in targets:
                while t and t not in modules:  # `import pagellm.a.b.c` of a name inside module a.b
                    t = t.rpartition(".")[0]
                if t.startswith("pagellm") and t != mod:
                    graph[mod].add(t)
    return graph


def imported_at_start(module: str, package: Path = PACKAGE) -> set[str]:
    """Every module of the package that importing `module` imports (its parents' __init__ too)."""
    graph = file_imports(package, eager=True)
    seen: set[str] = set()
    todo = [module]
    while todo:
        m = todo.pop()
        parts = m.split(".")
        for name in [m, *(".".join(parts[:i]) for i in range(1, len(parts)))]:
            if name in graph and name not in seen:
                seen.add(name)
                todo.extend(graph[name])
    return seen


def unit(module: str) -> str:
    """The folder or top-level module a module belongs to (the package's own __init__ is 'pagellm')."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def folder_edges(graph: dict[str, set[str]]) -> dict[tuple[str, str], set[str]]:
    """(importer, imported) unit -> the importing modules that make the edge."""
    edges: dict[tuple[str, str], set[str]] = defaultdict(set)
    for mod, targets in graph.items():
        for t in targets:
            if unit(t) != unit(mod):
                edges[(unit(mod), unit(t))].add(mod)
    return edges


def stack(nodes: set[str], edges: set[tuple[str, str]]) -> list[str]:
    """Top to bottom, importers above what they import where the graph allows (Eades-Lin-Smyth:
    nodes nobody left imports go up, nodes importing nothing left go down, and inside a circle the
    node with the most imports over importers goes up). Ties go by name, so the order is stable."""
    left, top, bottom = set(nodes), [], []
    while left:
        out = {n: {b for a, b in edges if a == n and b in left} for n in left}
        into = {n: {a for a, b in edges if b == n and a in left} for n in left}
        sinks = sorted(n for n in left if not out[n])
        sources = sorted(n for n in left if not into[n] and out[n])
        if sinks:
            bottom[:0] = sinks
            left -= set(sinks)
        elif sources:
            top += sources
            left -= set(sources)
        else:
            best = max(sorted(left), key=lambda n: len(out[n]) - len(into[n]))
            top.append(best)
            left.remove(best)
    return top + bottom


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The file-level import circles: strongly connected sets of two or more modules (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    path: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        path.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = path.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                found.append(sorted(scc))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def measure(package: Path = PACKAGE) -> tuple[list[str], dict[tuple[str, str], set[str]], list[list[str]]]:
    """(the stack top to bottom, the folder edges running back up it with their files, the circles)."""
    graph = file_imports(package)
    edges = folder_edges(graph)
    order = stack({unit(m) for m in graph}, set(edges))
    rank = {n: i for i, n in enumerate(order)}
    back = {e: files for e, files in edges.items() if rank[e[0]] > rank[e[1]]}
    return order, back, circles(graph)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 on any back-edge or circle")
    args = p.parse_args(argv)
    graph = file_imports()
    edges = folder_edges(graph)
    order, back, cycles = measure()
    print("stack, top to bottom (each imports only what stands below it, but for the back-edges):")
    for n in order:
        below = sorted(b for a, b in edges if a == n)
        print(f"  {n:16} -> {', '.join(below) if below else '(nothing)'}")
    print(f"{len(edges)} folder edges, {len(back)} running back up")
    for (a, b), files in sorted(back.items()):
        print(f"  {a} -> {b}: {', '.join(sorted(files))}")
    print(f"{len(cycles)} file-level import circles")
    for c in cycles:
        print("  " + " <-> ".join(c))
    return 1 if args.check and (back or cycles) else 0


if __name__ == "__main__":
    sys.exit(main())

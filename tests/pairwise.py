"""Pairwise parameter grids: every pair of values of any two axes meets in the fast suite, the
whole product runs with the slow sweeps (`make test-slow`).

A kernel's bugs mostly sit where two options meet (a window with a block size, a format with a
head size); a grid covering each pair once finds those in a tenth of the product's cases."""
from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest


def pairwise(**axes: Sequence) -> list:
    """`pytest.param`s for the product of `axes` (in their order, for `parametrize("a,b,...")`),
    each one not needed to cover a pair marked slow. The choice is greedy and deterministic:
    the case covering most pairs still uncovered, the first in product order on ties."""
    sizes = [len(v) for v in axes.values()]
    combos = list(itertools.product(*(range(n) for n in sizes)))
    axis_pairs = list(itertools.combinations(range(len(sizes)), 2))

    def pairs(combo: tuple[int, ...]) -> set:
        return {(i, combo[i], j, combo[j]) for i, j in axis_pairs}

    uncovered = set().union(*(pairs(c) for c in combos))
    fast: set[tuple[int, ...]] = set()
    while uncovered:
        best = max(combos, key=lambda c: len(pairs(c) & uncovered))
        fast.add(best)
        uncovered -= pairs(best)
    values = list(axes.values())
    return [pytest.param(*(values[i][k] for i, k in enumerate(c)), marks=() if c in fast else pytest.mark.slow)
            for c in combos]

"""Scoring text pairs by their embeddings, for /score, /rerank and `LLM.score`: the cosine of the
two texts' embeddings (the model's own pooling), paired as vLLM pairs them."""
from __future__ import annotations

import math
from collections.abc import Sequence

# The most documents one rerank or score request may hold (as Cohere's rerank API).
MAX_SCORE_DOCUMENTS = 1000


def pair_up(num_1: int, num_2: int) -> list[tuple[int, int]] | None:
    """(i, j) index pairs of two lists of texts, as vLLM pairs them: 1:1, 1:N (the one against
    each), N:N (in order); None for any other shape (N:M, N:1, an empty side)."""
    if num_1 == 0 or num_2 == 0:
        return None
    if num_1 == 1:
        return [(0, j) for j in range(num_2)]
    if num_1 == num_2:
        return [(i, i) for i in range(num_1)]
    return None


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """cos(a, b); 0.0 when either is the zero vector."""
    dot = math.fsum(x * y for x, y in zip(a, b))
    norms = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    return dot / norms if norms else 0.0

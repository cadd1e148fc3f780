"""Scoring text pairs, for /score, /rerank and `LLM.score`, paired as vLLM pairs them; a pair's
score is either

- the cosine of the two texts' embeddings (the model's own pooling): the default, for any model;
- for a cross-encoder (a *ForSequenceClassification checkpoint), its score head on the final
  hidden state of the pair's last token, the pair joined as its tokenizer joins two texts
  (loader/score_head.py);
- with `classifier_from_token` (two words, e.g. ["no", "yes"]), a causal LM used as a yes/no
  reranker, as Qwen3-Reranker is: after the query's tokens then the document's, the probability
  of the second word against the first, softmax over the two logits. The client formats the
  texts (Qwen3-Reranker's instruction, its chat markup), as vLLM's own examples do.

The yes/no score comes from the engine's ordinary requests: one greedy token per word, only that
word allowed; its logprob, taken from the model's logits before any rule, is log softmax over the
whole vocabulary, and the two words' logprobs differ exactly as their logits do.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from pagellm.outputs import RequestOutput
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import SamplingParams

# What a cross-encoder's score head reads: the last token's final hidden state, as it is.
HEAD_POOLING = PoolingParams(pooling_type="LAST", normalize=False)

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


def classifier_token_ids(words: Sequence[str], encode: Callable[[str], list[int]]) -> tuple[int, int]:
    """classifier_from_token's two words as token ids; each must be one token of the model's tokenizer."""
    ids = []
    for word in words:
        tokens = encode(word)
        if len(tokens) != 1:
            raise ValueError(f"classifier_from_token must be words of one token each; {word!r} is {len(tokens)} "
                             f"tokens of this model's tokenizer ({tokens})")
        ids.append(tokens[0])
    return ids[0], ids[1]


def pair_token_ids(tokenizer: Any, query: str, document: str) -> list[int]:
    """A pair's prompt for the yes/no reranker: the query's tokens (with the model's BOS, if it adds
    one), then the document's."""
    return tokenizer.encode(query) + tokenizer.encode(document, add_special_tokens=False)


def classifier_params(token_ids: tuple[int, int]) -> list[SamplingParams]:
    """The two requests that score one pair: one token, greedy, only the word allowed, its logprob back."""
    return [SamplingParams(max_tokens=1, temperature=0.0, allowed_token_ids=[t], logprobs=0) for t in token_ids]


def classifier_score(outputs: Sequence[RequestOutput], token_ids: tuple[int, int]) -> float:
    """P(second word) / (P(first) + P(second)) from the two requests of `classifier_params`."""
    no, yes = (out.outputs[0].logprobs[0][t].logprob for out, t in zip(outputs, token_ids))
    return 1.0 / (1.0 + math.exp(no - yes))

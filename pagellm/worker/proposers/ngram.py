"""Prompt lookup (n-gram) proposals: no weights, only the sequence's own tokens.

The last n tokens (n from prompt_lookup_max down to prompt_lookup_min) are looked for earlier in
the prompt and output; at the most recent earlier occurrence of the longest n that has one, the
tokens that followed it are proposed, as many as a match of that length vouches for. A model
copying from its context (editing a file, quoting a document, echoing JSON) makes these proposals
right.
"""
from __future__ import annotations

from array import array
from typing import Sequence

from pagellm.worker.proposers.base import Proposal, ProposalQuery, Proposer

# Tokens are searched as 4-byte integers with bytes.rfind: a C loop, not a Python one, over contexts
# of thousands of tokens every step.
_ITEM = array("i").itemsize


def vouched(n: int, max_n: int, num_tokens: int) -> int:
    """How many of the tokens after a match of the last `n` tokens are proposed: all `num_tokens`
    for a match of max_n, at most max(1, n // 2) after a shorter one. A short match is a weak
    promise that the text goes on as it did there, and every token proposed costs a row of the
    verification, kept or not (docs/speculative-decoding.md, "How many tokens a match proposes")."""
    return num_tokens if n >= max_n else min(num_tokens, max(1, n // 2))


def lookup(tokens: Sequence[int], num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """The tokens that followed the latest earlier occurrence of the longest suffix of `tokens` of
    length max_n .. min_n, as many as `vouched` gives a match of that length (at most
    `num_tokens`); [] when none occurs earlier."""
    length = len(tokens)
    if num_tokens < 1 or length <= min_n:
        return []
    data = array("i", tokens).tobytes()
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = data[(length - n) * _ITEM:]
        # Occurrences that start before the suffix itself does: they end by token length - 2.
        end = (length - 1) * _ITEM
        pos = data.rfind(suffix, 0, end)
        while pos > 0 and pos % _ITEM:  # a match across token boundaries: look further back
            pos = data.rfind(suffix, 0, pos + len(suffix) - 1)
        if pos >= 0:
            start = pos // _ITEM + n
            return list(tokens[start:start + vouched(n, max_n, num_tokens)])
    return []


class NgramProposer(Proposer):
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, contexts: Sequence[Sequence[int]], num_tokens: Sequence[int]) -> list[list[int]]:
        return [lookup(c, k, self.min_n, self.max_n) for c, k in zip(contexts, num_tokens)]

    def propose_for(self, queries: Sequence[ProposalQuery]) -> list[Proposal]:
        return [Proposal(p) for p in self.propose([q.context for q in queries], [q.num_tokens for q in queries])]

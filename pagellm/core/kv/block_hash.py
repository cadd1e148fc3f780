"""The identity of a full block of tokens, for prefix caching: a hash chained over its parent's
hash, its token ids and the request's cache salt, so a new request can start from the blocks an
earlier one computed (core/kv/coordinator.py), and a router can tell which replica holds a prefix.
"""
from __future__ import annotations

import hashlib
from array import array
from typing import Sequence

from pagellm.core.request import Request


def hash_block(parent: bytes | None, tokens: Sequence[int], salt: str | None = None) -> bytes:
    """Identity of a full block: its tokens and, through the parent hash, every token
    before it. The salt (first block only; the chain carries it) isolates tenants."""
    h = hashlib.blake2b(digest_size=16)
    if parent is None:
        h.update(b"salt:" + (salt or "").encode())
    else:
        h.update(parent)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def request_block_hashes(request: Request, block_size: int, num_full_blocks: int) -> list[bytes]:
    """The hashes of the request's first `num_full_blocks` full blocks, computed once each and
    kept on the request (forks inherit them)."""
    hashes = request.block_hashes
    tokens = None
    while len(hashes) < num_full_blocks:
        if tokens is None:
            tokens = request.all_token_ids
        i = len(hashes)
        hashes.append(hash_block(hashes[-1] if hashes else None, tokens[i * block_size:(i + 1) * block_size],
                                 request.cache_salt))
    return hashes

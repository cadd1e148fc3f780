"""Paged attention in torch against plain causal attention over contiguous K/V."""
from __future__ import annotations

import random

import pytest
import torch

from pagellm.attention.backend import AttentionMetadata, AttentionOptions
from pagellm.attention.torch_backend import TorchAttentionBackend


def naive(q, k, v, scale, window=None, softcap=None, sinks=None):
    """q: [ql, H, D] for the last ql positions of a context whose K/V are k, v: [ctx, KVH, D];
    a query at position i sees keys j with i - window < j <= i; scores capped as
    softcap * tanh(s / softcap); sinks: [H] extra logits in each softmax's denominator."""
    ql, h, _ = q.shape
    ctx, kvh, _ = k.shape
    k = k.repeat_interleave(h // kvh, dim=1)
    v = v.repeat_interleave(h // kvh, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    qpos = torch.arange(ctx - ql, ctx)[:, None]
    kpos = torch.arange(ctx)[None, :]
    hidden = kpos > qpos
    if window:
        hidden |= kpos <= qpos - window
    scores = scores.masked_fill(hidden, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks[:, None, None].expand(h, ql, 1)], dim=-1)
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1)[..., :-1], v)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("compiled", [False, True], ids=["torch", "compiled-decode"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("d", [8, 64])  # 64: the compiled kernel's unrolled path; 8: its generic one
@pytest.mark.parametrize("variant", ["plain", "window", "softcap", "sinks"])
def test_mixed_batch_matches_naive(block_size, heads, compiled, d, variant):
    rng = random.Random(block_size * 10 + heads[0])
    torch.manual_seed(block_size)
    h, kvh = heads
    num_blocks = 512
    # (context already cached, tokens computed this step): decodes first, then fresh
    # prefills, chunks on top of a cached part, and a one-token prompt.
    shapes = [(rng.randint(1, 40), 1) for _ in range(3)] + [(0, 1), (0, 13), (9, 7), (20, 1 + block_size)]
    shapes.sort(key=lambda s: s[1] != 1)
    k_cache = torch.zeros(num_blocks, block_size, kvh, d)
    v_cache = torch.zeros_like(k_cache)
    free = list(range(num_blocks))
    rng.shuffle(free)
    full_k, full_v, tables, qs, ks, vs, slots = [], [], [], [], [], [], []
    for cached, new in shapes:
        ctx = cached + new
        k_all, v_all = torch.randn(ctx, kvh, d), torch.randn(ctx, kvh, d)
        table = [free.pop() for _ in range(-(-ctx // block_size))]
        for p in range(cached):  # what earlier steps wrote
            k_cache[table[p // block_size], p % block_size] = k_all[p]
            v_cache[table[p // block_size], p % block_size] = v_all[p]
        slots += [table[p // block_size] * block_size + p % block_size for p in range(cached, ctx)]
        full_k.append(k_all), full_v.append(v_all), tables.append(table)
        qs.append(torch.randn(new, h, d)), ks.append(k_all[cached:]), vs.append(v_all[cached:])
    width = max(map(len, tables))
    seq_lens = [c + n for c, n in shapes]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        query_lens=[n for _, n in shapes], seq_lens=seq_lens, seq_lens_tensor=torch.tensor(seq_lens),
        num_decodes=sum(n == 1 for _, n in shapes), block_size=block_size)
    scale = d ** -0.5
    backend = TorchAttentionBackend(compiled_decode=compiled)
    if compiled:
        from pagellm.kernels import cpu as cpu_kernels

        assert cpu_kernels.available(), "the CPU kernel must build here (gcc and ninja are installed by the set-up)"
    window = 5 if variant == "window" else None
    softcap = 0.7 if variant == "softcap" else None
    sinks = torch.randn(h) if variant == "sinks" else None
    options = AttentionOptions(scale, window, softcap)
    out = backend.forward(torch.cat(qs), torch.cat(ks), torch.cat(vs), k_cache, v_cache, meta, scale, options, sinks)
    expected = torch.cat([naive(q, k, v, scale, window, softcap, sinks) for q, k, v in zip(qs, full_k, full_v)])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # Every new token's K/V landed in its slot.
    for (cached, new), table, k_all in zip(shapes, tables, full_k):
        for p in range(cached, cached + new):
            assert torch.equal(k_cache[table[p // block_size], p % block_size], k_all[p])

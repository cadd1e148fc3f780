"""Paged attention in torch against plain causal attention over contiguous K/V."""
from __future__ import annotations

import random

import pytest
import torch

from pagellm.attention.backend import AttentionMetadata, AttentionOptions
from pagellm.kv_format import resolve_kv_format
from pagellm.attention.torch_backend import TorchAttentionBackend
from tests.pairwise import pairwise


def naive(q, k, v, scale, window=None, softcap=None, sinks=None, chunk=None):
    """q: [ql, H, D] for the last ql positions of a context whose K/V are k, v: [ctx, KVH, D];
    a query at position i sees keys j with i - window < j <= i, and with j // chunk == i // chunk; scores capped as
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
    if chunk:
        hidden |= kpos // chunk != qpos // chunk
    scores = scores.masked_fill(hidden, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks[:, None, None].expand(h, ql, 1)], dim=-1)
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1)[..., :-1], v)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


# compiled: the compiled decode kernel, or torch's path; d 64: the compiled kernel's unrolled path, 8: its generic one.
@pytest.mark.parametrize("variant, d, heads, block_size, compiled", pairwise(
    variant=["plain", "window", "softcap", "sinks", "chunk"], d=[8, 64], heads=[(4, 4), (8, 2), (6, 1)],
    block_size=[1, 4, 16], compiled=[False, True]))
def test_mixed_batch_matches_naive(block_size, heads, compiled, d, variant):
    run_mixed_batch(block_size, heads, compiled, d, variant, None)


@pytest.mark.parametrize("variant, d, block_size, compiled, kv_cache_dtype", pairwise(
    variant=["plain", "window", "softcap", "sinks", "chunk"], d=[8, 64, 128], block_size=[4, 16],
    compiled=[False, True], kv_cache_dtype=["int8", "fp8_e4m3", "fp8_e5m2", "bfloat16"]))
def test_stored_formats_match_naive_on_what_the_cache_holds(block_size, compiled, d, variant, kv_cache_dtype):
    """8-bit (and bfloat16) caches: every path, prompts included, attends to the values the cache
    holds (kv_format.py), so the reference is exact attention over K/V rounded through
    the format; the compiled kernel reads the codes in place and must agree to float rounding.
    The stored rows are the bytes KVFormat.encode gives (the C++ store matches torch's)."""
    run_mixed_batch(block_size, (8, 2), compiled, d, variant, resolve_kv_format(kv_cache_dtype, torch.float32))


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("variant", ["plain", "window", "sinks", "chunk"])
def test_decodes_beside_short_prefills_match_naive(block_size, variant):
    """A speculative verification step: decodes and a few queries over each cached context, which
    the compiled kernel attends token by token in one call (SHORT_QUERY_TOKENS)."""
    run_mixed_batch(block_size, (8, 2), True, 64, variant, None,
                    shapes=[(17, 1), (3, 1), (30, 5), (12, 2), (40, 16), (1, 3)])


def run_mixed_batch(block_size, heads, compiled, d, variant, fmt, shapes=None):
    rng = random.Random(block_size * 10 + heads[0])
    torch.manual_seed(block_size)
    h, kvh = heads
    num_blocks = 512
    # (context already cached, tokens computed this step): decodes first, then fresh
    # prefills, chunks on top of a cached part, and a one-token prompt.
    shapes = shapes or [(rng.randint(1, 40), 1) for _ in range(3)] + [(0, 1), (0, 13), (9, 7), (20, 1 + block_size)]
    shapes.sort(key=lambda s: s[1] != 1)
    backend = TorchAttentionBackend(compiled_decode=compiled)
    backend.kv_format = fmt
    k_cache = torch.zeros(backend.kv_cache_shape(num_blocks, block_size, kvh, d),
                          dtype=torch.float32 if fmt is None else fmt.storage_dtype)
    v_cache = torch.zeros_like(k_cache)
    stored = (lambda x: x) if fmt is None else fmt.encode  # a row as the cache keeps it
    read = (lambda x: x) if fmt is None else (lambda x: fmt.decode(fmt.encode(x)))  # and as attention sees it
    free = list(range(num_blocks))
    rng.shuffle(free)
    full_k, full_v, tables, qs, ks, vs, slots = [], [], [], [], [], [], []
    for cached, new in shapes:
        ctx = cached + new
        # Rows of unequal sizes, so that per-row scales differ.
        k_all = torch.randn(ctx, kvh, d) * torch.rand(ctx, kvh, 1) * 4
        v_all = torch.randn(ctx, kvh, d) * torch.rand(ctx, kvh, 1) * 4
        table = [free.pop() for _ in range(-(-ctx // block_size))]
        for p in range(cached):  # what earlier steps wrote
            k_cache[table[p // block_size], p % block_size] = stored(k_all[p])
            v_cache[table[p // block_size], p % block_size] = stored(v_all[p])
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
    if compiled:
        from pagellm.kernels import cpu as cpu_kernels

        assert cpu_kernels.available(), "the CPU kernel must build here (gcc and ninja are installed by the set-up)"
    window = 5 if variant == "window" else None
    softcap = 0.7 if variant == "softcap" else None
    sinks = torch.randn(h) if variant == "sinks" else None
    chunk = 6 if variant == "chunk" else None  # contexts up to 40: chunk starts inside blocks and at their edges
    options = AttentionOptions(scale, window, softcap, chunk)
    out = backend.forward(torch.cat(qs), torch.cat(ks), torch.cat(vs), k_cache, v_cache, meta, scale, options, sinks)
    expected = torch.cat([naive(q, read(k), read(v), scale, window, softcap, sinks, chunk)
                          for q, k, v in zip(qs, full_k, full_v)])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # Every new token's K/V landed in its slot.
    for (cached, new), table, k_all, v_all in zip(shapes, tables, full_k, full_v):
        for p in range(cached, cached + new):
            assert torch.equal(k_cache[table[p // block_size], p % block_size], stored(k_all[p]))
            assert torch.equal(v_cache[table[p // block_size], p % block_size], stored(v_all[p]))


@pytest.mark.parametrize("dtype,kv_cache_dtype", [(torch.float32, None), (torch.float32, "int8"),
                                                  (torch.bfloat16, None)], ids=["f32", "f32-int8kv", "bf16"])
@pytest.mark.parametrize("variant", ["plain", "window", "softcap", "sinks", "chunk", "no-rope", "qk-norm-head",
                                     "qk-norm-full"])
@pytest.mark.parametrize("step", ["decode", "verify"])
def test_decode_from_qkv_is_the_split_path(dtype, kv_cache_dtype, variant, step):
    """The fused decode path (normalize, rotate, store and attend from the q/k/v projection in one
    call) gives the bits the split path gives: the q/k norms (per head as Qwen3, over all heads as
    OLMo 2) and rotate_qk on views of qkv, then forward; same cache bytes too. `verify`: a step where
    one sequence brings 3 tokens over its cached context (a speculative verification of 2
    proposals) beside decodes, each token attending to the keys up to its own."""
    from pagellm.kernels import cpu as cpu_kernels
    from pagellm.layers.norm import QKNorm, RMSNorm, ShardedRMSNorm
    from pagellm.layers.rotary import RotaryEmbedding, default_inverse_frequencies, rotate_qk

    assert cpu_kernels.available()
    torch.manual_seed(3)
    h, kvh, d, bs, num_blocks = 8, 2, 64, 16, 64
    fmt = resolve_kv_format(kv_cache_dtype, dtype) if kv_cache_dtype else None
    lens = [1, 17, 40, 5]  # each sequence's length after this step's tokens
    query_lens = [1] * len(lens) if step == "decode" else [1, 1, 3, 1]
    positions = torch.tensor([p for n, ql in zip(lens, query_lens) for p in range(n - ql, n)])
    perm = torch.randperm(num_blocks)
    tables = torch.stack([perm[4 * i:4 * i + 4] for i in range(len(lens))])
    seq_of = [i for i, ql in enumerate(query_lens) for _ in range(ql)]
    slots = torch.tensor([int(tables[i, int(p) // bs]) * bs + int(p) % bs for i, p in zip(seq_of, positions)])
    meta = AttentionMetadata(slot_mapping=slots, block_tables=tables, query_lens=query_lens, seq_lens=lens,
                             seq_lens_tensor=torch.tensor(lens), num_decodes=2 if step == "verify" else len(lens),
                             block_size=bs)
    options = AttentionOptions(d ** -0.5, 6 if variant == "window" else None, 0.7 if variant == "softcap" else None,
                               8 if variant == "chunk" else None)
    sinks = torch.randn(h) if variant == "sinks" else None
    rope = None
    if variant != "no-rope":
        rotary = RotaryEmbedding(default_inverse_frequencies(d, 10000.0), 128)
        rope = rotary.cos_sin(positions, dtype)
    qkv = (torch.randn(len(positions), (h + 2 * kvh) * d) * 2).to(dtype)
    qk_norm = None
    if variant.startswith("qk-norm"):
        per_head = variant == "qk-norm-head"
        norms = [RMSNorm(d, 1e-6) if per_head else ShardedRMSNorm(n * d, 1e-6, None) for n in (h, kvh)]
        for norm in norms:
            norm.weight.data = (torch.rand(norm.weight.shape) + 0.5).to(dtype)
        qk_norm = QKNorm(*norms, per_head=per_head)
        assert qk_norm.kernel_args(qkv) is not None
    results = []
    for fused in (True, False):
        backend = TorchAttentionBackend()
        backend.kv_format = fmt
        shape = backend.kv_cache_shape(num_blocks, bs, kvh, d)
        gen = torch.Generator().manual_seed(0)  # the same earlier context in both caches
        values = [torch.randn(num_blocks, bs, kvh, d, generator=gen) * 3 for _ in range(2)]
        caches = [x.to(dtype) if fmt is None else fmt.encode(x) for x in values]
        assert caches[0].shape == shape
        x = qkv.clone()
        if fused:
            out = backend.decode_from_qkv(x, h, kvh, rope, *caches, meta, options, sinks,
                                          qk_norm.kernel_args(x) if qk_norm else None)
            assert out is not None and out.dtype == dtype
        else:
            q, k, v = x.split([h * d, kvh * d, kvh * d], dim=-1)
            if qk_norm is not None and not qk_norm.per_head:
                q, k = qk_norm.q(q), qk_norm.k(k)
            q, k = q.view(-1, h, d), k.view(-1, kvh, d)
            if qk_norm is not None and qk_norm.per_head:
                q, k = qk_norm.q(q), qk_norm.k(k)
            if rope is not None:
                q, k = rotate_qk(q, k, *rope)
            out = backend.forward(q, k, v.reshape(-1, kvh, d), *caches, meta, options.scale, options,
                                  sinks).reshape(len(positions), h * d)
        results.append((out, x, caches))
    (out_f, x_f, caches_f), (out_s, x_s, caches_s) = results
    assert torch.equal(out_f, out_s)
    if qk_norm is None:
        assert torch.equal(x_f, x_s)  # q and k rotated in place in both (the split path's norms copy)
    assert all(torch.equal(a, b) for a, b in zip(caches_f, caches_s))
    # Steps the fused path does not take: the caller must fall back to the split one.
    backend = TorchAttentionBackend()
    backend.kv_format = fmt
    # a prompt's first chunk (no cached context) beside decodes: its tokens attend in the prefill path
    prompt_lens = [1, 17, 40, 3]
    prompt_slots = torch.cat([slots[:3], torch.tensor([int(tables[3, 0]) * bs + p for p in range(3)])])
    mixed = AttentionMetadata(slot_mapping=prompt_slots, block_tables=tables, query_lens=[1, 1, 1, 3],
                              seq_lens=prompt_lens, seq_lens_tensor=torch.tensor(prompt_lens), num_decodes=3,
                              block_size=bs)
    mixed_qkv = torch.randn(6, (h + 2 * kvh) * d).to(dtype)
    mixed_rope = None if rope is None else rotary.cos_sin(torch.tensor([0, 16, 39, 0, 1, 2]), dtype)
    assert backend.decode_from_qkv(mixed_qkv, h, kvh, mixed_rope, *caches_f, mixed, options, sinks) is None
    if rope is not None:  # partial rotary (the first half of each head)
        half = tuple(t[:, :d // 2].contiguous() for t in rope)
        assert backend.decode_from_qkv(qkv.clone(), h, kvh, half, *caches_f, meta, options, sinks) is None
    if qk_norm is not None:  # Gemma's 1 + w, and a norm all-reduced across ranks, have no kernel
        qk_norm.q.unit_offset = True
        assert qk_norm.kernel_args(qkv) is None
        qk_norm.q.unit_offset, qk_norm.k.tp = False, object()
        assert qk_norm.kernel_args(qkv) is None
    assert TorchAttentionBackend(batch_invariant=True).decode_from_qkv(
        qkv.clone(), h, kvh, rope, *caches_f, meta, options, sinks) is None


@pytest.mark.parametrize("field", ["sliding_window", "attention_chunk"])
def test_window_and_chunk_below_one_are_refused_by_name(field):
    with pytest.raises(ValueError, match=f"{field} must be at least 1, got 0"):
        AttentionOptions(0.5, **{field: 0})

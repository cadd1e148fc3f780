"""The Triton kernels against plain attention over contiguous K/V.

On a CPU they run under Triton's interpreter (tests/attention/conftest.py switches it on), so
shapes are small and cases few; on a GPU the same cases run compiled, in fp32 and bf16.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

import triton  # noqa: E402,F401  (a test dependency on Linux: missing, these tests must fail)

from pagellm.attention.backend import AttentionMetadata, AttentionOptions  # noqa: E402
from pagellm.kv_format import resolve_kv_format  # noqa: E402
from pagellm.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from pagellm.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from pagellm.attention.triton_kernels import (  # noqa: E402
    KernelConfig,
    choose_num_splits,
    paged_decode,
    paged_prefill,
    prefill_tiles,
    store_kv,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# fp32 everywhere; bf16 only where it is compiled (the interpreter's numpy has no bf16).
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
TOL = {torch.float32: dict(atol=1e-3, rtol=1e-3), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None = None,
          softcap: float | None = None, sinks: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor:
    """q: [ql, H, D], the last ql positions of a context with K/V k, v: [ctx, KVH, D]; fp64, causal.
    A query at position i sees keys j with i - window < j <= i and j // chunk == i // chunk; scores capped as
    softcap * tanh(s / softcap); sinks: [H] extra logits in each softmax's denominator."""
    ql, h, _ = q.shape
    ctx, kvh, _ = k.shape
    q, k, v = q.double(), k.double().repeat_interleave(h // kvh, 1), v.double().repeat_interleave(h // kvh, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    qpos = torch.arange(ctx - ql, ctx, device=q.device)[:, None]
    kpos = torch.arange(ctx, device=q.device)[None, :]
    hidden = kpos > qpos
    if window:
        hidden |= kpos <= qpos - window
    if chunk:
        hidden |= kpos // chunk != qpos // chunk
    scores = scores.masked_fill(hidden, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.double()[:, None, None].expand(h, ql, 1)], dim=-1)
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1)[..., :-1], v)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@dataclass
class Batch:
    """Sequences laid out in a shuffled paged pool, as the model runner would leave them."""

    shapes: list[tuple[int, int]]  # (tokens already cached, tokens computed this step)
    q: torch.Tensor
    k_new: torch.Tensor
    v_new: torch.Tensor
    full_k: list[torch.Tensor]
    full_v: list[torch.Tensor]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    slots: torch.Tensor
    tables: list[list[int]]

    @property
    def seq_lens(self) -> list[int]:
        return [c + n for c, n in self.shapes]

    def meta(self) -> AttentionMetadata:
        sl = self.seq_lens
        return AttentionMetadata(
            slot_mapping=self.slots, block_tables=self.block_tables, query_lens=[n for _, n in self.shapes],
            seq_lens=sl, seq_lens_tensor=torch.tensor(sl, device=DEVICE),
            num_decodes=sum(n == 1 for _, n in self.shapes), block_size=self.k_cache.shape[1])

    def expected(self, scale: float, **options) -> torch.Tensor:
        outs, start = [], 0
        for (_, n), k, v in zip(self.shapes, self.full_k, self.full_v):
            outs.append(naive(self.q[start:start + n], k, v, scale, **options))
            start += n
        return torch.cat(outs)


def make_batch(shapes, heads, head_dim, block_size, dtype, seed, num_blocks=64, store_new=False) -> Batch:
    """Random K/V for each sequence; the cached part written into the pool, the new part returned.

    With `store_new`, the new tokens are written into the pool too (what store_kv would do), for
    kernels that only read the pool.
    """
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    h, kvh = heads

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    k_cache = rand(num_blocks, block_size, kvh, head_dim)  # garbage everywhere nothing was written
    v_cache = rand(num_blocks, block_size, kvh, head_dim)
    free = list(range(num_blocks))
    rng.shuffle(free)
    full_k, full_v, tables, qs, ks, vs, slots = [], [], [], [], [], [], []
    for cached, new in shapes:
        ctx = cached + new
        k_all, v_all = rand(ctx, kvh, head_dim), rand(ctx, kvh, head_dim)
        table = [free.pop() for _ in range(-(-ctx // block_size))]
        upto = ctx if store_new else cached
        for p in range(upto):
            k_cache[table[p // block_size], p % block_size] = k_all[p]
            v_cache[table[p // block_size], p % block_size] = v_all[p]
        slots += [table[p // block_size] * block_size + p % block_size for p in range(cached, ctx)]
        full_k.append(k_all), full_v.append(v_all), tables.append(table)
        qs.append(rand(new, h, head_dim)), ks.append(k_all[cached:]), vs.append(v_all[cached:])
    width = max(map(len, tables)) + 1  # one spare column: padding the kernels must never read
    padded = [t + [0] * (width - len(t)) for t in tables]
    d = DEVICE
    return Batch(list(shapes), torch.cat(qs).to(d), torch.cat(ks).to(d), torch.cat(vs).to(d),
                 [x.to(d) for x in full_k], [x.to(d) for x in full_v], k_cache.to(d), v_cache.to(d),
                 torch.tensor(padded, device=d), torch.tensor(slots, device=d), tables)


# ---- store ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_writes_slots_and_skips_negative(dtype):
    kvh, d, bs, nb = 2, 16, 4, 8
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(5, kvh, d, generator=gen).to(dtype).to(DEVICE)
    # A strided V, as the model hands it over (a slice of the fused qkv projection).
    v = torch.randn(5, kvh, 2 * d, generator=gen).to(dtype).to(DEVICE)[..., :d]
    k_cache = torch.zeros(nb, bs, kvh, d, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([9, 0, -1, 31, 14], device=DEVICE)
    store_kv(k, v, k_cache, v_cache, slots)
    want_k, want_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            want_k[s // bs, s % bs], want_v[s // bs, s % bs] = k[t], v[t]
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


# ---- decode -------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("heads,head_dim", [((4, 4), 16), ((8, 4), 32), ((8, 2), 16)])
def test_decode_matches_naive(heads, head_dim, block_size, num_splits):
    # Ragged contexts: one token, one short of a block, a block, and a few blocks and a bit.
    shapes = [(0, 1), (block_size - 2, 1), (block_size - 1, 1), (45, 1), (17, 1)]
    for dtype in DTYPES:
        b = make_batch(shapes, heads, head_dim, block_size, dtype, seed=block_size + num_splits, store_new=True)
        scale = head_dim ** -0.5
        out = paged_decode(b.q, b.k_cache, b.v_cache, b.block_tables, torch.tensor(b.seq_lens, device=DEVICE),
                           scale, num_splits=num_splits)
        torch.testing.assert_close(out.double(), b.expected(scale), **TOL[dtype])


def test_decode_split_choice_and_empty_rows():
    """More splits than tiles, a strided output view, and seq_len 0 rows (padded graph rows) giving zeros."""
    b = make_batch([(30, 1), (3, 1)], (4, 2), 16, 4, torch.float32, seed=7, store_new=True)
    seq_lens = torch.tensor(b.seq_lens + [0], device=DEVICE)
    q = torch.cat([b.q, torch.randn(1, 4, 16, device=DEVICE)])
    tables = torch.cat([b.block_tables, torch.zeros_like(b.block_tables[:1])])
    scale = 0.25
    for splits in (1, 5):
        out = torch.full((3, 4, 32), 7.0, device=DEVICE)[..., :16]
        paged_decode(q, b.k_cache, b.v_cache, tables, seq_lens, scale, out=out, num_splits=splits)
        torch.testing.assert_close(out[:2].double(), b.expected(scale), atol=1e-3, rtol=1e-3)
        assert torch.equal(out[2], torch.zeros(4, 16, device=DEVICE))


def test_choose_num_splits():
    # Many sequences already fill the GPU: no split.
    assert choose_num_splits(256, 8, 4096, 132) == 1
    # One long sequence spreads over many programs, but not past the cap.
    assert choose_num_splits(1, 8, 131072, 132) == 32
    # A short context never makes splits shorter than their fixed cost.
    assert choose_num_splits(1, 8, 300, 132) == 1
    # 512 programs are enough for 132 multiprocessors; 128 are not.
    assert choose_num_splits(64, 8, 4096, 132) == 1
    assert choose_num_splits(16, 8, 4096, 132) == 3


# ---- prefill / extend ---------------------------------------------------------------------------
@pytest.mark.parametrize("block_size,heads,head_dim", [(4, (4, 4), 16), (16, (8, 2), 32)])
def test_prefill_matches_naive(block_size, heads, head_dim):
    # A fresh prompt, a one-token prompt, a chunk on earlier chunks, a prompt with a cached
    # prefix (whole blocks) and a long chunk crossing several query tiles.
    shapes = [(0, 13), (0, 1), (9, 7), (2 * block_size, 5), (3, 40)]
    cfg = KernelConfig(block_n=16, block_m=16) if DEVICE.type == "cpu" else None
    for dtype in DTYPES:
        b = make_batch(shapes, heads, head_dim, block_size, dtype, seed=block_size, store_new=True)
        scale = head_dim ** -0.5
        tiles = prefill_tiles(list(range(len(shapes))), [n for _, n in shapes], b.seq_lens,
                              cfg.block_m if cfg else 64, DEVICE)
        out = paged_prefill(b.q, b.k_cache, b.v_cache, b.block_tables, tiles, scale, config=cfg)
        torch.testing.assert_close(out.double(), b.expected(scale), **TOL[dtype])


# ---- the backend ----------------------------------------------------------------------------------
@pytest.mark.parametrize("block_size,heads", [(4, (8, 2)), (16, (4, 4))])
def test_backend_matches_torch_backend_on_mixed_batch(block_size, heads):
    # Decodes first, then a fresh prompt, a chunk over a cached part, and a cached prefix.
    shapes = [(12, 1), (0, 1), (33, 1), (0, 11), (9, 7), (block_size, 3)]
    head_dim = 16
    scale = head_dim ** -0.5
    caches = {}
    outs = {}
    for name, backend in (("torch", TorchAttentionBackend()), ("triton", TritonAttentionBackend(num_splits=2))):
        b = make_batch(shapes, heads, head_dim, block_size, torch.float32, seed=3)
        outs[name] = backend.forward(b.q, b.k_new, b.v_new, b.k_cache, b.v_cache, b.meta(), scale)
        caches[name] = (b.k_cache, b.v_cache)
    torch.testing.assert_close(outs["triton"], outs["torch"], atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(outs["triton"].double(), b.expected(scale), atol=1e-3, rtol=1e-3)
    assert torch.equal(caches["triton"][0], caches["torch"][0])
    assert torch.equal(caches["triton"][1], caches["torch"][1])


def test_select_backend():
    from pagellm.attention import select_backend

    assert type(select_backend(torch.device("cpu"))).__name__ == "TorchAttentionBackend"
    assert type(select_backend(torch.device("cpu"), "torch")).__name__ == "TorchAttentionBackend"
    # Under the interpreter (CPU) or on a GPU, "triton" is allowed.
    assert isinstance(select_backend(DEVICE, "triton"), TritonAttentionBackend)
    if DEVICE.type == "cuda":
        assert isinstance(select_backend(DEVICE), TritonAttentionBackend)
    with pytest.raises(ValueError, match="attention backend"):
        select_backend(torch.device("cpu"), "flash")


@pytest.mark.parametrize("heads,head_dim", [((4, 2), 80), ((2, 1), 96), ((32, 1), 16), ((24, 2), 16)])
def test_odd_head_dims_and_wide_gqa_groups(heads, head_dim):
    """Head dims that are not powers of two (80: Phi-2, 96: Phi-3) and GQA groups wider than 16
    query heads a KV head, for decode (with splits) and prefill."""
    block_size = 16
    b = make_batch([(0, 1), (13, 1), (40, 1)], heads, head_dim, block_size, torch.float32, seed=head_dim,
                   store_new=True)
    scale = head_dim ** -0.5
    out = paged_decode(b.q, b.k_cache, b.v_cache, b.block_tables, torch.tensor(b.seq_lens, device=DEVICE),
                       scale, num_splits=2)
    torch.testing.assert_close(out.double(), b.expected(scale), **TOL[torch.float32])
    cfg = KernelConfig(block_n=16, block_m=16) if DEVICE.type == "cpu" else None
    shapes = [(0, 9), (5, 7)]
    b = make_batch(shapes, heads, head_dim, block_size, torch.float32, seed=head_dim + 1, store_new=True)
    tiles = prefill_tiles([0, 1], [n for _, n in shapes], b.seq_lens, cfg.block_m if cfg else 64, DEVICE)
    out = paged_prefill(b.q, b.k_cache, b.v_cache, b.block_tables, tiles, scale, config=cfg)
    torch.testing.assert_close(out.double(), b.expected(scale), **TOL[torch.float32])


# ---- per-layer options: sliding window, soft-cap, sinks -------------------------------------------
def layer_options(variant: str, heads: int, window: int) -> dict:
    """Keyword options of `naive` and the kernels for one variant; sinks seeded, O(1) like the scores."""
    w = window if variant in ("window", "all", "window+chunk") else None
    # Chunks start inside 4-slot blocks and key tiles; beside a window, each of the two is the
    # tighter limit for some query.
    chunk = {"chunk": 6, "window+chunk": 5}.get(variant)
    cap = 0.7 if variant in ("softcap", "all") else None  # below the scores' spread: the cap bites
    sinks = (torch.randn(heads, generator=torch.Generator().manual_seed(heads)).to(DEVICE)
             if variant in ("sinks", "all") else None)
    return {"window": w, "softcap": cap, "sinks": sinks, "chunk": chunk}


def kernel_kwargs(opts: dict) -> dict:
    return {"sliding_window": opts["window"], "softcap": opts["softcap"], "sinks": opts["sinks"],
            "attention_chunk": opts["chunk"]}


def assert_options_matter(got: torch.Tensor, scale: float, b: Batch, opts: dict) -> None:
    """The case could fail: each option changes the answer (a window shorter than the context)."""
    for name in ("window", "softcap", "sinks", "chunk"):
        if opts[name] is not None:
            without = b.expected(scale, **{**opts, name: None})
            assert (got.double() - without).abs().max() > 1e-2, f"{name} changes nothing in this case"


# One split: sinks join in the decode kernel; three: in the combine, and the window's tiles are split.
@pytest.mark.parametrize("variant,window,num_splits", [("window", 6, 3), ("softcap", None, 1), ("sinks", None, 1),
                                                       ("sinks", None, 3), ("all", 20, 1), ("all", 20, 3),
                                                       ("chunk", None, 1), ("chunk", None, 3), ("window+chunk", 3, 3)])
def test_decode_with_options_matches_naive(variant, window, num_splits):
    """Contexts shorter and longer than the window (6: the tiles before it skipped; 20: its start
    inside a tile, the split across tiles), and a padded graph row (seq_len 0), which gives zeros."""
    heads, head_dim, block_size = (8, 2), 16, 4
    shapes = [(0, 1), (3, 1), (21, 1), (45, 1)]
    opts = layer_options(variant, heads[0], window)
    scale = head_dim ** -0.5
    for dtype in DTYPES:
        b = make_batch(shapes, heads, head_dim, block_size, dtype, seed=11, store_new=True)
        q = torch.cat([b.q, torch.randn(1, heads[0], head_dim, device=DEVICE).to(dtype)])
        tables = torch.cat([b.block_tables, torch.zeros_like(b.block_tables[:1])])
        seq_lens = torch.tensor(b.seq_lens + [0], device=DEVICE)
        out = paged_decode(q, b.k_cache, b.v_cache, tables, seq_lens, scale, num_splits=num_splits,
                           **kernel_kwargs(opts))
        torch.testing.assert_close(out[:-1].double(), b.expected(scale, **opts), **TOL[dtype])
        assert torch.equal(out[-1], torch.zeros_like(out[-1]))
        assert_options_matter(out[:-1], scale, b, opts)


@pytest.mark.parametrize("variant,window", [("window", 5), ("softcap", None), ("sinks", None), ("all", 20),
                                            ("chunk", None), ("window+chunk", 4)])
def test_prefill_with_options_matches_naive(variant, window):
    """A fresh prompt, a chunk on earlier chunks, a cached prefix, and a 40-token chunk over three
    query tiles. Window 5 is shorter than a key tile (16 here), so a tile's later rows see nothing
    in its first key tiles; 20 spans tiles."""
    heads, head_dim, block_size = (8, 2), 16, 4
    shapes = [(0, 13), (9, 7), (2 * block_size, 5), (3, 40)]
    cfg = KernelConfig(block_n=16, block_m=16) if DEVICE.type == "cpu" else None
    opts = layer_options(variant, heads[0], window)
    scale = head_dim ** -0.5
    for dtype in DTYPES:
        b = make_batch(shapes, heads, head_dim, block_size, dtype, seed=12, store_new=True)
        tiles = prefill_tiles(list(range(len(shapes))), [n for _, n in shapes], b.seq_lens,
                              cfg.block_m if cfg else 64, DEVICE)
        out = paged_prefill(b.q, b.k_cache, b.v_cache, b.block_tables, tiles, scale, config=cfg,
                            **kernel_kwargs(opts))
        torch.testing.assert_close(out.double(), b.expected(scale, **opts), **TOL[dtype])
        assert_options_matter(out, scale, b, opts)


def run_both_backends(variant: str, window: int | None, head_dim: int = 16, kv_format=None):
    """The torch backend (the reference) and the Triton backend (decodes split in two) on one mixed
    batch: decodes, a fresh prompt, a chunk over a cached part and a cached prefix, with a layer's
    options. With an 8-bit `kv_format` the caches hold codes and scales, and the new rows are of
    unequal sizes (per-row scales differ) with values far below their row's largest (fp8
    subnormals). Returns (outputs, caches) by backend name, the batch, the options and the scale."""
    shapes = [(12, 1), (0, 1), (33, 1), (0, 11), (9, 7), (4, 3)]
    heads, block_size = (8, 2), 4
    scale = head_dim ** -0.5
    opts = layer_options(variant, heads[0], window)
    options = AttentionOptions(scale, opts["window"], opts["softcap"], opts["chunk"])
    outs, caches = {}, {}
    for name, backend in (("torch", TorchAttentionBackend(compiled_decode=False)),
                          ("triton", TritonAttentionBackend(num_splits=2))):
        b = make_batch(shapes, heads, head_dim, block_size, torch.float32, seed=5)
        if kv_format is not None:
            backend.kv_format = kv_format
            sizes = torch.rand(b.k_new.shape[0], heads[1], 1, generator=torch.Generator().manual_seed(1)) * 8
            b.k_new, b.v_new = b.k_new * sizes.to(DEVICE), b.v_new * 1e-3
            b.k_new[..., ::4] *= 1e-5  # fp8 e4m3 subnormals
            b.v_new[..., 1::4] *= 1e-9  # e5m2 subnormals
            b.k_cache, b.v_cache = kv_format.encode(b.k_cache), kv_format.encode(b.v_cache)
        outs[name] = backend.forward(b.q, b.k_new, b.v_new, b.k_cache, b.v_cache, b.meta(), scale, options,
                                     opts["sinks"])
        caches[name] = (b.k_cache, b.v_cache)
    return outs, caches, b, opts, scale


@pytest.mark.parametrize("variant,window", [("window", 5), ("softcap", None), ("sinks", None), ("all", 9),
                                            ("chunk", None)])
def test_backend_with_options_matches_torch_backend_on_mixed_batch(variant, window):
    """The Triton backend serves window, soft-cap and sink layers itself, as the torch reference does."""
    outs, caches, b, opts, scale = run_both_backends(variant, window)
    torch.testing.assert_close(outs["triton"], outs["torch"], atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(outs["triton"].double(), b.expected(scale, **opts), atol=1e-3, rtol=1e-3)
    assert_options_matter(outs["triton"], scale, b, opts)
    assert torch.equal(caches["triton"][0], caches["torch"][0])
    assert torch.equal(caches["triton"][1], caches["torch"][1])


def test_option_arguments_are_checked():
    b = make_batch([(3, 1)], (4, 2), 16, 4, torch.float32, seed=1, store_new=True)
    seq_lens = torch.tensor(b.seq_lens, device=DEVICE)
    with pytest.raises(ValueError, match="sliding_window"):
        paged_decode(b.q, b.k_cache, b.v_cache, b.block_tables, seq_lens, 0.25, sliding_window=0)
    with pytest.raises(ValueError, match="attention_chunk"):
        paged_decode(b.q, b.k_cache, b.v_cache, b.block_tables, seq_lens, 0.25, attention_chunk=0)
    with pytest.raises(ValueError, match="sinks"):
        paged_decode(b.q, b.k_cache, b.v_cache, b.block_tables, seq_lens, 0.25, sinks=torch.zeros(2, device=DEVICE))


# ---- 8-bit KV caches --------------------------------------------------------------------------------
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("variant,window,head_dim", [("plain", None, 16), ("all", 9, 16), ("plain", None, 24)])
def test_backend_with_8bit_kv_matches_torch_backend(kv_cache_dtype, variant, window, head_dim):
    """uint8 caches of codes and scales: store_kv writes the bytes KVFormat.encode gives in torch
    (rows of mixed sizes, some values subnormal in fp8), and decode (split in two) and prefill
    read them back as the torch backend does: the same outputs, which equal exact attention over
    the values the format holds."""
    outs, caches, _, _, _ = run_both_backends(variant, window, head_dim,
                                              resolve_kv_format(kv_cache_dtype, torch.float32))
    assert torch.equal(caches["triton"][0], caches["torch"][0])
    assert torch.equal(caches["triton"][1], caches["torch"][1])
    torch.testing.assert_close(outs["triton"], outs["torch"], atol=1e-3, rtol=1e-3)

"""The compiled CPU kernels against the torch code they replace."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagellm.kv_format import plain_rows, resolve_kv_format
from pagellm.kernels import cpu
from pagellm.layers.rotary import RotaryEmbedding, apply_rope, default_inverse_frequencies, rotate_qk


def test_kernels_build_here():
    # The set-up installs gcc and ninja; without them every test below fails here first.
    assert cpu.available()


@pytest.mark.parametrize("head_dim", [64, 128])
def test_rope_in_place_is_bit_identical_to_the_reference(head_dim):
    torch.manual_seed(0)
    h, kvh, t = 6, 2, 37
    rope = RotaryEmbedding(default_inverse_frequencies(head_dim, 10000.0), 4096)
    positions = torch.randint(0, 4096, (t,))
    cos, sin = rope.cos_sin(positions, torch.float32)
    # q and k as the model has them: strided views into one fused qkv product.
    qkv = torch.randn(t, (h + 2 * kvh) * head_dim)
    q = qkv[:, :h * head_dim].view(t, h, head_dim)
    k = qkv[:, h * head_dim:(h + kvh) * head_dim].view(t, kvh, head_dim)
    expected_q, expected_k = apply_rope(q.clone(), cos, sin), apply_rope(k.clone(), cos, sin)
    v_before = qkv[:, (h + kvh) * head_dim:].clone()
    out_q, out_k = rotate_qk(q, k, cos, sin)
    assert out_q.data_ptr() == q.data_ptr()  # in place
    assert torch.equal(out_q, expected_q) and torch.equal(out_k, expected_k)
    assert torch.equal(qkv[:, (h + kvh) * head_dim:], v_before)  # v untouched


def test_silu_and_mul_matches_torch():
    torch.manual_seed(0)
    # 1540 features: the 16-wide vector loop and a scalar tail of 4.
    x = torch.randn(19, 2 * 1540) * 4
    # Gates where exp(-g) overflows, underflows or is not finite (silu(-inf) is NaN in torch too).
    x[0, :8] = torch.tensor([-100.0, -89.0, 89.0, 100.0, float("inf"), -float("inf"), float("nan"), 0.0])
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(cpu.silu_and_mul(x), F.silu(gate) * up, rtol=1e-6, atol=1e-6, equal_nan=True)


def test_bfloat16_element_wise_kernels_round_once_from_float32():
    torch.manual_seed(2)
    bf = torch.bfloat16
    # RoPE: the float32 formula over the widened inputs, rounded once.
    t, h, kvh, d = 11, 6, 2, 64
    rope = RotaryEmbedding(default_inverse_frequencies(d, 10000.0), 4096)
    cos, sin = rope.cos_sin(torch.randint(0, 4096, (t,)), bf)
    q, k = torch.randn(t, h, d).to(bf), torch.randn(t, kvh, d).to(bf)
    expected_q = apply_rope(q.float(), cos.float(), sin.float()).to(bf)
    expected_k = apply_rope(k.float(), cos.float(), sin.float()).to(bf)
    cpu.rotary_embedding_(q, k, cos, sin)
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)
    # SiLU-and-mul likewise (exp may differ from torch's in the last float bit: one bf16 unit at most).
    x = (torch.randn(7, 2 * 96) * 4).to(bf)
    gate, up = x.float().chunk(2, dim=-1)
    torch.testing.assert_close(cpu.silu_and_mul(x), (F.silu(gate) * up).to(bf), rtol=2 ** -7, atol=1e-6)
    # RMSNorm against the model's own torch path for bfloat16 (float32 statistics, two roundings).
    from pagellm.layers.norm import RMSNorm

    norm = RMSNorm(96, 1e-5).to(bf)
    norm.weight.data = (torch.rand(96) + 0.5).to(bf)
    rows = (torch.randn(13, 96) * 3).to(bf)
    xf = rows.float()
    reference = norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(bf)
    got = cpu.rms_norm(rows, norm.weight.data, 1e-5)
    assert got.dtype == bf
    torch.testing.assert_close(got.float(), reference.float(), rtol=2 ** -7, atol=0)
    torch.testing.assert_close(norm(rows).float(), reference.float(), rtol=2 ** -7, atol=0)  # the model uses it
    # float32, and rows of any leading shape (per-head q/k norms): the reference's steps up to the
    # order of the sum of squares.
    norm32 = RMSNorm(96, 1e-6)
    norm32.weight.data = torch.rand(96) + 0.5
    heads = torch.randn(5, 3, 96) * 3
    reference = norm32.weight * (heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(norm32(heads), reference, rtol=1e-6, atol=0)


def test_paged_attention_head_dim_128_through_scattered_blocks():
    torch.manual_seed(0)
    b, h, kvh, d, bs, nb = 5, 8, 2, 128, 16, 64
    k_cache, v_cache = torch.randn(nb, bs, kvh, d), torch.randn(nb, bs, kvh, d)
    lens = torch.tensor([1, 16, 17, 100, 200])
    tables = torch.stack([torch.randperm(nb)[:13] for _ in range(b)])
    q = torch.randn(b, h, d)
    out = cpu.paged_attention(q, k_cache, v_cache, tables, lens, d ** -0.5)
    for i in range(b):
        n = int(lens[i])
        k = k_cache[tables[i]].flatten(0, 1)[:n].repeat_interleave(h // kvh, dim=1)
        v = v_cache[tables[i]].flatten(0, 1)[:n].repeat_interleave(h // kvh, dim=1)
        p = (torch.einsum("hd,khd->hk", q[i], k) * d ** -0.5).softmax(-1)
        torch.testing.assert_close(out[i], torch.einsum("hk,khd->hd", p, v), rtol=1e-5, atol=1e-5)


def test_paged_attention_against_float64_on_long_contexts_and_nan():
    # Wide scores (keys scaled by 3) reach deep into exp's range; contexts of thousands split
    # into several runs merged by log-sum-exp. A NaN in a query reaches that head's output.
    torch.manual_seed(3)
    b, h, kvh, d, bs, nb = 3, 9, 3, 64, 16, 200
    k_cache, v_cache = torch.randn(nb, bs, kvh, d) * 3, torch.randn(nb, bs, kvh, d)
    lens = torch.tensor([5, 700, 3000])
    tables = torch.stack([torch.randperm(nb)[:190] for _ in range(b)])
    q = torch.randn(b, h, d)
    out = cpu.paged_attention(q, k_cache, v_cache, tables, lens, 0.125)
    for i in range(b):
        n = int(lens[i])
        k = k_cache[tables[i]].flatten(0, 1)[:n].double().repeat_interleave(h // kvh, dim=1)
        v = v_cache[tables[i]].flatten(0, 1)[:n].double().repeat_interleave(h // kvh, dim=1)
        p = (torch.einsum("hd,khd->hk", q[i].double(), k) * 0.125).softmax(-1)
        torch.testing.assert_close(out[i].double(), torch.einsum("hk,khd->hd", p, v), rtol=0, atol=5e-6)
    q[1, 0, 0] = float("nan")
    out = cpu.paged_attention(q, k_cache, v_cache, tables, lens, 0.125)
    assert torch.isnan(out[1, 0]).all() and not torch.isnan(out[1, 1:]).any() and not torch.isnan(out[0]).any()


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
@pytest.mark.parametrize("block_size", [1, 16, 32, 64])
def test_paged_attention_against_float64_at_every_block_size_and_head_dim(block_size, head_dim, cache_dtype):
    """An independent oracle (float64 softmax attention over the cache's own values) for the
    block sizes and head dims the vectorized paths special-case, float32, bfloat16 and float16 caches,
    GQA groups of 1 and 4, contexts that end inside, at and past block boundaries."""
    torch.manual_seed(block_size * 1000 + head_dim)
    lens = torch.tensor([1, block_size, block_size + 1, 300, 777])
    nb = int(lens.max()) // block_size + 2
    b = len(lens)
    for h, kvh in ((4, 4), (8, 2)):
        k_cache = (torch.randn(nb * 2, block_size, kvh, head_dim) * 2).to(cache_dtype)
        v_cache = torch.randn(nb * 2, block_size, kvh, head_dim).to(cache_dtype)
        tables = torch.stack([torch.randperm(nb * 2)[:nb] for _ in range(b)])
        q = torch.randn(b, h, head_dim)
        out = cpu.paged_attention(q, k_cache, v_cache, tables, lens, head_dim ** -0.5)
        for i in range(b):
            n = int(lens[i])
            k = k_cache[tables[i]].flatten(0, 1)[:n].double().repeat_interleave(h // kvh, dim=1)
            v = v_cache[tables[i]].flatten(0, 1)[:n].double().repeat_interleave(h // kvh, dim=1)
            p = (torch.einsum("hd,khd->hk", q[i].double(), k) * head_dim ** -0.5).softmax(-1)
            torch.testing.assert_close(out[i].double(), torch.einsum("hk,khd->hd", p, v), rtol=0, atol=5e-6)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_reads_a_16_bit_cache_as_float32(q_dtype, cache_dtype):
    # The same float32 arithmetic over the widened values: a 16-bit cache only halves the bytes.
    torch.manual_seed(1)
    b, h, kvh, d, bs, nb = 4, 9, 3, 64, 16, 80
    k_cache = torch.randn(nb, bs, kvh, d).to(cache_dtype)
    v_cache = torch.randn(nb, bs, kvh, d).to(cache_dtype)
    lens = torch.tensor([3, 33, 512, 1000])
    tables = torch.stack([torch.randperm(nb)[:63] for _ in range(b)])
    q = torch.randn(b, h, d).to(q_dtype)
    out = cpu.paged_attention(q, k_cache, v_cache, tables, lens, 0.125)
    assert out.dtype == q_dtype
    expected = cpu.paged_attention(q.float(), k_cache.float(), v_cache.float(), tables, lens, 0.125)
    # Float32 results agree to rounding (the two builds vectorize differently); a bfloat16 output
    # may then round one unit (up to 2^-7 relative) the other way.
    tol = 1e-6 if q_dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(out.float(), expected.to(q_dtype).float(), rtol=tol, atol=1e-6)


def test_bad_inputs_are_refused_with_a_message():
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        cpu.silu_and_mul(torch.randn(2, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match=r"\[T, 2I\]"):
        cpu.silu_and_mul(torch.randn(2, 7))
    q, k = torch.randn(5, 4, 8), torch.randn(5, 2, 8)
    with pytest.raises(RuntimeError, match=r"cos/sin must be \[T, D\]"):
        cpu.rotary_embedding_(q, k, torch.randn(3, 8), torch.randn(3, 8))  # fewer rows than tokens
    with pytest.raises(RuntimeError, match="cos must be a CPU tensor of BFloat16"):
        cpu.rotary_embedding_(q.bfloat16(), k.bfloat16(), torch.randn(5, 8), torch.randn(5, 8))
    kc = torch.randn(4, 4, 2, 8)
    with pytest.raises(RuntimeError, match="k_cache and v_cache must be CPU tensors of one dtype"):
        cpu.paged_attention(torch.randn(1, 4, 8), kc, kc.bfloat16(), torch.zeros(1, 1, dtype=torch.long),
                         torch.ones(1, dtype=torch.long), 1.0)
    int8 = resolve_kv_format("int8", torch.float32)
    with pytest.raises(RuntimeError, match="kv_format 1 does not match a cache of Float"):
        cpu.paged_attention(torch.randn(1, 4, 8), kc, kc, torch.zeros(1, 1, dtype=torch.long),
                            torch.ones(1, dtype=torch.long), 1.0, kv_format=int8)
    codes = int8.encode(kc)
    with pytest.raises(RuntimeError, match="disagree on head shapes"):  # rows of 8 + 2 bytes, q of 16
        cpu.paged_attention(torch.randn(1, 4, 16), codes, codes, torch.zeros(1, 1, dtype=torch.long),
                            torch.ones(1, dtype=torch.long), 1.0, kv_format=int8)
    with pytest.raises(RuntimeError, match="slot 64 is outside the cache's 16"):
        cpu.store_kv(torch.randn(1, 2, 8), torch.randn(1, 2, 8), codes, codes.clone(), torch.tensor([64]), int8)


@pytest.mark.parametrize("cache_dtype, k_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                    (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32),
                                                    (torch.float16, torch.bfloat16)])
def test_store_kv_into_a_float_cache_is_index_copy(cache_dtype, k_dtype):
    """The compiled store puts the same bits where two index_copy_ of kv_format.plain_rows(x, cache dtype)
    would: x.to(cache dtype), except that a float16 cache saturates what lies past its range instead of
    storing inf."""
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(5, 3, 16, generator=g).to(k_dtype) for _ in range(2))
    k[1, 2, :4] = torch.tensor([1e6, -1e6, 65519.0, -7e4]).to(k_dtype)  # past float16's 65504 (all but bfloat16's)
    slots = torch.tensor([7, 0, 63, 21, 40])
    kc, vc = torch.zeros(4, 16, 3, 16, dtype=cache_dtype), torch.zeros(4, 16, 3, 16, dtype=cache_dtype)
    want_k, want_v = kc.clone(), vc.clone()
    want_k.view(-1, 3, 16).index_copy_(0, slots, plain_rows(k, cache_dtype))
    want_v.view(-1, 3, 16).index_copy_(0, slots, plain_rows(v, cache_dtype))
    cpu.store_kv(k, v, kc, vc, slots)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    assert torch.isfinite(kc).all()
    if cache_dtype == torch.float16:
        assert kc.view(-1, 3, 16)[0, 2, :4].tolist() == [65504.0, -65504.0, 65504.0, -65504.0]
    with pytest.raises(RuntimeError, match="slot -1 is outside the cache's 64"):
        cpu.store_kv(k[:1], v[:1], kc, vc, torch.tensor([-1]))
    with pytest.raises(RuntimeError, match="the caches must be contiguous float32, bfloat16 or float16"):
        cpu.store_kv(k, v, kc[:, :, :2], vc, slots)


def test_row_logsumexp_matches_torch_and_ignores_the_batch():
    """Each row against float64, and a row's bits the same alone or among others (the sampler's
    logprobs must not depend on what else is in the step); non-finite rows as torch gives them.
    The maximum's index is torch.max's: the first of equal maxima, the first NaN."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 49152 + 37, generator=g) * 8  # a vocabulary that is no multiple of the vector width
    x[1, 40000] = x[1, 9] = x[1].max() + 1  # a tie: the first wins
    x[2, -1] = x[2].max() + 1  # the maximum in the scalar tail
    got, index = cpu.row_logsumexp(x)
    torch.testing.assert_close(got.double(), torch.logsumexp(x.double(), -1), rtol=1e-6, atol=1e-6)
    assert torch.equal(index, x.max(-1).indices) and index[1] == 9 and index[2] == x.shape[1] - 1
    for i in range(5):
        alone, at = cpu.row_logsumexp(x[i:i + 1])
        assert torch.equal(alone, got[i:i + 1]) and at.item() == index[i]
    odd = torch.tensor([[0.0, float("nan"), 1.0], [float("-inf")] * 3, [float("inf"), 0.0, 1.0], [1.0, 2.0, 3.0]])
    lse, index = cpu.row_logsumexp(odd)
    torch.testing.assert_close(lse, torch.logsumexp(odd, -1), equal_nan=True)
    assert index.tolist() == [1, 0, 0, 2] == odd.max(-1).indices.tolist()
    long_odd = torch.randn(4, 100, generator=g)  # the same, past the vectorized part's first 16 lanes
    long_odd[0, 37], long_odd[1], long_odd[2, 50] = float("nan"), float("-inf"), float("inf")
    lse, index = cpu.row_logsumexp(long_odd)
    torch.testing.assert_close(lse, torch.logsumexp(long_odd, -1), equal_nan=True)
    assert torch.equal(index, long_odd.max(-1).indices)


def test_build_is_keyed_by_its_source(tmp_path, monkeypatch):
    """Two checkouts with different kernel sources keep separate builds (a shared name made them
    rebuild each other's on every start)."""
    ours = cpu.build_name()
    other = tmp_path / "cpu_ops.cpp"
    other.write_text(cpu._SOURCE.read_text() + "\n// another version\n")
    monkeypatch.setattr(cpu, "_SOURCE", other)
    assert cpu.build_name() != ours and cpu.build_name().startswith("pagellm_cpu_ops_")
    assert cpu.build_name(cpu._QUANT_SOURCE).startswith("pagellm_quant_ops_")


def test_build_lock_clears_a_dead_builders_lock_and_excludes_live_ones(tmp_path):
    """A torch lock file left by a killed build would make every later start wait forever;
    under our flock it is known stale and removed, and while one process holds the flock
    another cannot (it waits for the build instead)."""
    import fcntl

    build_dir = tmp_path / "ext"
    build_dir.mkdir()
    (build_dir / "lock").touch()  # what a builder killed mid-build leaves
    with cpu.build_lock(str(build_dir)):
        assert not (build_dir / "lock").exists()
        with open(build_dir / "pagellm.flock", "a") as other:
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(build_dir / "pagellm.flock", "a") as other:  # released on exit
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_is_the_add_then_the_norm(dtype):
    """One kernel for the residual add and the next norm: the same bits as torch's add, then
    the RMSNorm layer's own path, in float32 and bfloat16."""
    from pagellm.layers.norm import RMSNorm

    torch.manual_seed(4)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = (torch.rand(576) + 0.5).to(dtype)
    x, h = (torch.randn(3, 576) * 3).to(dtype), torch.randn(3, 576).to(dtype)
    s, normed = norm.add_and_norm(x, h)
    assert torch.equal(s, x + h)
    assert torch.equal(normed, norm(x + h))
    ks, knormed = cpu.add_rms_norm(x, h, norm.weight, 1e-5)  # the kernel itself, whichever path the layer took
    assert torch.equal(ks, x + h) and torch.equal(knormed, normed)
    # The fallback (a Gemma unit-offset norm) gives the same pair.
    gemma = RMSNorm(576, 1e-5, unit_offset=True)
    s2, normed2 = gemma.add_and_norm(x, h)
    assert torch.equal(s2, x + h) and torch.equal(normed2, gemma(x + h))


@pytest.mark.parametrize("cache", ["float32", "bfloat16", "float16", "int8"])
@pytest.mark.parametrize("window,sinks", [(0, False), (0, True), (50, False)])
def test_paged_attention_groups_a_sequences_query_tokens_as_each_token_alone(window, sinks, cache):
    """A verification step's 1 + k query tokens of one sequence (consecutive, one block-table row)
    are attended together, block by block: each token must still read exactly its own keys (its
    causal end, a window, the sinks), in long contexts split into runs and in short ones, and give
    what it gives attended alone and what a float64 oracle gives. A context short enough to be one
    run gives the very bits of the token alone (AVX2 widens a group's 16-bit and 8-bit rows once
    for all its tokens, a token alone reads them in place), so greedy speculation keeps plain
    decoding's tokens."""
    torch.manual_seed(7 + window + sinks)
    h, kvh, d, bs, nb = 6, 2, 64, 16, 600
    fmt = resolve_kv_format(cache, torch.float32)
    k_cache, v_cache = fmt.encode(torch.randn(nb, bs, kvh, d) * 2), fmt.encode(torch.randn(nb, bs, kvh, d))
    kf, vf = fmt.decode(k_cache), fmt.decode(v_cache)  # the values the cache holds
    tables = torch.stack([torch.randperm(nb)[:200] for _ in range(3)])
    # Row 0: five tokens ending at 3000 (split into runs); row 1: one decode token; row 2: three
    # tokens of a short context, one of them a repeat length (two tokens may end alike).
    token_seq = torch.tensor([0, 0, 0, 0, 0, 1, 2, 2, 2])
    lens = torch.tensor([2996, 2997, 2998, 2999, 3000, 40, 9, 10, 10])
    q = torch.randn(len(lens), h, d)
    sink = torch.randn(h) if sinks else None
    out = cpu.paged_attention(q, k_cache, v_cache, tables, lens, 0.125, sliding_window=window or None,
                              sinks=sink, token_seq=token_seq, kv_format=fmt)
    for i in range(len(lens)):
        alone = cpu.paged_attention(q[i:i + 1], k_cache, v_cache, tables, lens[i:i + 1], 0.125,
                                    sliding_window=window or None, sinks=sink, token_seq=token_seq[i:i + 1],
                                    kv_format=fmt)
        torch.testing.assert_close(out[i], alone[0], rtol=0, atol=2e-6)
        if lens[i] < 64:  # one run either way
            assert torch.equal(out[i], alone[0]), i
        n, row = int(lens[i]), tables[int(token_seq[i])]
        first = max(0, n - window) if window else 0
        k = kf[row].flatten(0, 1)[first:n].double().repeat_interleave(h // kvh, dim=1)
        v = vf[row].flatten(0, 1)[first:n].double().repeat_interleave(h // kvh, dim=1)
        scores = torch.einsum("hd,khd->hk", q[i].double(), k) * 0.125
        if sink is not None:
            scores = torch.cat([scores, sink.double()[:, None]], dim=1)
        p = scores.softmax(-1)[:, :k.shape[0]]
        torch.testing.assert_close(out[i].double(), torch.einsum("hk,khd->hd", p, v), rtol=0, atol=5e-6)


@pytest.mark.parametrize("cache", ["bfloat16", "int8", "fp8_e4m3"])
@pytest.mark.parametrize("h,kvh,d", [(9, 3, 64), (16, 4, 128), (32, 2, 64)])
def test_attention_lanes_kernel_is_attend_run_in_another_order(cache, h, kvh, d):
    """The lanes kernel (query heads sharing a KV head as one vector's lanes; a bfloat16 or 8-bit
    cache's rows widened once per tile) against attend_run on the same tokens, both forced by the
    crossover, and against a float64 oracle over the cache's own values: verification groups of
    2-5 tokens (lane groups full, partial and past 16 lanes), tokens ending alike, a window, sinks,
    contexts split into runs and contexts shorter than a tile; a NaN in one query head stays in
    that head's lane. With the built-in crossovers (by the group alone), a short context's token
    gets the same bits verified among others as decoded alone, whichever kernel its group takes."""
    if cpu.set_attention_lanes_from(0) is None:
        pytest.skip("this build has one attention kernel (no AVX-512)")
    torch.manual_seed(h * d + len(cache))
    fmt = resolve_kv_format(cache, torch.float32)
    bs, nb = 16, 420
    k_cache = fmt.encode(torch.randn(nb, bs, kvh, d) * 2)
    v_cache = fmt.encode(torch.randn(nb, bs, kvh, d))
    k_vals, v_vals = fmt.decode(k_cache, torch.float64), fmt.decode(v_cache, torch.float64)
    tables = torch.stack([torch.randperm(nb)[:200] for _ in range(3)])
    token_seq = torch.tensor([0, 0, 0, 0, 0, 1, 1, 2, 2, 2])
    lens = torch.tensor([2996, 2997, 2998, 2999, 3000, 40, 41, 9, 10, 10])
    q = torch.randn(len(lens), h, d)
    q[2, 1, 5] = float("nan")
    for window, sink in ((0, None), (50, None), (0, torch.randn(h))):
        def attend(lanes_from: int) -> torch.Tensor:
            before = cpu.set_attention_lanes_from(lanes_from)
            try:
                return cpu.paged_attention(q, k_cache, v_cache, tables, lens, d ** -0.5, sliding_window=window or None,
                                           sinks=sink, token_seq=token_seq, kv_format=fmt)
            finally:
                cpu.set_attention_lanes_from(before)

        lanes, plain = attend(1), attend(1 << 30)
        # With the built-in crossovers a model takes one kernel whatever the run's tokens: a token of
        # a short context (one run, no split) gets the same bits verified among others as alone.
        together = attend(0)
        for i in range(5, len(lens)):
            before = cpu.set_attention_lanes_from(0)
            try:
                alone = cpu.paged_attention(q[i:i + 1], k_cache, v_cache, tables, lens[i:i + 1], d ** -0.5,
                                            sliding_window=window or None, sinks=sink, token_seq=token_seq[i:i + 1],
                                            kv_format=fmt)
            finally:
                cpu.set_attention_lanes_from(before)
            assert torch.equal(together[i], alone[0])
        assert torch.isnan(lanes[2, 1]).all() and torch.isnan(plain[2, 1]).all()
        lanes[2, 1] = plain[2, 1] = 0
        assert not lanes.isnan().any()
        torch.testing.assert_close(lanes, plain, rtol=0, atol=5e-6)
        for i in (0, 4, 5, 6, 8, 9):
            n, row = int(lens[i]), tables[int(token_seq[i])]
            first = max(0, n - window) if window else 0
            k = k_vals[row].flatten(0, 1)[first:n].repeat_interleave(h // kvh, dim=1)
            v = v_vals[row].flatten(0, 1)[first:n].repeat_interleave(h // kvh, dim=1)
            scores = torch.einsum("hd,khd->hk", q[i].double(), k) * d ** -0.5
            if sink is not None:
                scores = torch.cat([scores, sink.double()[:, None]], dim=1)
            p = scores.softmax(-1)[:, :k.shape[0]]
            torch.testing.assert_close(lanes[i].double(), torch.einsum("hk,khd->hd", p, v), rtol=0, atol=5e-6)

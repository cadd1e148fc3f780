"""The GGUF-blocks kernels against gguf-py's reference dequantization, for every type with a
kernel: rows widened exactly, and products within float32 summation error, for batch sizes
that cover the fused kernel's groupings (1, 2, odd, past 8 rows, a tail of W's rows) and the
tiled path; and the fallback without the compiled kernels gives the same results. The int8-
activation kernel (AVX-512 VNNI or AVX2) equals the exact product of the blocks with x rounded as
it documents."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T

from pagellm.kernels import cpu
from pagellm.layers.linear import MergedColumnParallelLinear
from pagellm.layers.quant import gguf as q
from pagellm.layers.quant.gguf import GGUFBlocks, GGUFLinearMethod
from tests.kernels.gguf_blocks import random_blocks, reference

TYPES = [T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]
RTOL = 2e-6  # of the largest output: float32 sums in another order

pytestmark = pytest.mark.skipif(cpu.quant_kernels() is None, reason="no compiler for the CPU kernels")


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_rows_widen_exactly_as_gguf_py(qtype):
    raw = random_blocks(qtype, 37, 512)
    dense = reference(raw, qtype, 512)
    rows = torch.tensor([36, 0, 5, 5])
    ours = q.dequantize_rows(torch.from_numpy(raw), int(qtype), 512, rows, torch.float32)
    assert torch.equal(ours, dense[rows])
    bf16 = q.dequantize_rows(torch.from_numpy(raw), int(qtype), 512, rows, torch.bfloat16)
    assert torch.equal(bf16, dense[rows].bfloat16())


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_products_match_the_dense_product(qtype):
    rows, cols = 103, 512  # 103: groups of 4 (and 2) rows of W, then a tail
    raw = random_blocks(qtype, rows, cols, seed=1)
    dense = reference(raw, qtype, cols)
    w = torch.from_numpy(raw)
    torch.manual_seed(0)
    for m in (1, 2, 3, 8, 9, 17, 40):  # fused (groups of 8 rows; widened once per pass past 8) up to 32, then tiled
        x = torch.randn(m, cols)
        expected = x @ dense.T
        ours = q.gguf_matmul(x, w, int(qtype), cols)
        assert ours.shape == (m, rows)
        assert (ours - expected).abs().max() <= RTOL * expected.abs().max(), (qtype.name, m)
    xb = torch.randn(3, cols).bfloat16()
    ours = q.gguf_matmul(xb, w, int(qtype), cols)
    assert ours.dtype == torch.bfloat16
    assert torch.allclose(ours.float(), (xb.float() @ dense.T).bfloat16().float(), rtol=2e-2, atol=1e-2)


def rounded_to_int8(x: torch.Tensor, two_codes: bool, block: int = 32) -> torch.Tensor:
    """x as the integer kernel rounds it: per `block` values, codes c = round(x * 127 / max|x|) (half
    to even, as the CPU's conversion) times the scale max|x| / 127; with two codes, plus r / 128 for
    r = round(128 * (x * 127 / max|x| - c)), what the first code left (x * (127 / max|x|) - c rounded
    once, as the kernel's FMA does)."""
    blocks = x.reshape(x.shape[0], -1, block)
    amax = blocks.abs().amax(-1, keepdim=True)
    # 127 / amax as one division, like the kernel (torch's `127 / t` multiplies by a rounded reciprocal)
    inv = torch.where(amax > 0, torch.full_like(amax, 127).div(amax), torch.zeros_like(amax))
    codes = torch.round(blocks * inv)
    if two_codes:
        left = (blocks.double() * inv.double() - codes.double()).float()  # exact product, one rounding
        codes = codes + torch.round(left * 128) / 128
    return (codes * (amax / 127)).reshape(x.shape)


# K 128 (the 32-value types only): a row of two 64-value chunks, as a small model's (test_gguf_quantized's
# mixed model is 128 wide), with every count of x's rows in a group (multiply_group's 1..8) and groups
# of 8 ending in a partial one; K 512 and 4352: x in groups of 8 rows, past K 4096 of 4.
# K 128 and 576 (SmolLM2's): 4 and 18 blocks of 32, a part of the 8 blocks AVX2's kernel takes at a time
INT8_SHAPES = [pytest.param(t, k, id=f"{t.name}-K{k}") for k in (128, 576) for t in TYPES
               if t in (T.Q4_0, T.Q4_1, T.Q8_0)] + [
    pytest.param(t, k, id=f"{t.name}-K{k}") for k in (512, 4352) for t in TYPES]


# With the tiles on, the product tests move every type's crossover down to this many rows, so that
# the tiles' few-row configurations (x's rows in a tile < 16) are checked too.
AMX_TEST_MIN_ROWS = 2


@pytest.fixture
def amx_tiles(request):
    """Sets the kernels' AMX switch for one test (the case's second value), and puts it back; with
    the tiles on, every product of AMX_TEST_MIN_ROWS rows or more takes them."""
    kernels = cpu.quant_kernels()
    if kernels is None:
        yield request.param
        return
    before = kernels.set_amx(request.param)
    moved = {kind: kernels.set_amx_min_rows(kind, AMX_TEST_MIN_ROWS) for kind in kernels.amx_min_rows} \
        if request.param else {}
    yield request.param
    for kind, rows in moved.items():
        kernels.set_amx_min_rows(kind, rows)
    kernels.set_amx(before)


@pytest.fixture
def without_amx():
    kernels = cpu.quant_kernels()
    before = kernels.set_amx(False) if kernels is not None else False
    yield
    if kernels is not None:
        kernels.set_amx(before)


@pytest.mark.skipif(not getattr(cpu.quant_kernels(), "has_int8_activations", False), reason="no AVX2 or VNNI")
@pytest.mark.parametrize("activations", ["int8", "int8x2"])
@pytest.mark.parametrize("qtype, cols", INT8_SHAPES)
@pytest.mark.usefixtures("without_amx")  # the blocks' kernels at every row count (AMX: the -amx cases below)
def test_int8_activation_products_are_the_rounded_activations_exact_product(qtype, activations, cols, monkeypatch):
    monkeypatch.setitem(q.INT8_MAX_ROWS, activations, 32)  # the kernel at every batch size tried here
    # groups of 8 (4) of W's rows for one row of x, then a tail; at K 4352, 120 rows span two of the passes
    # (kIntPassBytes) that several groups of x's rows take through W
    rows = 120 if cols == 4352 else 41
    raw = random_blocks(qtype, rows, cols, seed=4)
    dense = reference(raw, qtype, cols).double()
    w = torch.from_numpy(raw)
    torch.manual_seed(1)
    # The K-quants take x a 256-value super-block at a time, as llama.cpp's Q8_K; Q6_K with two codes
    # per 32 values, but per 256 from the rows where AVX-512 VNNI builds join the two codes into 16 bits
    wide_from = getattr(cpu.quant_kernels(), "int8x2_wide_min_rows", {}).get(int(qtype))
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 24, 31, 32) if cols == 128 else (1, 2, 3, 4, 6, 9, 24):
        wide = activations == "int8x2" and wide_from is not None and m >= wide_from
        block = 256 if qtype in (T.Q4_K, T.Q5_K) or (qtype == T.Q6_K and (activations == "int8" or wide)) else 32
        x = torch.randn(m, cols)
        x[0, min(256, cols // 2):] = 0  # an all-zero block (and super-block): scale 0, no division by it
        ours = q.gguf_matmul(x, w, int(qtype), cols, activations=activations)
        expected = rounded_to_int8(x, activations == "int8x2", block).double() @ dense.T
        assert (ours.double() - expected).abs().max() <= RTOL * expected.abs().max(), (qtype.name, m)
        # and it is not the float32 product: the rounding is there to see
        assert (ours.double() - x.double() @ dense.T).abs().max() > 1e-7 * expected.abs().max()
    # A row that went NaN or infinite stays non-finite (request isolation fails that row), and the
    # other rows of the batch are untouched.
    x = torch.randn(3, cols)
    x[1, 5], x[2, min(300, cols - 1)] = float("nan"), float("inf")
    ours = q.gguf_matmul(x, w, int(qtype), cols, activations=activations)
    assert ours[0].isfinite().all() and ours[1].isnan().all() and not ours[2].isfinite().any()
    with pytest.raises(RuntimeError, match="not a multiple of 64"):
        cpu.quant_kernels().gguf_matmul_int8(torch.randn(1, 32), torch.from_numpy(random_blocks(T.Q8_0, 2, 32)),
                                             int(T.Q8_0), 32)


@pytest.mark.skipif(not getattr(cpu.quant_kernels(), "has_int8_activations", False), reason="no AVX2 or VNNI")
@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda t: t.name)
def test_repacked_k_quants_multiply_as_their_blocks(qtype):
    """Q4_1 / Q4_K / Q5_K / Q6_K weights repacked into tiles of 8 rows (a layer's in the integer modes):
    the same bytes back; rows and float32 products equal to the blocks'; integer products (of 1, 3
    and 5 rows of x: Q6_K's byte kernel takes up to 4 together; x rounded alike) within float32 summation
    order of the blocks'. Q4_0's tiles are Q4_1's without m (its bytes, no more) and take Q4_1's
    kernels (m = -8 d): back it comes as Q4_1 blocks of the same values, and its float32 products too
    are Q4_1's arithmetic, within summation order."""
    kernels, cols = cpu.quant_kernels(), 1280  # 5 super-blocks
    if int(qtype) not in kernels.repacked_types:
        pytest.skip(f"this build keeps {qtype.name} in blocks (Q8_0: AVX-512 VNNI builds without AMX repack it)")
    raw = torch.from_numpy(random_blocks(qtype, 24, cols, seed=6))
    packed_id = kernels.repacked_types[int(qtype)]
    packed = kernels.gguf_repack(raw, int(qtype), cols)
    assert packed.numel() <= 1.12 * raw.numel() if qtype != T.Q4_0 else packed.numel() == raw.numel()
    back = kernels.gguf_repack(packed, packed_id, cols, True)
    if qtype == T.Q4_0:
        assert torch.equal(reference(back.numpy(), T.Q4_1, cols), reference(raw.numpy(), qtype, cols))
    else:
        assert torch.equal(back, raw)
    rows = torch.tensor([17, 0, 9, 23])
    assert torch.equal(q.dequantize_rows(packed, packed_id, cols, rows, torch.bfloat16),
                       reference(raw.numpy(), qtype, cols)[rows].bfloat16())
    for activations in ("none", "int8", "int8x2"):
        for m in (1, 3, 5):
            x = torch.randn(m, cols)
            x[0, 256:512] = 0  # an all-zero super-block: scale 0
            ours = q.gguf_matmul(x, packed, packed_id, cols, activations=activations)
            blocks = q.gguf_matmul(x, raw, int(qtype), cols, activations=activations)
            if activations == "none" and qtype != T.Q4_0:
                assert torch.equal(ours, blocks), m
            else:
                assert (ours - blocks).abs().max() <= RTOL * blocks.abs().max(), (activations, m)
        x = torch.randn(1, cols)
        x[0, 700] = float("nan")
        assert q.gguf_matmul(x, packed, packed_id, cols, activations=activations).isnan().all()
    if qtype == T.Q4_0:  # a prompt's products widen Q4_0's tiles as its blocks (codes u - 8): the same bits
        x = torch.randn(40, cols)
        for two in (False, True):
            assert torch.equal(kernels.gguf_matmul_int8(x, packed, packed_id, cols, two),
                               kernels.gguf_matmul_int8(x, raw, int(qtype), cols, two))
    assert q.repacked_type(int(T.Q4_K), 24, "int8x2", batch_invariant=False, cols=256) == kernels.repacked_types[int(T.Q4_K)]
    assert q.repacked_type(int(T.Q4_K), 24, "none", batch_invariant=False, cols=256) is None  # mode none keeps the blocks
    assert q.repacked_type(int(T.Q4_K), 20, "int8x2", batch_invariant=False, cols=256) is None  # not whole tiles
    assert q.repacked_type(int(T.Q4_1), 24, "int8x2", batch_invariant=False, cols=96) is None  # rows the kernels refuse
    assert q.repacked_type(int(T.Q6_K), 24, "int8", batch_invariant=False, cols=256) == kernels.repacked_types[int(T.Q6_K)]


@pytest.mark.skipif(not getattr(cpu.quant_kernels(), "has_int8_activations", False), reason="no AVX2 or VNNI")
def test_repacked_q5_k_at_its_largest_codes_sums_without_overflow():
    """Every Q5_K code at 31 and every sub-block scale at 63 against x's codes at 127: a 32-bit
    lane's 16 products of a sub-block (62,992) pass the 16 bits the scale's multiply-add reads, so
    the tile kernel must apply the scale every 8 (VNNI), and with two codes the super-block's sums
    times 128 pass 2^31, so it must convert the two codes' sums apart. The product is the
    dequantized one's."""
    kernels, cols = cpu.quant_kernels(), 512
    block = np.zeros(176, dtype=np.uint8)
    block[0:2] = np.frombuffer(np.float16(1.0).tobytes(), dtype=np.uint8)  # d 1, dmin 0
    block[4:] = 0xFF  # 6-bit scales and mins 63; every fifth bit and nibble set: codes 31
    raw = torch.from_numpy(np.tile(block, (16, cols // 256)))
    packed = kernels.gguf_repack(raw, int(T.Q5_K), cols)
    dense = reference(raw.numpy(), T.Q5_K, cols)
    assert dense.unique().tolist() == [31.0 * 63]
    x = torch.ones(3, cols)
    for activations in ("int8", "int8x2"):
        ours = q.gguf_matmul(x, packed, kernels.repacked_types[int(T.Q5_K)], cols, activations=activations)
        assert torch.allclose(ours, x @ dense.T, rtol=1e-6), activations


@pytest.mark.skipif(not getattr(cpu.quant_kernels(), "has_int8_activations", False), reason="no AVX2 or VNNI")
@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda t: t.name)
def test_a_large_repacked_product_claimed_in_chunks_is_its_one_thread_product(qtype):
    """Repacked products of several MB go to the two threads in chunks that each thread claims in
    turn (quant_ops.cpp, claimed_for; this size: 5-8 chunks, the last a short one): every row of W is
    multiplied, once, to the bits one thread gives."""
    kernels, cols, rows = cpu.quant_kernels(), 2048, 5208  # 651 tiles of 8 rows: 6-9 MB
    packed = kernels.gguf_repack(torch.from_numpy(random_blocks(qtype, rows, cols, seed=11)), int(qtype), cols)
    packed_id = kernels.repacked_types[int(qtype)]
    x = torch.randn(2, cols)
    for activations in ("int8", "int8x2"):
        torch.set_num_threads(1)
        alone = q.gguf_matmul(x, packed, packed_id, cols, activations=activations)
        torch.set_num_threads(2)
        claimed = q.gguf_matmul(x, packed, packed_id, cols, activations=activations)
        assert alone.isfinite().all() and torch.equal(claimed, alone), activations


def blocks_and_repacked(qtype, cols: int, seed: int) -> list[tuple[torch.Tensor, int]]:
    """24 random rows of `qtype` as (weight, type id) pairs: GGUF's blocks, and repacked where this
    build repacks the type."""
    kernels = cpu.quant_kernels()
    raw = torch.from_numpy(random_blocks(qtype, 24, cols, seed=seed))
    forms = [(raw, int(qtype))]
    if int(qtype) in kernels.repacked_types:
        forms.append((kernels.gguf_repack(raw, int(qtype), cols), kernels.repacked_types[int(qtype)]))
    return forms


def assert_rows_keep_their_bits(x: torch.Tensor, w: torch.Tensor, kind: int, cols: int, activations: str,
                                counts) -> None:
    """The first m rows of x multiplied together give, for each m in `counts`, each row's product
    alone, bit for bit."""
    alone = torch.cat([q.gguf_matmul(x[i:i + 1], w, kind, cols, activations=activations) for i in range(len(x))])
    for m in counts:
        together = q.gguf_matmul(x[:m], w, kind, cols, activations=activations)
        assert torch.equal(together, alone[:m]), (kind, activations, m)


@pytest.mark.skipif(not getattr(cpu.quant_kernels(), "has_int8_activations", False), reason="no AVX2 or VNNI")
@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda t: t.name)
def test_a_row_gets_the_same_bits_with_up_to_4_rows_beside_it(qtype):
    """In the integer modes a row of x multiplied with up to 4 others (a speculative verification of
    4 proposals) gets the bits it gets alone (a decode step), in GGUF's blocks and repacked: how x is
    rounded and which kernel sums it must not depend on the rows beside it below 6 rows, or greedy
    speculation would leave plain decoding's tokens at near-ties."""
    cols = 1280
    forms = blocks_and_repacked(qtype, cols, seed=7)
    torch.manual_seed(0)
    for w, kind in forms:
        for activations in ("int8", "int8x2"):
            assert_rows_keep_their_bits(torch.randn(5, cols), w, kind, cols, activations, range(2, 6))


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda t: t.name)
def test_repacked_and_block_rows_keep_their_bits_beside_many_rows(qtype):
    """In AVX2 builds a row of x gets the same bits multiplied with other rows, up to the mode's
    integer bound (32 rows in int8x2, the default mode), as alone, for every type, in blocks and
    repacked: a row's logits do not depend on what shares a step of up to that many rows (other
    streams, a speculative verification's proposals). The repacked K-quants take kernels of
    their own from a few rows (csrc q4_k_x8_many, q6_k_x8_many: each tile widened once into 16-bit
    pairs for every row of x), which must keep the tile kernels' bits. (AVX-512 VNNI builds keep
    them to 5 rows: test_a_row_gets_the_same_bits_with_up_to_4_rows_beside_it.)"""
    kernels, cols = cpu.quant_kernels(), 1280
    if getattr(kernels, "int8_kernel", "") != "avx2":
        pytest.skip("AVX2 builds' bound (PAGELLM_CPU_MARCH=x86-64-v3 builds them on AVX-512 machines)")
    forms = blocks_and_repacked(qtype, cols, seed=11)
    torch.manual_seed(1)
    for w, kind in forms:
        pairs_from = kernels.pair_min_rows.get(kind, 2)
        for activations in ("int8", "int8x2"):
            bound = q.int8_max_rows(activations, kind)
            # the many-row kernels' bound, and past each of their passes of 8 rows
            counts = sorted({2, 5, pairs_from, pairs_from + 1, 8, 9, 16, 17, 23, bound} & set(range(2, bound + 1)))
            assert_rows_keep_their_bits(torch.randn(bound, cols), w, kind, cols, activations, counts)


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q4_0, T.Q8_0], ids=lambda t: t.name)
def test_repacked_q4_1_rows_keep_their_bits_beside_up_to_16_rows(qtype):
    """Repacked Q4_1 (SmolLM2's layers; and Q4_0's and Q8_0's tiles, which take its row loop) keeps its
    row loop, whose rows' sums do not depend on the rows beside them, up to q4_1_row_loop_max rows in
    every build, ahead of the AMX tiles and the
    widening: a speculative verification of up to 15 proposals gets the bits of decoding its tokens
    one by one in these products, on AVX-512 VNNI builds too (whose other types keep them to 5 rows:
    test_a_row_gets_the_same_bits_with_up_to_4_rows_beside_it). There Q8_0's tiles take a 16-bit
    kernel of their own from 9 rows (csrc q8_0_x8_wide), which must keep the byte kernel's bits."""
    kernels, cols = cpu.quant_kernels(), 1280
    if not getattr(kernels, "q4_1_row_loop_max", 0) or int(qtype) not in kernels.repacked_types:
        pytest.skip(f"no integer kernels for repacked {qtype.name} in this build")
    (_, _), (w, kind) = blocks_and_repacked(qtype, cols, seed=12)
    most = kernels.q4_1_row_loop_max
    torch.manual_seed(2)
    assert_rows_keep_their_bits(torch.randn(most, cols), w, kind, cols, "int8x2", range(2, most + 1))


def test_repacked_q6_k_rows_keep_their_bits_beside_up_to_16_rows(without_amx):
    """Repacked Q6_K (a Q4_K_M file's head) rounds x per 32 values in its row loop up to 16 rows in
    every build (the widening, per 256, takes it from 17 in AVX-512 VNNI builds): a row's sums do not
    depend on the rows beside it, so a verification of up to 15 proposals gets decode's bits here.
    (AVX-512 VNNI builds' row loop takes its 16-bit kernel, q6_k_x8_wide, at every row count, in one
    pass of up to 16 rows; AVX2 builds' switches kernels at 5.)"""
    kernels, cols = cpu.quant_kernels(), 1280
    if not getattr(kernels, "has_int8_activations", False) or int(T.Q6_K) not in kernels.repacked_types:
        pytest.skip("no integer kernels for repacked Q6_K in this build")
    (_, _), (w, kind) = blocks_and_repacked(T.Q6_K, cols, seed=13)
    torch.manual_seed(3)
    for activations in ("int8x2", "int8"):
        assert_rows_keep_their_bits(torch.randn(16, cols), w, kind, cols, activations, range(2, 17))


def amx_cases() -> list:
    """(qtype, amx) for the product tests: AMX tiles (csrc amx_product) where this CPU and build have
    them, for the types they serve (repacked Q4_K, Q6_K, Q4_0 and Q4_1, Q8_0's and Q4_1's blocks); the other kernels
    always (set_amx(False)), Q5_K's blocks too."""
    kernels = cpu.quant_kernels()
    tiles = getattr(kernels, "amx_min_rows", {})
    cases = [pytest.param(t, False, id=t.name) for t in (T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0, T.Q4_0, T.Q4_1)]
    return cases + [pytest.param(t, True, id=f"{t.name}-amx") for t in (T.Q4_K, T.Q6_K, T.Q8_0, T.Q4_0, T.Q4_1)
                    if kernels.repacked_types.get(int(t), int(t)) in tiles]


@pytest.mark.skipif(not getattr(cpu.quant_kernels(), "prefill_types", ()), reason="no AVX2 or VNNI")
@pytest.mark.parametrize("qtype, amx_tiles", amx_cases() if cpu.quant_kernels() else [], indirect=["amx_tiles"])
def test_repacked_prefill_products_are_the_rounded_activations_exact_product(qtype, amx_tiles):
    """Past the row loops (32 rows), products of repacked Q4_K / Q5_K / Q6_K and of Q8_0's and Q5_K's blocks
    (and Q4_1's in AVX-512 VNNI builds, repacked Q4_1's up to 64 rows and Q5_K's up to 256 in AVX2 ones;
    csrc x8_prefill; AVX2 builds' Q4_K: q4_k_x8_many, tile by tile) widen each group of 8 rows of W once
    for every row of x, and so do those of Q8_0 and Q4_1's blocks from 9 rows, repacked Q4_1 and Q6_K
    from 17, Q4_K from 25 in AVX-512 VNNI builds (csrc widen_min_rows, kQ41RowLoopMax): x rounded as the
    mode's products of fewer rows round it (one or two codes; per 256 values against the K-quants, per
    32 against Q8_0 and Q4_1) times the exact weights, so the float64 product of the rounded x and the
    dequantized W up to float32 summation order. Rows 33-36 and 38 leave every remainder of the passes
    of 4 rows (AVX2: 2); 5 super-blocks, an odd count, and Q6_K's two halves each; Q8_0's and Q4_1's 21
    rows end in a part of a group; 420 rows take two chunks of x; 9, 16, 17 and 25 rows, decode-sized
    (either side of each type's widen_min_rows), whichever kernel the build gives them. With AMX tiles
    (the -amx cases), every product of at least AMX_TEST_MIN_ROWS rows (repacked Q4_1's from 17, past
    its row loop's kQ41RowLoopMax): 2, 3, 4, 5, 6, 7 and 9 rows fill part of one tile, 16 rows x's rows
    in one tile, 17 a second tile of one row; 24 rows of W, an odd count of pairs of groups (Q8_0's and
    Q4_1's 21, a part of 16 rows); the other cases run without them."""
    kernels = cpu.quant_kernels()
    # Q4_0, Q4_1 and Q5_K (and Q8_0 where the build repacks it) repacked, as a load gives them, and in
    # blocks (a weight whose rows are not whole tiles of 8)
    both = (T.Q4_0, T.Q4_1, T.Q5_K) + ((T.Q8_0,) if int(T.Q8_0) in kernels.repacked_types else ())
    for blocks in ((True, False) if qtype in both else (qtype == T.Q8_0,)):
        _prefill_products_case(kernels, qtype, amx_tiles, blocks)


def _prefill_products_case(kernels, qtype, amx_tiles: bool, blocks: bool) -> None:
    cols, rows = 1280, 21 if blocks else 24
    raw = random_blocks(qtype, rows, cols, seed=8)
    dense = reference(raw, qtype, cols).double()
    w, kind = torch.from_numpy(raw), int(qtype)
    if not blocks:
        kind = kernels.repacked_types[int(qtype)]
        w = kernels.gguf_repack(w, int(qtype), cols)
    # Q6_K with two codes below 33 rows: per 32 values, but per 256 from the rows where AVX-512 VNNI
    # builds join the two codes into 16 bits (as test_int8_activation_products...), and on AMX tiles
    # (which the -amx cases give every product of AMX_TEST_MIN_ROWS rows and more)
    wides = getattr(kernels, "int8x2_wide_min_rows", {})  # by the id multiplied: repacked Q6_K's from 17
    wide_from = AMX_TEST_MIN_ROWS if amx_tiles else wides.get(kind, wides.get(int(qtype)))
    torch.manual_seed(3)
    for two in (True, False):
        for m in (2, 3, 4, 5, 6, 7, 9, 16, 17, 25, 33, 34, 35, 36, 38, 420):  # 420: chunks of x's rows (K 1280: 408), then 12
            per32 = qtype in (T.Q8_0, T.Q4_0, T.Q4_1) or (qtype == T.Q6_K and two and m <= 32
                                                           and (wide_from is None or m < wide_from))
            block = 32 if per32 else 256
            x = torch.randn(m, cols)
            x[0, 256:512] = 0  # an all-zero super-block: scale 0
            x[1] *= 1e3  # rows of other magnitudes: each row its own scales
            ours = kernels.gguf_matmul_int8(x, w, kind, cols, two).double()
            expected = rounded_to_int8(x, two, block).double() @ dense.T
            assert (ours - expected).abs().max(1).values.le(RTOL * expected.abs().max(1).values).all(), (two, m)
            assert (ours - x.double() @ dense.T).abs().max() > 1e-7 * expected.abs().max()  # rounded: visible
    # the dispatch of the default mode: the integer kernel at a 16-stream decode step (not the float32
    # one; Q4_0's blocks in AVX-512 VNNI builds keep the float32 kernel past 8 rows) and, for the prefill
    # types, past 32 rows (not the float32 tiles)
    x = torch.randn(16, cols)
    integer = torch.equal(q.gguf_matmul(x, w, kind, cols, activations="int8x2"),
                          kernels.gguf_matmul_int8(x, w, kind, cols, True))
    assert integer == (qtype != T.Q4_0 or not blocks or kernels.int8_kernel != "avx512_vnni")
    x = torch.randn(40, cols)
    if qtype == T.Q4_1 and kernels.int8_kernel != "avx512_vnni" and blocks:  # AVX2 builds: the float32 tiles
        assert kind not in q.prefill_types("int8x2")
        return
    assert kind in q.prefill_types("int8x2")
    assert torch.equal(q.gguf_matmul(x, w, kind, cols, activations="int8x2"),
                       kernels.gguf_matmul_int8(x, w, kind, cols, True))
    # AVX2 builds' repacked Q4_1, Q4_0 and Q5_K: integer up to their caps, the float32 tiles past them
    cap = q.prefill_max_rows().get(kind)
    assert (cap is not None) == (qtype in (T.Q4_1, T.Q4_0, T.Q5_K) and kernels.int8_kernel != "avx512_vnni")
    if cap is not None:
        at_cap, past = torch.randn(cap, cols), torch.randn(cap + 1, cols)
        assert torch.equal(q.gguf_matmul(at_cap, w, kind, cols, activations="int8x2"),
                           kernels.gguf_matmul_int8(at_cap, w, kind, cols, True))
        assert torch.equal(q.gguf_matmul(past, w, kind, cols, activations="int8x2"),
                           q.widened_product(past, w, kind, cols))
    x[1, 5], x[2, min(300, cols - 1)] = float("nan"), float("inf")  # a row gone bad stays bad; the others are untouched
    ours = kernels.gguf_matmul_int8(x, w, kind, cols, True)
    assert ours[1].isnan().all() and not ours[2].isfinite().any()
    assert ours[[0, *range(3, 40)]].isfinite().all()


def test_a_layer_repacks_its_k_quant_segments_in_the_integer_modes():
    """q in Q4_K and k in Q6_K (repacked), v in Q8_0 (repacked where the build's kernels repack it: AVX-512 VNNI
    without AMX); products as the layer kept in blocks."""
    if q.repacked_type(int(T.Q4_K), 8, "int8x2", batch_invariant=False, cols=256) is None:
        pytest.skip("no repacking kernels in this build")
    types = (T.Q4_K, T.Q6_K, T.Q8_0)
    parts = [random_blocks(t, rows, 512, seed=7 + i) for i, (t, rows) in enumerate(zip(types, (8, 16, 16)))]
    layers = {}
    for activations in ("int8x2", "none"):
        layer = MergedColumnParallelLinear(512, [8, 16, 16], method=GGUFLinearMethod(torch.float32,
                                                                                    activations=activations))
        for i, (part, qtype) in enumerate(zip(parts, types)):
            layer.weight_loader(layer.weight, GGUFBlocks(torch.from_numpy(part), int(qtype), 512), i)
        layer.method.finish(layer)
        assert layer.segment_types == [int(t) for t in types]  # the file's types, whatever the layout
        layers[activations] = layer
    packed, blocks = layers["int8x2"], layers["none"]
    repacked = cpu.quant_kernels().repacked_types
    assert [kind for kind, _ in packed.gguf_products] == [repacked[int(T.Q4_K)], repacked[int(T.Q6_K)],
                                                          repacked.get(int(T.Q8_0), int(T.Q8_0))]
    for m in (1, 5):
        x = torch.randn(m, 512)
        packed.method.activations = blocks.method.activations = "int8x2"  # the same products on both
        expected = blocks(x)
        assert (packed(x) - expected).abs().max() <= RTOL * expected.abs().max()


@pytest.mark.slow
def test_the_avx2_build_repacks_and_multiplies_as_the_blocks(tmp_path):
    """The AVX2 kernels (PAGELLM_CPU_MARCH=x86-64-v3, built apart) pass the integer and repacking tests."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PAGELLM_CPU_MARCH": "x86-64-v3"}
    probe = subprocess.run([sys.executable, "-c", "from pagellm.kernels import cpu; print(cpu.quant_kernels().int8_kernel)"],
                           env=env, capture_output=True, text=True, timeout=900)
    if probe.returncode or probe.stdout.split()[-1:] != ["avx2"]:
        pytest.skip(f"no AVX2 build here: {probe.stdout[-200:]} {probe.stderr[-200:]}")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__, "-k",
                          "repack and not avx2 or int8_activation_products"],
                         env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:]


@pytest.mark.skipif(not getattr(cpu.quant_kernels(), "has_int8_activations", False), reason="no AVX2 or VNNI")
@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_K], ids=lambda t: t.name)
def test_int8x2_products_take_the_integer_kernel_up_to_their_bound_and_the_float32_one_past_it(qtype):
    # The bound depends on the type and the build (gguf.wide_int8_types): Q4_K's super-block kernel
    # keeps winning to 32 rows, the 32-value types' only to a few with AVX-512's float32 kernel; past
    # 32 rows the prefill types' widening takes over (gguf.prefill_types).
    raw = torch.from_numpy(random_blocks(qtype, 8, 256, seed=5))
    bound = q.int8_max_rows("int8x2", int(qtype))
    assert bound in (q.INT8_MAX_ROWS["int8x2"], q.WIDE_INT8_MAX_ROWS)
    assert qtype != T.Q4_K or bound == q.WIDE_INT8_MAX_ROWS
    integer = getattr(cpu.quant_kernels(), "has_int8_activations", False)
    # past it a prefill type stays integer (Q4_0's blocks in AVX2 builds from 33 rows, to their cap)
    past = bound + 1
    prefill = (past > q.WIDE_INT8_MAX_ROWS and int(qtype) in q.prefill_types("int8x2")
               and past <= q.prefill_max_rows().get(int(qtype), past))
    for rows, rounded in ((bound, integer), (past, prefill)):
        x = torch.randn(rows, 256)
        ours = q.gguf_matmul(x, raw, int(qtype), 256, activations="int8x2")
        assert torch.equal(ours, q.gguf_matmul(x, raw, int(qtype), 256)) != rounded, rows


@pytest.mark.skipif(not (getattr(cpu.quant_kernels(), "has_int8_activations", False) and q.BF16_TILES),
                    reason="no AVX-512 VNNI and BF16")
@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q6_K], ids=lambda t: t.name)
def test_int8_mode_past_its_rows_multiplies_bfloat16_tiles(qtype):
    """Mode int8 beyond INT8_MAX_ROWS: x rounded to bfloat16 times W widened to bfloat16, not the
    float32 product (int8x2, whose promise is ~15 bits, keeps that one)."""
    raw = torch.from_numpy(random_blocks(qtype, 24, 512, seed=6))
    x = torch.randn(q.int8_max_rows("int8", int(qtype)) + 1, 512)
    ours = q.gguf_matmul(x, raw, int(qtype), 512, activations="int8")
    assert ours.dtype == torch.float32
    w = q.dequantize_rows(raw, int(qtype), 512, torch.arange(24), torch.bfloat16)
    assert torch.equal(ours, torch.nn.functional.linear(x.to(torch.bfloat16), w).float())
    exact = q.gguf_matmul(x, raw, int(qtype), 512)
    assert not torch.equal(ours, exact)
    assert (ours - exact).abs().max() <= 2e-2 * exact.abs().max()  # bfloat16's 8 bits, summed over 512
    # int8x2 past its bound: never bfloat16; the integer prefill kernel (its two codes) where it takes
    # the type (Q4_1's blocks in AVX-512 VNNI builds), else the float32 product
    x = torch.randn(q.int8_max_rows("int8x2", int(qtype)) + 1, 512)
    prefill = int(qtype) in q.prefill_types("int8x2")
    expected = (cpu.quant_kernels().gguf_matmul_int8(x, raw, int(qtype), 512, True) if prefill
                else q.gguf_matmul(x, raw, int(qtype), 512))
    assert torch.equal(q.gguf_matmul(x, raw, int(qtype), 512, activations="int8x2"), expected)
    # Q4_1's blocks in AVX-512 VNNI builds only (an AVX2 build on a CPU with BF16 passes the skip above)
    assert prefill == (qtype == T.Q4_1 and cpu.quant_kernels().int8_kernel == "avx512_vnni")


def test_the_fallback_without_compiled_kernels_gives_the_same_results(monkeypatch):
    raw = torch.from_numpy(random_blocks(T.Q4_K, 20, 256, seed=2))
    x = torch.randn(5, 256)
    compiled = q.gguf_matmul(x, raw, int(T.Q4_K), 256)
    rows = q.dequantize_rows(raw, int(T.Q4_K), 256, torch.tensor([3, 1]), torch.float32)
    monkeypatch.setattr(cpu, "quant_kernels", lambda: None)
    assert (q.gguf_matmul(x, raw, int(T.Q4_K), 256) - compiled).abs().max() <= RTOL * compiled.abs().max()
    assert torch.equal(q.dequantize_rows(raw, int(T.Q4_K), 256, torch.tensor([3, 1]), torch.float32), rows)


def test_blocks_split_only_at_block_boundaries():
    blocks = GGUFBlocks(torch.from_numpy(random_blocks(T.Q4_K, 4, 512)), int(T.Q4_K), 512)
    half = blocks.narrow(1, 256, 256)
    assert half.shape == (4, 256)
    assert torch.equal(half.dequantize(), blocks.dequantize()[:, 256:])
    with pytest.raises(ValueError, match="cannot split Q4_K rows of 512 values at \\[128, 384\\)"):
        blocks.narrow(1, 128, 256)
    with pytest.raises(ValueError, match="Q8_0 rows of 64 values take 68 bytes"):
        GGUFBlocks(torch.zeros(2, 70, dtype=torch.uint8), int(T.Q8_0), 64)


def test_a_fused_layer_of_mixed_parts_multiplies_each_part_in_its_own_form():
    """gate in Q6_K and up as a dense tensor: two segments, and the layer's product is the dense one."""
    layer = MergedColumnParallelLinear(256, [8, 8], method=GGUFLinearMethod(torch.float32))
    gate_raw = random_blocks(T.Q6_K, 8, 256, seed=3)
    up = torch.randn(8, 256)
    layer.weight_loader(layer.weight, GGUFBlocks(torch.from_numpy(gate_raw), int(T.Q6_K), 256), 0)
    layer.weight_loader(layer.weight, up, 1)
    layer.method.finish(layer)
    assert layer.segment_types == [int(T.Q6_K), None]
    x = torch.randn(4, 256)
    expected = F.linear(x, torch.cat([reference(gate_raw, T.Q6_K, 256), up]))
    assert (layer(x) - expected).abs().max() <= RTOL * expected.abs().max()


def test_a_layer_with_rows_never_loaded_is_refused():
    layer = MergedColumnParallelLinear(256, [8, 8], method=GGUFLinearMethod(torch.float32))
    layer.weight_loader(layer.weight, torch.randn(8, 256), 1)
    with pytest.raises(ValueError, match=r"weight rows \[0, 8\) were never loaded"):
        layer.method.finish(layer)


@pytest.mark.skipif(not getattr(cpu.quant_kernels(), "amx_min_rows", {}), reason="no AMX tiles here")
def test_amx_crossovers_move_and_come_back():
    """set_amx_min_rows moves one type's crossover and returns the one before; an id that takes no
    tiles, or a count below 1, is refused with the value named."""
    kernels = cpu.quant_kernels()
    kind, rows = next(iter(kernels.amx_min_rows.items()))
    assert kernels.set_amx_min_rows(kind, 3) == rows
    assert kernels.set_amx_min_rows(kind, rows) == 3
    with pytest.raises(RuntimeError, match="type id 2 takes no AMX tiles"):
        kernels.set_amx_min_rows(int(T.Q4_0), 4)
    with pytest.raises(RuntimeError, match="rows must be >= 1, got 0"):
        kernels.set_amx_min_rows(kind, 0)

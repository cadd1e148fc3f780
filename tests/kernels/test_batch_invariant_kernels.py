"""Batch-invariant kernels: a row's result is the same bits whatever shares the call.

Products (layers/invariant.py, GGUF blocks and dense float32 / bfloat16 weights): row r of
x @ W^T for every batch size and position of the row, within float32 summation error of torch's
product. Attention (cpu.paged_attention with fixed runs): a token's output is the same whether it
is a decode in a batch, a prefill token of the whole prompt, or of a later chunk, with other
sequences around it; and it matches the float64 reference.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T

from pagellm.kv_format import resolve_kv_format
from pagellm.attention.torch_backend import INVARIANT_RUN
from pagellm.kernels import cpu
from pagellm.layers.invariant import check_in_features, invariant_linear
from pagellm.layers.quant import gguf as q
from tests.kernels.gguf_blocks import random_blocks, reference

pytestmark = pytest.mark.skipif(cpu.quant_kernels() is None or not cpu.available(),
                                reason="no compiler for the CPU kernels")
BATCHES = (1, 2, 3, 4, 5, 7, 8, 9, 17, 64, 130)


def assert_rows_invariant(product, x: torch.Tensor) -> None:
    """Row 0 of x (and the same row placed elsewhere) gives the same bits in every batch."""
    alone = product(x[:1])[0]
    for m in BATCHES:
        assert torch.equal(product(x[:m])[0], alone), m
        moved = torch.roll(x[:m], m // 2, 0)  # row 0 now sits at position m // 2
        assert torch.equal(product(moved)[m // 2], alone), ("moved", m)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_products_are_row_invariant_and_close_to_torch(dtype):
    torch.manual_seed(0)
    w = torch.randn(301, 576).to(dtype)  # 301: groups of 3 rows of W and a tail
    x = torch.randn(130, 576).to(dtype)
    assert_rows_invariant(lambda a: invariant_linear(a, w), x)
    got, expected = invariant_linear(x, w).float(), x.float() @ w.float().T
    if dtype == torch.float32:
        assert (got - expected).abs().max() <= 2e-6 * expected.abs().max()
    else:  # one rounding of the float32 sum to bfloat16
        torch.testing.assert_close(got, expected, rtol=2 ** -7, atol=1e-2)
    # torch's own product is the reason for the mode: its row 0 changes with the batch here.
    assert any(not torch.equal(F.linear(x[:m].float(), w.float())[0], F.linear(x[:1].float(), w.float())[0])
               for m in BATCHES)


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q6_K], ids=lambda t: t.name)
def test_gguf_products_are_row_invariant_past_the_fused_batch(qtype):
    raw = random_blocks(qtype, 67, 512, seed=2)
    w, dense = torch.from_numpy(raw), reference(raw, qtype, 512)
    torch.manual_seed(1)
    x = torch.randn(130, 512)
    assert_rows_invariant(lambda a: q.gguf_matmul(a, w, int(qtype), 512, batch_invariant=True), x)
    expected = x @ dense.T
    got = q.gguf_matmul(x, w, int(qtype), 512, batch_invariant=True)
    assert (got - expected).abs().max() <= 2e-6 * expected.abs().max()


def test_input_features_must_fit_the_kernel_chunks():
    check_in_features(576)
    with pytest.raises(ValueError, match="multiple of 32; this model has a layer with 100"):
        check_in_features(100)


def reference_attention(q, k_cache, v_cache, table, n, scale):
    h, kvh = q.shape[0], k_cache.shape[2]
    k = k_cache[table].flatten(0, 1)[:n].double().repeat_interleave(h // kvh, dim=1)
    v = v_cache[table].flatten(0, 1)[:n].double().repeat_interleave(h // kvh, dim=1)
    p = (torch.einsum("hd,khd->hk", q.double(), k) * scale).softmax(-1)
    return torch.einsum("hk,khd->hd", p, v)


@pytest.mark.parametrize("kv_cache_dtype", ["float32", "bfloat16", "int8", "fp8_e4m3"])
def test_a_tokens_attention_does_not_depend_on_how_it_is_batched(kv_cache_dtype):
    torch.manual_seed(4)
    fmt = resolve_kv_format(kv_cache_dtype, torch.float32)
    h, kvh, d, bs, nb = 6, 2, 64, 16, 160
    k_cache = fmt.encode(torch.randn(nb, bs, kvh, d) * 2)
    v_cache = fmt.encode(torch.randn(nb, bs, kvh, d))
    k_values, v_values = fmt.decode(k_cache), fmt.decode(v_cache)  # what the reference attends to
    tables = torch.stack([torch.randperm(nb)[:70] for _ in range(3)])
    length = 2 * INVARIANT_RUN + 37  # several fixed runs, and a partial one
    queries = torch.randn(length, h, d)  # sequence 0's query at every position
    scale = d ** -0.5

    def run(rows: list[int], positions: list[int], other: int) -> torch.Tensor:
        """Sequence 0's queries at `positions` (rows of block table `rows`), after `other` decodes of
        sequences 1 and 2; returns sequence 0's outputs."""
        qs = torch.cat([torch.randn(other, h, d), queries[positions]])
        seq = torch.tensor([1 + i % 2 for i in range(other)] + rows)
        lens = torch.tensor([100 + 300 * (i % 2) for i in range(other)] + [p + 1 for p in positions])
        return cpu.paged_attention(qs, k_cache, v_cache, tables, lens, scale, token_seq=seq,
                                   fixed_run=INVARIANT_RUN, kv_format=fmt)[other:]

    whole = run([0] * length, list(range(length)), 0)  # the prompt prefilled at once
    for i in (0, 17, INVARIANT_RUN, length - 1):
        torch.testing.assert_close(whole[i].double(), reference_attention(queries[i], k_values, v_values, tables[0],
                                                                          i + 1, scale), rtol=0, atol=2e-5)
    chunk = list(range(300, 350))  # a later chunk, beside two decodes
    assert torch.equal(run([0] * len(chunk), chunk, 2), whole[300:350])
    for p in (5, INVARIANT_RUN - 1, INVARIANT_RUN, length - 1):  # decodes, alone and in a batch
        assert torch.equal(run([0], [p], 0)[0], whole[p])
        assert torch.equal(run([0], [p], 7)[0], whole[p])

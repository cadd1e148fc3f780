"""The MXFP4 / IQ4_NL / IQ4_XS kernels (csrc/quant_codebook_ops.cpp, through layers/quant/gguf.py's
dispatch) against gguf-py's dequantization: rows widened exactly; float32 products within float32
summation error at batch sizes that cover the kernel's groups of rows and the widened tiles past
its bound; integer-activation products equal to the exact product of x rounded as documented
(the other types' rounding, tests/kernels/test_quant_ops.py); non-finite rows stay their own."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

from pagellm.kernels import cpu
from pagellm.layers.quant import codebook
from pagellm.layers.quant import gguf as q
from pagellm.layers.quant.gguf import GGUFBlocks
from tests.kernels.gguf_blocks import random_blocks, reference
from tests.kernels.test_quant_ops import rounded_to_int8

TYPES = [T.MXFP4, T.IQ4_NL, T.IQ4_XS]
RTOL = 2e-6  # of the largest output: float32 sums in another order

pytestmark = pytest.mark.skipif(cpu.codebook_kernels() is None, reason="no compiler for the CPU kernels")
INT8 = getattr(cpu.codebook_kernels(), "has_int8_activations", False)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_rows_widen_exactly_as_gguf_py(qtype):
    raw = random_blocks(qtype, 37, 512)
    dense = reference(raw, qtype, 512)
    rows = torch.tensor([36, 0, 5, 5])
    assert torch.equal(q.dequantize_rows(torch.from_numpy(raw), int(qtype), 512, rows, torch.float32), dense[rows])
    assert torch.equal(q.dequantize_rows(torch.from_numpy(raw), int(qtype), 512, rows, torch.bfloat16),
                       dense[rows].bfloat16())
    assert torch.equal(GGUFBlocks(torch.from_numpy(raw), int(qtype), 512).narrow(1, 256, 256).dequantize(),
                       dense[:, 256:])


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_products_match_the_dense_product(qtype):
    rows, cols = 41, 512
    raw = random_blocks(qtype, rows, cols, seed=1)
    dense = reference(raw, qtype, cols)
    w = torch.from_numpy(raw)
    torch.manual_seed(0)
    bound = codebook.FUSED_MAX_ROWS[torch.float32]
    for m in (1, 2, 3, 5, 9, bound, bound + 1):  # groups of 4 (AVX2) or 8 rows of x, then widened tiles
        x = torch.randn(m, cols)
        expected = x @ dense.T
        ours = q.gguf_matmul(x, w, int(qtype), cols)
        assert (ours - expected).abs().max() <= RTOL * expected.abs().max(), (qtype.name, m)
        # a row's sums do not depend on the batch: the batch-invariant mode's product
        alone = q.gguf_matmul(x[-1:], w, int(qtype), cols, batch_invariant=True)
        assert torch.equal(q.gguf_matmul(x, w, int(qtype), cols, batch_invariant=True)[-1:], alone)
    xb = torch.randn(3, cols).bfloat16()
    ours = q.gguf_matmul(xb, w, int(qtype), cols)
    assert ours.dtype == torch.bfloat16
    assert torch.allclose(ours.float(), (xb.float() @ dense.T).bfloat16().float(), rtol=2e-2, atol=1e-2)


@pytest.mark.skipif(not INT8, reason="no AVX2")
@pytest.mark.parametrize("activations", ["int8", "int8x2"])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_int8_activation_products_are_the_rounded_activations_exact_product(qtype, activations):
    rows, cols = 19, 512
    raw = random_blocks(qtype, rows, cols, seed=4)
    dense = reference(raw, qtype, cols).double()
    w = torch.from_numpy(raw)
    torch.manual_seed(1)
    for m in (1, 3, min(9, codebook.INT8_MAX_ROWS[activations])):  # 9: a group of 8 rows, then one
        x = torch.randn(m, cols)
        x[0, 256:] = 0  # all-zero runs: scale 0, no division by it
        ours = q.gguf_matmul(x, w, int(qtype), cols, activations=activations)
        expected = rounded_to_int8(x, activations == "int8x2").double() @ dense.T
        assert (ours.double() - expected).abs().max() <= RTOL * expected.abs().max(), (qtype.name, m)
        assert (ours.double() - x.double() @ dense.T).abs().max() > 1e-7 * expected.abs().max()  # rounded
    x = torch.randn(3, cols)
    x[1, 5], x[2, 300] = float("nan"), float("inf")
    ours = q.gguf_matmul(x, w, int(qtype), cols, activations=activations)
    assert ours[0].isfinite().all() and ours[1].isnan().all() and not ours[2].isfinite().any()
    past = torch.randn(codebook.INT8_MAX_ROWS[activations] + 1, cols)  # the float32 product past the bound
    assert torch.equal(q.gguf_matmul(past, w, int(qtype), cols, activations=activations),
                       q.gguf_matmul(past, w, int(qtype), cols))


def test_the_fallback_without_compiled_kernels_gives_the_same_results(monkeypatch):
    raw = torch.from_numpy(random_blocks(T.IQ4_XS, 20, 256, seed=2))
    x = torch.randn(5, 256)
    compiled = q.gguf_matmul(x, raw, int(T.IQ4_XS), 256)
    monkeypatch.setattr(cpu, "codebook_kernels", lambda: None)
    assert (q.gguf_matmul(x, raw, int(T.IQ4_XS), 256) - compiled).abs().max() <= RTOL * compiled.abs().max()
    assert torch.equal(q.dequantize_rows(raw, int(T.IQ4_XS), 256, torch.arange(20), torch.float32),
                       reference(raw.numpy(), T.IQ4_XS, 256))

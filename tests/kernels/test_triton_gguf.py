"""The Triton GGUF product (layers/quant/triton_gguf.py) against gguf-py's dequantization: under
Triton's interpreter on CPU tensors here, compiled on a GPU when there is one."""
from __future__ import annotations

from pagellm.attention.interpreter import use_interpreter_without_gpu

use_interpreter_without_gpu()

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

from pagellm.layers.quant import triton_gguf  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("m,n,k", [(1, 70, 256), (5, 64, 512), (33, 130, 256)])
def test_matches_the_dequantized_product(qtype, m, n, k):
    rng = np.random.default_rng(7)
    if qtype in (T.Q4_K, T.Q6_K):
        # gguf-py cannot quantize to K-quants: random block bytes with finite float16 scales.
        from tests.kernels.gguf_blocks import random_blocks

        raw = random_blocks(qtype, n, k, seed=7)
    else:
        raw = quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    dense = torch.from_numpy(np.asarray(dequantize(raw, qtype), dtype=np.float32).reshape(n, k))
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
    got = triton_gguf.gguf_matmul(x.to(DEVICE), torch.from_numpy(raw).to(DEVICE), int(qtype), k).cpu()
    want = x.double() @ dense.double().T
    # fp32 products of K terms, summed in another order than float64's.
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4 * k ** 0.5)


def test_refuses_what_it_cannot_read():
    raw = torch.zeros(4, 34, dtype=torch.uint8)
    with pytest.raises(ValueError, match="no Triton kernel"):
        triton_gguf.gguf_matmul(torch.zeros(1, 256), raw, int(T.Q5_K), 256)
    with pytest.raises(ValueError, match="bytes per row"):
        triton_gguf.gguf_matmul(torch.zeros(1, 64), raw, int(T.Q8_0), 64)

"""The tests' own K-quant encoder (gguf_blocks.quantize_k) against gguf-py's decoder: every value of
random rows comes back within half its run's step (the step read from the blocks as gguf-py reads
it), the error is the type's (relative RMS bounds measured on these rows), and decoded values encode
back to themselves. Nothing here builds the CPU kernels."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import Q4_K, dequantize

from tests.kernels.gguf_blocks import quantize_k

K_TYPES = [T.Q4_K, T.Q5_K, T.Q6_K]
# Relative RMS error (of the rows' RMS) each type must stay under on the rows below but "heavy". Measured:
# Q4_K 0.042-0.076 (0.074 on normal rows), Q5_K 0.020-0.036, Q6_K 0.015-0.0177; on heavy-tailed rows (Student's
# t, 2 degrees), whose outliers stretch their runs' steps, 0.108 / 0.053 / 0.029.
RMS_BOUND = {T.Q4_K: 0.085, T.Q5_K: 0.042, T.Q6_K: 0.021}
ROWS, COLS = 16, 512


def _rows(kind: str) -> np.ndarray:
    """ROWS x COLS float32 values of one kind (each row two super-blocks of 256)."""
    rng = np.random.default_rng(["normal", "weights", "positive", "negative", "skewed", "zeros", "heavy"].index(kind))
    x = {"normal": lambda: rng.standard_normal((ROWS, COLS)),
         "weights": lambda: rng.standard_normal((ROWS, COLS)) * 0.02,  # a small model's weights
         "positive": lambda: np.abs(rng.standard_normal((ROWS, COLS))),
         "negative": lambda: -np.abs(rng.standard_normal((ROWS, COLS))),
         "skewed": lambda: rng.uniform(-3, 1, (ROWS, COLS)),
         "zeros": lambda: rng.standard_normal((ROWS, COLS)),
         "heavy": lambda: rng.standard_t(2, (ROWS, COLS))}[kind]().astype(np.float32)
    if kind == "zeros":  # a zero run of 32 (Q4_K / Q5_K's), one of 16 (Q6_K's; half a run of 32), a zero super-block
        x[:, 32:64] = 0
        x[:, 304:320] = 0
        x[0, :256] = 0
    return x


KINDS = ["normal", "weights", "positive", "negative", "skewed", "zeros", "heavy"]


def _steps(blocks: np.ndarray, qtype: T) -> np.ndarray:
    """Each value's step |d * sc| as gguf-py's decoder reads the blocks, [rows, COLS]."""
    b = blocks.reshape(-1, GGML_QUANT_SIZES[qtype][1])
    if qtype == T.Q6_K:
        d = b[:, 208:210].copy().view(np.float16).astype(np.float32)
        step = np.abs(d * b[:, 192:208].copy().view(np.int8).astype(np.float32))  # [blocks, 16 runs of 16]
        return np.repeat(step, 16, axis=-1).reshape(ROWS, COLS)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
    sc, _ = Q4_K.get_scale_min(b[:, 4:16].copy())
    return np.repeat(d * sc.astype(np.float32), 32, axis=-1).reshape(ROWS, COLS)  # 8 runs of 32


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
def test_k_quant_blocks_decode_within_half_a_step(qtype, kind):
    x = _rows(kind)
    blocks = quantize_k(x, qtype)
    assert blocks.dtype == np.uint8 and blocks.shape == (ROWS, COLS // 256 * GGML_QUANT_SIZES[qtype][1])
    y = dequantize(blocks, qtype).reshape(ROWS, COLS)
    # Half a step, and float32 rounding of the values and offsets (the grids cover each run up to 1e-5 of it).
    amax = np.repeat(np.abs(x).reshape(-1, 256).max(-1), 256).reshape(ROWS, COLS)
    err = np.abs(y - x)
    assert (err <= 0.5 * _steps(blocks, qtype) + 3e-5 * amax).all(), err.max()
    if kind == "zeros":  # zero runs decode to zeros
        assert (y[:, 32:64] == 0).all() and (y[0, :256] == 0).all()
        assert qtype != T.Q6_K or (y[:, 304:320] == 0).all()
    if kind != "heavy":
        assert np.sqrt(((y - x) ** 2).mean() / (x ** 2).mean()) < RMS_BOUND[qtype]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
def test_k_quant_values_encode_back_to_themselves(qtype, kind):
    """The runs' grids are chosen so that decoded values re-encode exactly: the same values, bit for bit."""
    y = dequantize(quantize_k(_rows(kind), qtype), qtype).reshape(ROWS, COLS)
    assert np.array_equal(dequantize(quantize_k(y, qtype), qtype).reshape(ROWS, COLS), y)

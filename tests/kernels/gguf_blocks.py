"""Random GGUF blocks for kernel tests and benchmarks. Kept apart from test_quant_ops, whose import
builds the CPU kernels: the Triton tests on a GPU machine need the blocks, not the CPU build."""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

# Byte offsets of each block's float16 scales (the rest of a block may be any bytes).
HALF_OFFSETS = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q8_0: [0], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
                T.IQ4_NL: [0], T.IQ4_XS: [0], T.MXFP4: []}
# Byte offsets of each block's E8M0 exponent (MXFP4's scale: 2^(e - 128)).
EXPONENT_OFFSETS = {T.MXFP4: [0]}


def random_blocks(qtype: T, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Valid blocks of random content: any bits for the quants and sub-scales, small finite scales."""
    rng = np.random.default_rng(seed)
    values, nbytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // values, nbytes), dtype=np.uint8)
    for off in HALF_OFFSETS[qtype]:
        scales = (rng.standard_normal((rows, cols // values)) * 0.01).astype(np.float16)
        raw[:, :, off:off + 2] = scales.view(np.uint8).reshape(rows, cols // values, 2)
    for off in EXPONENT_OFFSETS.get(qtype, []):  # scales 2^-11 .. 2^-4, like the fp16 ones above
        raw[:, :, off] = rng.integers(117, 125, size=(rows, cols // values), dtype=np.uint8)
    return raw.reshape(rows, -1)


def reference(raw: np.ndarray, qtype: T, cols: int) -> torch.Tensor:
    """gguf-py's dequantization of `raw`, as float32 rows."""
    return torch.from_numpy(np.asarray(dequantize(raw, qtype), dtype=np.float32).reshape(raw.shape[0], cols))


IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)


def _iq4_runs(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Runs [n, 32] as 16 bytes of codes each (nearest table value to x / scale; value j in byte
    j % 16's low nibble for j < 16, else its high one)."""
    safe = np.where(scale == 0, 1, scale)
    codes = np.abs(x[..., None] / safe[:, None, None] - IQ4_VALUES).argmin(-1).astype(np.uint8)
    return codes[:, :16] | (codes[:, 16:] << 4)


def quantize_iq4(dense: np.ndarray, qtype: T) -> np.ndarray:
    """IQ4_NL or IQ4_XS blocks of float32 rows [..., K], by a plain nearest-value encoder (gguf-py only
    decodes these types; llama.cpp's encoder searches scales harder, the format is the same)."""
    rows = dense.reshape(-1, 32).astype(np.float32)
    if qtype == T.IQ4_NL:
        d = (np.abs(rows).max(-1) / 127).astype(np.float16)
        out = np.concatenate([d.view(np.uint8).reshape(-1, 2), _iq4_runs(rows, d.astype(np.float32))], axis=-1)
        return out.reshape(*dense.shape[:-1], -1)
    sub = np.abs(rows).max(-1).reshape(-1, 8) / 127  # IQ4_XS: each run's ideal scale, 8 runs a super-block
    d = (np.abs(sub).max(-1) / 31).astype(np.float16)
    df = np.where(d == 0, 1, d.astype(np.float32))
    ls = np.clip(np.round(sub / df[:, None]) + 32, 0, 63).astype(np.uint16)
    run_scale = d.astype(np.float32)[:, None] * (ls.astype(np.float32) - 32)
    qs = _iq4_runs(rows, run_scale.reshape(-1)).reshape(-1, 128)
    high = np.bitwise_or.reduce((ls >> 4) << (2 * np.arange(8, dtype=np.uint16)), axis=-1).astype(np.uint16)
    low = (ls & 0x0F).astype(np.uint8)
    out = np.concatenate([d.view(np.uint8).reshape(-1, 2), high.view(np.uint8).reshape(-1, 2),
                          low[:, 0::2] | (low[:, 1::2] << 4), qs], axis=-1)
    return out.reshape(*dense.shape[:-1], -1)


def _fp16_up(v: np.ndarray) -> np.ndarray:
    """The float16 nearest v, stepped up where it falls short of v by more than float32 rounding (a scale
    that must reach v; re-derived from values it encoded, it comes back unchanged)."""
    h = v.astype(np.float16)
    return np.where(h.astype(np.float32) < v * np.float32(1 - 1e-5), np.nextafter(h, np.float16(np.inf)), h)


def _k_search(x: np.ndarray, d: np.ndarray, dmin: np.ndarray, nsc: int, nmin: int, qmin: int, qmax: int):
    """For each run x [n, runs, values] the codes of the (scale, min) pair, scale in 0..nsc-1 (step d * scale)
    and min in 0..nmin-1 (offset dmin * min), whose values d*sc*q - dmin*m cover the run (up to float32
    rounding) with the least squared error; q in qmin..qmax. Values on one of these grids (same d, dmin) come
    back exactly: their own pair has no error. Returns (sc, m, q) as integers."""
    f = np.float32
    sc_all, m_all = np.arange(nsc, dtype=f), np.arange(nmin, dtype=f)
    sc_out = np.empty(x.shape[:2], dtype=np.int64)
    m_out = np.empty(x.shape[:2], dtype=np.int64)
    chunk = max(1, (1 << 22) // (x.shape[1] * nsc * nmin * x.shape[2]))  # ~4M values of work at a time
    for s in range(0, x.shape[0], chunk):
        xs = x[s:s + chunk, :, None, None, :]
        step = (d[s:s + chunk, None, None, None] * sc_all)[..., None]  # [n, 1, 1, nsc, 1]
        off = (dmin[s:s + chunk, None, None] * m_all)[..., None, None]  # [n, 1, nmin, 1, 1]
        with np.errstate(divide="ignore"):
            inv = np.where(step > 0, f(1) / step, f(0))
        r = (xs + off) * inv  # the codes, then the values they decode to (as gguf-py computes them)
        np.clip(np.rint(r, out=r), qmin, qmax, out=r)
        np.subtract(xs, np.subtract(np.multiply(step, r, out=r), off, out=r), out=r)
        err = np.einsum("...v,...v->...", r, r)  # [n, runs, nmin, nsc]
        lo, hi = x[s:s + chunk].min(-1)[..., None, None], x[s:s + chunk].max(-1)[..., None, None]
        tol = f(1e-5) * (np.abs(lo) + np.abs(hi) + off[..., 0]) + f(1e-30)
        covers = (step[..., 0] * qmin - off[..., 0] <= lo + tol) & (step[..., 0] * qmax - off[..., 0] >= hi - tol)
        best = np.where(covers, err, np.inf).reshape(*err.shape[:2], -1).argmin(-1)
        m_out[s:s + chunk], sc_out[s:s + chunk] = best // nsc, best % nsc
    step = d[:, None] * sc_out.astype(f)
    off = dmin[:, None] * m_out.astype(f)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.clip(np.rint(np.where(step[..., None] > 0, (x + off[..., None]) / step[..., None], 0)), qmin, qmax)
    return sc_out, m_out, q.astype(np.int64)


def _k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 12 bytes of eight 6-bit scales and mins: bytes 0-3 scales 0-3, 4-7 mins 0-3, each with
    the top 2 bits of scale / min j + 4 above; bytes 8-11 their low 4 bits (scale low, min high)."""
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    return np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), m[:, :4] | ((m[:, 4:] >> 4) << 6),
                           (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)], axis=-1)


def quantize_k(dense: np.ndarray, qtype: T) -> np.ndarray:
    """Q4_K, Q5_K or Q6_K blocks of float32 rows [..., K], K a multiple of 256 (gguf-py only decodes
    these types). Super-block scales d (and dmin) just reach the largest run's needs; each run's 6-bit
    scale (and min; Q6_K: int8 scale per 16 values) is the one of least squared error among those whose
    grid covers the run, so every value is within half its run's step d * sc of the input (llama.cpp's
    encoder also weighs and shifts the runs, the format is the same). The values the blocks decode to
    encode back to the same values: the largest runs' extremes land on their grids' ends, so d and dmin
    come back (short of d or dmin in float16's coarse subnormals, or runs of nearly equal values)."""
    if dense.shape[-1] % 256:
        raise ValueError(f"K-quant rows are runs of 256 values, not {dense.shape[-1]}")
    f = np.float32
    x = dense.reshape(-1, 256).astype(f)
    if qtype == T.Q6_K:  # value = d * sc * (q - 32), sc int8 per 16 values; the codes -31..31 used
        runs = x.reshape(-1, 16, 16)
        d = _fp16_up(np.abs(x).max(-1) / f(31 * 127))
        sc, _, q = _k_search(runs, d.astype(f), np.zeros_like(d, dtype=f), 128, 1, -31, 31)
        q = (q + 32).astype(np.uint8).reshape(-1, 2, 128)  # halves of 128 values
        low = (q & 0x0F).reshape(-1, 2, 2, 64)  # [half, nibble, byte]
        high = (q >> 4).reshape(-1, 2, 4, 32)  # [half, bit pair, byte]
        ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
        qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(-1, 64)
        out = np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), d.view(np.uint8).reshape(-1, 2)], axis=-1)
        return out.reshape(*dense.shape[:-1], -1)
    if qtype not in (T.Q4_K, T.Q5_K):
        raise ValueError(f"quantize_k takes Q4_K, Q5_K and Q6_K, not {qtype!r}")
    nmax = 15 if qtype == T.Q4_K else 31
    runs = x.reshape(-1, 8, 32)  # value = d * sc * q - dmin * m per run of 32, q in 0..nmax
    neg = np.maximum(-runs.min(-1), 0)  # the offset each run needs
    dmin = _fp16_up(neg.max(-1) / f(63))
    dminf = dmin.astype(f)
    with np.errstate(divide="ignore", invalid="ignore"):
        m_least = np.where(dminf[:, None] > 0, np.minimum(np.ceil(neg / dminf[:, None]), 63), 0)
    d = _fp16_up((runs.max(-1) + dminf[:, None] * m_least).max(-1) / f(63 * nmax))
    sc, m, q = _k_search(runs, d.astype(f), dminf, 64, 64, 0, nmax)
    q = q.astype(np.uint8).reshape(-1, 4, 2, 32)  # [pair of runs, run, value]
    qs = ((q[:, :, 0] & 0x0F) | ((q[:, :, 1] & 0x0F) << 4)).reshape(-1, 128)
    parts = [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), _k_scales(sc, m)]
    if qtype == T.Q5_K:  # bit j of qh byte l: the fifth bit of value 32 j + l
        fifth = q.reshape(-1, 8, 32) >> 4
        parts.append(np.bitwise_or.reduce(fifth << np.arange(8, dtype=np.uint8)[None, :, None], axis=1))
    return np.concatenate([*parts, qs], axis=-1).reshape(*dense.shape[:-1], -1)

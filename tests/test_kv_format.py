"""The stored formats of the KV cache (kv_format.py): sizes, error bounds, odd rows."""
from __future__ import annotations

import pytest
import torch

from pagellm.kv_format import plain_rows, resolve_kv_format
from pagellm.config import make_config

EIGHT_BIT = ["int8", "fp8_e4m3", "fp8_e5m2"]


@pytest.mark.parametrize("name", EIGHT_BIT)
def test_row_bytes_are_codes_and_a_float16_scale(name):
    fmt = resolve_kv_format(name, torch.float32)
    assert fmt.quantized and fmt.storage_dtype == torch.uint8
    assert fmt.bytes_per_row(64) == 66 and fmt.bytes_per_row(128) == 130
    rows = fmt.encode(torch.randn(5, 3, 64))
    assert rows.shape == (5, 3, 66) and rows.dtype == torch.uint8
    # Against bfloat16, the format that --dtype bfloat16 caches in: 1.94x the tokens per byte at D = 64.
    bf16 = resolve_kv_format("bfloat16", torch.float32)
    assert bf16.bytes_per_row(64) / fmt.bytes_per_row(64) > 1.9


def test_float16_rows_saturate_instead_of_overflowing():
    x = torch.tensor([1e6, -1e6, 70000.0, 1.5, float("nan")])
    for source in (torch.float32, torch.bfloat16):
        rows = plain_rows(x.to(source), torch.float16)
        assert rows.dtype == torch.float16
        assert rows[:4].tolist() == [65504.0, -65504.0, 65504.0, 1.5] and rows[4].isnan()
    assert resolve_kv_format("float16", torch.float32).encode(x)[0] == 65504.0
    assert plain_rows(x, torch.float32) is x  # other caches take the values as they are


def test_auto_follows_the_model_and_fp8_means_e4m3():
    assert resolve_kv_format("auto", torch.bfloat16).dtype == torch.bfloat16
    assert resolve_kv_format("auto", torch.float32).bytes_per_row(64) == 256
    assert resolve_kv_format("fp8", torch.float32) == resolve_kv_format("fp8_e4m3", torch.float32)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        resolve_kv_format("int4", torch.float32)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of .*got 'fp16'"):
        make_config(kv_cache_dtype="fp16")


# The largest error of a decoded value, relative to its row's largest magnitude: half a step of
# 127 for int8; for fp8, half an ulp at the top of the range (3 and 2 mantissa bits).
BOUND = {"int8": 0.5 / 127, "fp8_e4m3": 2.0 ** -4, "fp8_e5m2": 2.0 ** -3}


@pytest.mark.parametrize("name", EIGHT_BIT)
@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 300.0, 1e5])
def test_decoded_rows_stay_within_the_format_s_step(name, magnitude):
    fmt = resolve_kv_format(name, torch.float32)
    torch.manual_seed(0)
    x = torch.randn(64, 4, 128) * magnitude * torch.rand(64, 4, 1)
    got = fmt.decode(fmt.encode(x))
    amax = x.abs().amax(-1, keepdim=True)
    # Scales are floored at 2**-14 (float16's smallest normal): rows that small are stored to
    # within 2**-15 absolute rather than relative to their size.
    err = ((got - x).abs() - 2.0 ** -15).clamp(min=0) / amax
    assert err.max().item() <= BOUND[name] * 1.01
    # fp8 is relative near zero too: small values keep their size, not just the row's step.
    if name != "int8" and magnitude >= 1:
        mid = (x.abs() > amax / 64)
        assert (((got - x).abs() / x.abs())[mid]).max().item() <= BOUND[name] * 1.01


@pytest.mark.parametrize("name", EIGHT_BIT)
def test_zero_tiny_and_one_hot_rows(name):
    fmt = resolve_kv_format(name, torch.float32)
    x = torch.zeros(3, 1, 16)
    x[1, 0] = 1e-9  # below the scale's floor: stored within 2**-15 absolute (as 0)
    x[2, 0, 5] = -7.0  # one large value: within the step, the rest exactly 0
    got = fmt.decode(fmt.encode(x))
    assert torch.equal(got[0], x[0])
    assert got[1].abs().max() <= 2.0 ** -15
    assert (got[2] - x[2]).abs().max() <= 7.0 * BOUND[name] and torch.count_nonzero(got[2]) == 1


def test_one_numbering_of_the_formats_reaches_every_kernel():
    """KVCode is the only place the formats are numbered: the C++ build gets it as defines, the
    Triton kernels compare against it, and a number that is no KVCode is refused by the kernels."""
    from pagellm.attention.interpreter import use_interpreter_without_gpu

    use_interpreter_without_gpu()  # before the kernels are defined, as tests/attention does
    from pagellm.attention import triton_kernels as tk
    from pagellm.kernels import cpu
    from pagellm.kv_format import KVCode, kernel_defines

    assert {resolve_kv_format(n, torch.float32).kernel_code for n in ("int8", "fp8_e4m3", "fp8_e5m2")} == \
        set(KVCode) - {KVCode.PLAIN}
    assert kernel_defines() == [f"-DPAGELLM_KV_{c.name}={int(c)}" for c in KVCode]
    assert (tk.KV_PLAIN.value, tk.KV_INT8.value, tk.KV_FP8_E4M3.value) == (KVCode.PLAIN, KVCode.INT8, KVCode.FP8_E4M3)
    if cpu.available():
        k = torch.zeros(1, 2, 16)
        cache = torch.zeros(4, 4, 2, 18, dtype=torch.uint8)
        with pytest.raises(RuntimeError, match="kv_format 7 is no KVCode"):
            cpu._load().store_kv(k, k, cache, cache.clone(), torch.zeros(1, dtype=torch.long), 7)

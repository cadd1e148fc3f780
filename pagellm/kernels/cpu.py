"""Fused kernels for the CPU path, compiled on first use: float32 and bfloat16.

torch has no op that reads K/V through a block table, so the pure-torch path gathers
each sequence's blocks into a padded copy before attending; on the CPU that copy, not
the arithmetic, dominates a long-context decode step. RoPE and the MLP's activation are
chains of small element-wise ops in torch, each a full pass over memory. The C++ in
csrc/cpu_ops.cpp does each in one pass (see its header). It is compiled once
(torch.utils.cpp_extension, cached under TORCH_EXTENSIONS_DIR); when no compiler is at
hand, or PAGELLM_CPU_KERNELS=0, the torch code runs instead, with the same results up
to float rounding (bit-identical for float32 RoPE). csrc/quant_ops.cpp, the matrix product
over GGUF-quantized weights, is a second extension built the same way (see layers/quant/), and
csrc/quant_codebook_ops.cpp, the same for the types whose 4-bit codes index a table (MXFP4,
IQ4_NL, IQ4_XS), a third.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import time
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
import torch

from pagellm import envs
from pagellm.kv_format import KVFormat, kernel_code, kernel_defines

logger = logging.getLogger(__name__)
_DTYPES = (torch.float32, torch.bfloat16)
_KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # plain caches the kernels read and write
_CSRC = Path(__file__).with_name("csrc")
_SOURCE = _CSRC / "cpu_ops.cpp"
# The GGUF-blocks matmul is a second extension, built only when a quantized model is loaded.
_QUANT_SOURCE = _CSRC / "quant_ops.cpp"
_CODEBOOK_SOURCE = _CSRC / "quant_codebook_ops.cpp"


def build_name(source: Path | None = None) -> str:
    """The extension's name, keyed by its source and the -march it is built for: two checkouts (or
    versions, or instruction sets) on one machine each keep their own build instead of rebuilding
    each other's."""
    source = source or _SOURCE
    march = envs.cpu_march()
    suffix = "" if march == "native" else "_" + "".join(c if c.isalnum() else "_" for c in march)
    digest = hashlib.sha256(source.read_bytes() + " ".join(kernel_defines()).encode()).hexdigest()[:16]
    return f"pagellm_{source.stem}_{digest}{suffix}"


def _build_directory(name: str) -> str | None:
    """Where torch builds this extension (None if its private helper for that is gone: then the
    build runs without our lock, and the log line below says nothing)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        return _get_build_directory(name, verbose=False)
    except Exception:
        return None


@contextlib.contextmanager
def build_lock(build_dir: str) -> Iterator[None]:
    """Hold the build directory while torch builds or loads the extension, and clear a lock that
    a dead builder left behind.

    torch's own lock is a file that exists while someone builds; a builder killed mid-build (a
    test run stopped with Ctrl-C) leaves it, and every later process then waits for it forever.
    An flock is released by the kernel when its holder dies, so whoever holds ours is the only
    pagellm process building this extension: a torch lock file it finds is stale and goes."""
    os.makedirs(build_dir, exist_ok=True)
    with open(os.path.join(build_dir, "pagellm.flock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # a live builder holds it for the length of its build
        try:
            stale = os.path.join(build_dir, "lock")
            if os.path.exists(stale):
                logger.warning("pagellm: removing %s, left by a build that did not finish", stale)
                with contextlib.suppress(FileNotFoundError):
                    os.remove(stale)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@lru_cache(maxsize=None)
def _build(source: Path, what: str):
    if not envs.cpu_kernels_enabled():
        return None
    try:
        from torch.utils.cpp_extension import load

        name = build_name(source)
        build_dir = _build_directory(name)
        built = build_dir is None or os.path.exists(os.path.join(build_dir, f"{name}.so"))
        if not built:  # say why the first start takes a while
            logger.warning("pagellm: building the %s (once per version of their source; about 30 s)", what)
        start = time.monotonic()
        with build_lock(build_dir) if build_dir else contextlib.nullcontext():
            module = load(name=name, sources=[str(source)],
                          extra_cflags=["-O3", f"-march={envs.cpu_march()}", "-fopenmp", *kernel_defines()],
                          extra_ldflags=["-fopenmp"],
                          verbose=False)
        if not built:
            logger.warning("pagellm: %s built in %.0f s", what, time.monotonic() - start)
        return module
    except Exception as e:  # no compiler, no ninja, a broken toolchain: fall back, loudly once
        logger.warning("pagellm: %s unavailable (%s); using the torch path", what, e)
        return None


def _load():
    return _build(_SOURCE, "CPU kernels")


def quant_kernels():
    """The GGUF-blocks kernels (csrc/quant_ops.cpp), or None where they cannot be built."""
    return _build(_QUANT_SOURCE, "quantized-matmul CPU kernels")


def codebook_kernels():
    """The MXFP4 / IQ4_NL / IQ4_XS kernels (csrc/quant_codebook_ops.cpp), or None where they cannot be built."""
    return _build(_CODEBOOK_SOURCE, "MXFP4 / IQ4 CPU kernels")


def available() -> bool:
    return _load() is not None


def usable(x: torch.Tensor) -> bool:
    """Whether the compiled element-wise kernels serve this tensor: float32 or bfloat16 on the CPU, and built."""
    return x.is_cpu and x.dtype in _DTYPES and available()  # is_cpu: a fifth of device.type's cost, per call


def kv_kernels_usable(x: torch.Tensor, k_cache: torch.Tensor, kv_format: KVFormat | None = None) -> bool:
    """Whether the kernels that read and write the paged cache (paged_attention, store_kv) serve
    x (the step's q, or its new k) and this cache: CPU tensors, a float32, bfloat16, float16 or 8-bit cache, contiguous
    (not a layer's view of a larger slot, model_runner._allocate_mixed_shapes), built."""
    plain = kv_format is None or not kv_format.quantized
    return k_cache.is_cpu and (k_cache.dtype in _KV_DTYPES or not plain) and k_cache.is_contiguous() and usable(x)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
                    softcap: float | None = None, sinks: torch.Tensor | None = None,
                    token_seq: torch.Tensor | None = None, fixed_run: int = 0,
                    kv_format: KVFormat | None = None, attention_chunk: int | None = None) -> torch.Tensor:
    """q: [B, H, D] on the CPU, B query tokens; a float32, bfloat16 or float16 cache, or an 8-bit one of
    `kv_format` (kv_format.py). Returns [B, H, D] in q's dtype.

    Query b reads the first `seq_lens[b]` keys of block-table row `token_seq[b]` (None: row b, one
    decode token per sequence). The arithmetic is float32 either way: a 16-bit cache is widened
    as it is read, 8-bit codes are widened and scaled by their row's scale. With a sliding window
    W only the last W keys are read; with `attention_chunk` C only the keys of the query's own chunk
    of C positions (Llama 4); `softcap` caps each score (Gemma 2); `sinks` [H] join each head's softmax
    denominator (gpt-oss). `fixed_run` > 0
    splits long contexts at fixed positions (batch-invariant mode); 0 splits by the batch's load.
    """
    out = _load().paged_attention(q.float(), k_cache, v_cache, block_tables, seq_lens, scale, sliding_window or 0,
                                  attention_chunk or 0, softcap or 0.0, sinks, token_seq, fixed_run,
                                  kernel_code(kv_format))
    return out if q.dtype == torch.float32 else out.to(q.dtype)


def set_attention_lanes_from(lanes: int) -> int | None:
    """From how many query heads per KV head paged_attention reads a bfloat16 or 8-bit cache with
    its lanes kernel (csrc/cpu_ops.cpp, attend_run_lanes), for every head size; 0 restores the
    built-in crossovers (8 at head size 64, 12 at 128). Returns the previous setting, or None in
    builds without AVX-512, which have one kernel only. For the measurements and tests that compare
    the two kernels."""
    return _load().set_attention_lanes_from(lanes)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor, kv_format: KVFormat | None = None) -> None:
    """Write k, v [T, KVH, D] into the caches' rows at `slots` [T]: float32, bfloat16 or float16 caches
    (kv_format None or unquantized) get the values converted as `kv_format.plain_rows` converts them, uint8
    caches of a quantized `kv_format` the same bytes as `kv_format.encode`; one call instead of
    two index_copy_ (or a dozen torch ops for 8-bit rows) per layer."""
    _load().store_kv(k, v, k_cache, v_cache, slots, kernel_code(kv_format))


def decode_attention_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int,
                         rope: tuple[torch.Tensor, torch.Tensor] | None, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
                         seq_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
                         softcap: float | None = None, sinks: torch.Tensor | None = None,
                         kv_format: KVFormat | None = None,
                         qk_norm: tuple[torch.Tensor, torch.Tensor, float, bool] | None = None,
                         attention_chunk: int | None = None, token_seq: torch.Tensor | None = None) -> torch.Tensor:
    """A decode step's attention for one layer, from its fused projection qkv [T, (H + 2 KVH) * D]
    (T decode tokens, one per block-table row): q and k normalized in place where `qk_norm` =
    (q weight, k weight, eps, per_head) is given (rms_norm's roundings; per head, weights [D], or
    over all heads, weights [H * D] and [KVH * D]), rotary_embedding_ of q and k in place with
    rope = (cos, sin) [T, D] (None: no rotation), store_kv, then paged_attention (with its window,
    chunk, soft-cap and sinks), in one call. With `token_seq` [T] (a speculative verification's
    tokens, several a sequence): token t reads block_tables' row token_seq[t] and attends to its
    first seq_lens[t] keys, as paged_attention's token_seq.
    Returns [T, H * D] in qkv's dtype."""
    cos, sin = rope if rope is not None else (None, None)
    return _load().decode_attention_qkv(qkv, num_heads, num_kv_heads, cos, sin, k_cache, v_cache, slots, block_tables,
                                        seq_lens, *_decode_options(scale, sliding_window, softcap, sinks, kv_format,
                                                                   qk_norm, attention_chunk), token_seq)


def _decode_options(scale: float, sliding_window: int | None, softcap: float | None, sinks: torch.Tensor | None,
                    kv_format: KVFormat | None, qk_norm: tuple[torch.Tensor, torch.Tensor, float, bool] | None,
                    attention_chunk: int | None) -> tuple:
    """decode_attention_qkv's compiled arguments after the step's tensors, as the kernel takes them."""
    q_norm, k_norm, eps, per_head = qk_norm if qk_norm is not None else (None, None, 0.0, False)
    return (scale, sliding_window or 0, attention_chunk or 0, softcap or 0.0, sinks, kernel_code(kv_format),
            q_norm, k_norm, eps, per_head)


class DecodeAttention:
    """decode_attention_qkv with one layer's fixed arguments bound once (layers/decode_plan.py):
    a call passes only what changes between steps."""

    __slots__ = ("kernel", "num_heads", "num_kv_heads", "tail")

    def __init__(self, num_heads: int, num_kv_heads: int, scale: float, sliding_window: int | None,
                 softcap: float | None, sinks: torch.Tensor | None, kv_format: KVFormat | None,
                 qk_norm: tuple[torch.Tensor, torch.Tensor, float, bool] | None,
                 attention_chunk: int | None) -> None:
        self.kernel = _load().decode_attention_qkv
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.tail = _decode_options(scale, sliding_window, softcap, sinks, kv_format, qk_norm, attention_chunk)

    def __call__(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor) -> torch.Tensor:
        cos, sin = rope if rope is not None else (None, None)
        return self.kernel(qkv, self.num_heads, self.num_kv_heads, cos, sin, k_cache, v_cache, slots, block_tables,
                           seq_lens, *self.tail)


def row_logsumexp(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logsumexp, index of the maximum) of each row of float32 x [B, V] on the CPU: each row summed
    in one order whatever B is; the first maximal index, or the first NaN, as torch.max gives."""
    lse, index = _load().row_logsumexp(x)
    return lse, index


def rotary_embedding_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q: [T, H, D] and k: [T, KVH, D] in place; cos, sin: [T, D] contiguous, q's dtype.

    float32: bit-identical to the reference formula. bfloat16: computed in float32 and
    rounded once, where torch's bfloat16 ops round three times.
    """
    _load().rotary_embedding_(q, k, cos, sin)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] (gate, then up) -> silu(gate) * up: [T, I], in x's dtype (float32 inside)."""
    return _load().silu_and_mul(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of float32 or bfloat16 rows x: [T, H] with the reference's roundings (float32
    statistics, the normalized row rounded to x's dtype before the weight multiplies it)."""
    return _load().rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + h, rms_norm(x + h)) for rows x, h: [T, H] of one dtype, in one call: the sum rounded to
    that dtype as torch's add rounds it, then rms_norm's roundings."""
    s, normed = _load().add_rms_norm(x, h, weight, eps)  # a list from C++; a pair here
    return s, normed


def gdn_decode_step(proj: torch.Tensor, conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                    norm_weight: torch.Tensor, eps: float, kv_cache: tuple[torch.Tensor, torch.Tensor],
                    block_ids: torch.Tensor, fresh: torch.Tensor, num_k_heads: int, dk: int, dv: int,
                    tiled: bool) -> torch.Tensor:
    """Gated DeltaNet's decode step (layers/gated_delta_net.py) for N sequences of one token each,
    float32: from in_proj's output proj [N, C + Hv dv + 2 Hv] (qkv, z, b, a) to out_proj's input
    [N, Hv dv] (the gated norm applied; heads in the tiled order where `tiled`). Each sequence's
    state (conv [C, K - 1] then ssm [Hv, dk, dv], float32) is read and updated where it lies:
    the bytes of its row of `block_ids` [N, blocks] in the pool kv_cache, K then V of each block
    (layers/recurrent.py's layout); the rows in `fresh` start from zeros. conv_weight: [C, K]."""
    k_cache, v_cache = kv_cache
    return _load().gdn_decode_step(proj, conv_weight, A_log, dt_bias, norm_weight, eps, k_cache, v_cache, block_ids,
                                   fresh, num_k_heads, dk, dv, tiled)

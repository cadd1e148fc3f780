"""GGUF-quantized weights served in their blocks: a linear method that keeps each weight as the
file stores it (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K; and MXFP4, IQ4_NL, IQ4_XS, whose products
are layers/quant/codebook.py's) and multiplies by it without ever building
the dense matrix.

A fused layer (q/k/v, gate/up) is filled from several file tensors, which may have different
types (a Q4_K_M file keeps v in Q6_K and q, k in Q4_K): each run of rows of one type is a
segment, multiplied on its own, and the segments' outputs are concatenated. Rows of a type
with no kernel arrive dequantized (the loader warns) and form dense segments. In the integer
activation modes a Q4_1, Q4_K or Q6_K segment is repacked at load into the kernels' tiles of 8
rows (repacked_type): `segment_types` keeps the file's type, `gguf_products` the layout's id.

Products (csrc/quant_ops.cpp): with `activation_quantization` "int8" (or "int8x2"), batches up to
int8_max_rows rows (by mode, weight type and build, as measured) round their activations to one int8
code per value (or two) and multiply them by the blocks with integer dot products (AVX-512 VNNI,
or AVX2's byte products on CPUs without it: the same rounding), as llama.cpp does: one scale per
32 values, or per 256 against the K-quants (Q4_K, Q5_K, Q6_K; in mode "int8x2" Q4_K and Q5_K, and
Q6_K in AVX-512 VNNI builds from 6 rows, whose two codes then join into one 16-bit value) as
llama.cpp's Q8_K, whose sub-block scales then apply to integer sums. Larger batches in mode
"int8" (prefills, and decode steps that a prefill joins) round their activations to bfloat16
instead and multiply bfloat16 tiles of the weight (AVX-512 BF16): past 16 rows a product is
compute-bound, and those tiles run 2-5x faster than float32 ones (benchmarks/quant_matmul.py). Larger
batches against repacked Q4_K / Q6_K, Q8_0 and Q5_K (and Q4_1 in AVX-512 VNNI builds; in AVX2 ones Q5_K
up to 256 rows, repacked Q4_1 up to 64) in mode "int8x2" (and "int8" without those tiles) stay integer:
csrc x8_prefill widens each group of 8 rows of W once to 16-bit values for all the rows of x
(prefill_types). On CPUs with AMX, products of at least `amx_min_rows` rows against repacked Q4_K / Q6_K
and Q8_0 and Q4_1 blocks (decode steps of many streams, prefills) multiply the same rounded activations
on its int8 tiles instead (csrc amx_product). Otherwise, up to FUSED_MAX_ROWS rows of activations
(decode steps) run the fused kernel, which streams the blocks once and multiplies in float32; larger
batches are compute-bound, and widen TILE_VALUES of the weight at a time for torch's GEMM (AVX-512 BF16
or AMX in bfloat16, so a bfloat16 model switches to tiles at fewer rows). Without a compiler the tiles
are widened by gguf-py instead: slow, same results.
"""
from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagellm.kernels import cpu
from pagellm.layers import invariant
from pagellm.layers.linear import DirectProduct, LinearMethod
from pagellm.layers.quant import codebook
from pagellm.layers.quant.formats import WeightFormat, register
from pagellm.layers.quant.gguf_types import BLOCK_TYPES
from pagellm.layers.quant.tiled import tiled_product

# GGML type id -> name, for the types with a kernel (gguf_types.py's table).
NATIVE_TYPES = {i: t.name for i, t in BLOCK_TYPES.items()}
# (values, bytes) per block.
_BLOCK = {i: (t.values, t.bytes) for i, t in BLOCK_TYPES.items()}
# Batches up to this many rows use the fused kernel, by activation dtype: past it, widened tiles
# through torch's GEMM win (measured per batch size: benchmarks/quant_matmul.py).
FUSED_MAX_ROWS = {torch.float32: 32, torch.bfloat16: 16}
# By activation_quantization: batches up to this many rows take the integer kernel, which beats the
# float32 one there on the measured shapes (benchmarks/quant_matmul.py): int8x2's second code costs a
# second dot product per row of x, so against AVX-512's float32 kernel it pays only while unpacking
# the blocks dominates (on 2026-12-04, Intel, quant-matmul-2026-12-04-native.json: alone, it wins at
# 4 rows on every shape, at 8 on most; in whole decode steps, 8 against 4: SmolLM2 Q4_1 at 6 and 8
# streams 1.4x faster, a 1B Q8_0 1.2-1.3x, 16 streams even: products-by-type-*-int8x2-bounds-*.json).
INT8_MAX_ROWS = {"int8": 16, "int8x2": 8}
# ... and up to WIDE_INT8_MAX_ROWS where the integer kernel keeps winning (wide_int8_types): in mode
# int8 against the K-quants, whose products take x a 256-value super-block at a time and apply the
# sub-block scales to integer sums (csrc int8_super_rows; 1B shapes at 32 rows: Q4_K gate/up 1.5x,
# Q6_K down 1.4x faster than bfloat16 tiles, quant-matmul-2026-12-03-q6k.json), and against every
# type where the CPU has no bfloat16 tiles to take over; in mode int8x2 against the K-quants where
# the integer kernels are AVX-512 VNNI, whose products of several rows then join each value's two
# codes into one 16-bit value (csrc wide_super_rows; at 16 rows Q4_K gate/up 3.7 ms against the
# float32 kernel's 7.0, Q6_K down 2.4 against 3.7), and against every type in AVX2 builds, whose
# float32 kernel (8 lanes, 16 registers) loses to two codes at every batch up to 32 on every shape
# (quant-matmul-2026-12-04-avx2.json: 1.1-1.9x at 16 rows); and in mode int8x2 against Q4_1 and
# Q8_0 in AVX-512 VNNI builds, whose products past 8 rows widen each group of 8 rows of W once to
# 16-bit values for all the rows of x (csrc widen_min_rows; the SmolLM2 shapes at 16 rows 1.2-1.5x
# the float32 kernel, its Q8_0 head 1.65x: benchmarks/kernel_ab.py).
K_QUANTS = frozenset(i for i, t in BLOCK_TYPES.items() if t.k_quant)
WIDE_INT8_MAX_ROWS = 32
# Past INT8_MAX_ROWS, mode "int8" rounds the activations to bfloat16 for bfloat16 tiles, where the
# CPU multiplies bfloat16 natively (AVX-512 BF16 / AMX); "int8x2" keeps float32 products, since its
# promise is ~15 bits per activation and bfloat16 keeps 8.
BF16_TILES = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()


class GGUFBlocks:
    """A 2-D weight as a GGUF file stores it: `data` uint8 [rows, row_bytes], each row a run of
    blocks of type `qtype` holding `cols` values. Quacks like the tensor slices the layers'
    loaders take: `shape`, `narrow`, and `to` (a no-op: blocks keep their type)."""

    def __init__(self, data: torch.Tensor, qtype: int, cols: int) -> None:
        values, nbytes = _BLOCK[qtype]
        if data.dim() != 2 or cols % values or data.shape[1] != cols // values * nbytes:
            raise ValueError(f"{NATIVE_TYPES[qtype]} rows of {cols} values take {cols // values * nbytes} bytes, "
                             f"got {tuple(data.shape)}")
        self.data, self.qtype, self.cols = data, qtype, cols

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.data.shape[0], self.cols))

    @property
    def type_name(self) -> str:
        return NATIVE_TYPES[self.qtype]

    def narrow(self, dim: int, start: int, length: int) -> GGUFBlocks:
        if dim == 0:
            return GGUFBlocks(self.data.narrow(0, start, length), self.qtype, self.cols)
        values, nbytes = _BLOCK[self.qtype]
        if start % values or length % values:
            # A row-parallel split must cut rows at block boundaries.
            raise ValueError(f"cannot split {self.type_name} rows of {self.cols} values at [{start}, {start + length}): "
                             f"not a multiple of its {values}-value blocks")
        return GGUFBlocks(self.data.narrow(1, start // values * nbytes, length // values * nbytes).contiguous(),
                          self.qtype, length)

    def to(self, *args, **kwargs) -> GGUFBlocks:
        return self

    def with_rows(self, data: torch.Tensor) -> GGUFBlocks:
        """The same type and width over other rows (reordered, padded)."""
        return GGUFBlocks(data, self.qtype, self.cols)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_rows(self.data, self.qtype, self.cols, torch.arange(self.data.shape[0]), dtype)


class ExpertBlocks:
    """Every expert's matrix of one kind (gate, up or down) as a GGUF file stacks them: `data`
    uint8 [experts, rows, row_bytes] of type `qtype`, rows of `cols` values. layers/moe.py keeps
    them so; anything else takes `dequantize()`."""

    def __init__(self, data: torch.Tensor, qtype: int, cols: int) -> None:
        GGUFBlocks(data[0], qtype, cols)  # checks the row size
        self.data, self.qtype, self.cols = data, qtype, cols

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.data.shape[:2], self.cols))

    @property
    def type_name(self) -> str:
        return NATIVE_TYPES[self.qtype]

    def to(self, *args, **kwargs) -> ExpertBlocks:
        return self

    def expert(self, e: int) -> GGUFBlocks:
        return GGUFBlocks(self.data[e], self.qtype, self.cols)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.stack([self.expert(e).dequantize(dtype) for e in range(self.data.shape[0])])


def dequantize_rows(data: torch.Tensor, qtype: int, cols: int, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `rows` of a block matrix as dense [len(rows), cols] rows of `dtype`."""
    kernels = cpu.quant_kernels() if data.device.type == "cpu" else None
    if qtype in _repacked_bases():  # only ever made by these kernels
        wide = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
        return kernels.gguf_dequantize_rows(data, qtype, cols, rows, wide).to(dtype)
    if qtype in codebook.CODEBOOK_TYPES:
        dense = codebook.dequantize_rows(data, qtype, cols, rows, dtype)
        if dense is not None:
            return dense
    elif kernels is not None and dtype in (torch.float32, torch.bfloat16):
        return kernels.gguf_dequantize_rows(data, qtype, cols, rows, dtype)
    from gguf.quants import dequantize

    picked = data[rows.to(data.device)].cpu().numpy()
    dense = np.asarray(dequantize(picked, qtype), dtype=np.float32).reshape(len(rows), cols)
    return torch.from_numpy(dense).to(device=data.device, dtype=dtype)


def check_activation_quantization(mode: str, weight_format: str, batch_invariant: bool) -> None:
    """Refuse `activation_quantization=mode` where it cannot run, naming why."""
    if mode not in INT8_MAX_ROWS:
        raise ValueError(f"activation_quantization must be one of none, {', '.join(INT8_MAX_ROWS)}, got {mode!r}")
    if weight_format != "gguf":
        raise ValueError(f"activation_quantization {mode!r} rounds the activations of a GGUF model's quantized "
                         f"products; this model's weights are {weight_format!r} (serve a GGUF file on the CPU, "
                         "with quantization 'auto')")
    if batch_invariant:
        raise ValueError(f"activation_quantization {mode!r} and batch_invariant exclude each other: the invariant "
                         "mode multiplies in float32 in a fixed order")
    kernels = cpu.quant_kernels()
    if kernels is None or not kernels.has_int8_activations:
        raise ValueError(f"activation_quantization {mode!r} needs the compiled CPU kernels on a CPU with AVX2 or "
                         "AVX-512 VNNI; this machine or build has "
                         + ("no compiled kernels" if kernels is None else "neither"))


def resolve_activation_quantization(mode: str, weight_format: str, batch_invariant: bool,
                                    device_type: str) -> tuple[str, str | None]:
    """(the mode the products run, a line for the start-up log or None). "auto" takes int8x2 where
    the model's products are GGUF blocks on a CPU whose compiled kernels have integer activations:
    the fastest mode that keeps greedy agreement with the dequantized model near 99.9% (99.85-100% on
    the files measured, every miss at a near-tie of the reference; int8 keeps 97-98%:
    docs/quantization.md); "none" elsewhere. Other modes pass through, to be checked where
    the layers are built."""
    if mode != "auto":
        return mode, None
    if weight_format != "gguf" or device_type != "cpu":
        return "none", None
    if batch_invariant:
        return "none", ("GGUF products take float32 activations (activation_quantization auto -> none: "
                        "batch_invariant multiplies in float32 in a fixed order)")
    kernels = cpu.quant_kernels()
    if kernels is None or not kernels.has_int8_activations:
        why = "no compiled CPU kernels" if kernels is None else "kernels without AVX2 or AVX-512 VNNI"
        return "none", f"GGUF products take float32 activations (activation_quantization auto -> none: {why})"
    return "int8x2", (f"GGUF products round their activations to two int8 codes (activation_quantization auto "
                      f"-> int8x2, {kernels.int8_kernel} kernels; 99.85-100% greedy agreement with the dequantized "
                      "model measured); --activation-quantization none gives the dequantized model's float32 "
                      "products, int8 llama.cpp's arithmetic: docs/quantization.md, 'Activations'")


def gguf_matmul(x: torch.Tensor, data: torch.Tensor, qtype: int, cols: int,
                batch_invariant: bool = False, activations: str = "none") -> torch.Tensor:
    """x [M, cols] @ W^T for W in blocks: [M, rows], in x's dtype. `batch_invariant`: the fused
    kernel at every batch size, whose sums do not depend on M (layers/invariant.py).
    `activations` "int8" / "int8x2": batches of up to int8_max_rows rows round x to one / two int8
    codes per value for the integer kernel (where cols is a multiple of its 64-value chunks); larger
    ones in "int8" round x to bfloat16 for bfloat16 tiles (BF16_TILES)."""
    if qtype in codebook.CODEBOOK_TYPES:
        y = codebook.product(x, data, qtype, cols, batch_invariant, activations)
        return widened_product(x, data, qtype, cols) if y is None else _as(y, x.dtype)
    if batch_invariant:
        return _as(invariant.kernels().gguf_matmul(x, data, qtype, cols), x.dtype)
    kernels = cpu.quant_kernels() if x.is_cpu else None  # is_cpu: a fifth of device.type's cost
    if activations != "none" and kernels is not None:
        bound = int8_max_rows(activations, qtype)
        rows = x.shape[0]
        if (rows <= bound or (rows > WIDE_INT8_MAX_ROWS and qtype in prefill_types(activations)
                              and rows <= prefill_max_rows().get(qtype, rows))) and cols % 64 == 0:
            return _as(kernels.gguf_matmul_int8(x, data, qtype, cols, activations == "int8x2"), x.dtype)
        if activations == "int8" and BF16_TILES and x.shape[0] > bound:
            return _as(widened_product(x.to(torch.bfloat16), data, qtype, cols), x.dtype)
    if kernels is not None and x.shape[0] <= FUSED_MAX_ROWS.get(x.dtype, 0):
        return _as(kernels.gguf_matmul(x, data, qtype, cols), x.dtype)
    return widened_product(x, data, qtype, cols)


def int8_max_rows(activations: str, qtype: int) -> int:
    """The most rows of x a product in mode `activations` gives the integer kernel."""
    qtype = _repacked_bases().get(qtype, qtype)
    bound = INT8_MAX_ROWS[activations]
    return max(bound, WIDE_INT8_MAX_ROWS) if qtype in wide_int8_types(activations) else bound


@functools.cache
def wide_int8_types(activations: str) -> frozenset[int]:
    """The weight types whose products in mode `activations` take the integer kernel up to
    WIDE_INT8_MAX_ROWS rows (see there), on this CPU and build."""
    kernels = cpu.quant_kernels()
    if activations == "int8":
        return K_QUANTS if BF16_TILES else frozenset(NATIVE_TYPES)
    if kernels is None:
        return frozenset()
    if kernels.float_lanes < 16:
        return frozenset(NATIVE_TYPES)
    if kernels.int8_kernel != "avx512_vnni":
        return frozenset()
    # the types whose products of decode-sized batches widen each group of 8 rows of W once for
    # all the rows of x (csrc widen_min_rows: Q4_1, Q8_0; 1.2-1.7x the float32 kernel at 9-32 rows)
    return K_QUANTS | frozenset(getattr(kernels, "widen_min_rows", {}))


@functools.cache
def prefill_types(activations: str) -> frozenset[int]:
    """The weight ids (repacked Q4_K, Q5_K and Q6_K, Q8_0's and Q5_K's blocks; Q4_1, repacked and in blocks,
    in AVX-512 VNNI builds, repacked in AVX2 ones, where it and Q5_K stop at prefill_max_rows) whose
    products in mode `activations` take the integer kernel past WIDE_INT8_MAX_ROWS rows too (prefills):
    csrc x8_prefill widens each group of 8 rows of W once to 16-bit values for all the rows of x,
    rounded as the mode's products of fewer rows round them, and beats widening float32 tiles for
    torch's GEMM (docs/quantization.md, "Prefill products"). Mode int8 on a CPU with bfloat16 tiles
    keeps those (BF16_TILES)."""
    kernels = cpu.quant_kernels()
    if kernels is None or (activations == "int8" and BF16_TILES):
        return frozenset()
    if getattr(kernels, "prefill_min_rows", 0) != WIDE_INT8_MAX_ROWS + 1:
        return frozenset()  # a build whose row loops end elsewhere: its kernels past them are not these
    return frozenset(getattr(kernels, "prefill_types", ()))


@functools.cache
def prefill_max_rows() -> dict[int, int]:
    """The prefill types whose integer products stop at a number of rows, past which the float32
    tiles win again: in AVX2 builds repacked Q4_1 and Q4_0 up to 64 rows, Q5_K up to 256 (csrc
    avx2_prefill_max_rows)."""
    kernels = cpu.quant_kernels()
    return dict(getattr(kernels, "prefill_max_rows", {})) if kernels is not None else {}


# The types repacked at load: the ones whose tiles' kernels (csrc/quant_ops.cpp, "Q4_K / Q6_K
# repacked", q4_1_x8_rows) beat the blocks' at one row of x (a decode step of one sequence) and keep
# up with them at every batch the integer kernels take (the measured ratios: docs/quantization.md,
# "Repacked Q4_K and Q6_K", "Repacked Q4_1"). Q6_K carries a Q4_K_M file's output matrix, a quarter
# of the bytes a 1B decode step reads; Q4_1 all of the bundled SmolLM2's layers. Q4_0 repacks into
# Q4_1's tiles without m and takes their kernels, which compute m = -8 d ("Q4_0's tiles"); Q5_K into
# Q4_K's tiles with its fifth bits beside, and takes their kernel ("Repacked Q5_K"). Q8_0 repacks
# where the build's kernels list it (AVX-512 VNNI without AMX: repacked_types), its codes + 128 in
# Q4_1's row kernel ("Q8_0's tiles").
REPACKED = frozenset(t for t, name in NATIVE_TYPES.items() if name in ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"))


def repacked_type(qtype: int, rows: int, activations: str, batch_invariant: bool, cols: int) -> int | None:
    """The id of the layout the kernels repack a weight of `qtype` with `rows` rows of `cols` values
    into at load, or None to keep GGUF's blocks (rows not whole tiles of 8, or rows of values the
    integer kernels do not take: not a multiple of 64). The types of REPACKED, in the integer modes,
    whose products of up to 32 rows read tiles of 8 rows without unpacking scales per token
    (csrc/quant_ops.cpp, "Q4_K / Q6_K repacked", q4_1_x8_rows); larger products widen each tile back
    in cache, so mode none, whose products never take the integer kernels, keeps the blocks."""
    kernels = cpu.quant_kernels()
    if (activations not in INT8_MAX_ROWS or batch_invariant or kernels is None or not kernels.has_int8_activations
            or rows % 8 or cols % 64 or qtype not in REPACKED):
        return None
    return getattr(kernels, "repacked_types", {}).get(qtype)


@functools.cache
def _repacked_bases() -> dict[int, int]:
    """Repacked id -> the GGUF type whose kernels it takes (Q4_0's tiles take Q4_1's)."""
    return dict(getattr(cpu.quant_kernels(), "repacked_bases", {}))


def widened_product(x: torch.Tensor, data: torch.Tensor, qtype: int, cols: int) -> torch.Tensor:
    """x @ W^T through torch's GEMM, W widened to x's dtype a tile at a time (tiled_product)."""
    return tiled_product(x, data.shape[0], cols,
                         lambda start, end: dequantize_rows(data, qtype, cols, torch.arange(start, end), x.dtype))


def _as(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # The kernels return float32. `.to` of a tensor already in the dtype still costs ~2 us of
    # dispatch, paid by each of a decode step's ~120 products.
    return y if y.dtype == dtype else y.to(dtype)


class GGUFLinearMethod(LinearMethod):
    """Weights kept in their GGUF blocks. `dtype`: the model's, for dense segments and for
    the embedding rows looked up from blocks. `batch_invariant`: products whose sums do not
    depend on the batch (layers/invariant.py). `activations` "int8" / "int8x2": small batches'
    products round the activations to int8 codes (gguf_matmul)."""

    def __init__(self, dtype: torch.dtype, batch_invariant: bool = False, activations: str = "none") -> None:
        self.dtype = dtype
        self.batch_invariant = batch_invariant
        self.activations = activations

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int) -> None:
        if self.batch_invariant:
            invariant.check_in_features(in_features)
        # A placeholder until loading, when the parts arrive with their types.
        layer.weight = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        layer.gguf_shape = (out_features, in_features)
        layer.gguf_parts = []

    def load(self, layer: nn.Module, loaded, row_offset: int) -> None:
        rows, cols = loaded.shape
        if cols != layer.gguf_shape[1] or row_offset + rows > layer.gguf_shape[0]:
            raise ValueError(f"shape {tuple(loaded.shape)} at row {row_offset} does not fit {layer.gguf_shape}")
        layer.gguf_parts.append((row_offset, loaded))

    def finish(self, layer: nn.Module) -> None:
        parts = sorted(layer.gguf_parts, key=lambda p: p[0])
        expected = 0
        for offset, part in parts:
            if offset != expected:
                raise ValueError(f"weight rows [{expected}, {offset}) were never loaded")
            expected += part.shape[0]
        if expected != layer.gguf_shape[0]:
            raise ValueError(f"weight rows [{expected}, {layer.gguf_shape[0]}) were never loaded")
        segments: list[list] = []  # [qtype or None, [parts]]
        for _, part in parts:
            kind = part.qtype if isinstance(part, GGUFBlocks) else None
            if segments and segments[-1][0] == kind:
                segments[-1][1].append(part)
            else:
                segments.append([kind, [part]])
        del layer.weight, layer.gguf_parts
        layer.segment_types = [kind for kind, _ in segments]
        layer.segments = nn.ParameterList(
            [nn.Parameter(torch.cat([p.data if kind is not None else p.to(self.dtype) for p in group]),
                          requires_grad=False) for kind, group in segments])
        kinds = [kind if kind is None else self._repack(layer, i, kind) for i, kind in enumerate(layer.segment_types)]
        # The same Parameter objects in a plain tuple for apply: iterating an nn.ParameterList costs
        # several microseconds, paid by every linear layer at every step (a decode step of the
        # bundled model makes 121 products). Kinds as the kernels take them (repacked ids).
        layer.gguf_products = tuple(zip(kinds, layer.segments))

    def _repack(self, layer: nn.Module, i: int, qtype: int) -> int:
        """Segment i's blocks in the kernels' tiles of 8 rows where repacked_type says so (its
        Parameter's data replaced in place); the type id the products take."""
        data = layer.segments[i].data
        packed = repacked_type(qtype, data.shape[0], self.activations, self.batch_invariant, layer.gguf_shape[1])
        if packed is not None and data.is_cpu:
            layer.segments[i].data = cpu.quant_kernels().gguf_repack(data, qtype, layer.gguf_shape[1])
            return packed
        return qtype

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        cols = layer.gguf_shape[1]
        products = layer.gguf_products
        if len(products) == 1:  # most layers: one type throughout, no list and no cat
            kind, w = products[0]
            return self._dense(x, w) if kind is None else gguf_matmul(x, w, kind, cols, self.batch_invariant,
                                                                       self.activations)
        outs = [self._dense(x, w) if kind is None else gguf_matmul(x, w, kind, cols, self.batch_invariant,
                                                                    self.activations)
                for kind, w in products]
        return torch.cat(outs, dim=-1)

    def direct_product(self, layer: nn.Module) -> DirectProduct | None:
        """The compiled call gguf_matmul makes for float32 x of up to max_rows rows (decode steps),
        where the weight is one segment of one GGUF type: the integer kernel in the int8 modes, the
        float32 one in mode none. Codebook types, batch-invariant products and dense segments: None."""
        kernels = cpu.quant_kernels()
        if kernels is None or self.batch_invariant or len(layer.gguf_products) != 1:
            return None
        kind, w = layer.gguf_products[0]
        cols = layer.gguf_shape[1]
        if kind is None or kind in codebook.CODEBOOK_TYPES or not w.is_cpu:
            return None
        if self.activations != "none":
            if cols % 64:
                return None
            return DirectProduct(kernels.gguf_matmul_int8, (w, kind, cols, self.activations == "int8x2"),
                                 int8_max_rows(self.activations, kind))
        return DirectProduct(kernels.gguf_matmul, (w, kind, cols), FUSED_MAX_ROWS[torch.float32])

    def _dense(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return invariant.invariant_linear(x, w) if self.batch_invariant else F.linear(x, w)

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        ((kind, w),) = layer.gguf_products
        if kind is None:
            return F.embedding(ids, w)
        flat = dequantize_rows(w, kind, layer.gguf_shape[1], ids.reshape(-1), self.dtype)
        return flat.reshape(*ids.shape, layer.gguf_shape[1])


register(WeightFormat("gguf", lambda dtype, invariant, activations: lambda: GGUFLinearMethod(dtype, invariant,
                                                                                            activations)))

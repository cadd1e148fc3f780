"""Linear layers: replicated, column-parallel (fused q/k/v and gate/up included) and
row-parallel, each with a `LinearMethod` that decides how the weight is stored and
multiplied (the quantized formats plug in there) and a weight loader per parameter that
takes a checkpoint tensor, or one part of a fused one, and keeps this rank's shard.

Column-parallel layers split their output features over ranks and need no communication;
row-parallel layers split their input features and sum the partial products with one
all-reduce, so a transformer block costs two all-reduces (Megatron).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.layers.parallel import TensorParallelGroup
from pagellm.layers.module import HotModule
from pagellm.layers.parallel import HeadSplit, divide, load_whole, rank_and_size


class DirectProduct(NamedTuple):
    """A layer's product as one compiled call, its arguments fixed once (layers/decode_plan.py):
    `fn(x, *args)` is what the layer's forward returns for a float32 x of at most `max_rows`
    rows, bias included where `bias` is not None (added after, as forward adds it)."""

    fn: Callable[..., torch.Tensor]
    args: tuple
    max_rows: int
    bias: torch.Tensor | None = None


class LinearMethod(ABC):
    """How a linear layer holds its weight and multiplies by it: create the weight, load it
    (rows of it, for fused layers), finish it once every part is in, apply it."""

    @abstractmethod
    def create_weights(self, layer: nn.Module, in_features: int, out_features: int) -> None:
        """Register the layer's weight parameter(s) for this rank's [out, in] shard."""

    def load(self, layer: nn.Module, loaded, row_offset: int) -> None:
        """Put `loaded` (this rank's part of a checkpoint tensor: a dense tensor, or a
        quantized one such as GGUF blocks) at rows [row_offset, ...) of the weight."""
        load_whole(layer.weight.data.narrow(0, row_offset, loaded.shape[0]), loaded)

    def finish(self, layer: nn.Module) -> None:
        """Called once after loading: repack what was loaded into the form `apply` reads."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T, without the bias."""

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W (the token embedding's lookup)."""
        return F.embedding(ids, layer.weight)

    def direct_product(self, layer: nn.Module) -> DirectProduct | None:
        """`apply` for float32 x as one call whose arguments do not change between steps (bias
        left out), or None where the method has none: it must give apply's bits."""
        return None


class UnquantizedLinearMethod(LinearMethod):
    """A dense [out, in] weight in the model's dtype (a quantized checkpoint tensor is
    dequantized as it is loaded)."""

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int) -> None:
        layer.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight)

    def direct_product(self, layer: nn.Module) -> DirectProduct | None:
        if layer.weight.dtype != torch.float32:
            return None
        return DirectProduct(F.linear, (layer.weight,), 1 << 30)


# The method a layer built without an explicit one gets: the model loader sets it around
# building a model from a quantized checkpoint, so no family file passes methods around.
_default_method: Callable[[], LinearMethod] = UnquantizedLinearMethod


@contextmanager
def linear_method_for_new_layers(factory: Callable[[], LinearMethod]) -> Iterator[None]:
    """Layers built inside this block (linear layers, embeddings) get `factory()`'s method."""
    global _default_method
    previous, _default_method = _default_method, factory
    try:
        yield
    finally:
        _default_method = previous


def default_linear_method() -> LinearMethod:
    return _default_method()


class LinearBase(HotModule):
    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallelGroup | None,
                 method: LinearMethod | None) -> None:
        super().__init__()
        self.tp = tp
        self.tp_rank, self.tp_size = rank_and_size(tp)
        self.in_features, self.out_features = in_features, out_features  # this rank's
        self.method = method or default_linear_method()
        self.method.create_weights(self, in_features, out_features)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        for p in self.parameters(recurse=False):
            p.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        self.store(param, loaded)

    def store(self, param: nn.Parameter, loaded: torch.Tensor, row_offset: int = 0) -> None:
        """Put this rank's part of a checkpoint tensor at rows [row_offset, ...): the weight
        through the linear method (which may keep it quantized), the bias as it is."""
        if param is self.bias:
            load_whole(param.data.narrow(0, row_offset, loaded.shape[0]), loaded)
        else:
            self.method.load(self, loaded, row_offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, x)
        return y if self.bias is None else y + self.bias

    def direct_product(self) -> DirectProduct | None:
        """This layer's forward on float32 rows as one fixed call (LinearMethod.direct_product), or
        None: its method has none, or a rank's output needs the others' (tensor parallelism)."""
        if self.tp_size != 1:
            return None
        product = self.method.direct_product(self)
        return None if product is None else product._replace(bias=self.bias)


class ReplicatedLinear(LinearBase):
    """The same whole weight on every rank (e.g. a mixture-of-experts router)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 method: LinearMethod | None = None) -> None:
        super().__init__(in_features, out_features, bias, None, method)


class ColumnParallelLinear(LinearBase):
    """Output features split over ranks; the output stays split."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 tp: TensorParallelGroup | None = None, method: LinearMethod | None = None) -> None:
        _, size = rank_and_size(tp)
        super().__init__(in_features, divide(out_features, size, "output features"), bias, tp, method)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        n = self.out_features
        self.store(param, loaded.narrow(0, self.tp_rank * n, n))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel layers side by side in one matrix (gate and up): one product
    instead of several. A checkpoint stores them apart (`shard_id` = their index) or fused
    (`shard_id` None: Phi-3's gate_up_proj)."""

    def __init__(self, in_features: int, out_features: Sequence[int], bias: bool = False,
                 tp: TensorParallelGroup | None = None, method: LinearMethod | None = None) -> None:
        self.output_sizes = list(out_features)
        super().__init__(in_features, sum(self.output_sizes), bias, tp, method)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        if shard_id is None:
            for i, part in enumerate(loaded.split(self.output_sizes, dim=0)):
                self.weight_loader(param, part, i)
            return
        local = [s // self.tp_size for s in self.output_sizes]
        offset, n = sum(local[:shard_id]), local[shard_id]
        self.store(param, loaded.narrow(0, self.tp_rank * n, n), offset)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matrix, split by heads (KV heads replicated on the ranks
    that share one when there are fewer KV heads than ranks). `q_per_head` 2: each query head's
    rows are its query then an output gate (Qwen3.5's gated attention), kept together."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 tp: TensorParallelGroup | None = None, method: LinearMethod | None = None,
                 q_per_head: int = 1) -> None:
        self.heads = HeadSplit.of(num_heads, num_kv_heads, tp)
        self.head_dim = head_dim
        self.total = (num_heads * head_dim * q_per_head, num_kv_heads * head_dim)
        self.q_size = self.heads.num_heads * head_dim * q_per_head
        self.kv_size = self.heads.num_kv_heads * head_dim
        _, size = rank_and_size(tp)
        # ColumnParallelLinear divides by the group size; hand it the whole-model width.
        super().__init__(hidden_size, (self.q_size + 2 * self.kv_size) * size, bias, tp, method)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        if shard_id is None:  # a fused checkpoint tensor (Phi-3's qkv_proj)
            q, kv = self.total
            for sid, part in zip("qkv", loaded.split([q, kv, kv], dim=0)):
                self.weight_loader(param, part, sid)
            return
        d = self.head_dim
        if shard_id == "q":
            dst, src = (0, self.q_size), (self.tp_rank * self.q_size, self.q_size)
        else:
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            dst, src = (offset, self.kv_size), (self.heads.first_kv_head * d, self.kv_size)
        self.store(param, loaded.narrow(0, *src), dst[0])


class RowParallelLinear(LinearBase):
    """Input features split over ranks; the partial products are summed over ranks, and the
    bias is added once, after the sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 tp: TensorParallelGroup | None = None, method: LinearMethod | None = None) -> None:
        _, size = rank_and_size(tp)
        super().__init__(divide(in_features, size, "input features"), out_features, bias, tp, method)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param is self.bias:
            load_whole(param, loaded)
            return
        n = self.in_features
        self.store(param, loaded.narrow(1, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, x)
        if self.tp is not None:
            y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias

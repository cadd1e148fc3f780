"""What a model runner is built from: the one place the engine's options become a ModelRunner's
arguments, for a one-process engine and for every tensor-parallel rank alike."""
from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any

import torch

from pagellm.layers.parallel import TensorParallelGroup
from pagellm.models.arch import ModelArchConfig

if typing.TYPE_CHECKING:
    from pagellm.config import EngineConfig
    from pagellm.loader.source import ModelSource


@dataclass
class WorkerSpec:
    """What rank 0 tells each worker about the model, right after the group forms."""

    arch: ModelArchConfig
    model_path: str
    load_format: str
    device_type: str
    dtype: torch.dtype
    max_model_len: int
    seed: int
    quantization: str = "auto"
    weight_format: str = "dense"
    sliding_kv: bool = False  # sliding-window layers in their own KV groups (core/kv/groups.py)
    kv_cache_dtype: str = "auto"  # how K/V are stored (kv_format.py)
    activation_quantization: str = "none"  # "int8" / "int8x2": GGUF products round their activations

    @classmethod
    def from_config(cls, config: EngineConfig, source: ModelSource, device: torch.device, dtype: torch.dtype,
                    max_model_len: int, quantization: str, activation_quantization: str) -> WorkerSpec:
        """The spec of an engine's model (`source`, loaded with `quantization`, its products taking
        `activation_quantization` as resolved from the option): the one place the engine's options
        become ModelRunner's, for one rank or many."""
        return cls(source.arch, source.path, config.load_format, device.type, dtype, max_model_len, config.seed,
                   quantization, source.weight_format,
                   sliding_kv=config.kv_policy == "paged", kv_cache_dtype=config.kv_cache_dtype,
                   activation_quantization=activation_quantization)

    def runner_arguments(self, device: torch.device,
                         tp: TensorParallelGroup | None) -> tuple[tuple, dict[str, Any]]:
        """ModelRunner's arguments for this rank: the one place every rank, rank 0 of a
        tensor-parallel engine and a single-rank engine included, takes them from, so no option reaches
        some ranks and not others (rank 0 once built its shard without activation_quantization
        while the workers had it)."""
        return ((self.arch, device, self.dtype, self.max_model_len),
                dict(seed=self.seed, tp=tp, weight_format=self.weight_format, sliding_kv=self.sliding_kv,
                     kv_cache_dtype=self.kv_cache_dtype, activation_quantization=self.activation_quantization))

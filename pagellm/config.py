"""Engine options, validated where they are built."""
from __future__ import annotations

from dataclasses import dataclass

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_LOAD_FORMATS = ("auto", "gguf", "safetensors", "dummy")
# How KV memory is handed out: in blocks (PagedAttention), or one contiguous region per
# request as before paging (the baselines of `pagellm bench`; see pagellm.core.contiguous).
KV_POLICIES = ("paged", "contiguous-max", "contiguous-pow2", "contiguous-oracle")


@dataclass
class EngineConfig:
    """Everything the engine needs besides the model files; names follow vLLM."""

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None
    # Bytes (an int > 1) or a fraction of the memory free at start-up (a float in (0, 1]).
    kv_cache_memory: float | int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    load_format: str = "auto"
    seed: int = 0
    enable_prefix_caching: bool = True
    kv_policy: str = "paged"
    # Run decode steps eagerly on a GPU instead of replaying captured CUDA graphs.
    enforce_eager: bool = False
    # Ranks that split each layer's heads and features (torch.distributed; see README "Tensor parallelism").
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, value: object, limit: str) -> None:
            if not ok:
                raise ValueError(f"{name} must be {limit}, got {value!r}")

        need(self.dtype in _DTYPES, "dtype", self.dtype, f"one of {_DTYPES}")
        need(self.device in ("auto", "cpu") or self.device.startswith("cuda"), "device", self.device,
             "'auto', 'cpu' or 'cuda[:N]'")
        need(self.kv_policy in KV_POLICIES, "kv_policy", self.kv_policy, f"one of {KV_POLICIES}")
        need(self.load_format in _LOAD_FORMATS, "load_format", self.load_format, f"one of {_LOAD_FORMATS}")
        need(isinstance(self.block_size, int) and 1 <= self.block_size <= 1024, "block_size", self.block_size,
             "an integer in [1, 1024]")
        need(self.num_kv_blocks is None or (isinstance(self.num_kv_blocks, int) and self.num_kv_blocks >= 1),
             "num_kv_blocks", self.num_kv_blocks, "an integer >= 1")
        mem = self.kv_cache_memory
        need(mem is None or (isinstance(mem, float) and 0 < mem <= 1) or (isinstance(mem, int) and mem > 1),
             "kv_cache_memory", mem, "a byte count (int > 1) or a fraction of free memory in (0, 1]")
        need(isinstance(self.max_num_seqs, int) and self.max_num_seqs >= 1, "max_num_seqs", self.max_num_seqs,
             "an integer >= 1")
        need(isinstance(self.max_num_batched_tokens, int) and self.max_num_batched_tokens >= 1,
             "max_num_batched_tokens", self.max_num_batched_tokens, "an integer >= 1")
        need(isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1, "tensor_parallel_size",
             self.tensor_parallel_size, "an integer >= 1")
        need(self.max_model_len is None or (isinstance(self.max_model_len, int) and self.max_model_len >= 2),
             "max_model_len", self.max_model_len, "an integer >= 2")

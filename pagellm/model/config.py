"""The architecture of a model, whatever file format it came from."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any


@dataclass
class ModelArchConfig:
    """The shapes and constants the engine reads (KV cache size, vocabulary, context), plus the
    model's whole Hugging Face config (`hf_config`, defaults filled in by transformers), from
    which each family reads its own details. A GGUF file's metadata is turned into the same
    Hugging Face config, so a family reads one thing whatever the file format."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # HF-style rope_scaling dict, e.g. {"rope_type": "llama3", "factor": 8.0, ...}; None for plain RoPE.
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases (Qwen2)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    architecture: str = "llama"  # the family (pagellm.models.registry)
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False)
    # Where the model came from, for error messages (differs between machines: not compared).
    model_name: str = field(default="this model", compare=False)

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if not self.hf_config:
            self.hf_config = llama_style_config(self)

    @cached_property
    def hf(self):
        """`hf_config` as a transformers config object (what the reference model is built from)."""
        from transformers import AutoConfig

        kwargs = dict(self.hf_config)
        return AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)


def llama_style_config(arch: ModelArchConfig) -> dict[str, Any]:
    """A Hugging Face config for the Llama-family fields alone (GGUF files, synthetic shapes)."""
    model_type = {"qwen2": "qwen2", "mistral": "mistral"}.get(arch.architecture, "llama")
    rope = {"rope_type": "default", **(arch.rope_scaling or {}), "rope_theta": arch.rope_theta}
    config = {
        "model_type": model_type, "vocab_size": arch.vocab_size, "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size, "num_hidden_layers": arch.num_hidden_layers,
        "num_attention_heads": arch.num_attention_heads, "num_key_value_heads": arch.num_key_value_heads,
        "head_dim": arch.head_dim, "rms_norm_eps": arch.rms_norm_eps, "rope_parameters": rope,
        "max_position_embeddings": arch.max_position_embeddings, "tie_word_embeddings": arch.tie_word_embeddings,
        "hidden_act": "silu",
    }
    if model_type == "llama":
        config["attention_bias"] = arch.attention_bias
    if model_type == "mistral":
        config["sliding_window"] = None
    return config

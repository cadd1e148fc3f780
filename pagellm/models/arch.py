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
    # False for a bare decoder checkpoint (`Qwen3Model`, as sentence-transformers saves an embedding
    # model): no language-model head, embeddings only.
    has_lm_head: bool = True
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
        return global_view(AutoConfig.for_model(kwargs.pop("model_type"), **kwargs))


def global_view(hf):
    """`hf` with its global values of per-layer fields readable (transformers refuses them on a
    config whose layers differ, Gemma 4's): the family reads each layer's own from per_layer_config."""
    if getattr(hf, "per_layer_config", None):
        hf.allow_global_per_layer_attribute_access = True
    return hf


def arch_from_hf(hf, family: str, *, bos_token_id: int | None, eos_token_ids: list[int], model_name: str,
                 attention_bias: bool = False, has_lm_head: bool = True) -> ModelArchConfig:
    """The ModelArchConfig of `hf`, a transformers config (read from config.json, or made from
    a GGUF file's metadata) of a model of `family` (pagellm.models.registry)."""
    hf = global_view(hf)
    heads = int(hf.num_attention_heads)
    rope_theta, rope_scaling = rope_from_hf(hf.to_dict(), model_name)
    return ModelArchConfig(
        vocab_size=int(hf.vocab_size),
        hidden_size=int(hf.hidden_size),
        intermediate_size=int(getattr(hf, "intermediate_size", 0) or 0),
        num_hidden_layers=int(hf.num_hidden_layers),
        num_attention_heads=heads,
        num_key_value_heads=int(getattr(hf, "num_key_value_heads", None) or heads),
        head_dim=getattr(hf, "head_dim", None),
        rms_norm_eps=float(getattr(hf, "rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(getattr(hf, "max_position_embeddings", None) or 4096),
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        has_lm_head=has_lm_head,
        # Qwen2 always has q/k/v biases and its config has no key for them.
        attention_bias=attention_bias or family == "qwen2" or bool(getattr(hf, "attention_bias", False)),
        bos_token_id=bos_token_id,
        eos_token_ids=eos_token_ids,
        architecture=family,
        hf_config=hf.to_dict(),
        model_name=model_name,
    )


def rope_from_hf(cfg: dict, where: str) -> tuple[float, dict | None]:
    """`(rope_theta, HF-style rope_scaling or None)` from either transformers spelling (v4
    `rope_scaling` + `rope_theta`, v5 `rope_parameters`); per layer type, the global layers'."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]  # one dict per layer type (Gemma 3): the global layers' here
    if not isinstance(params, dict):
        raise ValueError(f"{where}: rope parameters should be a JSON object, got {params!r}")
    params = dict(params)
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    if "type" in params:  # v4's older name for rope_type
        params.setdefault("rope_type", params.pop("type"))
    params.pop("partial_rotary_factor", None)  # the family reads it from the whole config
    if params.get("rope_type", "default") == "default":
        return theta, None
    return theta, params


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

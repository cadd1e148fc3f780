"""Rotary position embeddings in the rotate-half (GPT-NeoX) layout, as in Hugging Face.

`RotaryEmbedding` holds cos/sin tables for every position; the model looks up this step's
rows once and hands them to every layer that rotates. Partial rotary (only the first
`rotary_dim` features of each head rotate: Phi-4-mini) and the scaled variants follow the
model's config: the default frequencies are computed here, every scaled kind (linear,
llama3, YaRN, LongRoPE) by transformers' own `ROPE_INIT_FUNCTIONS`, so the frequencies and
the attention factor folded into cos/sin are the reference's by construction. A model that
scales its queries by position (Ministral 3's Llama 4-style temperature tuning) gets the
factors from the same table lookup, as a third entry beside cos and sin.
"""
from __future__ import annotations

import torch

from pagellm.kernels import cpu

# Kinds whose frequencies change with the length of the sequence as it runs: a paged cache
# holds keys rotated once, so they cannot be served exactly.
_UNSUPPORTED = ("dynamic",)


def default_inverse_frequencies(rotary_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, inv_freq: torch.Tensor, max_positions: int, attention_scaling: float = 1.0) -> None:
        super().__init__()
        self.rotary_dim = 2 * inv_freq.numel()
        device = torch.get_default_device()  # where the model is being built (cuda, cpu, or meta)
        with torch.device("cpu"):  # the tables themselves are computed on the CPU, as the reference's
            freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq.cpu().float()[None, :]
            emb = torch.cat([freqs, freqs], dim=-1)
            cos, sin = emb.cos() * attention_scaling, emb.sin() * attention_scaling
        self.register_buffer("cos", cos.to(device), persistent=False)
        self.register_buffer("sin", sin.to(device), persistent=False)
        self.register_buffer("query_scale", None, persistent=False)

    def scale_queries(self, scale: torch.Tensor) -> None:
        """Multiply the rotated queries (not the keys) by `scale` [max_positions], a factor per
        position, e.g. llama4_query_scale's; the step's factors then come with cos and sin."""
        if scale.shape != self.cos.shape[:1]:
            raise ValueError(f"query scale has {tuple(scale.shape)} entries, expected one per position "
                             f"({self.cos.shape[0]})")
        self.query_scale = scale.to(self.cos.device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """[T, rotary_dim] tables for this step's positions; and where queries are scaled by
        position, third, the [T] factors (see Attention.forward_qkv)."""
        tables = (self.cos[positions].to(dtype), self.sin[positions].to(dtype))
        if self.query_scale is None:
            return tables
        return (*tables, self.query_scale[positions].to(dtype))


def rope_parameters(hf, layer_type: str | None = None) -> dict:
    """The rope parameters of `hf` (a transformers config) for layers of `layer_type`: v5
    configs keep one dict, or one per layer type (Gemma 3's local and global layers)."""
    params = dict(getattr(hf, "rope_parameters", None) or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    params.setdefault("rope_type", "default")
    return params


def get_rope(hf, head_dim: int, max_positions: int, layer_type: str | None = None,
             model: str = "this model") -> RotaryEmbedding:
    """The rotary embedding the reference builds for `hf`'s layers of `layer_type`.

    LongRoPE picks its short or long factors by the sequence length; a served model fixes the
    choice by `max_positions` (the engine's max_model_len): short factors while it is within
    the original context, which is exactly the reference for every sequence the engine admits.
    """
    device = torch.get_default_device()
    with torch.device("cpu"):  # computed on the CPU also while the model is built elsewhere, or on meta
        return _get_rope(hf, head_dim, max_positions, layer_type, model).to(device)


def _get_rope(hf, head_dim: int, max_positions: int, layer_type: str | None, model: str) -> RotaryEmbedding:
    params = rope_parameters(hf, layer_type)
    kind = params["rope_type"]
    rotary_dim = int(head_dim * float(params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0)
                                                 or 1.0)))
    if kind == "proportional":  # rotates a fraction of each head by frequencies of the whole: the rest's are 0
        rotary_dim = head_dim
    if kind == "default":
        return RotaryEmbedding(default_inverse_frequencies(rotary_dim, float(params["rope_theta"])), max_positions)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if kind in _UNSUPPORTED or kind not in ROPE_INIT_FUNCTIONS:
        supported = ", ".join(["default"] + [k for k in ROPE_INIT_FUNCTIONS if k not in _UNSUPPORTED])
        raise ValueError(f"{model}: rope_type {kind!r} is not supported (supported: {supported})")
    kwargs = {"layer_type": layer_type} if isinstance((hf.rope_parameters or {}).get(layer_type), dict) else {}
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[kind](hf, "cpu", seq_len=max_positions, **kwargs)
    if inv_freq.numel() * 2 != rotary_dim:
        raise ValueError(f"{model}: rope gives {inv_freq.numel() * 2} rotary dimensions, expected {rotary_dim}")
    return RotaryEmbedding(inv_freq, max_positions, float(scaling))


def llama4_query_scale(max_positions: int, beta: float, floor_scale: int) -> torch.Tensor:
    """Llama 4's attention temperature tuning as Ministral 3 configures it (`llama_4_scaling_beta`,
    stepping at the YaRN original context): the factor 1 + beta * log(1 + floor(pos / floor_scale))
    for every position, computed in float32 as the reference computes it from position ids, so
    that attention far past the original context stays as sharp as within it."""
    with torch.device("cpu"):
        positions = torch.arange(max_positions)
        return 1 + beta * torch.log(1 + torch.floor(positions / floor_scale))


def llama4_attention_temperature(max_positions: int, attn_scale: float, floor_scale: int) -> torch.Tensor:
    """Llama 4's attention temperature tuning on its NoPE layers (attn_temperature_tuning): the
    factor 1 + attn_scale * log1p(floor((pos + 1) / floor_scale)) for every position, with the
    reference's float32 operations in its order."""
    with torch.device("cpu"):
        positions = torch.arange(max_positions).float()
        return torch.log1p(torch.floor((positions + 1.0) / floor_scale)) * attn_scale + 1.0


class QueryScale(torch.nn.Module):
    """A query scale per position for layers that do not rotate (Llama 4's NoPE layers): it
    travels where a rotary table would, as (None, None, factors) (see Attention.forward_qkv)."""

    def __init__(self, scale: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("query_scale", scale.to(torch.get_default_device()), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[None, None, torch.Tensor]:
        return None, None, self.query_scale[positions].to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D] rotated in the rotate-half layout (the reference formula)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def rotate_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, H, D], k: [T, KVH, D], rotated over their first cos.shape[-1] features.

    Whole heads rotate in place in the compiled kernel where it serves (in float32, the same
    bits as apply_rope; in bfloat16, one rounding instead of apply_rope's three)."""
    rd = cos.shape[-1]
    if rd < q.shape[-1]:  # partial rotary: the rest of each head passes through
        return (torch.cat([apply_rope(q[..., :rd], cos, sin), q[..., rd:]], dim=-1),
                torch.cat([apply_rope(k[..., :rd], cos, sin), k[..., rd:]], dim=-1))
    if cpu.usable(q):
        cpu.rotary_embedding_(q, k, cos, sin)
        return q, k
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

"""Gemma 2: norms before and after each block, RMSNorm weights applied as (1 + w),
embeddings scaled by sqrt(hidden_size), GELU (tanh) gates, attention scaled by
query_pre_attn_scalar, attention and final logits soft-capped, and sliding-window layers
alternating with global ones."""
from __future__ import annotations

from torch import nn

from pagellm.attention.backend import AttentionBackend
from pagellm.distributed.group import TensorParallelGroup
from pagellm.layers.activation import check_activation
from pagellm.layers.embedding import LogitsHead
from pagellm.layers.norm import RMSNorm
from pagellm.layers.rotary import get_rope
from pagellm.model.config import ModelArchConfig
from pagellm.models.base import CausalLM
from pagellm.models.llama import LlamaAttention, LlamaMLP


class GemmaDecoderLayer(nn.Module):
    """Sandwich norms: each block's input and output are normalized, then added to the residual."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, hidden_size: int, eps: float, rope_name: str) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, eps, unit_offset=True)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, unit_offset=True)
        self.pre_feedforward_layernorm = RMSNorm(hidden_size, eps, unit_offset=True)
        self.mlp = mlp
        self.post_feedforward_layernorm = RMSNorm(hidden_size, eps, unit_offset=True)
        self.rope_name = rope_name

    def forward(self, rope, x, kv_cache, meta):
        x = x + self.post_attention_layernorm(self.self_attn(rope, self.input_layernorm(x), kv_cache, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma2ForCausalLM(CausalLM):
    qk_norm: str | None = None  # Gemma 3 normalizes q and k per head

    def __init__(self, arch: ModelArchConfig, backend: AttentionBackend, max_positions: int,
                 tp: TensorParallelGroup | None = None) -> None:
        super().__init__(arch, tp)
        hf = self.hf
        act = hf.hidden_activation
        check_activation(act, arch.model_name)
        self.embedding_scale = arch.hidden_size ** 0.5
        self.logits = LogitsHead(arch.vocab_size, tp, softcap=hf.final_logit_softcapping)
        types = list(hf.layer_types)
        self.set_ropes(self.make_ropes(arch, max_positions, types))
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(
                LlamaAttention(arch, i, backend, tp, qkv_bias=arch.attention_bias, o_bias=arch.attention_bias,
                               qk_norm=self.qk_norm, unit_offset_norm=True,
                               scale=float(hf.query_pre_attn_scalar) ** -0.5, softcap=hf.attn_logit_softcapping),
                LlamaMLP(arch.hidden_size, arch.intermediate_size, act, tp),
                arch.hidden_size, arch.rms_norm_eps, self.rope_for(types[i]))
            for i in range(arch.num_hidden_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, unit_offset=True)

    def make_ropes(self, arch: ModelArchConfig, max_positions: int, types: list[str]) -> dict:
        return {"default": get_rope(self.hf, arch.head_dim, max_positions, model=arch.model_name)}

    def rope_for(self, layer_type: str) -> str:
        return "default"

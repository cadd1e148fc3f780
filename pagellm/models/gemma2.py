"""Gemma 2: norms before and after each block, RMSNorm weights applied as (1 + w),
embeddings scaled by sqrt(hidden_size), GELU (tanh) gates, attention scaled by
query_pre_attn_scalar, attention and final logits soft-capped, and sliding-window layers
alternating with global ones."""
from __future__ import annotations

from torch import nn

from pagellm.attention.backend import AttentionBackend
from pagellm.layers.parallel import TensorParallelGroup
from pagellm.layers.embedding import LogitsHead
from pagellm.layers.norm import RMSNorm
from pagellm.models.arch import ModelArchConfig
from pagellm.models.llama import LlamaAttention, LlamaForCausalLM


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


class Gemma2ForCausalLM(LlamaForCausalLM):
    act_field = "hidden_activation"
    unit_offset_norms = True

    def __init__(self, arch: ModelArchConfig, backend: AttentionBackend, max_positions: int,
                 tp: TensorParallelGroup | None = None) -> None:
        super().__init__(arch, backend, max_positions, tp)
        self.embedding_scale = arch.hidden_size ** 0.5
        self.logits = LogitsHead(arch.vocab_size, tp, softcap=self.hf.final_logit_softcapping)

    def make_attention(self, layer: int, backend: AttentionBackend, tp: TensorParallelGroup | None) -> nn.Module:
        arch, hf = self.cfg, self.hf
        return LlamaAttention(arch, layer, backend, tp, qkv_bias=arch.attention_bias, o_bias=arch.attention_bias,
                              qk_norm=self.qk_norm, unit_offset_norm=True,
                              scale=float(hf.query_pre_attn_scalar) ** -0.5,
                              softcap=getattr(hf, "attn_logit_softcapping", None))

    def make_layer(self, layer: int, backend: AttentionBackend, tp: TensorParallelGroup | None) -> nn.Module:
        return GemmaDecoderLayer(self.make_attention(layer, backend, tp), self.make_mlp(layer, tp),
                                 self.cfg.hidden_size, self.cfg.rms_norm_eps, self.rope_for(layer))

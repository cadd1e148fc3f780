"""Granite (3.x): Llama with four multipliers: on the embeddings, on each block's output
before the residual sum, as the attention scale, and dividing the logits."""
from __future__ import annotations

from torch import nn

from pagellm.attention.backend import AttentionBackend
from pagellm.layers.parallel import TensorParallelGroup
from pagellm.layers.embedding import LogitsHead
from pagellm.models.arch import ModelArchConfig
from pagellm.models.llama import LlamaAttention, LlamaForCausalLM


class GraniteForCausalLM(LlamaForCausalLM):
    def __init__(self, arch: ModelArchConfig, backend: AttentionBackend, max_positions: int,
                 tp: TensorParallelGroup | None = None) -> None:
        super().__init__(arch, backend, max_positions, tp)
        self.embedding_scale = float(self.hf.embedding_multiplier)
        self.logits = LogitsHead(arch.vocab_size, tp, scale=float(self.hf.logits_scaling))

    def make_attention(self, layer: int, backend: AttentionBackend, tp: TensorParallelGroup | None) -> nn.Module:
        arch = self.cfg
        return LlamaAttention(arch, layer, backend, tp, qkv_bias=arch.attention_bias, o_bias=arch.attention_bias,
                              scale=float(self.hf.attention_multiplier))

    def make_layer(self, layer: int, backend: AttentionBackend, tp: TensorParallelGroup | None) -> nn.Module:
        block = super().make_layer(layer, backend, tp)
        block.residual_scale = float(self.hf.residual_multiplier)
        return block

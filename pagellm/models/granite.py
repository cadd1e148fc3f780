"""Granite (3.x): Llama with four multipliers: on the embeddings, on each block's output
before the residual sum, as the attention scale, and dividing the logits."""
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
from pagellm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP


class GraniteForCausalLM(CausalLM):
    def __init__(self, arch: ModelArchConfig, backend: AttentionBackend, max_positions: int,
                 tp: TensorParallelGroup | None = None) -> None:
        super().__init__(arch, tp)
        hf = self.hf
        check_activation(hf.hidden_act, arch.model_name)
        self.embedding_scale = float(hf.embedding_multiplier)
        self.logits = LogitsHead(arch.vocab_size, tp, scale=float(hf.logits_scaling))
        self.set_ropes({"default": get_rope(hf, arch.head_dim, max_positions, model=arch.model_name)})
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(
                LlamaAttention(arch, i, backend, tp, qkv_bias=arch.attention_bias, o_bias=arch.attention_bias,
                               scale=float(hf.attention_multiplier)),
                LlamaMLP(arch.hidden_size, arch.intermediate_size, hf.hidden_act, tp, bool(hf.mlp_bias)),
                arch.hidden_size, arch.rms_norm_eps, residual_scale=float(hf.residual_multiplier))
            for i in range(arch.num_hidden_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

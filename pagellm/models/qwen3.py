"""Qwen3: Llama with q and k normalized per head before the rotary embedding, and no biases."""
from __future__ import annotations

from torch import nn

from pagellm.attention.backend import AttentionBackend
from pagellm.distributed.group import TensorParallelGroup
from pagellm.layers.activation import check_activation
from pagellm.layers.norm import RMSNorm
from pagellm.layers.rotary import get_rope
from pagellm.model.config import ModelArchConfig
from pagellm.models.base import CausalLM
from pagellm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP


class Qwen3ForCausalLM(CausalLM):
    def __init__(self, arch: ModelArchConfig, backend: AttentionBackend, max_positions: int,
                 tp: TensorParallelGroup | None = None) -> None:
        super().__init__(arch, tp)
        act = self.hf.hidden_act
        check_activation(act, arch.model_name)
        self.set_ropes({"default": get_rope(self.hf, arch.head_dim, max_positions, model=arch.model_name)})
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(
                LlamaAttention(arch, i, backend, tp, qkv_bias=arch.attention_bias, qk_norm="head"),
                LlamaMLP(arch.hidden_size, arch.intermediate_size, act, tp),
                arch.hidden_size, arch.rms_norm_eps)
            for i in range(arch.num_hidden_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

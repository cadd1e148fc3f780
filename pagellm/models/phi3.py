"""Phi-3 and Phi-4-mini: Llama whose checkpoints store q/k/v and gate/up already fused,
with LongRoPE scaling and, in Phi-4-mini, a rotary embedding over part of each head."""
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


class Phi3ForCausalLM(CausalLM):
    # The checkpoint's qkv_proj and gate_up_proj go whole to the fused layers' loaders,
    # which split them into parts (and this rank's shard of each).
    stacked_params = ()

    def __init__(self, arch: ModelArchConfig, backend: AttentionBackend, max_positions: int,
                 tp: TensorParallelGroup | None = None) -> None:
        super().__init__(arch, tp)
        hf = self.hf
        check_activation(hf.hidden_act, arch.model_name)
        self.set_ropes({"default": get_rope(hf, arch.head_dim, max_positions, model=arch.model_name)})
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(
                LlamaAttention(arch, i, backend, tp),
                LlamaMLP(arch.hidden_size, arch.intermediate_size, hf.hidden_act, tp),
                arch.hidden_size, arch.rms_norm_eps)
            for i in range(arch.num_hidden_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

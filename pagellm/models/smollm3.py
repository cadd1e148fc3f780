"""SmolLM3: Llama in which every fourth layer (the config's `no_rope_layers`) has no
rotary embedding at all (NoPE)."""
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


class SmolLM3ForCausalLM(CausalLM):
    def __init__(self, arch: ModelArchConfig, backend: AttentionBackend, max_positions: int,
                 tp: TensorParallelGroup | None = None) -> None:
        super().__init__(arch, tp)
        hf = self.hf
        check_activation(hf.hidden_act, arch.model_name)
        self.set_ropes({"default": get_rope(hf, arch.head_dim, max_positions, model=arch.model_name)})
        uses_rope = hf.no_rope_layers  # 1: the layer rotates, 0: it does not
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(
                LlamaAttention(arch, i, backend, tp, qkv_bias=arch.attention_bias, o_bias=arch.attention_bias),
                LlamaMLP(arch.hidden_size, arch.intermediate_size, hf.hidden_act, tp, bool(hf.mlp_bias)),
                arch.hidden_size, arch.rms_norm_eps, rope_name="default" if uses_rope[i] else None)
            for i in range(arch.num_hidden_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

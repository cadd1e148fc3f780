"""OLMo 2: norms after each block instead of before (on the block's output, before the
residual sum), and q/k normalized over all heads at once."""
from __future__ import annotations

from torch import nn

from pagellm.attention.backend import AttentionBackend
from pagellm.distributed.group import TensorParallelGroup
from pagellm.layers.activation import check_activation
from pagellm.layers.norm import RMSNorm
from pagellm.layers.rotary import get_rope
from pagellm.model.config import ModelArchConfig
from pagellm.models.base import CausalLM
from pagellm.models.llama import LlamaAttention, LlamaMLP


class Olmo2DecoderLayer(nn.Module):
    rope_name = "default"

    def __init__(self, arch: ModelArchConfig, layer: int, backend: AttentionBackend,
                 tp: TensorParallelGroup | None) -> None:
        super().__init__()
        eps = arch.rms_norm_eps
        self.self_attn = LlamaAttention(arch, layer, backend, tp, qkv_bias=arch.attention_bias,
                                        o_bias=arch.attention_bias, qk_norm="full")
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, eps)
        self.mlp = LlamaMLP(arch.hidden_size, arch.intermediate_size, arch.hf.hidden_act, tp)
        self.post_feedforward_layernorm = RMSNorm(arch.hidden_size, eps)

    def forward(self, rope, x, kv_cache, meta):
        x = x + self.post_attention_layernorm(self.self_attn(rope, x, kv_cache, meta))
        return x + self.post_feedforward_layernorm(self.mlp(x))


class Olmo2ForCausalLM(CausalLM):
    def __init__(self, arch: ModelArchConfig, backend: AttentionBackend, max_positions: int,
                 tp: TensorParallelGroup | None = None) -> None:
        super().__init__(arch, tp)
        check_activation(self.hf.hidden_act, arch.model_name)
        self.set_ropes({"default": get_rope(self.hf, arch.head_dim, max_positions, model=arch.model_name)})
        self.layers = nn.ModuleList(Olmo2DecoderLayer(arch, i, backend, tp) for i in range(arch.num_hidden_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

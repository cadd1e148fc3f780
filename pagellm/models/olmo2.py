"""OLMo 2: norms after each block instead of before (on the block's output, before the
residual sum), and q/k normalized over all heads at once."""
from __future__ import annotations

from torch import nn

from pagellm.attention.backend import AttentionBackend
from pagellm.layers.parallel import TensorParallelGroup
from pagellm.layers.norm import RMSNorm
from pagellm.models.llama import LlamaForCausalLM


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, self_attn: nn.Module, mlp: nn.Module, hidden_size: int, eps: float,
                 rope_name: str = "default") -> None:
        super().__init__()
        self.rope_name = rope_name
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)
        self.mlp = mlp
        self.post_feedforward_layernorm = RMSNorm(hidden_size, eps)

    def forward(self, rope, x, kv_cache, meta):
        x = x + self.post_attention_layernorm(self.self_attn(rope, x, kv_cache, meta))
        return x + self.post_feedforward_layernorm(self.mlp(x))


class Olmo2ForCausalLM(LlamaForCausalLM):
    qk_norm = "full"

    def make_layer(self, layer: int, backend: AttentionBackend, tp: TensorParallelGroup | None) -> nn.Module:
        return Olmo2DecoderLayer(self.make_attention(layer, backend, tp), self.make_mlp(layer, tp),
                                 self.cfg.hidden_size, self.cfg.rms_norm_eps, self.rope_for(layer))

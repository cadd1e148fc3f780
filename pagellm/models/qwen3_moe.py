"""Qwen3-MoE: Qwen3's attention (q/k norms) with sparse mixture-of-experts MLPs (top-k of
many small experts, routing weights renormalized when norm_topk_prob); layers listed in
mlp_only_layers, or off the decoder_sparse_step rhythm, keep a dense MLP."""
from __future__ import annotations

from torch import nn

from pagellm.attention.backend import AttentionBackend
from pagellm.distributed.group import TensorParallelGroup
from pagellm.layers.activation import check_activation
from pagellm.layers.moe import SparseMoeBlock, route_expert_weight
from pagellm.layers.norm import RMSNorm
from pagellm.layers.rotary import get_rope
from pagellm.model.config import ModelArchConfig
from pagellm.models.base import CausalLM
from pagellm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP


class Qwen3MoeForCausalLM(CausalLM):
    def __init__(self, arch: ModelArchConfig, backend: AttentionBackend, max_positions: int,
                 tp: TensorParallelGroup | None = None) -> None:
        super().__init__(arch, tp)
        hf = self.hf
        check_activation(hf.hidden_act, arch.model_name)
        self.set_ropes({"default": get_rope(hf, arch.head_dim, max_positions, model=arch.model_name)})

        def mlp(i: int) -> nn.Module:
            if i not in hf.mlp_only_layers and hf.num_experts > 0 and (i + 1) % hf.decoder_sparse_step == 0:
                return SparseMoeBlock(hf.num_experts, hf.num_experts_per_tok, arch.hidden_size,
                                      hf.moe_intermediate_size, hf.hidden_act, bool(hf.norm_topk_prob), tp)
            return LlamaMLP(arch.hidden_size, arch.intermediate_size, hf.hidden_act, tp)

        self.layers = nn.ModuleList(
            LlamaDecoderLayer(LlamaAttention(arch, i, backend, tp, qkv_bias=arch.attention_bias, qk_norm="head"),
                              mlp(i), arch.hidden_size, arch.rms_norm_eps)
            for i in range(arch.num_hidden_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def route(self, name: str, params: dict) -> tuple[str, object]:
        return route_expert_weight(name) or super().route(name, params)

"""Mixtral: Llama attention (with Mistral's window) and a sparse mixture-of-experts MLP
(top-2 of 8 experts, routing weights renormalized)."""
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
from pagellm.models.llama import LlamaAttention, LlamaDecoderLayer


class MixtralForCausalLM(CausalLM):
    def __init__(self, arch: ModelArchConfig, backend: AttentionBackend, max_positions: int,
                 tp: TensorParallelGroup | None = None) -> None:
        super().__init__(arch, tp)
        hf = self.hf
        check_activation(hf.hidden_act, arch.model_name)
        self.set_ropes({"default": get_rope(hf, arch.head_dim, max_positions, model=arch.model_name)})
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(
                LlamaAttention(arch, i, backend, tp),
                SparseMoeBlock(hf.num_local_experts, hf.num_experts_per_tok, arch.hidden_size,
                               arch.intermediate_size, hf.hidden_act, renormalize=True, tp=tp),
                arch.hidden_size, arch.rms_norm_eps)
            for i in range(arch.num_hidden_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def checkpoint_name(self, name: str) -> str | None:
        name = super().checkpoint_name(name)
        return None if name is None else name.replace(".block_sparse_moe.", ".mlp.")

    def route(self, name: str, params: dict) -> tuple[str, object]:
        return route_expert_weight(name) or super().route(name, params)

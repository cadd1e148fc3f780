"""Mixtral: Llama attention (with Mistral's window) and a sparse mixture-of-experts MLP
(top-2 of 8 experts, routing weights renormalized)."""
from __future__ import annotations

from torch import nn

from pagellm.layers.parallel import TensorParallelGroup
from pagellm.layers.moe import SparseMoeBlock, route_expert_weight
from pagellm.models.llama import LlamaForCausalLM


class MixtralForCausalLM(LlamaForCausalLM):
    def make_mlp(self, layer: int, tp: TensorParallelGroup | None) -> nn.Module:
        hf = self.hf
        return SparseMoeBlock(hf.num_local_experts, hf.num_experts_per_tok, self.cfg.hidden_size,
                              self.cfg.intermediate_size, self.act, renormalize=True, tp=tp)

    def checkpoint_name(self, name: str) -> str | None:
        name = super().checkpoint_name(name)
        return None if name is None else name.replace(".block_sparse_moe.", ".mlp.")

    def route(self, name: str, params: dict) -> tuple[str, object]:
        return route_expert_weight(name) or super().route(name, params)

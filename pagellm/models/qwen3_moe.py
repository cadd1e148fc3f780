"""Qwen3-MoE: Qwen3's attention (q/k norms) with sparse mixture-of-experts MLPs (top-k of
many small experts, routing weights renormalized when norm_topk_prob); layers listed in
mlp_only_layers, or off the decoder_sparse_step rhythm, keep a dense MLP."""
from __future__ import annotations

from torch import nn

from pagellm.layers.parallel import TensorParallelGroup
from pagellm.layers.moe import SparseMoeBlock, route_expert_weight
from pagellm.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def make_mlp(self, layer: int, tp: TensorParallelGroup | None) -> nn.Module:
        hf = self.hf
        if layer not in hf.mlp_only_layers and hf.num_experts > 0 and (layer + 1) % hf.decoder_sparse_step == 0:
            return SparseMoeBlock(hf.num_experts, hf.num_experts_per_tok, self.cfg.hidden_size,
                                  hf.moe_intermediate_size, self.act, bool(hf.norm_topk_prob), tp)
        return super().make_mlp(layer, tp)

    def route(self, name: str, params: dict) -> tuple[str, object]:
        return route_expert_weight(name) or super().route(name, params)

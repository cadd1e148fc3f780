"""Qwen3.5-MoE (text): Qwen3.5's layers (Gated DeltaNet and gated attention) with a mixture of
experts in every layer: top-k of many small experts, weights renormalized, beside a shared
expert gated per token. Its MTP layer (Qwen3_5MoeMTP) is Qwen3.5's with the experts."""
from __future__ import annotations

from torch import nn

from pagellm.layers.moe import GatedSharedExpertMoeBlock, route_expert_weight
from pagellm.layers.parallel import TensorParallelGroup
from pagellm.models.llama import LlamaMLP
from pagellm.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5MTP


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    def make_mlp(self, layer: int, tp: TensorParallelGroup | None) -> nn.Module:
        hf, hidden = self.hf, self.cfg.hidden_size
        return GatedSharedExpertMoeBlock(hf.num_experts, hf.num_experts_per_tok, hidden, hf.moe_intermediate_size,
                                         self.act, True, LlamaMLP(hidden, hf.shared_expert_intermediate_size,
                                                                  self.act, tp), tp)

    def route(self, name: str, params: dict) -> tuple[str, object]:
        return route_expert_weight(name) or super().route(name, params)


class Qwen3_5MoeMTP(Qwen3_5MTP, Qwen3_5MoeForCausalLM):
    """Qwen3.5's MTP layer (models/qwen3_5.py) with this family's experts in its decoder layer."""

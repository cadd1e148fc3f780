"""Ministral 3: Mistral (one window for every layer, where the config sets one) with YaRN
rope scaling and Llama 4-style query scaling: past each multiple of the original context the
rotated queries are multiplied by 1 + beta * log(1 + floor(position / original context))."""
from __future__ import annotations

from pagellm.layers.rotary import RotaryEmbedding, llama4_query_scale, rope_parameters
from pagellm.models.llama import LlamaForCausalLM


class Ministral3ForCausalLM(LlamaForCausalLM):
    def make_ropes(self, max_positions: int) -> dict[str, RotaryEmbedding]:
        ropes = super().make_ropes(max_positions)
        params = rope_parameters(self.hf)
        beta = params.get("llama_4_scaling_beta")
        if beta:  # 0 or absent: no scaling
            floor = params.get("original_max_position_embeddings")
            if not floor:
                raise ValueError(f"{self.cfg.model_name}: llama_4_scaling_beta needs the rope parameters' "
                                 "original_max_position_embeddings (where the query scale steps)")
            ropes["default"].scale_queries(llama4_query_scale(max_positions, float(beta), int(floor)))
        return ropes

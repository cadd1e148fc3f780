"""Gemma 3 (text): Gemma 2 with q and k normalized per head, no attention soft-cap, and
two rotary embeddings: the sliding-window layers' (a local base frequency) and the global
layers' (scaled for long context)."""
from __future__ import annotations

from pagellm.layers.rotary import get_rope
from pagellm.model.config import ModelArchConfig
from pagellm.models.gemma2 import Gemma2ForCausalLM


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = "head"

    def make_ropes(self, arch: ModelArchConfig, max_positions: int, types: list[str]) -> dict:
        return {t: get_rope(self.hf, arch.head_dim, max_positions, layer_type=t, model=arch.model_name)
                for t in sorted(set(types))}

    def rope_for(self, layer_type: str) -> str:
        return layer_type

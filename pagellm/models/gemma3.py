"""Gemma 3 (text): Gemma 2 with q and k normalized per head, no attention soft-cap, and
two rotary embeddings: the sliding-window layers' (a local base frequency) and the global
layers' (scaled for long context)."""
from __future__ import annotations

from pagellm.layers.rotary import RotaryEmbedding, get_rope
from pagellm.models.gemma2 import Gemma2ForCausalLM


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = "head"

    def make_ropes(self, max_positions: int) -> dict[str, RotaryEmbedding]:
        return {t: get_rope(self.hf, self.cfg.head_dim, max_positions, layer_type=t, model=self.cfg.model_name)
                for t in sorted(set(self.hf.layer_types))}

    def rope_for(self, layer: int) -> str | None:
        return self.hf.layer_types[layer]

"""SmolLM3: Llama in which every fourth layer (the config's `no_rope_layers`) has no
rotary embedding at all (NoPE)."""
from __future__ import annotations

from pagellm.models.llama import LlamaForCausalLM


class SmolLM3ForCausalLM(LlamaForCausalLM):
    def rope_for(self, layer: int) -> str | None:
        return "default" if self.hf.no_rope_layers[layer] else None  # 1: the layer rotates

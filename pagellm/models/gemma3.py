"""Gemma 3 (text): Gemma 2 with q and k normalized per head, no attention soft-cap, and
two rotary embeddings: the sliding-window layers' (a local base frequency) and the global
layers' (scaled for long context)."""
from __future__ import annotations

from pagellm.models.gemma2 import Gemma2ForCausalLM


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = "head"
    ropes_by_layer_type = True

"""Qwen3: Llama with q and k normalized per head before the rotary embedding."""
from __future__ import annotations

from pagellm.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = "head"

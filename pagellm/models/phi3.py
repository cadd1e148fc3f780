"""Phi-3 and Phi-4-mini: Llama whose checkpoints store q/k/v and gate/up already fused,
with LongRoPE scaling and, in Phi-4-mini, a rotary embedding over part of each head (both
read from the config by get_rope)."""
from __future__ import annotations

from pagellm.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    # The checkpoint's qkv_proj and gate_up_proj go whole to the fused layers' loaders,
    # which split them into parts (and this rank's shard of each).
    stacked_params = ()

"""OLMo 3: OLMo 2 with sliding-window layers (config `layer_types`; three in four by default)
and a rotary table per layer type: the full layers' scaled for long context (YaRN), the
sliding layers' unscaled."""
from __future__ import annotations

from pagellm.models.olmo2 import Olmo2ForCausalLM


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    ropes_by_layer_type = True

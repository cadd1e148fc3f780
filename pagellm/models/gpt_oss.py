"""gpt-oss: Llama-shaped attention with q/k/v/o biases and a learned sink logit per head,
sliding-window layers alternating with full ones (layer_types), YaRN rope, and a mixture of
experts whose router has a bias and softmaxes its top-k logits alone, and whose experts have
biases and a clamped SwiGLU."""
from __future__ import annotations

from torch import nn

from pagellm.attention.backend import AttentionBackend
from pagellm.layers.activation import ClampedSwiGLU
from pagellm.layers.moe import SparseMoeBlock, route_expert_weight, route_interleaved_expert_weight
from pagellm.layers.parallel import TensorParallelGroup
from pagellm.models.llama import LlamaAttention, LlamaForCausalLM

# Checkpoint name -> this family's module names.
_RENAMES = ((".mlp.router.", ".mlp.gate."), (".self_attn.sinks", ".self_attn.attn.sinks"))


class GptOssForCausalLM(LlamaForCausalLM):
    def make_attention(self, layer: int, backend: AttentionBackend, tp: TensorParallelGroup | None) -> nn.Module:
        bias = self.cfg.attention_bias
        return LlamaAttention(self.cfg, layer, backend, tp, qkv_bias=bias, o_bias=bias, sinks=True)

    def make_mlp(self, layer: int, tp: TensorParallelGroup | None) -> nn.Module:
        hf = self.hf
        return SparseMoeBlock(hf.num_local_experts, hf.num_experts_per_tok, self.cfg.hidden_size,
                              self.cfg.intermediate_size, ClampedSwiGLU(hf.swiglu_alpha, hf.swiglu_limit),
                              renormalize=False, tp=tp, softmax_after_topk=True, bias=True)

    def checkpoint_name(self, name: str) -> str | None:
        name = super().checkpoint_name(name)
        if name is not None:
            for old, new in _RENAMES:
                name = name.replace(old, new)
        return name

    def route(self, name: str, params: dict) -> tuple[str, object]:
        # GGUF files stack gate, up and down (and their biases) apart: route_expert_weight's names.
        return route_interleaved_expert_weight(name) or route_expert_weight(name) or super().route(name, params)

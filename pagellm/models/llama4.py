"""Llama 4 (text): chunked-attention layers with RoPE and a weightless L2 norm on q and k,
alternating with global NoPE layers (no_rope_layers) whose queries are scaled up with their
position (attention temperature tuning); feed-forward blocks that are, on the layers of
moe_layers, a shared expert beside routed experts picked by a sigmoid router (top-k, the
weight multiplying the expert's input), and elsewhere a dense MLP of intermediate_size_mlp.

Its checkpoints rotate adjacent feature pairs (complex multiplication); pagellm rotates
halves. q_proj and k_proj rows are permuted within each head at load time (even features
first, then odd): q.k is unchanged by a permutation applied to both, and so is the norm, so
the layer computes what the reference computes.

Chunked layers keep every block of the context, as full-attention layers do: freeing the
blocks before the current chunk is a cache kind left for later (core/kv/)."""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagellm.attention.backend import AttentionBackend
from pagellm.layers.linear import ReplicatedLinear
from pagellm.layers.moe import FusedMoE, route_expert_weight
from pagellm.layers.norm import QKNorm, RMSNorm
from pagellm.layers.quant.gguf import GGUFBlocks
from pagellm.layers.parallel import TensorParallelGroup
from pagellm.layers.rotary import QueryScale, RotaryEmbedding, llama4_attention_temperature
from pagellm.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP

# Checkpoint name -> this family's module names.
_RENAMES = ((".feed_forward.", ".mlp."),)
# The experts' stacked checkpoint tensors ([experts, in, out]) -> (FusedMoE parameter, part kind).
_EXPERT_TENSORS = {"gate_up_proj": ("w13", "w13_t"), "down_proj": ("w2", "w2_t")}


def _weightless_norm(size: int, eps: float) -> RMSNorm:
    """An RMSNorm without a learned weight (Llama 4's L2 norm of q and k): its weight is a buffer of ones."""
    norm = RMSNorm(size, eps)
    del norm.weight
    norm.register_buffer("weight", torch.ones(size), persistent=False)
    return norm


class Llama4MoE(nn.Module):
    """Routed experts plus a shared expert that every token goes through."""

    def __init__(self, hf, hidden_size: int, act: str, tp: TensorParallelGroup | None) -> None:
        super().__init__()
        self.top_k = hf.num_experts_per_tok
        self.router = ReplicatedLinear(hidden_size, hf.num_local_experts, False)
        self.experts = FusedMoE(hf.num_local_experts, self.top_k, hidden_size, hf.intermediate_size, act, tp,
                                scale_inputs=True)
        self.shared_expert = LlamaMLP(hidden_size, hf.intermediate_size, act, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, experts = torch.topk(self.router(x), self.top_k, dim=-1)
        weights = torch.sigmoid(top.float()).to(x.dtype)
        return self.shared_expert(x) + self.experts(x, weights, experts)


class Llama4ForCausalLM(LlamaForCausalLM):
    def make_ropes(self, max_positions: int) -> dict[str, RotaryEmbedding | QueryScale]:
        ropes: dict = super().make_ropes(max_positions)
        hf = self.hf
        if hf.attn_temperature_tuning and not all(hf.no_rope_layers):
            ropes["nope"] = QueryScale(llama4_attention_temperature(max_positions, float(hf.attn_scale),
                                                                    int(hf.floor_scale)))
        return ropes

    def rope_for(self, layer: int) -> str | None:
        if self.hf.no_rope_layers[layer]:  # 1: the layer rotates
            return "default"
        return "nope" if self.hf.attn_temperature_tuning else None

    def make_attention(self, layer: int, backend: AttentionBackend, tp: TensorParallelGroup | None) -> nn.Module:
        hf = self.hf
        chunk = hf.attention_chunk_size if hf.layer_types[layer] == "chunked_attention" else None
        bias = self.cfg.attention_bias
        attn = LlamaAttention(self.cfg, layer, backend, tp, qkv_bias=bias, o_bias=bias, attention_chunk=chunk)
        if hf.use_qk_norm and hf.no_rope_layers[layer]:
            # The reference normalizes after RoPE; a rotation keeps each pair's length, so before is the same.
            d = self.cfg.head_dim
            attn.qk_norm = QKNorm(_weightless_norm(d, hf.rms_norm_eps), _weightless_norm(d, hf.rms_norm_eps),
                                  per_head=True)
        return attn

    def make_mlp(self, layer: int, tp: TensorParallelGroup | None) -> nn.Module:
        if layer in self.hf.moe_layers:
            return Llama4MoE(self.hf, self.cfg.hidden_size, self.act, tp)
        return LlamaMLP(self.cfg.hidden_size, self.hf.intermediate_size_mlp, self.act, tp)

    def checkpoint_name(self, name: str) -> str | None:
        name = super().checkpoint_name(name)
        if name is not None:
            for old, new in _RENAMES:
                name = name.replace(old, new)
        return name

    def route(self, name: str, params: dict) -> tuple[str, object]:
        head, sep, tail = name.partition(".experts.")
        if sep and tail in _EXPERT_TENSORS:
            param, kind = _EXPERT_TENSORS[tail]
            return f"{head}.experts.{param}", ("all", kind)
        return route_expert_weight(name) or super().route(name, params)  # a GGUF file's stacked experts

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights((name, self._pairs_to_halves(name, tensor)) for name, tensor in weights)

    def _pairs_to_halves(self, name: str, tensor: torch.Tensor | GGUFBlocks) -> torch.Tensor | GGUFBlocks:
        """q_proj and k_proj rows (weight or bias) of each head reordered from the checkpoint's
        rotated pairs (0, 1), (2, 3), ... to rotate-half order: even features, then odd (a GGUF
        file's quantized rows as whole runs of blocks)."""
        if ".self_attn.q_proj." not in name and ".self_attn.k_proj." not in name:
            return tensor
        if isinstance(tensor, GGUFBlocks):
            return tensor.with_rows(self._pairs_to_halves(name, tensor.data))
        d = self.cfg.head_dim
        heads = tensor.view(-1, d // 2, 2, *tensor.shape[1:])
        return heads.transpose(1, 2).reshape(tensor.shape)

"""Granite 4 hybrid (GraniteMoeHybrid): Mamba-2 layers (layers/mamba2.py, a fixed-size state
per sequence) with some attention layers between them, by `layer_types`; Granite's four
multipliers; each layer's MLP is a shared dense MLP plus, when the model has experts, a
mixture of experts (top-k, weights softmaxed over the chosen experts); attention without
rotary embeddings unless position_embedding_type is "rope"."""
from __future__ import annotations

import torch
from torch import nn

from pagellm.attention.backend import AttentionBackend
from pagellm.layers.mamba2 import Mamba2Mixer
from pagellm.layers.moe import SparseMoeBlock, route_expert_weight
from pagellm.layers.norm import RMSNorm
from pagellm.layers.parallel import TensorParallelGroup
from pagellm.layers.rotary import RotaryEmbedding
from pagellm.models.granite import GraniteForCausalLM
from pagellm.models.llama import LlamaMLP

# Checkpoint name fragment -> this family's parameter fragment. The checkpoints keep every expert's
# gate and up projections stacked in input_linear [E, 2I, H] and their down ones in output_linear
# (GGUF files: experts.w1, experts.w3 and experts.w2, the shared MLP's halves apart).
_RENAMES = ((".block_sparse_moe.router.layer.", ".moe.gate."),
            (".block_sparse_moe.input_linear.weight", ".moe.experts.gate_up_proj"),
            (".block_sparse_moe.output_linear.weight", ".moe.experts.down_proj"),
            (".block_sparse_moe.experts.", ".moe.experts."),  # one kind at a time, as GGUF files stack them
            (".shared_mlp.input_linear.", ".shared_mlp.gate_up_proj."),
            (".shared_mlp.output_linear.", ".shared_mlp.down_proj."))


class GraniteHybridDecoderLayer(nn.Module):
    def __init__(self, mixer: nn.Module, moe: nn.Module | None, shared_mlp: nn.Module, hidden_size: int, eps: float,
                 mamba: bool, rope_name: str | None, residual_scale: float) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, eps)
        if mamba:
            self.mamba = mixer
        else:
            self.self_attn = mixer
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)
        self.moe = moe
        self.shared_mlp = shared_mlp
        self.is_mamba = mamba
        self.rope_name = rope_name
        self.residual_scale = residual_scale

    def forward(self, rope, x: torch.Tensor, kv_cache, meta) -> torch.Tensor:
        h = self.input_layernorm(x)
        h = self.mamba.cached_forward(h, kv_cache, meta) if self.is_mamba else self.self_attn(rope, h, kv_cache, meta)
        x, normed = self.post_attention_layernorm.add_and_norm(x, h * self.residual_scale)
        h = self.shared_mlp(normed)
        if self.moe is not None:
            h = self.moe(normed) + h
        return x + h * self.residual_scale


class GraniteMoeHybridForCausalLM(GraniteForCausalLM):
    def make_ropes(self, max_positions: int) -> dict[str, RotaryEmbedding]:
        return super().make_ropes(max_positions) if self.hf.position_embedding_type == "rope" else {}

    def make_layer(self, layer: int, backend: AttentionBackend, tp: TensorParallelGroup | None) -> nn.Module:
        hf, arch = self.hf, self.cfg
        mamba = hf.layer_types[layer] == "linear_attention"
        mixer = Mamba2Mixer(hf, tp) if mamba else self.make_attention(layer, backend, tp)
        moe = None
        if hf.num_local_experts:
            moe = SparseMoeBlock(hf.num_local_experts, hf.num_experts_per_tok, arch.hidden_size, arch.intermediate_size,
                                 self.act, renormalize=True, tp=tp)
        rope = "default" if self.ropes and not mamba else None
        return GraniteHybridDecoderLayer(mixer, moe, LlamaMLP(arch.hidden_size, hf.shared_intermediate_size, self.act,
                                                              tp),
                                         arch.hidden_size, arch.rms_norm_eps, mamba, rope, float(hf.residual_multiplier))

    def checkpoint_name(self, name: str) -> str | None:
        name = super().checkpoint_name(name)
        if name is None:
            return None
        for old, new in _RENAMES:
            name = name.replace(old, new)
        return name

    def route(self, name: str, params: dict) -> tuple[str, object]:
        return route_expert_weight(name) or super().route(name, params)

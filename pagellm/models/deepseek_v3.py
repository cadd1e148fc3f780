"""DeepSeek-V3 (and Kimi K2, which is its architecture): multi-head latent attention
(layers/mla.py), whose cache is one latent row per token, with YaRN rope on the decoupled rotary
key; the first `first_k_dense_replace` layers have a dense MLP, the rest a mixture of experts
routed by sigmoid scores with a correction bias, in groups (n_group, topk_group), scaled by
routed_scaling_factor, beside `n_shared_experts` shared experts that every token runs."""
from __future__ import annotations

import torch
from torch import nn

from pagellm.attention.backend import AttentionBackend
from pagellm.layers.activation import Activation
from pagellm.layers.mla import MultiHeadLatentAttention, mla_softmax_scale
from pagellm.layers.moe import SparseMoeBlock, route_expert_weight
from pagellm.layers.parallel import TensorParallelGroup
from pagellm.layers.rotary import RotaryEmbedding, get_rope
from pagellm.models.arch import ModelArchConfig
from pagellm.models.llama import LlamaForCausalLM, LlamaMLP
from pagellm.models.mtp import MultiTokenPredictor


class DeepseekV3MoE(SparseMoeBlock):
    """The routed experts (SparseMoeBlock's sigmoid router) plus the shared experts, one MLP of
    n_shared_experts * moe_intermediate_size features."""

    def __init__(self, hf, act: Activation, tp: TensorParallelGroup | None) -> None:
        groups = (hf.n_group, hf.topk_group) if (hf.n_group or 1) > 1 else None
        super().__init__(hf.n_routed_experts, hf.num_experts_per_tok, hf.hidden_size, hf.moe_intermediate_size, act,
                         bool(hf.norm_topk_prob), tp, sigmoid=True, groups=groups,
                         routed_scaling_factor=float(hf.routed_scaling_factor))
        self.shared_experts = (LlamaMLP(hf.hidden_size, hf.moe_intermediate_size * hf.n_shared_experts, act, tp)
                               if hf.n_shared_experts else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out if self.shared_experts is None else out + self.shared_experts(x)


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    def make_ropes(self, max_positions: int) -> dict[str, RotaryEmbedding]:
        return {"default": get_rope(self.hf, self.hf.qk_rope_head_dim, max_positions, model=self.cfg.model_name)}

    def make_attention(self, layer: int, backend: AttentionBackend, tp: TensorParallelGroup | None) -> nn.Module:
        hf = self.hf
        scale = mla_softmax_scale(hf.rope_parameters, hf.qk_nope_head_dim + hf.qk_rope_head_dim)
        # q_a_layernorm and kv_a_layernorm keep the reference's default eps (1e-6), not rms_norm_eps.
        return MultiHeadLatentAttention(hf.hidden_size, hf.num_attention_heads, hf.q_lora_rank, hf.kv_lora_rank,
                                        hf.qk_nope_head_dim, hf.qk_rope_head_dim, hf.v_head_dim, backend, scale,
                                        bias=bool(hf.attention_bias), interleaved_rope=bool(hf.rope_interleave), tp=tp)

    def make_mlp(self, layer: int, tp: TensorParallelGroup | None) -> nn.Module:
        if layer < self.hf.first_k_dense_replace:
            return super().make_mlp(layer, tp)
        return DeepseekV3MoE(self.hf, self.act, tp)

    @property
    def num_kv_heads(self) -> int:
        return 1  # one latent row per token and layer, read by every head

    def kv_cache_rows(self) -> tuple[int, int, int]:
        # Every rank caches the whole row (it does not depend on the head).
        return 1, self.hf.kv_lora_rank + self.hf.qk_rope_head_dim, 0

    def checkpoint_name(self, name: str) -> str | None:
        parts = name.split(".")
        if name.startswith("model.layers.") and int(parts[2]) >= self.cfg.num_hidden_layers:
            return None  # the multi-token-prediction layers (num_nextn_predict_layers) after the stack
        if name.endswith("weight_scale_inv"):
            raise ValueError(f"{self.cfg.model_name}: weight {name!r} is an FP8 block scale: DeepSeek-V3's FP8 "
                             "checkpoints are not read yet; serve one converted to bfloat16")
        name = super().checkpoint_name(name)
        return None if name is None else name.replace(".mlp.gate.e_score_correction_bias",
                                                      ".mlp.e_score_correction_bias")

    def route(self, name: str, params: dict) -> tuple[str, object]:
        return route_expert_weight(name) or super().route(name, params)


class DeepseekV3MTP(MultiTokenPredictor, DeepseekV3ForCausalLM):
    """The multi-token-prediction layer DeepSeek-V3 ships after its stack (num_nextn_predict_layers;
    checkpoint names `model.layers.{N}.*`, N = num_hidden_layers): `enorm`, `hnorm`, `eh_proj`, the
    decoder layer (latent attention, the experts) and `shared_head.norm` (models/mtp.py). As
    released, position 0's embedding is zeroed, and the chain reads the layer's output before
    `shared_head.norm`. The checkpoint's copies of the embedding and head in layer N
    (`embed_tokens`, `shared_head.head`) are not read: DeepSeek-V3 trains them shared with the
    target's."""

    layers_field = "num_nextn_predict_layers"
    part_names = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "norm": "shared_head.norm"}
    unread = ("embed_tokens.", "shared_head.head.")
    zero_first_embedding = True

    @classmethod
    def prefix(cls, arch: ModelArchConfig) -> str:
        return f"model.layers.{arch.num_hidden_layers}."

    def make_block(self, backend: AttentionBackend, tp: TensorParallelGroup | None) -> nn.Module:
        return self.make_layer(self.cfg.num_hidden_layers, backend, tp)  # past first_k_dense_replace: experts

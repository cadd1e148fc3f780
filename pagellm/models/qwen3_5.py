"""Qwen3.5 (text): three Gated DeltaNet linear-attention layers (layers/gated_delta_net.py, a
fixed-size state per sequence) for each full-attention layer, by `layer_types`; the attention
layers gate their output per head (q_proj yields a gate beside each query) and normalize q and
k per head; every RMSNorm applies its weight as 1 + w; partial rotary embeddings. Its text
positions are the same in the three M-RoPE sections, so the rotary tables are plain ones.
Qwen3_5MTP is the multi-token-prediction layer its checkpoints ship (`mtp.*`)."""
from __future__ import annotations

import torch
from torch import nn

from pagellm.attention.backend import AttentionBackend
from pagellm.layers.gated_delta_net import GatedDeltaNet
from pagellm.layers.norm import RMSNorm
from pagellm.layers.parallel import TensorParallelGroup
from pagellm.models.arch import ModelArchConfig
from pagellm.models.base import STACKED_QKV_GATE_UP
from pagellm.models.llama import LlamaAttention, LlamaForCausalLM
from pagellm.models.mtp import MultiTokenPredictor


class Qwen3_5DecoderLayer(nn.Module):
    def __init__(self, mixer: nn.Module, mlp: nn.Module, hidden_size: int, eps: float, linear: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, eps, unit_offset=True)
        if linear:
            self.linear_attn = mixer
        else:
            self.self_attn = mixer
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, unit_offset=True)
        self.mlp = mlp
        self.linear = linear
        self.rope_name = None if linear else "default"

    def forward(self, rope, x: torch.Tensor, kv_cache, meta) -> torch.Tensor:
        h = self.input_layernorm(x)
        h = self.linear_attn.cached_forward(h, kv_cache, meta) if self.linear else self.self_attn(rope, h, kv_cache,
                                                                                                  meta)
        x, normed = self.post_attention_layernorm.add_and_norm(x, h)
        return x + self.mlp(normed)


class Qwen3_5ForCausalLM(LlamaForCausalLM):
    qk_norm = "head"
    unit_offset_norms = True
    stacked_params = STACKED_QKV_GATE_UP + GatedDeltaNet.stacked_params

    def make_attention(self, layer: int, backend: AttentionBackend, tp: TensorParallelGroup | None) -> nn.Module:
        arch = self.cfg
        return LlamaAttention(arch, layer, backend, tp, qkv_bias=arch.attention_bias, o_bias=arch.attention_bias,
                              qk_norm="head", unit_offset_norm=True, output_gate=True)

    def make_layer(self, layer: int, backend: AttentionBackend, tp: TensorParallelGroup | None) -> nn.Module:
        linear = self.hf.layer_types[layer] == "linear_attention"
        mixer = GatedDeltaNet(self.hf, tp) if linear else self.make_attention(layer, backend, tp)
        return Qwen3_5DecoderLayer(mixer, self.make_mlp(layer, tp), self.cfg.hidden_size, self.cfg.rms_norm_eps,
                                   linear)


class Qwen3_5MTP(MultiTokenPredictor, Qwen3_5ForCausalLM):
    """The multi-token-prediction layer Qwen3.5 checkpoints store beside the model (config
    `mtp_num_hidden_layers`, 1 where absent as in vLLM; tensors `mtp.*`, in the text and the
    image-text layouts alike): `pre_fc_norm_embedding`, `pre_fc_norm_hidden`, `fc`, one
    full-attention decoder layer `layers.0` (gated attention, the family's MLP or experts) and
    `norm` (models/mtp.py). Every norm is the family's (1 + w), as vLLM's Qwen3_5RMSNorm
    (GemmaRMSNorm) applies them; position 0's embedding is not zeroed, and the output passes `norm`
    before it is a chain's next hidden state, as vLLM's Qwen3_5MultiTokenPredictor returns it."""

    layers_field = "mtp_num_hidden_layers"
    part_names = {"enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden", "eh_proj": "fc", "norm": "norm"}
    block_prefix = "layers.0."
    normed_output = True

    @classmethod
    def prefix(cls, arch: ModelArchConfig) -> str:
        return "mtp."

    def make_block(self, backend: AttentionBackend, tp: TensorParallelGroup | None) -> nn.Module:
        # Built as the target's full-attention layers are: their index picks the attention's
        # options (no window) and, in the MoE model, the experts.
        layer = self.hf.layer_types.index("full_attention")
        return Qwen3_5DecoderLayer(self.make_attention(layer, backend, tp), self.make_mlp(layer, tp),
                                   self.cfg.hidden_size, self.cfg.rms_norm_eps, linear=False)

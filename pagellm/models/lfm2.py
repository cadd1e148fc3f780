"""LFM2: most layers mix tokens by a short causal convolution (layers/short_conv.py, a state of
L_cache - 1 inputs per sequence) instead of attention; the others attend with q/k normalized
per head. The final norm is named embedding_norm, and the MLP's width is derived from
block_* fields when block_auto_adjust_ff_dim is set."""
from __future__ import annotations

import torch
from torch import nn

from pagellm.attention.backend import AttentionBackend
from pagellm.layers.norm import RMSNorm
from pagellm.layers.parallel import TensorParallelGroup
from pagellm.layers.short_conv import ShortConv
from pagellm.models.arch import ModelArchConfig
from pagellm.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP

# Checkpoint name fragment -> this family's (Llama-named) parameter fragment.
_RENAMES = ((".self_attn.out_proj.", ".self_attn.o_proj."), (".q_layernorm.", ".q_norm."),
            (".k_layernorm.", ".k_norm."), (".feed_forward.w1.", ".mlp.gate_proj."),
            (".feed_forward.w3.", ".mlp.up_proj."), (".feed_forward.w2.", ".mlp.down_proj."))


def ffn_size(hf) -> int:
    """The MLP's width as transformers' Lfm2MLP derives it."""
    size = hf.intermediate_size
    if hf.block_auto_adjust_ff_dim:
        size = int(2 * size / 3)
        if hf.block_ffn_dim_multiplier is not None:
            size = int(hf.block_ffn_dim_multiplier * size)
            size = hf.block_multiple_of * -(-size // hf.block_multiple_of)
    return size


class Lfm2DecoderLayer(nn.Module):
    def __init__(self, mixer: nn.Module, mlp: nn.Module, hidden_size: int, eps: float, attention: bool) -> None:
        super().__init__()
        self.operator_norm = RMSNorm(hidden_size, eps)
        if attention:
            self.self_attn = mixer
        else:
            self.conv = mixer
        self.mlp = mlp
        self.ffn_norm = RMSNorm(hidden_size, eps)
        self.attention = attention
        self.rope_name = "default" if attention else None

    def forward(self, rope, x: torch.Tensor, kv_cache, meta) -> torch.Tensor:
        h = self.operator_norm(x)
        h = self.self_attn(rope, h, kv_cache, meta) if self.attention else self.conv.cached_forward(h, kv_cache, meta)
        x, normed = self.ffn_norm.add_and_norm(x, h)
        return x + self.mlp(normed)


class Lfm2ForCausalLM(LlamaForCausalLM):
    qk_norm = "head"

    def __init__(self, arch: ModelArchConfig, backend: AttentionBackend, max_positions: int,
                 tp: TensorParallelGroup | None = None) -> None:
        super().__init__(arch, backend, max_positions, tp)
        self.norm = RMSNorm(arch.hidden_size, self.hf.norm_eps)

    def make_layer(self, layer: int, backend: AttentionBackend, tp: TensorParallelGroup | None) -> nn.Module:
        hf, arch = self.hf, self.cfg
        attention = hf.layer_types[layer] == "full_attention"
        if attention:
            mixer = LlamaAttention(arch, layer, backend, tp, qk_norm="head", norm_eps=hf.norm_eps)
        else:
            mixer = ShortConv(arch.hidden_size, hf.conv_L_cache, bool(hf.conv_bias), tp)
        return Lfm2DecoderLayer(mixer, LlamaMLP(arch.hidden_size, ffn_size(hf), "silu", tp), arch.hidden_size,
                                hf.norm_eps, attention)

    def checkpoint_name(self, name: str) -> str | None:
        name = super().checkpoint_name(name)
        if name is None:
            return None
        if name == "embedding_norm.weight":
            return "norm.weight"
        for old, new in _RENAMES:
            name = name.replace(old, new)
        return name

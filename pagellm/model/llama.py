"""The Llama-family network (Llama 2/3, Mistral, Qwen2, SmolLM2) over a flat batch of tokens.

Tokens of all sequences in a step are concatenated into one [T, hidden] tensor, so
every linear layer runs once per step; attention goes through the backend, which reads
and writes the paged KV cache.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.attention.backend import AttentionBackend, AttentionMetadata
from pagellm.model.config import ModelArchConfig
from pagellm.model.rope import RotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32 like the reference, whatever the model dtype.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelArchConfig, rope: RotaryEmbedding, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # q, k and v in one matrix: one product per layer instead of three.
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.scale = self.head_dim ** -0.5
        self.rope = rope
        self.backend = backend

    def forward(self, positions, x, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata):
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rope(positions, q, k)
        o = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(o.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelArchConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, rope: RotaryEmbedding, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rope, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, positions, x, kv_cache, meta):
        x = x + self.self_attn(positions, self.input_layernorm(x), kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelArchConfig, backend: AttentionBackend, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, rope, backend) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer, kv in zip(self.layers, kv_caches):
            x = layer(positions, x, kv, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in, fusing q/k/v and gate/up as they arrive."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the head
            target, rows = _fused_target(name, self.cfg)
            if target not in params:
                raise ValueError(f"unexpected weight {name!r} for a {self.cfg.architecture} model")
            param = params[target]
            dst = param.data if rows is None else param.data[rows[0]:rows[1]]
            if dst.shape != tensor.shape:
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(tensor)
            loaded.add(name)
        missing = set(_expected_names(self.cfg)) - loaded
        if missing:
            raise ValueError(f"model file lacks {len(missing)} weights, e.g. {sorted(missing)[:3]}")


def _fused_target(name: str, cfg: ModelArchConfig) -> tuple[str, tuple[int, int] | None]:
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    inter = cfg.intermediate_size
    name = name.removeprefix("model.")
    parts = {
        "self_attn.q_proj": ("self_attn.qkv_proj", (0, q)),
        "self_attn.k_proj": ("self_attn.qkv_proj", (q, q + kv)),
        "self_attn.v_proj": ("self_attn.qkv_proj", (q + kv, q + 2 * kv)),
        "mlp.gate_proj": ("mlp.gate_up_proj", (0, inter)),
        "mlp.up_proj": ("mlp.gate_up_proj", (inter, 2 * inter)),
    }
    for src, (dst, rows) in parts.items():
        if f".{src}." in name:
            return name.replace(src, dst), rows
    return name, None


def _expected_names(cfg: ModelArchConfig) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        names += [p + s + ".weight" for s in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm")]
        if cfg.attention_bias:
            names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
    return names

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
from pagellm.distributed.group import TensorParallelGroup
from pagellm.kernels import cpu
from pagellm.model.config import ModelArchConfig
from pagellm.model.parallel import ShardShapes, column_linear, embedding, gather_logits, row_linear, shard_weight
from pagellm.model.rope import RotaryEmbedding, rotate_qk
from pagellm.timing import phase


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # One fused kernel; bit-identical to the reference's three steps in fp32.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        if x.dtype == torch.bfloat16 and x.dim() == 2 and cpu.usable(x):
            return cpu.rms_norm_bf16(x, self.weight, self.eps)  # the same roundings, one pass
        # Normalize in fp32 like the reference, whatever the model dtype.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelArchConfig, backend: AttentionBackend,
                 tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        shapes = ShardShapes.of(cfg, tp)  # this rank's heads
        self.num_heads = shapes.num_heads
        self.num_kv_heads = shapes.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # q, k and v in one matrix: one product per layer instead of three.
        self.qkv_proj = column_linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.attention_bias, tp)
        self.o_proj = row_linear(self.q_size, cfg.hidden_size, False, tp)
        self.scale = self.head_dim ** -0.5
        self.backend = backend

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata):
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        q, k = rotate_qk(q, k, *rope)
        with phase(self.backend.timer, "attention"):
            o = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(o.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelArchConfig, tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        inter = ShardShapes.of(cfg, tp).intermediate_size
        self.gate_up_proj = column_linear(cfg.hidden_size, 2 * inter, False, tp)
        self.down_proj = row_linear(inter, cfg.hidden_size, False, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if cpu.usable(gate_up):
            return self.down_proj(cpu.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, backend: AttentionBackend,
                 tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, backend, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp)

    def forward(self, rope, x, kv_cache, meta):
        x = x + self.self_attn(rope, self.input_layernorm(x), kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """With `tp`, this rank's shard of the network (see pagellm.model.parallel); without, all of it."""

    def __init__(self, cfg: ModelArchConfig, backend: AttentionBackend, max_positions: int,
                 tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        self.shapes = ShardShapes.of(cfg, tp)
        # cos/sin are looked up once per step and handed to every layer.
        self.rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = embedding(self.shapes.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend, tp) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:  # column-parallel over the vocabulary
            self.lm_head = nn.Linear(cfg.hidden_size, self.shapes.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        rope = self.rope.cos_sin(positions, x.dtype)
        for layer, kv in zip(self.layers, kv_caches):
            x = layer(rope, x, kv, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[rows, vocab] float32 logits; under tensor parallelism on rank 0 only (None elsewhere)."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if self.tp is None:
            return F.linear(hidden, weight).float()
        logits = gather_logits(F.linear(hidden, weight), self.tp, self.cfg.vocab_size)
        return None if logits is None else logits.float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in, fusing q/k/v and gate/up as they arrive (and
        cutting each down to this rank's shard first, under tensor parallelism)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the head
            if self.tp is not None:
                tensor = shard_weight(name, tensor, self.cfg, self.tp)
            target, rows = _fused_target(name, self.shapes, self.cfg.head_dim)
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


def _fused_target(name: str, shapes: ShardShapes, head_dim: int) -> tuple[str, tuple[int, int] | None]:
    q = shapes.num_heads * head_dim
    kv = shapes.num_kv_heads * head_dim
    inter = shapes.intermediate_size
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

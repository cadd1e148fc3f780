"""Gemma 4 (text): Gemma's sandwich norms and scaled embeddings, with

- per-layer embeddings (PLE): a second embedding table gives every token a small vector per
  layer, mixed with a projection of the token's embedding; each layer gates it with its hidden
  state and adds the result to the residual stream;
- attention scaled by 1 (q and k are RMS-normalized per head, v too, without a weight);
  sliding-window and full layers with their own head size, KV heads and rotary embedding (the
  full layers' "proportional" rope rotates a fraction of each head, by frequencies of the whole
  head); with `attention_k_eq_v` the full layers have no v_proj and take v from k's projection;
- KV-shared layers: the last `num_kv_shared_layers` compute no K/V and cache nothing; each
  attends to the K/V of the last earlier layer of its type, through that layer's cache;
- an optional mixture of experts beside each dense MLP (`enable_moe_block`), a layer scalar
  multiplying each layer's output, and a final logit soft-cap.

Every RMSNorm applies its weight as it is (not Gemma 2/3's 1 + w)."""
from __future__ import annotations

import torch
from torch import nn

from pagellm.attention.backend import AttentionBackend, AttentionMetadata
from pagellm.layers.activation import ACTIVATIONS
from pagellm.layers.attention import Attention
from pagellm.layers.embedding import LogitsHead, VocabParallelEmbedding
from pagellm.layers.linear import ColumnParallelLinear, QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from pagellm.layers.moe import FusedMoE, route_expert_weight
from pagellm.layers.norm import RMSNorm
from pagellm.layers.parallel import TensorParallelGroup
from pagellm.layers.rotary import RotaryEmbedding, apply_rope, get_rope, rotate_qk
from pagellm.models.arch import ModelArchConfig
from pagellm.models.base import sliding_window
from pagellm.models.llama import LlamaForCausalLM, LlamaMLP

# Per layer type, the K/V the type's producing layer computed this step, and its attention
# (whose cache and KV group the shared layers read).
SharedKV = dict[str, tuple[torch.Tensor, torch.Tensor, Attention]]


def _weightless_norm(size: int, eps: float) -> RMSNorm:
    """An RMSNorm without a learned weight (Gemma 4's v norm): its weight is a buffer of ones."""
    norm = RMSNorm(size, eps)
    del norm.weight
    norm.register_buffer("weight", torch.ones(size), persistent=False)
    return norm


def kv_producers(hf) -> list[int]:
    """Per layer, the layer whose K/V it attends to: itself, or for the last
    `num_kv_shared_layers` (which compute none) the last earlier layer of its type."""
    n, shared = hf.num_hidden_layers, hf.num_kv_shared_layers or 0
    first = n - shared
    producers = list(range(n))
    for i in range(first, n):
        same = [j for j in range(first) if hf.layer_types[j] == hf.layer_types[i]]
        if not same:
            raise ValueError(f"num_kv_shared_layers={shared}: layer {i} ({hf.layer_types[i]}) shares K/V, but no "
                             f"earlier layer of its type computes any")
        producers[i] = same[-1]
    return producers


class Gemma4Attention(nn.Module):
    """`shares_kv`: the layer computes queries only, and attends to the K/V its type's producing
    layer computed (SharedKV); otherwise it computes its own (v from k_proj's output where
    `k_eq_v`) and, where `produces` is set, hands them on."""

    def __init__(self, arch: ModelArchConfig, layer: int, head_dim: int, num_kv_heads: int,
                 backend: AttentionBackend, tp: TensorParallelGroup | None, shares_kv: bool, k_eq_v: bool) -> None:
        super().__init__()
        hf, eps = arch.hf, arch.rms_norm_eps
        heads = arch.num_attention_heads
        self.layer_type = hf.layer_types[layer]
        self.shares_kv, self.k_eq_v, self.produces = shares_kv, k_eq_v, False
        self.head_dim = head_dim
        self.q_norm = RMSNorm(head_dim, eps)
        if shares_kv:
            self.q_proj = ColumnParallelLinear(arch.hidden_size, heads * head_dim, arch.attention_bias, tp)
            self.num_heads = self.q_proj.out_features // head_dim
            self.attn = None
        else:
            # With k_eq_v the checkpoint's k_proj fills both the k and the v rows.
            self.qkv_proj = QKVParallelLinear(arch.hidden_size, head_dim, heads, num_kv_heads, arch.attention_bias, tp)
            split = self.qkv_proj.heads
            self.num_heads, self.num_kv_heads = split.num_heads, split.num_kv_heads
            self.k_norm = RMSNorm(head_dim, eps)
            self.v_norm = _weightless_norm(head_dim, eps)
            self.attn = Attention(split.num_heads, split.num_kv_heads, head_dim, backend, scale=1.0,
                                  sliding_window=sliding_window(hf, layer), tp=tp)
        self.o_proj = RowParallelLinear(heads * head_dim, arch.hidden_size, arch.attention_bias, tp)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, shared: SharedKV) -> torch.Tensor:
        h, d = self.num_heads, self.head_dim
        cos, sin = rope
        if self.shares_kv:
            k, v, attn = shared[self.layer_type]
            q = apply_rope(self.q_norm(self.q_proj(x).view(-1, h, d)), cos, sin)
        else:
            kvh, attn = self.num_kv_heads, self.attn
            q, k, v = self.qkv_proj(x).split([h * d, kvh * d, kvh * d], dim=-1)
            q, k = self.q_norm(q.reshape(-1, h, d)), self.k_norm(k.reshape(-1, kvh, d))
            v = self.v_norm(v.reshape(-1, kvh, d))
            q, k = rotate_qk(q, k, cos, sin)
            if self.produces:
                shared[self.layer_type] = (k, v, attn)
        # A shared layer writes its producer's K/V again into the same slots: the same values.
        return self.o_proj(attn.forward(q, k, v, kv_cache, meta))


class Gemma4Router(nn.Module):
    """Each token's top-k experts by a softmax over all of them (of a weightless-normalized,
    scaled input), the k weights renormalized, then multiplied by a learned scale per expert."""

    def __init__(self, hf, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.top_k = hf.top_k_experts
        self.norm = _weightless_norm(hidden_size, eps)
        self.proj = ReplicatedLinear(hidden_size, hf.num_experts)
        self.scale = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.per_expert_scale = nn.Parameter(torch.ones(hf.num_experts), requires_grad=False)
        self.root_size = hidden_size ** -0.5

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.proj(self.norm(x) * self.scale * self.root_size)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights * self.per_expert_scale[experts]).to(x.dtype), experts


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, self_attn: Gemma4Attention, mlp: nn.Module, arch: ModelArchConfig,
                 tp: TensorParallelGroup | None, act: str) -> None:
        super().__init__()
        hf, size, eps = arch.hf, arch.hidden_size, arch.rms_norm_eps
        self.self_attn = self_attn
        self.mlp = mlp
        self.rope_name = self_attn.layer_type
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, RMSNorm(size, eps))
        self.act = ACTIVATIONS[act]
        self.moe = bool(hf.enable_moe_block)
        if self.moe:
            self.router = Gemma4Router(hf, size, eps)
            self.experts = FusedMoE(hf.num_experts, hf.top_k_experts, size, hf.moe_intermediate_size, act, tp)
            self.post_feedforward_layernorm_1 = RMSNorm(size, eps)
            self.post_feedforward_layernorm_2 = RMSNorm(size, eps)
            self.pre_feedforward_layernorm_2 = RMSNorm(size, eps)
        self.per_layer = bool(hf.hidden_size_per_layer_input)
        if self.per_layer:
            ple = hf.hidden_size_per_layer_input
            self.per_layer_input_gate = ReplicatedLinear(size, ple)
            self.per_layer_projection = ReplicatedLinear(ple, size)
            self.post_per_layer_input_norm = RMSNorm(size, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)

    def forward(self, rope, x: torch.Tensor, kv_cache, meta: AttentionMetadata, per_layer_input: torch.Tensor | None,
                shared: SharedKV) -> torch.Tensor:
        h = self.self_attn(rope, self.input_layernorm(x), kv_cache, meta, shared)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        if self.moe:
            weights, experts = self.router(x)  # routed by the block's input, not the MLP's
            routed = self.experts(self.pre_feedforward_layernorm_2(x), weights, experts)
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(routed)
        x = x + self.post_feedforward_layernorm(h)
        if self.per_layer:
            h = self.per_layer_projection(self.act(self.per_layer_input_gate(x)) * per_layer_input)
            x = x + self.post_per_layer_input_norm(h)
        return x * self.layer_scalar


class Gemma4ForCausalLM(LlamaForCausalLM):
    act_field = "hidden_activation"

    def __init__(self, arch: ModelArchConfig, backend: AttentionBackend, max_positions: int,
                 tp: TensorParallelGroup | None = None) -> None:
        hf = arch.hf
        if getattr(hf, "use_bidirectional_attention", None) == "all":
            raise ValueError(f"{arch.model_name}: use_bidirectional_attention='all' (every token attends to the "
                             f"whole sequence) is not served: a causal decoder's cache cannot hold it")
        self.producers = kv_producers(hf)
        super().__init__(arch, backend, max_positions, tp)
        self.embedding_scale = arch.hidden_size ** 0.5
        self.logits = LogitsHead(arch.vocab_size, tp, softcap=hf.final_logit_softcapping)
        for producer in {p for i, p in enumerate(self.producers) if p != i}:
            self.layers[producer].self_attn.produces = True
        # Per layer, its index among the layers that cache (the model runner's order of Attention modules).
        caching = [i for i, p in enumerate(self.producers) if p == i]
        self.cache_index = [caching.index(p) for p in self.producers]
        self.ple = hf.hidden_size_per_layer_input or 0
        if self.ple:
            layers_ple = hf.num_hidden_layers * self.ple
            self.embed_tokens_per_layer = VocabParallelEmbedding(hf.vocab_size_per_layer_input, layers_ple, tp)
            self.per_layer_model_projection = ReplicatedLinear(arch.hidden_size, layers_ple)
            self.per_layer_projection_norm = RMSNorm(self.ple, arch.rms_norm_eps)

    # ---- shapes per layer type -----------------------------------------------------------
    def layer_shape(self, layer: int) -> tuple[int, int]:
        """(head_dim, KV heads) of layer `layer`: the full-attention layers' differ (global_head_dim,
        and num_global_key_value_heads where attention_k_eq_v)."""
        return self.hf.per_layer_config[layer].head_dim, self.hf.per_layer_config[layer].num_key_value_heads

    def layer_kv_rows(self, layer: nn.Module) -> tuple[int, int, int]:
        return layer.num_kv_heads, layer.head_dim, layer.head_dim

    def make_ropes(self, max_positions: int) -> dict[str, RotaryEmbedding]:
        hf = self.hf
        return {t: get_rope(hf, hf.per_layer_config[t].head_dim, max_positions, layer_type=t, model=self.cfg.model_name)
                for t in sorted(set(hf.layer_types))}

    def make_attention(self, layer: int, backend: AttentionBackend, tp: TensorParallelGroup | None) -> nn.Module:
        head_dim, kv_heads = self.layer_shape(layer)
        k_eq_v = bool(self.hf.attention_k_eq_v) and self.hf.layer_types[layer] != "sliding_attention"
        return Gemma4Attention(self.cfg, layer, head_dim, kv_heads, backend, tp, self.producers[layer] != layer,
                               k_eq_v)

    def make_mlp(self, layer: int, tp: TensorParallelGroup | None) -> nn.Module:
        wide = self.hf.use_double_wide_mlp and self.producers[layer] != layer
        return LlamaMLP(self.cfg.hidden_size, self.cfg.intermediate_size * (2 if wide else 1), self.act, tp)

    def make_layer(self, layer: int, backend: AttentionBackend, tp: TensorParallelGroup | None) -> nn.Module:
        return Gemma4DecoderLayer(self.make_attention(layer, backend, tp), self.make_mlp(layer, tp), self.cfg, tp,
                                  self.act)

    # ---- forward -------------------------------------------------------------------------
    def per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """[T, layers, ple]: each token's own per-layer vectors mixed with a projection of its embedding."""
        layers = self.cfg.num_hidden_layers
        own = (self.embed_tokens_per_layer(input_ids) * self.ple ** 0.5).view(-1, layers, self.ple)
        mixed = (self.per_layer_model_projection(x) * self.cfg.hidden_size ** -0.5).view(-1, layers, self.ple)
        return (self.per_layer_projection_norm(mixed) + own) * 2.0 ** -0.5

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed(input_ids)
        per_layer = self.per_layer_inputs(input_ids, x) if self.ple else None
        tables = {name: rope.cos_sin(positions, x.dtype) for name, rope in self.ropes.items()}
        shared: SharedKV = {}
        for i, layer in enumerate(self.layers):
            x = layer(tables[layer.rope_name], x, kv_caches[self.cache_index[i]], meta,
                      None if per_layer is None else per_layer[:, i], shared)
        return self.norm(x)

    # ---- weights -------------------------------------------------------------------------
    def checkpoint_name(self, name: str) -> str | None:
        name = super().checkpoint_name(name)
        if name is None:
            return None
        parts = name.split(".")
        if len(parts) > 3 and parts[0] == "layers" and parts[2] == "self_attn":
            layer = int(parts[1])
            if self.producers[layer] != layer and parts[3] in ("k_proj", "v_proj", "k_norm", "v_norm"):
                return None  # written by some checkpoints for the shared layers, read by none
        return name

    def route(self, name: str, params: dict) -> tuple[str, object]:
        routed = route_expert_weight(name)
        if routed is not None:
            return routed
        return super().route(name, params)

    def load_weights(self, weights) -> None:
        super().load_weights(self._k_as_v(weights))

    def _k_as_v(self, weights):
        """With attention_k_eq_v, a full layer's k_proj is its v_proj as well."""
        for name, tensor in weights:
            yield name, tensor
            if ".self_attn.k_proj." in name and self.hf.attention_k_eq_v:
                layer = int(name.split("layers.")[1].split(".")[0])
                if self.hf.layer_types[layer] != "sliding_attention":
                    yield name.replace(".k_proj.", ".v_proj."), tensor

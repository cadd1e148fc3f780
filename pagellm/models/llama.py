"""Llama 2/3 and the families that are Llama with a detail changed: Mistral (a sliding
window), Qwen2 (q/k/v biases). Its attention, MLP and decoder layer are the parts the
other dense families reuse."""
from __future__ import annotations

import functools

import torch
from torch import nn

from pagellm import envs
from pagellm.attention.backend import AttentionBackend
from pagellm.kernels import cpu
from pagellm.layers.parallel import TensorParallelGroup
from pagellm.layers.activation import act_and_mul, check_activation
from pagellm.layers.attention import Attention
from pagellm.layers.decode_plan import PreNormDecodePlan, direct_products, norm_serves
from pagellm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagellm.layers.module import HotModule
from pagellm.layers.norm import QKNorm, RMSNorm, ShardedRMSNorm
from pagellm.layers.parallel import rank_and_size
from pagellm.layers.rotary import RotaryEmbedding, get_rope
from pagellm.models.arch import ModelArchConfig
from pagellm.models.base import CausalLM, sliding_window


class LlamaAttention(HotModule):
    """`qk_norm`: "head" normalizes q and k per head (Qwen3, Gemma 3), "full" over all heads
    at once (OLMo 2); `rope_name` None: this layer has no rotary embedding (SmolLM3); `sinks`:
    a learned sink logit per head (gpt-oss, layers/attention.py); `output_gate`: q_proj also
    yields a gate per head, and the output is multiplied by its sigmoid before o_proj (Qwen3.5);
    `attention_chunk`: queries see their own chunk of that many positions only (Llama 4)."""

    def __init__(self, arch: ModelArchConfig, layer: int, backend: AttentionBackend, tp: TensorParallelGroup | None,
                 *, qkv_bias: bool = False, o_bias: bool = False, qk_norm: str | None = None,
                 norm_eps: float | None = None, scale: float | None = None, softcap: float | None = None,
                 unit_offset_norm: bool = False, sinks: bool = False, output_gate: bool = False,
                 attention_chunk: int | None = None) -> None:
        super().__init__()
        d = arch.head_dim
        self.qkv_proj = QKVParallelLinear(arch.hidden_size, d, arch.num_attention_heads, arch.num_key_value_heads,
                                          qkv_bias, tp, q_per_head=2 if output_gate else 1)
        self.output_gate = output_gate
        heads = self.qkv_proj.heads
        self.num_heads, self.num_kv_heads, self.head_dim = heads.num_heads, heads.num_kv_heads, d
        self.o_proj = RowParallelLinear(arch.num_attention_heads * d, arch.hidden_size, o_bias, tp)
        eps = arch.rms_norm_eps if norm_eps is None else norm_eps
        self.qk_norm: QKNorm | None = None
        if qk_norm == "head":
            self.q_norm = RMSNorm(d, eps, unit_offset_norm)
            self.k_norm = RMSNorm(d, eps, unit_offset_norm)
        elif qk_norm == "full":
            if tp is not None and arch.num_key_value_heads < rank_and_size(tp)[1]:
                raise ValueError(f"tensor_parallel_size={tp.size} does not fit this model: its k norm spans all "
                                 f"{arch.num_key_value_heads} KV heads, which cannot be replicated")
            self.q_norm = ShardedRMSNorm(arch.num_attention_heads * d, eps, tp)
            self.k_norm = ShardedRMSNorm(arch.num_key_value_heads * d, eps, tp)
        if qk_norm is not None:
            self.qk_norm = QKNorm(self.q_norm, self.k_norm, per_head=qk_norm == "head")
        self.attn = Attention(heads.num_heads, heads.num_kv_heads, d, backend, scale=scale,
                              sliding_window=sliding_window(arch.hf, layer), softcap=softcap, sinks=sinks, tp=tp,
                              attention_chunk=attention_chunk)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor] | None, x: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        if not self.output_gate:
            return self.o_proj(self.attn.forward_qkv(qkv, rope, kv_cache, meta, self.qk_norm))
        h, d = self.num_heads, self.head_dim
        query_gate, kv = qkv.split([2 * h * d, qkv.shape[-1] - 2 * h * d], dim=-1)
        query, gate = query_gate.view(-1, h, 2 * d).split(d, dim=-1)
        o = self.attn.forward_qkv(torch.cat([query.reshape(-1, h * d), kv], dim=-1), rope, kv_cache, meta,
                                  self.qk_norm)
        return self.o_proj(o * torch.sigmoid(gate.reshape(-1, h * d)))


class LlamaMLP(HotModule):
    def __init__(self, hidden_size: int, intermediate_size: int, act: str, tp: TensorParallelGroup | None,
                 bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias, tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, tp)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(act_and_mul(self.gate_up_proj(x), self.act))


class LlamaDecoderLayer(HotModule):
    """Pre-norm residual blocks; `residual_scale` multiplies each block's output (Granite)."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, hidden_size: int, eps: float,
                 rope_name: str | None = "default", residual_scale: float = 1.0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)
        self.mlp = mlp
        self.rope_name = rope_name
        self.residual_scale = residual_scale
        self.decode_plan: PreNormDecodePlan | None = None  # made on the first call (make_decode_plan)

    def forward(self, rope, x, kv_cache, meta):
        plan = self.decode_plan
        if plan is None or plan.k_cache is not kv_cache[0]:
            plan = self.decode_plan = self.make_decode_plan(rope, x, kv_cache)
        if plan.serves:
            out = plan(rope, x, kv_cache, meta)
            if out is not None:
                return out
        h = self.self_attn(rope, self.input_layernorm(x), kv_cache, meta)
        x, normed = self.post_attention_layernorm.add_and_norm(
            x, h if self.residual_scale == 1.0 else h * self.residual_scale)
        h = self.mlp(normed)
        return x + (h if self.residual_scale == 1.0 else h * self.residual_scale)

    def make_decode_plan(self, rope, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> PreNormDecodePlan:
        """This layer's small steps as direct kernel calls (layers/decode_plan.py) where every part
        has one, for x's dtype and this cache; else a plan that serves no step."""
        unserved = PreNormDecodePlan(kv_cache[0], 0)
        attn = self.self_attn
        if (not envs.decode_plans_enabled() or x.dtype != torch.float32
                or type(attn).forward is not LlamaAttention.forward or attn.output_gate):
            return unserved
        products = direct_products(attn.qkv_proj, attn.o_proj)
        if not (norm_serves(self.input_layernorm, x) and norm_serves(self.post_attention_layernorm, x)) \
                or products is None:
            return unserved
        if rope is not None and (len(rope) != 2 or rope[0].shape[-1] != attn.head_dim):
            return unserved  # scaled queries (Llama 4) or a partial rotation: the modules' split path
        norm_args = attn.qk_norm.kernel_args(x) if attn.qk_norm is not None else None
        if attn.qk_norm is not None and norm_args is None:
            return unserved
        call = attn.attn.backend.decode_call(attn.num_heads, attn.num_kv_heads, attn.attn.options, attn.attn.sinks,
                                             norm_args, x, kv_cache[0])
        if call is None:
            return unserved
        mlp = self.mlp
        mlp_products = None
        if type(mlp).forward is LlamaMLP.forward and mlp.act in ("silu", "swish") and cpu.usable(x):
            mlp_products = direct_products(mlp.gate_up_proj, mlp.down_proj)
        gate_up, down = mlp_products or (None, None)
        attend = functools.partial(attn.attn.forward_qkv, qk_norm=attn.qk_norm)
        return PreNormDecodePlan(kv_cache[0], attn.attn.kv_group, call, attend, attn.attn.backend,
                                 (self.input_layernorm, self.post_attention_layernorm), self.residual_scale,
                                 *products, gate_up, down,
                                 None if mlp_products else mlp)


class LlamaForCausalLM(CausalLM):
    """With `tp`, this rank's shard of the network; without, all of it.

    The families that are Llama with a part changed subclass this and override what differs:
    a class attribute (`qk_norm`, `act_field`, `unit_offset_norms`, `ropes_by_layer_type`) or one
    of the hooks `make_ropes`, `rope_for`, `make_attention`, `make_mlp`, `make_layer`."""

    qk_norm: str | None = None          # "head" (Qwen3, Gemma 3) or "full" (OLMo 2): see LlamaAttention
    act_field = "hidden_act"            # the config field naming the MLP's activation
    unit_offset_norms = False           # RMSNorm weights applied as 1 + w (Gemma)
    # A rotary table per layer type (config `layer_types`), each from its own rope parameters:
    # the sliding-window layers rotate unscaled, or with another base (Gemma 3, OLMo 3).
    ropes_by_layer_type = False

    def __init__(self, arch: ModelArchConfig, backend: AttentionBackend, max_positions: int,
                 tp: TensorParallelGroup | None = None) -> None:
        super().__init__(arch, tp)
        self.act = getattr(self.hf, self.act_field, None) or "silu"
        check_activation(self.act, arch.model_name)
        self.set_ropes(self.make_ropes(max_positions))
        self.layers = nn.ModuleList(self.make_layer(i, backend, tp) for i in range(arch.num_hidden_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, unit_offset=self.unit_offset_norms)

    def make_ropes(self, max_positions: int) -> dict[str, RotaryEmbedding]:
        """The rotary tables, by name (one, "default", unless layers rotate differently)."""
        if self.ropes_by_layer_type:
            return {t: get_rope(self.hf, self.cfg.head_dim, max_positions, layer_type=t, model=self.cfg.model_name)
                    for t in sorted(set(self.hf.layer_types))}
        return {"default": get_rope(self.hf, self.cfg.head_dim, max_positions, model=self.cfg.model_name)}

    def rope_for(self, layer: int) -> str | None:
        """The rotary table layer `layer` uses; None: it does not rotate."""
        return self.hf.layer_types[layer] if self.ropes_by_layer_type else "default"

    def make_attention(self, layer: int, backend: AttentionBackend, tp: TensorParallelGroup | None) -> nn.Module:
        arch = self.cfg
        # attention_bias covers o_proj too, except in Qwen2 (q/k/v biases only).
        o_bias = arch.attention_bias and arch.architecture != "qwen2"
        return LlamaAttention(arch, layer, backend, tp, qkv_bias=arch.attention_bias, o_bias=o_bias,
                              qk_norm=self.qk_norm, unit_offset_norm=self.unit_offset_norms)

    def make_mlp(self, layer: int, tp: TensorParallelGroup | None) -> nn.Module:
        return LlamaMLP(self.cfg.hidden_size, self.cfg.intermediate_size, self.act, tp,
                        bool(getattr(self.hf, "mlp_bias", False)))

    def make_layer(self, layer: int, backend: AttentionBackend, tp: TensorParallelGroup | None) -> nn.Module:
        return LlamaDecoderLayer(self.make_attention(layer, backend, tp), self.make_mlp(layer, tp),
                                 self.cfg.hidden_size, self.cfg.rms_norm_eps, self.rope_for(layer))

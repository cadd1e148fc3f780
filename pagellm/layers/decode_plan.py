"""A decoder layer's small steps as direct kernel calls.

On a decode step of a small model most of a layer's time is Python, not arithmetic: each of its
modules checks, at every call, what cannot change between steps (whether the compiled kernels
serve, the weight's type and layout, the activation mode, the cache's format) before it reaches
its kernel. A plan makes those checks once, the first time a layer runs with a given cache, and
keeps the calls they lead to with their fixed arguments. A step of no more rows than its products
take (decodes, a speculative verification, a short prompt) then goes from kernel to kernel, its
attention in one call when every sequence decodes one token, through the attention module
otherwise; a larger step runs the modules. The kernels and their arguments are the modules' own,
so the outputs are the same bits.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from pagellm.attention.metadata import AttentionMetadata
from pagellm.kernels import cpu
from pagellm.layers.linear import DirectProduct, LinearBase
from pagellm.layers.norm import RMSNorm, kernel_serves


def norm_serves(norm: nn.Module, x: torch.Tensor) -> bool:
    """Whether cpu.rms_norm with norm's weight and eps normalizes rows like x as `norm` does (not
    Gemma's 1 + w, not another dtype, compiled kernels at hand)."""
    return type(norm) is RMSNorm and x.dim() == 2 and kernel_serves(norm, x)


def direct_products(*layers: LinearBase) -> list[DirectProduct] | None:
    """Each layer's DirectProduct, or None unless every one has one."""
    products = [layer.direct_product() for layer in layers]
    return None if any(p is None for p in products) else products


class PreNormDecodePlan:
    """x + mlp(norm2(x + attn(norm1(x)))), each block's output times `residual_scale` (Granite's),
    with the attention's q/k/v from one fused projection, as models/llama.py's LlamaDecoderLayer
    computes it: RMSNorm, the qkv product, the backend's decode call (q/k norms, RoPE, the cache
    write and attention in one; `attend`, the attention module's forward_qkv, on steps where a
    sequence has several tokens), the o product, the residual add fused with the second norm, then
    the gated MLP's two products around silu_and_mul, or the layer's own MLP module where its
    products have no direct call (experts). `timer_owner`: the backend, whose timer (when a
    benchmark attaches one) times the attention calls.

    `k_cache`: the cache the plan was made for; a layer given another remakes its plan."""

    def __init__(self, k_cache: torch.Tensor, kv_group: int, attention: Callable[..., torch.Tensor] | None = None,
                 attend: Callable[..., torch.Tensor] | None = None, timer_owner: object = None,
                 norms: tuple[RMSNorm, RMSNorm] | None = None, residual_scale: float = 1.0,
                 qkv: DirectProduct | None = None, o: DirectProduct | None = None,
                 gate_up: DirectProduct | None = None, down: DirectProduct | None = None,
                 mlp: nn.Module | None = None) -> None:
        self.k_cache, self.kv_group = k_cache, kv_group
        self.serves = attention is not None  # False: a layer this plan does not serve (it runs its modules)
        if not self.serves:
            return
        self.attention, self.attend, self.timer_owner = attention, attend, timer_owner
        (self.norm1, self.eps1), (self.norm2, self.eps2) = ((n.weight, n.eps) for n in norms)
        self.residual_scale = residual_scale
        self.qkv, self.o, self.gate_up, self.down, self.mlp = qkv, o, gate_up, down, mlp
        products = [p for p in (qkv, o, gate_up, down) if p is not None]
        self.max_rows = min(p.max_rows for p in products)
        kernels = cpu._load()
        self.rms_norm, self.add_rms_norm, self.silu_and_mul = kernels.rms_norm, kernels.add_rms_norm, kernels.silu_and_mul

    def __call__(self, rope: tuple[torch.Tensor, torch.Tensor] | None, x: torch.Tensor,
                 kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor | None:
        """The layer's output for a step of at most max_rows tokens; None for a larger one."""
        rows = x.shape[0]
        if not self.serves or rows > self.max_rows:
            return None
        p = self.qkv
        qkv = p.fn(self.rms_norm(x, self.norm1, self.eps1), *p.args)
        if p.bias is not None:
            qkv = qkv + p.bias
        if meta.num_decodes == rows and len(meta.query_lens) == rows:
            timer = self.timer_owner.timer
            start = time.perf_counter() if timer is not None else 0.0
            group = meta.for_group(self.kv_group)
            o = self.attention(qkv, rope, kv_cache[0], kv_cache[1], group.slot_mapping, group.block_tables,
                               group.seq_lens_tensor)
            if timer is not None:
                timer.record("attention", time.perf_counter() - start)
        else:  # a verification's or a short prompt's several tokens a sequence: the attention module
            o = self.attend(qkv, rope, kv_cache, meta)
        p = self.o
        h = p.fn(o, *p.args)
        if p.bias is not None:
            h = h + p.bias
        scale = self.residual_scale
        x, normed = self.add_rms_norm(x, h if scale == 1.0 else h * scale, self.norm2, self.eps2)
        if self.mlp is not None:
            h = self.mlp(normed)
        else:
            p = self.gate_up
            gate_up = p.fn(normed, *p.args)
            if p.bias is not None:
                gate_up = gate_up + p.bias
            p = self.down
            h = p.fn(self.silu_and_mul(gate_up), *p.args)
            if p.bias is not None:
                h = h + p.bias
        return x + (h if scale == 1.0 else h * scale)

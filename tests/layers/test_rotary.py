"""Queries scaled by position (Ministral 3's Llama 4-style temperature tuning): the factors are
the reference's bits, travel with the step's cos/sin, and multiply the rotated queries only.
The families' exactness against transformers: tests/models/test_families.py."""
from __future__ import annotations

import pytest
import torch

from pagellm.attention.backend import AttentionMetadata
from pagellm.attention.torch_backend import TorchAttentionBackend
from pagellm.layers.attention import Attention
from pagellm.layers.rotary import RotaryEmbedding, default_inverse_frequencies, llama4_query_scale, rotate_qk


def test_llama4_query_scale_is_the_references():
    from transformers.models.ministral3.modeling_ministral3 import get_llama_4_attn_scale

    positions = torch.arange(200)
    want = get_llama_4_attn_scale(positions[None], 0.1, 16)[0, 0, :, 0]
    got = llama4_query_scale(200, 0.1, 16)
    assert torch.equal(got, want)
    assert got[15] == 1.0 and got[16] > 1.0 and got[31] == got[16] < got[32]  # steps every 16 positions


def test_scaled_queries_are_rotated_then_multiplied_keys_are_not():
    """A decode step whose tables carry query factors: the fused decode path (which rotates q and
    k alike) is not taken; the result is the split path's with q multiplied after the rotation."""
    torch.manual_seed(0)
    h, kvh, d, bs, num_blocks = 4, 2, 16, 8, 16
    lens = [3, 20, 37]
    tables = torch.arange(15).reshape(3, 5)
    slots = torch.tensor([int(tables[i, (n - 1) // bs]) * bs + (n - 1) % bs for i, n in enumerate(lens)])
    meta = AttentionMetadata(slot_mapping=slots, block_tables=tables, query_lens=[1] * 3, seq_lens=lens,
                             seq_lens_tensor=torch.tensor(lens), num_decodes=3, block_size=bs)
    rope = RotaryEmbedding(default_inverse_frequencies(d, 10000.0), 64)
    rope.scale_queries(llama4_query_scale(64, 0.5, 16))
    cos, sin, scale = rope.cos_sin(torch.tensor(lens) - 1, torch.float32)
    assert scale.tolist() == llama4_query_scale(64, 0.5, 16)[torch.tensor(lens) - 1].tolist()
    qkv = torch.randn(3, (h + 2 * kvh) * d)
    backend = TorchAttentionBackend()
    caches = [torch.randn(backend.kv_cache_shape(num_blocks, bs, kvh, d)) for _ in range(2)]

    got = Attention(h, kvh, d, backend).forward_qkv(qkv.clone(), (cos, sin, scale), [c.clone() for c in caches], meta)

    q, k, v = qkv.clone().split([h * d, kvh * d, kvh * d], dim=-1)
    q, k = rotate_qk(q.reshape(-1, h, d), k.reshape(-1, kvh, d), cos, sin)
    want = Attention(h, kvh, d, backend).forward(q * scale[:, None, None], k, v, [c.clone() for c in caches], meta)
    assert torch.equal(got, want)
    unscaled = Attention(h, kvh, d, backend).forward_qkv(qkv.clone(), (cos, sin), [c.clone() for c in caches], meta)
    assert not torch.allclose(got, unscaled)


def test_a_query_scale_has_one_factor_per_position():
    rope = RotaryEmbedding(default_inverse_frequencies(8, 10000.0), 32)
    with pytest.raises(ValueError, match=r"expected one per position \(32\)"):
        rope.scale_queries(llama4_query_scale(16, 0.1, 4))

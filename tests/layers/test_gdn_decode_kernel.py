"""The compiled decode step of Gated DeltaNet (cpu.gdn_decode_step, through GatedDeltaNet.cached_forward)
against the layer's torch path (RecurrentMixer.cached_forward: the states copied out of the pool,
forward, copied back) on the same pool, float32: batches of 1-3 decodes over several steps, key
heads shared by two value heads, heads as wide as the kernel's vector strips, a fresh sequence
among them (its blocks holding garbage), pools whose block halves cut the state's fields (spans
copied out and back) or hold them whole (used in place), a bfloat16 pool (the state is its bytes
whatever the dtype), a layer's strided view of a larger slot, and out_proj's tiled column order.
Tolerance: 1e-5 relative and absolute (values of order 1), for float32 sums taken in other orders
(and SiLU's exp by a polynomial)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen3_5TextConfig

from pagellm.kernels import cpu
from pagellm.layers import gated_delta_net
from pagellm.layers.gated_delta_net import GatedDeltaNet
from pagellm.layers.recurrent import RecurrentMixer, blocks_for_state, read_state

pytestmark = pytest.mark.skipif(not cpu.available(), reason="the compiled CPU kernels are not built here")

# Two key heads of 16, four value heads of 8 (groups of two), a kernel of 4: a state of 800 floats
# (conv 96 x 3, then ssm 4 x 16 x 8).
CONFIG = Qwen3_5TextConfig(hidden_size=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                           linear_value_head_dim=8, linear_conv_kernel_dim=4, num_hidden_layers=1,
                           layer_types=["linear_attention"])
# Value heads of 208: several of the kernel's vector strips of the state's columns (64 with
# AVX-512, 32 with AVX2) and the columns past them.
WIDE = {"linear_num_key_heads": 1, "linear_num_value_heads": 2, "linear_key_head_dim": 32,
        "linear_value_head_dim": 208}
RTOL, ATOL = 1e-5, 1e-5  # the outputs and states are of order 1: about 1e-5 of their size


def random_layer(tiled: bool = False, **config_changes) -> GatedDeltaNet:
    config = Qwen3_5TextConfig(**{**CONFIG.to_dict(), "linear_out_proj_tiled": tiled, **config_changes})
    layer = GatedDeltaNet(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.25)
        layer.conv1d.weight.mul_(2)
        layer.A_log.copy_(torch.linspace(-4, 0, layer.num_v_heads))  # slow to fast heads
        layer.norm.weight.add_(1)
    return layer


def torch_path(layer: GatedDeltaNet, x: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], meta) -> torch.Tensor:
    return RecurrentMixer.cached_forward(layer, x, kv, meta)


def pool(layer: GatedDeltaNet, block: tuple[int, ...], dtype: torch.dtype, seqs: int,
         wider: int = 0) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A pool of random bytes whose blocks (K and V parts of shape `block`) hold `seqs` states, in
    shuffled blocks; `wider` > 0: the layer's view of a slot whose blocks are that many elements longer."""
    half = torch.Size(block).numel() * dtype.itemsize
    per_seq = blocks_for_state(layer.state_bytes, 2 * half)
    gen = torch.Generator().manual_seed(1)
    n = 2 + seqs * per_seq
    kv = []
    for _ in range(2):
        flat = (torch.randn(n, torch.Size(block).numel() + wider, generator=gen) * 0.1).to(dtype)
        kv.append(flat[:, :torch.Size(block).numel()].view(n, *block))
    ids = torch.randperm(seqs * per_seq, generator=gen).add_(2).view(seqs, per_seq)
    return (kv[0], kv[1]), ids


def meta_for(ids: torch.Tensor, fresh: list[int], verifying: list[int] | None = None) -> SimpleNamespace:
    return SimpleNamespace(state_block_ids=ids[None], fresh_states=torch.tensor(fresh, dtype=torch.long),
                           query_lens=[1] * ids.shape[0], verifying=verifying, state_rollbacks=[])


def states(layer, kv, ids) -> torch.Tensor:
    return read_state(kv, ids).view(torch.float32)[:, :layer.state_bytes // 4]


@pytest.mark.parametrize("block, dtype, wider, config", [
    ((4, 9), torch.float32, 0, {}),     # halves of 36 floats: every ssm head and most conv strips cut
    ((8, 64), torch.float32, 0, {}),    # halves of 512 floats: some heads whole (in place), one cut
    ((8, 128), torch.bfloat16, 0, {}),  # the same bytes in a bfloat16 pool
    ((8, 64), torch.float32, 24, {}),   # a layer's view of a slot sized for larger layers
    ((128, 128), torch.float32, 0, WIDE),  # heads of 32 x 208 floats, each whole in one half
])
def test_decode_steps_equal_the_torch_path(block, dtype, wider, config):
    layer = random_layer(**config)
    kv, ids = pool(layer, block, dtype, seqs=3, wider=wider)
    kv_ref = tuple(t.clone() for t in kv)
    gen = torch.Generator().manual_seed(2)
    assert gated_delta_net.decode_kernel_serves(layer, torch.zeros(3, 64), kv, meta_for(ids, []))
    assert layer.dv == 208 or not config
    for step, fresh in enumerate([[1], [], []]):  # row 1 starts fresh over garbage, then all carry on
        x = torch.randn(3, 64, generator=gen)
        with torch.no_grad():
            got = layer.cached_forward(x, kv, meta_for(ids, fresh))
            want = torch_path(layer, x, kv_ref, meta_for(ids, fresh))
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"step {step}: {m}")
        torch.testing.assert_close(states(layer, kv, ids), states(layer, kv_ref, ids), rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"states after step {step}: {m}")
    # Blocks that are no sequence's state are untouched (ids start at 2).
    for t, r in zip(kv, kv_ref):
        assert torch.equal(t[:2], r[:2])


@pytest.mark.parametrize("seqs", [1, 2])
def test_tiled_out_proj_order_and_single_sequences(seqs):
    layer = random_layer(tiled=True)
    assert layer.tiled
    kv, ids = pool(layer, (8, 64), torch.float32, seqs=seqs)
    kv_ref = tuple(t.clone() for t in kv)
    x = torch.randn(seqs, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = layer.cached_forward(x, kv, meta_for(ids, []))
        want = torch_path(layer, x, kv_ref, meta_for(ids, []))
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(states(layer, kv, ids), states(layer, kv_ref, ids), rtol=RTOL, atol=ATOL)


def test_the_kernel_leaves_prefills_verifications_and_bfloat16_to_the_torch_path():
    layer = random_layer()
    kv, ids = pool(layer, (8, 64), torch.float32, seqs=2)
    x = torch.zeros(2, 64)
    serves = gated_delta_net.decode_kernel_serves
    assert serves(layer, x, kv, meta_for(ids, []))
    assert not serves(layer, x, kv, meta_for(ids, [], verifying=[0]))
    assert not serves(layer, x, kv, SimpleNamespace(**{**vars(meta_for(ids, [])), "query_lens": [1, 2]}))
    assert not serves(layer, x.bfloat16(), kv, meta_for(ids, []))
    assert not serves(random_layer().to(torch.bfloat16), x, kv, meta_for(ids, []))


def test_bad_inputs_are_refused_with_what_is_wrong():
    layer = random_layer()
    kv, ids = pool(layer, (8, 64), torch.float32, seqs=2)
    proj = torch.zeros(2, layer.in_proj.weight.shape[0])
    args = (layer.conv1d.weight[:, 0], layer.A_log, layer.dt_bias, layer.norm.weight, 1e-6, kv)
    with pytest.raises(RuntimeError, match="block id 99 outside the pool's"):
        cpu.gdn_decode_step(proj, *args, torch.full_like(ids, 99), torch.tensor([], dtype=torch.long), 2, 16, 8,
                            False)
    with pytest.raises(RuntimeError, match="does not fit in 0 blocks"):
        cpu.gdn_decode_step(proj, *args, ids[:, :0].contiguous(), torch.tensor([], dtype=torch.long), 2, 16, 8,
                            False)
    with pytest.raises(RuntimeError, match="proj must be"):
        cpu.gdn_decode_step(proj[:, 1:], *args, ids, torch.tensor([], dtype=torch.long), 2, 16, 8, False)

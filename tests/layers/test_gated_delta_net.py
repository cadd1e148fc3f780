"""Gated DeltaNet against transformers' Qwen3_5GatedDeltaNet (its torch fallbacks) with random
weights, fp32: sequences batched from zero state, a prompt in chunks then one token a step,
a batch of decodes, the states left behind, the layer split over two ranks, and out_proj as a
GGUF file stores it (quantized blocks, value heads tiled)."""
from __future__ import annotations

import threading

import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize
from transformers import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

from pagellm.layers.gated_delta_net import GatedDeltaNet
from pagellm.layers.parallel import TensorParallelGroup
from pagellm.layers.quant import linear_methods
from pagellm.layers.quant.gguf import GGUFBlocks
from tests.layers.recurrent_checks import (check_batched_decodes, check_chunks_then_decodes, check_two_ranks, close,
                                          fresh_state, load, load_tensors, reference, seqs, step)

CONFIG = Qwen3_5TextConfig(hidden_size=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                           linear_value_head_dim=8, linear_conv_kernel_dim=4, num_hidden_layers=1,
                           layer_types=["linear_attention"])



def random_module(config: Qwen3_5TextConfig) -> Qwen3_5GatedDeltaNet:
    torch.manual_seed(0)
    module = Qwen3_5GatedDeltaNet(config, 0).eval()
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.25)
        module.conv1d.weight.normal_(0, 0.5)
        # Slow heads (A_log -4) remember across the whole 155 tokens, fast ones (0) a few tokens.
        module.A_log.copy_(torch.linspace(-4, 0, 4) + 0.1 * torch.randn(4))
        module.dt_bias.normal_(0, 1)
        module.norm.weight.copy_(1 + 0.3 * torch.randn(config.linear_value_head_dim))
    return module


@pytest.fixture(scope="module")
def ref() -> Qwen3_5GatedDeltaNet:
    return random_module(CONFIG)


@pytest.fixture(scope="module")
def layer(ref) -> GatedDeltaNet:
    return load(GatedDeltaNet(CONFIG), ref)



def test_batched_sequences_equal_each_alone_and_leave_its_states(ref, layer):
    xs = seqs(1, 7, 150)  # 150: three chunks of 64, the last one part-filled
    state = fresh_state(layer, 3)
    outs = step(layer, xs, state)
    for i, x in enumerate(xs):
        out, conv, ssm = reference(ref, CONFIG, x)
        close(outs[i], out)
        close(state["conv"][i], conv)
        close(state["ssm"][i], ssm)


def test_prompt_in_chunks_then_decodes_equals_the_whole_sequence(ref, layer):
    check_chunks_then_decodes(layer, lambda x: reference(ref, CONFIG, x)[0])


def test_a_batch_of_decodes_equals_one_at_a_time(ref, layer):
    check_batched_decodes(layer, lambda x: reference(ref, CONFIG, x)[0])


def test_two_ranks_compute_what_one_does(ref, layer):
    # Half the heads and channels on each rank.
    check_two_ranks(layer, lambda tp: load(GatedDeltaNet(CONFIG, tp), ref), {"conv": (48, 3), "ssm": (2, 16, 8)})


def test_out_proj_kept_in_a_gguf_files_blocks_and_tiled_order():
    """A GGUF file's out_proj: Q8_0 blocks whose columns take the value heads tiled across key heads
    (llama.cpp's order, linear_out_proj_tiled). It stays in its blocks, cut at block boundaries on
    two ranks, and the layer gives transformers' output with the same weight."""
    config = Qwen3_5TextConfig(**{**CONFIG.to_dict(), "linear_value_head_dim": 32})  # a head: one Q8_0 block
    module = random_module(config)
    out = module.out_proj.weight.detach()
    key_heads, per_key, dv = 2, 2, 32
    tiled = out.view(-1, key_heads, per_key, dv).transpose(1, 2).reshape(out.shape)
    blocks = GGUFBlocks(torch.from_numpy(quantize(tiled.numpy(), T.Q8_0)), int(T.Q8_0), out.shape[1])
    with torch.no_grad():  # the reference multiplies by the weight the blocks hold, in its own order
        module.out_proj.weight.copy_(blocks.dequantize().view(-1, per_key, key_heads, dv).transpose(1, 2)
                                     .reshape(out.shape))
    gguf_config = Qwen3_5TextConfig(**{**config.to_dict(), "linear_out_proj_tiled": True})
    building = threading.Lock()  # linear_methods sets a process-wide default; the ranks are threads

    def gguf_layer(tp: TensorParallelGroup | None) -> GatedDeltaNet:
        with building, linear_methods("gguf", torch.float32):
            layer = GatedDeltaNet(gguf_config, tp)
        load_tensors(layer, ((n, blocks if n == "out_proj.weight" else p.detach())
                             for n, p in module.named_parameters()))
        assert layer.out_proj.segment_types == [int(T.Q8_0)]
        return layer

    layer = gguf_layer(None)
    (x,) = seqs(20, seed=7)
    close(step(layer, [x], fresh_state(layer, 1))[0], reference(module, config, x)[0])
    check_two_ranks(layer, gguf_layer, {"conv": (96, 3), "ssm": (2, 16, 32)})


def test_a_split_that_does_not_divide_the_heads_is_refused():
    with torch.device("meta"):
        with pytest.raises(ValueError, match=r"linear_num_key_heads \(2\) must be divisible by 4"):
            GatedDeltaNet(CONFIG, TensorParallelGroup(0, 4))
        big = Qwen3_5TextConfig(**{**CONFIG.to_dict(), "linear_num_key_heads": 16, "linear_num_value_heads": 48,
                                   "linear_key_head_dim": 128, "linear_value_head_dim": 128, "hidden_size": 2048})
        shard = GatedDeltaNet(big, TensorParallelGroup(0, 2))  # Qwen3.5's sizes, as rank 0 of 2
    assert shard.in_proj.weight.shape == (2 * 8 * 128 + 2 * 24 * 128 + 2 * 24, 2048)  # q, k, v, z, b, a
    assert shard.conv1d.weight.shape == (2 * 8 * 128 + 24 * 128, 1, 4)
    assert shard.out_proj.weight.shape == (2048, 24 * 128)
    assert shard.state_shapes == {"conv": (2 * 8 * 128 + 24 * 128, 3), "ssm": (24, 128, 128)}


def test_bfloat16_weights_and_inputs_give_bfloat16_near_float32(ref, layer):
    xs = seqs(1, 90, seed=6)
    expected = step(layer, xs, fresh_state(layer, 2))
    half = load(GatedDeltaNet(CONFIG), ref).to(torch.bfloat16)
    outs = step(half, [x.bfloat16() for x in xs], fresh_state(half, 2))  # the recurrence still in float32
    for got, want in zip(outs, expected):
        assert got.dtype == torch.bfloat16
        error = ((got.float() - want).norm() / want.norm()).item()
        assert error < 0.03, error  # a few bf16 roundings (weights, projections, norm) of ~0.4% each


def test_bfloat16_prefill_equals_the_same_tokens_decoded(ref):
    """In bfloat16 the recurrence still runs in float32: a prefill (the chunked form) from a
    carried state gives the state and, within a bfloat16 rounding, the outputs that one-token
    steps (the recurrent form) give."""
    half = load(GatedDeltaNet(CONFIG), ref).to(torch.bfloat16)
    before, x = (s.bfloat16() for s in seqs(30, 100, seed=8))
    state = fresh_state(half, 1)
    step(half, [before], state)
    stepped = {name: s.clone() for name, s in state.items()}
    prefill = step(half, [x], state)[0]
    decoded = torch.cat([step(half, [x[t:t + 1]], stepped)[0] for t in range(x.shape[0])])
    assert prefill.dtype == torch.bfloat16
    torch.testing.assert_close(prefill.float(), decoded.float(), rtol=0.01, atol=2e-3)
    for name in state:
        torch.testing.assert_close(state[name], stepped[name], rtol=0, atol=1e-5)

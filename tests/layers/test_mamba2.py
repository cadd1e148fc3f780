"""The Mamba-2 mixer against transformers' GraniteMoeHybridMambaLayer (its torch path) with
random weights, fp32: sequences batched from zero state, a prompt in chunks then one token a
step, a batch of decodes, the states left behind, and the layer split over two ranks with its
groups split or shared."""
from __future__ import annotations

from functools import lru_cache

import pytest
import torch
from transformers import GraniteMoeHybridConfig
from transformers.models.granitemoehybrid.modeling_granitemoehybrid import GraniteMoeHybridMambaLayer

from pagellm.layers.mamba2 import Mamba2Mixer
from pagellm.layers.parallel import TensorParallelGroup
from tests.layers.recurrent_checks import (check_batched_decodes, check_chunks_then_decodes, check_two_ranks, close,
                                          fresh_state, load, reference, seqs, step)

HEADS = 8


def config(groups: int = 2, heads: int = HEADS, hidden: int = 64) -> GraniteMoeHybridConfig:
    # Chunks of 64 rather than Granite's 256, so that 150 tokens make three of them.
    return GraniteMoeHybridConfig(hidden_size=hidden, mamba_n_heads=heads, mamba_n_groups=groups, mamba_d_state=16,
                                  mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=64, num_hidden_layers=1,
                                  layer_types=["mamba"])



@lru_cache(maxsize=None)
def make_ref(groups: int = 2) -> GraniteMoeHybridMambaLayer:
    torch.manual_seed(0)
    module = GraniteMoeHybridMambaLayer(config(groups), 0).eval()
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.25)
        module.conv1d.weight.normal_(0, 0.5)
        # Slow heads (A = exp(-4)) remember across the whole 155 tokens, fast ones (exp(1)) a few tokens.
        module.A_log.copy_(torch.linspace(-4, 1, HEADS) + 0.1 * torch.randn(HEADS))
        module.dt_bias.normal_(0, 1)
        module.D.normal_(1, 0.5)
        module.norm.weight.copy_(1 + 0.3 * torch.randn(module.norm.weight.shape))
    return module


@pytest.fixture(scope="module")
def ref() -> GraniteMoeHybridMambaLayer:
    return make_ref()


@pytest.fixture(scope="module")
def layer(ref) -> Mamba2Mixer:
    return load(Mamba2Mixer(config()), ref)



def test_batched_sequences_equal_each_alone_and_leave_its_states(ref, layer):
    xs = seqs(1, 7, 150)  # 150: three chunks of 64, the last one part-filled
    state = fresh_state(layer, 3)
    outs = step(layer, xs, state)
    for i, x in enumerate(xs):
        out, conv, ssm = reference(ref, config(), x)
        close(outs[i], out)
        close(state["conv"][i], conv)
        close(state["ssm"][i], ssm)


def test_prompt_in_chunks_then_decodes_equals_the_whole_sequence(ref, layer):
    check_chunks_then_decodes(layer, lambda x: reference(ref, config(), x)[0])


def test_a_batch_of_decodes_equals_one_at_a_time(ref, layer):
    check_batched_decodes(layer, lambda x: reference(ref, config(), x)[0])


@pytest.mark.parametrize("groups", [2, 1])  # split over the ranks; one group both ranks read (Granite 4)
def test_two_ranks_compute_what_one_does(groups):
    ref = make_ref(groups)
    whole = load(Mamba2Mixer(config(groups)), ref)
    # Half the heads; B and C of the rank's one group (16 channels each), however many groups there are.
    check_two_ranks(whole, lambda tp: load(Mamba2Mixer(config(groups), tp), ref),
                    {"conv": (64 + 2 * 16, 3), "ssm": (4, 16, 16)})


def test_a_split_that_does_not_fit_is_refused():
    with torch.device("meta"):
        with pytest.raises(ValueError, match=r"mamba_n_heads \(8\) must be divisible by 3"):
            Mamba2Mixer(config(), TensorParallelGroup(0, 3))
        with pytest.raises(ValueError, match=r"mamba_n_groups \(3\) must be divisible by 2, or divide it"):
            Mamba2Mixer(config(groups=3, heads=6, hidden=96), TensorParallelGroup(0, 2))
        # Granite 4.0-H-Small's sizes, as rank 0 of 2: 128 heads of 64, one group of 128.
        big = GraniteMoeHybridConfig(hidden_size=4096, mamba_n_heads=128, mamba_n_groups=1, mamba_d_state=128,
                                     mamba_d_head=64, num_hidden_layers=1, layer_types=["mamba"])
        shard = Mamba2Mixer(big, TensorParallelGroup(0, 2))
    assert shard.in_proj.weight.shape == (2 * 4096 + 2 * 128 + 64, 4096)  # z, x, B, C, dt
    assert shard.conv1d.weight.shape == (4096 + 2 * 128, 1, 4)
    assert shard.out_proj.weight.shape == (4096, 4096)
    assert shard.state_shapes == {"conv": (4096 + 2 * 128, 3), "ssm": (64, 64, 128)}


def test_bfloat16_weights_and_inputs_give_bfloat16_near_float32(ref, layer):
    xs = seqs(1, 90, seed=6)
    expected = step(layer, xs, fresh_state(layer, 2))
    half = load(Mamba2Mixer(config()), ref).to(torch.bfloat16)
    outs = step(half, [x.bfloat16() for x in xs], fresh_state(half, 2))  # the scan still in float32
    for got, want in zip(outs, expected):
        assert got.dtype == torch.bfloat16
        error = ((got.float() - want).norm() / want.norm()).item()
        assert error < 0.03, error  # a few bf16 roundings (weights, projections, norm) of ~0.4% each

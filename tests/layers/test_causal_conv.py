"""The recurrent layers' causal convolution against torch's padded convolution of the whole
sequence: batched sequences of different lengths, a prompt in chunks, then one token a step."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagellm.layers.causal_conv import causal_conv1d

C, K = 6, 4


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, silu: bool) -> torch.Tensor:
    out = F.conv1d(x.t().unsqueeze(0), w.unsqueeze(1), b, padding=K - 1, groups=C)[0, :, :x.shape[0]].t()
    return F.silu(out) if silu else out


@pytest.mark.parametrize("activation", [None, "silu"])
def test_batched_chunked_and_decoded_equal_the_whole_sequence(activation):
    torch.manual_seed(0)
    w, b = torch.randn(C, K), torch.randn(C)
    seqs = [torch.randn(n, C) for n in (1, 2, 5, 9)]
    expected = [_reference(s, w, b, activation == "silu") for s in seqs]
    state = torch.zeros(len(seqs), C, K - 1)
    out = causal_conv1d(torch.cat(seqs), w, b, state, [len(s) for s in seqs], activation)
    torch.testing.assert_close(out, torch.cat(expected), rtol=0, atol=1e-5)
    # The state holds each sequence's last K - 1 inputs, zeros where it had fewer.
    torch.testing.assert_close(state[3], seqs[3][-(K - 1):].t())
    torch.testing.assert_close(state[0], torch.cat([torch.zeros(C, K - 2), seqs[0].t()], dim=1))
    # A prompt of 9 in chunks of 1 (fewer tokens than the window), 3, then one token a step.
    s, state = seqs[3], torch.zeros(1, C, K - 1)
    parts = [causal_conv1d(s[:1], w, b, state, [1], activation), causal_conv1d(s[1:4], w, b, state, [3], activation)]
    parts += [causal_conv1d(s[i:i + 1], w, b, state, [1], activation) for i in range(4, 9)]
    torch.testing.assert_close(torch.cat(parts), expected[3], rtol=0, atol=1e-5)


def test_unknown_activation_is_named():
    with pytest.raises(ValueError, match="'relu'"):
        causal_conv1d(torch.zeros(1, C), torch.zeros(C, K), None, torch.zeros(1, C, K - 1), [1], "relu")

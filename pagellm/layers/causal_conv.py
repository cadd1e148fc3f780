"""The causal depthwise convolution of recurrent layers (LFM2's short convolutions, Gated
DeltaNet's and Mamba-2's input convolutions), over a flat batch of sequences that each carry
the last K - 1 inputs of their previous steps as state.

A sequence's state starts at zero (nothing before its first token), which is what a
convolution padded with K - 1 zeros on the left computes; after each step it holds the
sequence's last K - 1 inputs, so a prompt split into chunks, or a prompt and then one token
a step, gives what the whole sequence at once gives.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from pagellm.layers.recurrent import StateTrace


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: torch.Tensor,
                  query_lens: list[int], activation: str | None = None, trace: StateTrace | None = None,
                  field: str = "conv") -> torch.Tensor:
    """x: [T, C], the step's tokens of `len(query_lens)` sequences back to back; weight: [C, K];
    state: [num_seqs, C, K - 1], each sequence's inputs before this step (updated in place).
    -> [T, C], `activation` ("silu" or None) applied. The sequences of `trace` have their state
    after each of their tokens recorded under `field` (layers/recurrent.py)."""
    k = weight.shape[1]
    if all(n == 1 for n in query_lens):  # decode: one window per sequence, one product
        window = torch.cat([state, x.unsqueeze(-1)], dim=-1)  # [N, C, K]
        out = (window * weight).sum(-1)
        state.copy_(window[:, :, 1:])
    else:
        parts = []
        for i, xs in enumerate(x.split(query_lens)):
            window = torch.cat([state[i], xs.t()], dim=-1)  # [C, K - 1 + L]
            parts.append(F.conv1d(window.unsqueeze(0), weight.unsqueeze(1), groups=weight.shape[0])[0].t())
            if trace is not None and i in trace.rows:
                for j in range(xs.shape[0]):  # after token j: the K - 1 inputs up to it
                    trace.record(field, i, window[:, j + 1:j + k])
            state[i].copy_(window[:, window.shape[1] - (k - 1):])
        out = torch.cat(parts)
    if bias is not None:
        out = out + bias
    if activation == "silu":
        out = F.silu(out)
    elif activation is not None:
        raise ValueError(f"causal_conv1d: activation {activation!r} is not one of None, 'silu'")
    return out

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
        # Token-major, as x comes: out[t] = sum_j weight[:, j] * window[t + j] over the window of the
        # K - 1 state inputs and the sequence's tokens, K passes of multiply-adds over [L, C] rows.
        # (F.conv1d wants channels-major rows: the two transposed copies there and back cost more
        # than the convolution itself.)
        taps = weight.t().contiguous()  # [K, C]: tap j of every channel, a contiguous row
        out = x.new_empty(x.shape)
        start = 0
        for i, n in enumerate(query_lens):
            window = torch.cat([state[i].t(), x[start:start + n]])  # [K - 1 + L, C]
            o = torch.mul(window[:n], taps[0], out=out[start:start + n])
            for j in range(1, k):
                o.addcmul_(window[j:j + n], taps[j])
            if trace is not None and i in trace.rows:
                for t in range(n):  # after token t: the K - 1 inputs up to it
                    trace.record(field, i, window[t + 1:t + k].t())
            state[i].copy_(window[n:].t())
            start += n
    if bias is not None:
        out.add_(bias)
    if activation == "silu":
        F.silu(out, inplace=True)
    elif activation is not None:
        raise ValueError(f"causal_conv1d: activation {activation!r} is not one of None, 'silu'")
    return out

"""The gated delta rule's chunked form (prefill) against two references on random inputs with
a random initial state: the form it replaced (per value head, one chunk's products at a time,
kept here as it was), and the recurrent form a token at a time (decode's `recurrent_step`).
Lengths below, at and past one chunk and not multiples of it, one token; key heads serving
two value heads each, as Qwen3.5's do."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagellm.layers.gated_delta_net import _l2norm, chunked_delta_rule, recurrent_step

KEY_HEADS, GROUP, DK, DV = 2, 2, 32, 16
HEADS = KEY_HEADS * GROUP


def previous_chunked_delta_rule(q, k, v, g, beta, state, chunk=64):
    """The chunked form before the chunk-major rewrite: q, k [L, H, dk] per value head."""
    length, heads = g.shape
    chunk = min(chunk, length)
    pad = -length % chunk
    n = (length + pad) // chunk

    def chunked(t):
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, 0, 0, pad)).transpose(0, 1)
        return t.reshape(heads, n, chunk, *t.shape[2:])

    q, k, v, g, beta = (chunked(t) for t in (q, k, v, g, beta))
    cum = g.cumsum(-1)
    future = torch.ones(chunk, chunk, dtype=torch.bool).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(future, float("-inf")).exp()
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    s = state
    out = torch.empty_like(v)
    for i in range(n):
        v_new = u[:, i] - w[:, i] @ s
        out[:, i] = q_decayed[:, i] @ s + attn[:, i] @ v_new
        s = s * chunk_decay[:, i] + k_to_end[:, i].transpose(-1, -2) @ v_new
    state.copy_(s)
    return out.reshape(heads, n * chunk, -1)[:, :length].transpose(0, 1)


def inputs(length: int, seed: int) -> tuple[torch.Tensor, ...]:
    """q, k on key heads (l2-normalised, q scaled as the layer scales it), v, g, beta, an initial
    state. Decays from slow (remembering the whole sequence) to fast (a few tokens)."""
    gen = torch.Generator().manual_seed(seed)
    q = _l2norm(torch.randn(length, KEY_HEADS, DK, generator=gen)) * DK ** -0.5
    k = _l2norm(torch.randn(length, KEY_HEADS, DK, generator=gen))
    v = torch.randn(length, HEADS, DV, generator=gen)
    g = -torch.logspace(-3, 0, HEADS) * torch.rand(length, HEADS, generator=gen) * 2
    beta = torch.rand(length, HEADS, generator=gen)
    state = torch.randn(HEADS, DK, DV, generator=gen) * 0.5
    return q, k, v, g, beta, state


def by_value_head(t: torch.Tensor) -> torch.Tensor:
    return t.repeat_interleave(GROUP, dim=1)


@pytest.mark.parametrize("length, chunk, fresh", [(1, 64, False), (5, 64, False), (64, 64, False), (100, 64, False),
                                                 (90, 32, False), (45, 16, False), (1, 64, True), (70, 64, True)])
def test_chunked_form_equals_the_previous_one_and_the_recurrent_form(length, chunk, fresh):
    """From a carried state, and from a fresh (zero) one, whose first chunk skips its products."""
    q, k, v, g, beta, state0 = inputs(length, seed=length)
    if fresh:
        state0.zero_()
    state = state0.clone()
    out = chunked_delta_rule(q, k, v, g, beta, state, chunk)
    assert out.shape == (length, HEADS, DV)

    before = state0.clone()
    expected = previous_chunked_delta_rule(by_value_head(q), by_value_head(k), v, g, beta, before, chunk)
    torch.testing.assert_close(out, expected, rtol=0, atol=2e-6)
    torch.testing.assert_close(state, before, rtol=0, atol=2e-6)

    stepped = state0.clone()[None]
    tokens = [recurrent_step(by_value_head(q[t:t + 1]), by_value_head(k[t:t + 1]), v[t:t + 1], g[t:t + 1],
                             beta[t:t + 1], stepped) for t in range(length)]
    torch.testing.assert_close(out, torch.cat(tokens), rtol=0, atol=1e-5)
    torch.testing.assert_close(state, stepped[0], rtol=0, atol=1e-5)


def test_a_sequence_in_pieces_carries_the_state_as_a_whole_one():
    """Prefill chunks of a prompt (cut inside a chunk) leave the state the whole prompt leaves."""
    q, k, v, g, beta, state0 = inputs(150, seed=3)
    whole = state0.clone()
    expected = chunked_delta_rule(q, k, v, g, beta, whole)
    pieces, cuts = state0.clone(), [0, 37, 101, 150]
    outs = [chunked_delta_rule(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], pieces) for a, b in zip(cuts, cuts[1:])]
    torch.testing.assert_close(torch.cat(outs), expected, rtol=0, atol=2e-6)
    torch.testing.assert_close(pieces, whole, rtol=0, atol=2e-6)


def test_heads_that_forget_within_a_few_tokens_agree_with_the_recurrent_form():
    """Decays of e^-1 to e^-21 a token: across a chunk their factors fall far below float32's normal range,
    which the chunked form floors at 2^-40 (subnormal products are slow); what they weight is
    then below float32's rounding."""
    q, k, v, g, beta, state0 = inputs(100, seed=9)
    g = g * 10 - 1  # -1 to -21 a token
    state = state0.clone()
    out = chunked_delta_rule(q, k, v, g, beta, state)
    stepped = state0.clone()[None]
    tokens = [recurrent_step(by_value_head(q[t:t + 1]), by_value_head(k[t:t + 1]), v[t:t + 1], g[t:t + 1],
                             beta[t:t + 1], stepped) for t in range(100)]
    torch.testing.assert_close(out, torch.cat(tokens), rtol=0, atol=1e-5)
    torch.testing.assert_close(state, stepped[0], rtol=0, atol=1e-5)
    assert out.abs().max() > 0.1  # not all forgotten: each token's own write is read back

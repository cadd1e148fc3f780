"""A recurrent layer's state kept in the bytes of KV pool blocks: what is written is read back
bit for bit, spread over several blocks, in pools of every storage dtype, without touching
other blocks; a sequence without computed tokens reads zeros."""
from __future__ import annotations

import pytest
import torch

from pagellm.layers.recurrent import RecurrentMixer, blocks_for_state, read_state, write_state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_state_round_trips_through_blocks(dtype):
    shape = (16, 1, 1, 8)  # blocks, block_size, kv heads, row: 8 values of each of K and V a block
    k, v = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    block_bytes = 8 * dtype.itemsize * 2  # K and V of one block id
    state_bytes = 20 * 4
    blocks = blocks_for_state(state_bytes, block_bytes)  # 2, 3 and 5 blocks: the last one part-filled
    assert blocks * block_bytes >= state_bytes > (blocks - 1) * block_bytes
    order = torch.randperm(15, generator=torch.Generator().manual_seed(0)) + 1
    ids = order[:2 * blocks].view(2, blocks)
    rows = torch.randn(2, 20)
    raw = read_state((k, v), ids)
    assert raw.shape == (2, blocks * block_bytes)
    raw.view(torch.float32)[:, :20] = rows
    write_state((k, v), ids, raw)
    assert torch.equal(read_state((k, v), ids).view(torch.float32)[:, :20], rows)
    untouched = [b for b in range(16) if b not in ids.flatten().tolist()]
    assert not k[untouched].any() and not v[untouched].any()


class _Sum(RecurrentMixer):
    """Adds each token to a running sum: the state is the sum of every token before."""

    state_shapes = {"sum": (3,)}

    def forward(self, x, state, query_lens, trace=None):
        outs = []
        for i, xs in enumerate(x.split(query_lens)):
            run = state["sum"][i] + xs.cumsum(0)
            state["sum"][i] = run[-1]
            outs.append(run)
        return torch.cat(outs)


def test_cached_forward_carries_state_across_steps_and_restarts_fresh_sequences():
    from types import SimpleNamespace

    k, v = torch.zeros(4, 1, 1, 2), torch.zeros(4, 1, 1, 2)  # 16 bytes a block id: one block holds 3 floats
    layer = _Sum()
    x = torch.arange(12, dtype=torch.float32).view(4, 3)
    meta = SimpleNamespace(state_block_ids=torch.tensor([[[1], [2]]]), fresh_states=torch.tensor([0, 1]), verifying=None,
                           query_lens=[3, 1])
    first = layer.cached_forward(x, (k, v), meta)
    torch.testing.assert_close(first[2], x[:3].sum(0))
    meta = SimpleNamespace(state_block_ids=torch.tensor([[[1], [2]]]), fresh_states=torch.tensor([1]), verifying=None,
                           query_lens=[1, 1])
    nxt = layer.cached_forward(torch.ones(2, 3), (k, v), meta)
    torch.testing.assert_close(nxt[0], x[:3].sum(0) + 1)  # carried on
    torch.testing.assert_close(nxt[1], torch.ones(3))     # block 2 held x[3], but the sequence is new

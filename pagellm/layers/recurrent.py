"""Layers that keep a fixed-size state per sequence instead of K/V rows per token (LFM2's
short convolutions, Gated DeltaNet, Mamba-2), and where that state lives: in blocks of the
KV pool, so one memory budget holds every kind of layer (core/kv/coordinator.py).

A recurrent layer declares its state's fields and shapes per sequence (`state_shapes`) and
computes on them as float32 tensors [num_seqs, *shape], one row per sequence of the step in
step order, which it updates in place. Around that call, `cached_forward` reads the rows out
of the sequences' state blocks and writes them back: a sequence's state takes the bytes of
`state_blocks` blocks of its layer's slot (the K then the V tensor of each block, in table
order), whatever the pool's dtype. A sequence computing its first tokens starts from zeros.
"""
from __future__ import annotations

import math

import torch

from pagellm.layers.module import HotModule

STATE_DTYPE = torch.float32


class RecurrentMixer(HotModule):
    """A token mixer with per-sequence state. Subclasses set `state_shapes` and implement
    `forward(x [T, hidden], state, query_lens) -> [T, hidden]`."""

    # Field name -> shape of one sequence's state on this rank (float32).
    state_shapes: dict[str, tuple[int, ...]]
    # The KV group whose state blocks this layer reads (set by the model runner, core/kv/groups.py).
    kv_group: int = 0

    @property
    def state_bytes(self) -> int:
        """Bytes of one sequence's state in this layer."""
        return sum(math.prod(s) for s in self.state_shapes.values()) * STATE_DTYPE.itemsize

    def forward(self, x: torch.Tensor, state: dict[str, torch.Tensor], query_lens: list[int]) -> torch.Tensor:
        raise NotImplementedError

    def cached_forward(self, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], meta) -> torch.Tensor:
        """forward() on the states held in the pool: `meta.state_block_ids[kv_group]` [num_seqs, blocks]
        are each sequence's state blocks, `meta.has_state` [num_seqs] whether it computed tokens before."""
        block_ids = meta.state_block_ids[self.kv_group]
        rows = read_state(kv_cache, block_ids, self.state_bytes)
        rows.mul_(meta.has_state.view(-1, 1))  # a fresh sequence starts from zeros, whatever its blocks held
        state, start = {}, 0
        for name, shape in self.state_shapes.items():
            n = math.prod(shape)
            state[name] = rows[:, start:start + n].view(-1, *shape)
            start += n
        out = self.forward(x, state, meta.query_lens)
        write_state(kv_cache, block_ids, rows)
        return out


def blocks_for_state(state_bytes: int, block_bytes: int) -> int:
    """Blocks of a pool whose block ids hold `block_bytes` per layer slot that one sequence's
    `state_bytes` take."""
    return -(-state_bytes // block_bytes)


def _byte_rows(kv_cache: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = kv_cache
    return k.view(torch.uint8).view(k.shape[0], -1), v.view(torch.uint8).view(v.shape[0], -1)


def read_state(kv_cache: tuple[torch.Tensor, torch.Tensor], block_ids: torch.Tensor, state_bytes: int) -> torch.Tensor:
    """[num_seqs, state floats]: each sequence's state bytes gathered from its blocks."""
    k, v = _byte_rows(kv_cache)
    raw = torch.stack([k[block_ids], v[block_ids]], dim=2)  # [N, blocks, 2, block bytes]
    raw = raw.reshape(block_ids.shape[0], -1)[:, :state_bytes].contiguous()
    return raw.view(STATE_DTYPE)


def write_state(kv_cache: tuple[torch.Tensor, torch.Tensor], block_ids: torch.Tensor, rows: torch.Tensor) -> None:
    """Put read_state's rows (changed) back into the same blocks."""
    k, v = _byte_rows(kv_cache)
    n, blocks = block_ids.shape
    raw = rows.contiguous().view(torch.uint8)
    size = blocks * 2 * k.shape[1]
    if raw.shape[1] < size:
        raw = torch.cat([raw, raw.new_zeros(n, size - raw.shape[1])], dim=1)
    raw = raw.view(n, blocks, 2, k.shape[1])
    k[block_ids] = raw[:, :, 0]
    v[block_ids] = raw[:, :, 1]

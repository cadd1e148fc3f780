"""Layers that keep a fixed-size state per sequence instead of K/V rows per token (LFM2's
short convolutions, Gated DeltaNet, Mamba-2), and where that state lives: in blocks of the
KV pool, so one memory budget holds every kind of layer (core/kv/coordinator.py).

A recurrent layer declares its state's fields and shapes per sequence (`state_shapes`) and
computes on them as float32 tensors [num_seqs, *shape], one row per sequence of the step in
step order, which it updates in place. Around that call, `cached_forward` copies the rows out
of the sequences' state blocks and back, one pass each way: a sequence's state takes the bytes
of `state_blocks` blocks of its layer's slot (the K then the V tensor of each block, in table
order), whatever the pool's dtype. A sequence computing its first tokens starts from zeros.
(A layer may instead compute on the states where they lie in that layout, as Gated DeltaNet's
compiled decode step does: layers/gated_delta_net.py.)

Speculative decoding verifies a sequence's k proposals in one step, which advances its state
through all of them; the rejected ones' must be undone. So the sequences of a step that verify
(`meta.verifying`) are computed a token at a time inside the layer (as decodes are), each state
field recorded after each token (StateTrace), and once the proposals are judged,
`roll_back_states` writes into each sequence's blocks the state after its last accepted token.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

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

    def forward(self, x: torch.Tensor, state: dict[str, torch.Tensor], query_lens: list[int],
                trace: StateTrace | None = None) -> torch.Tensor:
        """The step's tokens of each sequence (query_lens) on its state rows, updated in place;
        the sequences of `trace` a token at a time, each field recorded after each token."""
        raise NotImplementedError

    def cached_forward(self, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], meta) -> torch.Tensor:
        """forward() on the states held in the pool: `meta.state_block_ids[kv_group]` [num_seqs, blocks]
        are each sequence's state blocks, `meta.fresh_states` the sequences (rows) computing their
        first tokens."""
        block_ids = meta.state_block_ids[self.kv_group]
        raw = read_state(kv_cache, block_ids)
        rows = raw.view(STATE_DTYPE)
        rows.index_fill_(0, meta.fresh_states, 0)  # a fresh sequence starts from zeros, whatever its blocks held
        state, start = {}, 0
        for name, shape in self.state_shapes.items():
            n = math.prod(shape)
            state[name] = rows[:, start:start + n].view(-1, *shape)
            start += n
        trace = StateTrace(frozenset(meta.verifying)) if meta.verifying else None
        out = self.forward(x, state, meta.query_lens, trace)
        write_state(kv_cache, block_ids, raw)
        if trace is not None:
            meta.state_rollbacks.append(self._rollback(trace, kv_cache, block_ids, raw))
        return out

    def _rollback(self, trace: StateTrace, kv_cache: tuple[torch.Tensor, torch.Tensor], block_ids: torch.Tensor,
                  raw: torch.Tensor) -> StateRollback:
        """What roll_back_states needs of this layer: per verifying row, its state after each token
        as the row's bytes (fields in state_shapes order, then the blocks' unused tail as written)."""
        after = {}
        for row in trace.rows:
            fields = [torch.stack(trace.after[name][row]).flatten(1) for name in self.state_shapes]
            values = torch.cat(fields, dim=1)
            states = raw[row].view(STATE_DTYPE).repeat(values.shape[0], 1)
            states[:, :values.shape[1]] = values
            after[row] = states.view(torch.uint8)
        return StateRollback(kv_cache, block_ids, after)


@dataclass
class StateTrace:
    """The rows (sequences, in step order) whose tokens verify proposals, and each state field of
    theirs after each of their tokens: after[name][row][j] follows the row's token j."""

    rows: frozenset[int]
    after: dict[str, dict[int, list[torch.Tensor]]] = field(default_factory=dict)

    def record(self, name: str, row: int, value: torch.Tensor) -> None:
        self.after.setdefault(name, {}).setdefault(row, []).append(value.clone())


@dataclass
class StateRollback:
    """One layer's traced states of a step: per verifying row, [tokens, state bytes]."""

    kv_cache: tuple[torch.Tensor, torch.Tensor]
    block_ids: torch.Tensor
    after: dict[int, torch.Tensor]


def roll_back_states(rollbacks: list[StateRollback], kept: dict[int, int]) -> None:
    """Each verifying row's state, in every recurrent layer, back to what it was after its first
    kept[row] tokens of the step (its last token and its accepted proposals), where it verified
    more than it kept."""
    for rb in rollbacks:
        for row, n in kept.items():
            states = rb.after.get(row)
            if states is not None and n < states.shape[0]:
                write_state(rb.kv_cache, rb.block_ids[row:row + 1], states[n - 1:n])


def blocks_for_state(state_bytes: int, block_bytes: int) -> int:
    """Blocks of a pool whose block ids hold `block_bytes` per layer slot that one sequence's
    `state_bytes` take."""
    return -(-state_bytes // block_bytes)


def _words(kv_cache: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as [num_blocks, words of a block] in the widest integer type that divides a block:
    torch copies rows of wide elements several times faster than rows of bytes."""
    k, v = (t.view(torch.uint8).view(t.shape[0], -1) for t in kv_cache)
    size = k.shape[1]
    word = torch.int32 if size % 4 == 0 else torch.int16 if size % 2 == 0 else torch.uint8
    return k.view(word), v.view(word)


def _halves(raw: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V parts of every block in read_state's rows, [num_seqs * blocks, words] each
    (strided views into `raw`)."""
    parts = raw.view(k.dtype).view(-1, 2, k.shape[1])
    return parts[:, 0], parts[:, 1]


def read_state(kv_cache: tuple[torch.Tensor, torch.Tensor], block_ids: torch.Tensor) -> torch.Tensor:
    """Each sequence's state blocks' bytes, K then V of each block in table order: uint8
    [num_seqs, blocks x 2 x block bytes], copied out of the pool in one pass."""
    k, v = _words(kv_cache)
    n, blocks = block_ids.shape
    raw = torch.empty(n, blocks * 2 * k.shape[1] * k.element_size(), dtype=torch.uint8, device=k.device)
    to_k, to_v = _halves(raw, k)
    flat = block_ids.reshape(-1)
    torch.index_select(k, 0, flat, out=to_k)
    torch.index_select(v, 0, flat, out=to_v)
    return raw


def write_state(kv_cache: tuple[torch.Tensor, torch.Tensor], block_ids: torch.Tensor, raw: torch.Tensor) -> None:
    """Put read_state's bytes (changed) back into the same blocks."""
    k, v = _words(kv_cache)
    from_k, from_v = _halves(raw, k)
    flat = block_ids.reshape(-1)
    k.index_copy_(0, flat, from_k)
    v.index_copy_(0, flat, from_v)

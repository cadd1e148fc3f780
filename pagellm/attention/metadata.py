"""What every attention backend reads about a step: where this step's tokens go in the paged
cache, each sequence's block table and length, how many are decodes."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """Where this step's tokens come from and go to.

    Sequences are ordered decodes first (one query token each), then prefills (a
    prompt, a chunk of one, or a recomputation), so backends can batch the decodes.
    """

    # [num_tokens] flat index into the cache's (num_blocks * block_size) slots.
    slot_mapping: torch.Tensor
    # [num_seqs, max_blocks] physical block ids; rows padded with 0 (a valid block id).
    block_tables: torch.Tensor
    # Per sequence: tokens computed this step, and context length after this step.
    query_lens: list[int]
    seq_lens: list[int]
    # [num_seqs] seq_lens as a tensor on the device.
    seq_lens_tensor: torch.Tensor
    num_decodes: int
    block_size: int
    # With several KV groups (sliding-window layers, core/kv/groups.py): every group's slot
    # mapping [groups, num_tokens] and block tables [groups, num_seqs, max_blocks]; the two
    # fields above are group 0's. None with one group.
    group_slot_mappings: torch.Tensor | None = None
    group_block_tables: torch.Tensor | None = None
    # With recurrent layers (layers/recurrent.py): per group, each sequence's state blocks
    # [groups, num_seqs, state_blocks] (zeros in attention groups), and the sequences that
    # computed no tokens before this step (their rows; their states start from zeros).
    state_block_ids: torch.Tensor | None = None
    fresh_states: torch.Tensor | None = None
    # The sequences (rows) whose tokens verify proposals: the recurrent layers trace their states
    # token by token into state_rollbacks, for the runner to roll the rejected tokens back.
    verifying: list[int] | None = None
    state_rollbacks: list = field(default_factory=list, repr=False, compare=False)

    # for_group()'s results, built once per step rather than once per layer.
    _groups: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    # query_token_keys()'s result, computed once per step rather than once per layer.
    _token_keys: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False, compare=False)

    def query_token_keys(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per query token of the step: its sequence's row in block_tables, and how many keys it
        attends to (its position + 1: a prefill's tokens see the keys before them and their own)."""
        if self._token_keys is None:
            ql = torch.tensor(self.query_lens, device=self.seq_lens_tensor.device)
            seq = torch.repeat_interleave(torch.arange(len(self.query_lens), device=ql.device), ql)
            first = torch.cumsum(ql, 0) - ql  # each sequence's first token in the step
            within = torch.arange(seq.numel(), device=ql.device) - first[seq]
            keys = self.seq_lens_tensor.to(ql.device)[seq] - ql[seq] + 1 + within
            self._token_keys = (seq, keys)
        return self._token_keys

    def for_group(self, group: int) -> AttentionMetadata:
        """The metadata a layer of KV group `group` reads: this step's tokens through that group's
        slot mapping and block tables."""
        if group == 0 or self.group_block_tables is None:
            return self
        meta = self._groups.get(group)
        if meta is None:
            meta = AttentionMetadata(self.group_slot_mappings[group], self.group_block_tables[group], self.query_lens,
                                     self.seq_lens, self.seq_lens_tensor, self.num_decodes, self.block_size)
            meta._token_keys = self.query_token_keys()  # shared: positions do not depend on the group
            self._groups[group] = meta
        return meta

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes

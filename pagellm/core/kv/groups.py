"""Which layers share a block table: the KV groups of a model with sliding-window layers.

Layers are grouped by attention kind (full, or sliding with window W); a window as long as the
longest sequence never slides anything out and counts as full. Every group gets the same number
of layers S (the fewest layers of any kind; a kind whose count S does not divide gets a last,
partly empty group), so that the KV pool can be S pairs of K/V tensors shared by one layer of
each group: a block id then holds the K/V of one group's S layers, and any group can take any
free block (one pool, as vLLM's hybrid allocator does). A model whose layers are all of one kind
has one group: today's single table.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVGroupPlan:
    windows: tuple[int | None, ...]  # per group: None (full attention) or its window
    layer_group: tuple[int, ...]     # per layer: its group
    layer_slot: tuple[int, ...]      # per layer: which of the `slots` K/V tensor pairs it uses
    slots: int                       # K/V tensor pairs in the pool (layers per group)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def bytes_per_block(self, block_size: int, kv_heads: int, row_bytes: int) -> int:
        """K and V of one block id: `block_size` tokens of the `slots` layers it holds, `row_bytes`
        per token per KV head (head_dim values, and a scale in 8-bit formats)."""
        return 2 * self.slots * block_size * kv_heads * row_bytes

    @property
    def hybrid(self) -> bool:
        """Some group slides: the KV manager must keep per-group tables."""
        return any(w is not None for w in self.windows)


def plan_kv_groups(layer_windows: list[int | None], max_model_len: int) -> KVGroupPlan:
    """The groups for layers with these windows (None: full attention), in layer order."""
    if not layer_windows:
        raise ValueError("a model with no attention layers has no KV cache")
    windows = [None if w is None or w >= max_model_len else w for w in layer_windows]
    kinds = sorted(set(windows), key=lambda w: (w is not None, w or 0))  # full first, then by window
    by_kind = {k: [i for i, w in enumerate(windows) if w == k] for k in kinds}
    size = min(len(layers) for layers in by_kind.values())
    group_windows: list[int | None] = []
    layer_group = [0] * len(windows)
    layer_slot = [0] * len(windows)
    for kind, layers in by_kind.items():
        for start in range(0, len(layers), size):
            for slot, layer in enumerate(layers[start:start + size]):
                layer_group[layer], layer_slot[layer] = len(group_windows), slot
            group_windows.append(kind)
    return KVGroupPlan(tuple(group_windows), tuple(layer_group), tuple(layer_slot), size)

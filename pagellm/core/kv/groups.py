"""Which layers share a block table: the KV groups of a model with sliding-window or recurrent layers.

Layers are grouped by cache kind (full attention, sliding with window W, or recurrent STATE:
a fixed-size state per sequence, layers/recurrent.py); a window as long as the
longest sequence never slides anything out and counts as full. Every group gets the same number
of layers S (the fewest layers of any kind; a kind whose count S does not divide gets a last,
partly empty group), so that the KV pool can be S pairs of K/V tensors shared by one layer of
each group: a block id then holds the K/V of one group's S layers, and any group can take any
free block (one pool, as vLLM's hybrid allocator does). A model whose layers are all of one kind
has one group: today's single table.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# The kind of a group of recurrent layers: each sequence holds a fixed number of blocks of it,
# which hold its state (core/kv/coordinator.py).
STATE = "state"


def kind_name(kind: int | None | str) -> str:
    """"full", "sliding" or "state": how stats and metrics name a group's kind."""
    return "full" if kind is None else STATE if kind == STATE else "sliding"


@dataclass(frozen=True)
class KVGroupPlan:
    windows: tuple[int | None | str, ...]  # per group: None (full attention), its window, or STATE
    layer_group: tuple[int, ...]     # per layer: its group
    layer_slot: tuple[int, ...]      # per layer: which of the `slots` K/V tensor pairs it uses
    slots: int                       # K/V tensor pairs in the pool (layers per group)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def bytes_per_block(self, block_size: int, kv_heads: int, row_bytes: int, v_row_bytes: int | None = None) -> int:
        """K and V of one block id: `block_size` tokens of the `slots` layers it holds, `row_bytes`
        per token per KV head in K (head_dim values, and a scale in 8-bit formats) and
        `v_row_bytes` in V (the same unless given: 0 for latent rows, held in K alone)."""
        v = row_bytes if v_row_bytes is None else v_row_bytes
        return self.slots * block_size * kv_heads * (row_bytes + v)

    @property
    def hybrid(self) -> bool:
        """Some group slides or holds state: the KV manager must keep per-group tables."""
        return any(w is not None for w in self.windows)

    @property
    def has_state(self) -> bool:
        """Some layers are recurrent (their groups hold per-sequence state)."""
        return STATE in self.windows


def plan_kv_groups(layer_windows: list[int | None | str], max_model_len: int) -> KVGroupPlan:
    """The groups for layers of these kinds (None: full attention, W: a window, STATE: recurrent),
    in layer order."""
    if not layer_windows:
        raise ValueError("a model with no attention layers has no KV cache")
    if all(w == STATE for w in layer_windows):
        raise ValueError("a model with recurrent layers alone is not served yet: the pool's blocks are sized by "
                         "its attention layers")
    windows = [w if w is None or w == STATE or w < max_model_len else None for w in layer_windows]
    # Full first, then by window, then the recurrent layers: group 0 is always an attention group.
    kinds = sorted(set(windows), key=lambda w: (0, 0) if w is None else (2, 0) if w == STATE else (1, w))
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


def group_names(plan: KVGroupPlan, layer_names: Sequence[str | None]) -> tuple[str, ...]:
    """How stats and metrics name each group: the name its layers share where the model names
    them (layer_names, per layer: "latent" for latent-attention layers, "chunked" for chunked
    attention, None for nothing beyond the window kind), else its window kind (kind_name)."""
    if len(layer_names) != len(plan.layer_group):
        raise ValueError(f"{len(layer_names)} layer names for {len(plan.layer_group)} layers")
    names = []
    for g, window in enumerate(plan.windows):
        own = {name for name, lg in zip(layer_names, plan.layer_group) if lg == g}
        names.append(own.pop() if len(own) == 1 and None not in own else kind_name(window))
    return tuple(names)

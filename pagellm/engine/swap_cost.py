"""preemption_mode "auto"'s judge: swap a preempted sequence's blocks out to the KV tier, or
compute its tokens again, whichever the rates measured so far say is cheaper."""
from __future__ import annotations

from pagellm.worker.kv_tier import DiskKVTier


class SwapCost:
    def __init__(self, tier: DiskKVTier | None) -> None:
        self.tier = tier  # rank 0's: its rates stand for every rank's
        # Seconds per computed token, a moving average over steps: what recomputing costs.
        # None until a step has run.
        self.seconds_per_token: float | None = None

    def record_step(self, seconds: float, num_tokens: int) -> None:
        sample = seconds / num_tokens
        prev = self.seconds_per_token
        self.seconds_per_token = sample if prev is None else 0.8 * prev + 0.2 * sample

    def __call__(self, num_tokens: int, num_blocks: int) -> bool:
        """Writing and reading back `num_blocks` blocks against computing `num_tokens` tokens again
        (recompute until both rates are known)."""
        per_token = self.seconds_per_token
        per_byte = None if self.tier is None else self.tier.seconds_per_byte
        if per_token is None or per_byte is None:
            return False
        return 2 * num_blocks * self.tier.block_bytes * per_byte < num_tokens * per_token

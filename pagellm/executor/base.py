"""The executor interface: what the engine asks of the ranks that run its model."""
from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from typing import Any, Iterable

import torch

from pagellm.core.step_plan import StepPlan
from pagellm.timing import PhaseTimer
from pagellm.worker.model_runner import ModelRunner, StepResult


class Executor(ABC):
    """Runs steps on one or more model runners. `driver` is rank 0's runner: the one that
    samples, and whose model, KV groups and format the engine reads (every rank has the same)."""

    driver: ModelRunner

    @abstractmethod
    def collective_rpc(self, method: str, args: tuple = (), local_args: tuple | None = None) -> list[Any]:
        """Run ModelRunner.`method` on every rank, with `args` (rank 0 with `local_args` when given:
        what only it holds, such as the weights it reads); every rank's value, rank 0's first."""

    def execute(self, plan: StepPlan, eos_token_ids: set[int]) -> StepResult:
        """Run one step; only rank 0 samples, so its result is the step's."""
        return self.driver.execute(plan, eos_token_ids)

    def release_sequences(self, request_ids: list[str]) -> None:
        """Sequences that gave back their blocks: rank 0's proposer (the only one) frees its state."""
        self.driver.release_sequences(request_ids)

    @abstractmethod
    def shutdown(self) -> None:
        """Release what outlives the engine (the ranks' processes); idempotent."""

    # ---- runner operations whose ranks' answers combine ------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Rank 0 loads `weights`; every other rank reads its own copy of the model's files."""
        self.collective_rpc("load_weights", local_args=(weights,))

    def num_blocks_for_budget(self, block_size: int, kv_cache_memory: float | int | None) -> int:
        # Every rank must hold the same blocks: the one with the least room decides.
        return min(self.collective_rpc("num_blocks_for_budget", (block_size, kv_cache_memory)))

    def capture_cuda_graphs(self, max_num_seqs: int) -> None:
        self.collective_rpc("capture_cuda_graphs", (max_num_seqs,))

    def memory_report(self) -> list[dict]:
        """Per rank: bytes of weights and of KV cache it holds, its KV heads, its peak memory."""
        return self.collective_rpc("memory_report")

    def attach_timer(self, timer: PhaseTimer | None) -> None:
        self.driver.attach_timer(timer)  # rank 0's phases stand for the step's

    # ---- the second tier: each rank keeps its own shard of every block ---------------------------
    def stage_tier_block(self, key: bytes) -> bool:
        """True only if every rank holds its shard of the block: a block some rank lost is recomputed."""
        hits = self.collective_rpc("stage_tier_block", (key,))
        if all(hits):
            return True
        if any(hits):
            self.collective_rpc("unstage_tier_block", (key,))
        return False

    def apply_tier_ops(self, ops: list) -> None:
        # The payloads stay in the ranks (staged there): only the moves travel.
        moves = [dataclasses.replace(op, payload=None) for op in ops]
        self.collective_rpc("apply_tier_ops", (moves,), local_args=(ops,))

    def close_kv_tier(self, cached_blocks: list[tuple[int, bytes]]) -> None:
        self.collective_rpc("close_kv_tier", (cached_blocks,))

"""Joining a tensor-parallel group: the torch.distributed process groups every rank needs,
whether the engine spawned the ranks itself or torchrun started them.

Two groups: the default one for the model's collectives (gloo on the CPU, NCCL on CUDA,
with a timeout that bounds a hung peer) and a gloo group for rank 0's commands, whose
timeout is practically unbounded because workers wait on it while the engine is idle.
"""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from pagellm import envs
from pagellm.distributed.channel import Channel
from pagellm.layers.parallel import TensorParallelGroup

_CTRL_TIMEOUT = timedelta(days=365)


def collective_timeout() -> timedelta:
    """How long a collective of the forward pass waits for a peer before it fails."""
    return timedelta(seconds=envs.tp_timeout_s())


def threads_per_rank(ranks_on_this_machine: int) -> int:
    """Split this machine's cores between its ranks, so they do not oversubscribe them."""
    return max(1, len(os.sched_getaffinity(0)) // ranks_on_this_machine)


def backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def local_device(device_type: str, local_rank: int) -> torch.device:
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def join(rank: int, size: int, device: torch.device, store: dist.Store | None = None
         ) -> tuple[TensorParallelGroup, Channel]:
    """Join the group (through `store`, or torchrun's env:// variables) and make its control channel."""
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized in this process; pagellm runs one "
                           "tensor-parallel engine per process (shut the other one down first)")
    kwargs = {"store": store} if store is not None else {"init_method": "env://"}
    dist.init_process_group(backend_for(device.type), rank=rank, world_size=size, timeout=collective_timeout(),
                            **kwargs)
    ctrl = dist.new_group(backend="gloo", timeout=_CTRL_TIMEOUT)
    return TensorParallelGroup(rank, size), Channel(rank, ctrl, None, device)


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()

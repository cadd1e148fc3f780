"""What the recurrent-mixer tests share: loading a transformers module's weights into a pagellm
layer the way a checkpoint is loaded, running the layer over a flat batch of sequences from
given states, running the transformers module on one sequence with its cache, and tensor
parallelism without processes (the ranks of a group as threads whose all_reduce sums through
shared memory)."""
from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache

from pagellm.layers.parallel import TensorParallelGroup
from pagellm.layers.recurrent import RecurrentMixer
from pagellm.models.base import CausalLM


class _Holder(CausalLM):
    """Just enough of a model for CausalLM.load_weights: the layer, and its stacked_params."""

    def __init__(self, layer: RecurrentMixer) -> None:
        nn.Module.__init__(self)
        self.layer = layer
        self.cfg = SimpleNamespace(architecture="test")
        self.stacked_params = getattr(layer, "stacked_params", ())


def load(layer: RecurrentMixer, ref: nn.Module) -> RecurrentMixer:
    """Copy `ref`'s parameters into `layer` by their names, through the checkpoint load path."""
    _Holder(layer).load_weights((f"model.layer.{n}", p.detach()) for n, p in ref.named_parameters())
    return layer


def fresh_state(layer: RecurrentMixer, num_seqs: int) -> dict[str, torch.Tensor]:
    """Zero states laid out as cached_forward hands them over: views into one row per sequence."""
    sizes = [math.prod(shape) for shape in layer.state_shapes.values()]
    rows = torch.zeros(num_seqs, sum(sizes)).split(sizes, dim=1)
    return {name: r.view(-1, *shape) for r, (name, shape) in zip(rows, layer.state_shapes.items())}


def step(layer: RecurrentMixer, seqs: list[torch.Tensor], state: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """One forward over `seqs` ([len, hidden] each) back to back; each one's output."""
    lens = [s.shape[0] for s in seqs]
    with torch.no_grad():
        return list(layer(torch.cat(seqs), state, lens).split(lens))


def reference(ref: nn.Module, config, seq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """transformers' module on one whole sequence from an empty cache: (output, the conv state as
    pagellm keeps it (the last K - 1 inputs), the recurrent state)."""
    cache = DynamicCache(config=config)
    with torch.no_grad():
        out = ref(seq[None], cache=cache)[0]
    layer = cache.layers[0]
    return out, layer.conv_states[0][0, :, 1:], layer.recurrent_states[0][0]


@dataclass(frozen=True)
class ThreadGroup(TensorParallelGroup):
    slots: list = field(default_factory=list)
    barrier: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.slots[self.rank] = x.clone()
        self.barrier.wait()
        total = sum(self.slots[1:], self.slots[0].clone())  # the same order on every rank
        self.barrier.wait()  # nobody writes the next call's slot before everyone has summed this one
        return x.copy_(total)


def run_ranks(size: int, fn: Callable[[TensorParallelGroup], Any]) -> list:
    """fn(group) on each of `size` ranks at once; their results in rank order."""
    slots, barrier = [None] * size, threading.Barrier(size, timeout=60)
    results, errors = [None] * size, []

    def run(rank: int) -> None:
        try:
            results[rank] = fn(ThreadGroup(rank, size, slots=slots, barrier=barrier))
        except BaseException as e:  # re-raised below, in the test's thread
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return results

"""What the recurrent-mixer tests share: loading a transformers module's weights into a pagellm
layer the way a checkpoint is loaded, running the layer over a flat batch of sequences from
given states, running the transformers module on one sequence with its cache, and tensor
parallelism without processes (the ranks of a group as threads whose all_reduce sums through
shared memory)."""
from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable
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
    return load_tensors(layer, ((n, p.detach()) for n, p in ref.named_parameters()))


def load_tensors(layer: RecurrentMixer, tensors: Iterable[tuple[str, Any]]) -> RecurrentMixer:
    """Load (name in the layer's checkpoint, tensor or GGUF blocks) pairs into `layer`."""
    _Holder(layer).load_weights((f"model.layer.{n}", t) for n, t in tensors)
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


# Both layers' outputs and states agree with transformers' within this, in float32.
ATOL = 1e-4


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=ATOL)


def seqs(*lens: int, seed: int = 1, hidden: int = 64) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, hidden, generator=g) for n in lens]


def check_chunks_then_decodes(layer: RecurrentMixer, whole: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """A 155-token prompt in chunks of 10, 64 and 76, then 5 one-token steps, gives what
    `whole` (the reference on the whole sequence) gives; and the context matters."""
    (x,) = seqs(155, seed=2)
    expected = whole(x)
    state = fresh_state(layer, 1)
    outs, start = [], 0
    for n in (10, 64, 76) + (1,) * 5:
        outs += step(layer, [x[start:start + n]], state)
        start += n
    close(torch.cat(outs), expected)
    # The context matters: the last tokens alone give something else.
    alone = step(layer, [x[-20:]], fresh_state(layer, 1))[0]
    assert (alone[-5:] - expected[-5:]).abs().max() > 0.05


def check_batched_decodes(layer: RecurrentMixer, whole: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Three sequences' decodes in one step equal each one alone (outputs and states) and the
    reference's last output on the whole sequence."""
    prompts, nxt = seqs(3, 70, 12, seed=3), seqs(1, 1, 1, seed=4)
    state = fresh_state(layer, 3)
    step(layer, prompts, state)
    alone = {k: v.clone() for k, v in state.items()}
    together = step(layer, nxt, state)
    for i in range(3):
        one = {k: v[i:i + 1] for k, v in alone.items()}
        close(together[i], step(layer, [nxt[i]], one)[0])
        close(together[i][0], whole(torch.cat([prompts[i], nxt[i]]))[-1])
        for k in state:
            close(state[k][i], one[k][0])


def check_two_ranks(whole: RecurrentMixer, shard: Callable[[TensorParallelGroup], RecurrentMixer],
                    state_shapes: dict[str, tuple[int, ...]]) -> None:
    """Two decodes (from a fresh start) and two prefills give on two ranks, each holding
    `shard(tp)` with `state_shapes`, what `whole` gives on one."""
    xs = seqs(1, 1, 9, 70, seed=5)
    expected = step(whole, xs, fresh_state(whole, 4))

    def rank(tp: TensorParallelGroup) -> list[torch.Tensor]:
        layer = shard(tp)
        assert layer.state_shapes == state_shapes
        return step(layer, xs, fresh_state(layer, 4))

    for outs in run_ranks(2, rank):
        for got, want in zip(outs, expected):
            close(got, want)

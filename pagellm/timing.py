"""Per-phase wall-clock timers: the explicit hook through which benchmarks see where a step's
time goes. Detached (the default), a phase costs one `None` check.

    timer = PhaseTimer()
    engine.attach_timer(timer)     # the engine, its model runner and attention backend report to it
    ... engine.step() ...
    engine.attach_timer(None)
    timer.seconds["attention"], timer.calls["step"]

Phases: step (all of it), schedule, grammar (structured outputs' bitmasks), execute (the runner's whole part), prepare_inputs,
model_forward, attention (inside model_forward), logits, sampler.
"""
from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from typing import ContextManager, Iterator


class PhaseTimer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.record(name, time.perf_counter() - start)

    def record(self, name: str, seconds: float) -> None:
        """One call of `name` that took `seconds`: for a block timed only when it turns out to run."""
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        self.calls[name] = self.calls.get(name, 0) + 1


_OFF = nullcontext()


def phase(timer: PhaseTimer | None, name: str) -> ContextManager[None]:
    """`with phase(timer, "schedule"):` times the block when a timer is attached."""
    return _OFF if timer is None else timer.phase(name)

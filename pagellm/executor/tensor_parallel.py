"""Tensor-parallel ranks: rank 0's runner here, ranks 1..N-1 in their own processes
(pagellm/distributed/), every operation run on all of them.

The scheduler and the block allocator run once, above; each step's inputs are broadcast to the
workers before rank 0 runs its own shard, and only rank 0 samples.
"""
from __future__ import annotations

import logging
import weakref
from functools import partial
from typing import Any, Callable

from pagellm.distributed.driver import WorkerGroup
from pagellm.distributed.worker import pack, warm_up_kernels
from pagellm.executor.base import Executor
from pagellm.models.registry import check_tensor_parallel
from pagellm.worker.model_runner import ModelRunner, StepInputs
from pagellm.worker.spec import WorkerSpec

logger = logging.getLogger(__name__)


class TensorParallelExecutor(Executor):
    def __init__(self, size: int, spec: WorkerSpec, **driver_kwargs: Any) -> None:
        """Check the model splits `size` ways, start the ranks and build every shard;
        `driver_kwargs` go to rank 0's runner alone (its proposer: only rank 0 samples)."""
        check_tensor_parallel(spec.arch, size)
        self.workers = WorkerGroup.start(size, spec.device_type)
        self._finalizer = weakref.finalize(self, self.workers.close)
        try:
            def build() -> ModelRunner:
                args, kwargs = spec.runner_arguments(self.workers.device, self.workers.tp)
                runner = ModelRunner(*args, **kwargs, **driver_kwargs, mirror=partial(_mirror_step, self.workers),
                                     mirror_call=self.workers.call)
                warm_up_kernels(self.workers.device)
                return runner

            built: list[ModelRunner] = []
            self.workers.call("init", (spec,), lambda: built.append(build()))
            self.driver = built[0]
        except BaseException:
            self.shutdown()
            raise

    def collective_rpc(self, method: str, args: tuple = (), local_args: tuple | None = None) -> list[Any]:
        local = getattr(self.driver, method)
        return self.workers.call(method, args, lambda: local(*(args if local_args is None else local_args)))

    def capture_cuda_graphs(self, max_num_seqs: int) -> None:
        logger.info("pagellm: tensor-parallel steps run eagerly (no CUDA graphs)")

    def close_kv_tier(self, cached_blocks: list[tuple[int, bytes]]) -> None:
        if self.workers.error is not None:  # the workers are gone (shutdown after a failure): rank 0's own
            self.driver.close_kv_tier(cached_blocks)
            return
        super().close_kv_tier(cached_blocks)

    def shutdown(self) -> None:
        self._finalizer()

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the ranks this engine spawned (none under torchrun)."""
        return self.workers.pids


def _mirror_step(workers: WorkerGroup, inputs: StepInputs, run_step: Callable[[StepInputs], Any]) -> Any:
    """Broadcast a step's inputs, then run rank 0's shard: the workers run theirs meanwhile."""
    workers.check()
    values, tensors = pack(inputs)
    try:
        workers.channel.send("step", values, tensors)
        return run_step(inputs)
    except Exception as e:  # the ranks are out of step now: the group is done
        raise workers.failed(e) from e

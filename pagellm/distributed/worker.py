"""A worker rank (1..N-1) of a tensor-parallel engine: it holds its shard of the model and of
the KV cache and does whatever rank 0 broadcasts, until told to stop.

Ranks are started by the engine (`spawn_main`, through torch.multiprocessing) or by torchrun
(`run_from_env`, e.g. `torchrun ... -m pagellm.distributed.worker_main`). A worker never
outlives the process that started it: it exits when its parent goes, and when rank 0's end
of a collective closes.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
import traceback
import typing
from typing import Any

import torch
import torch.distributed as dist

from pagellm import envs
from pagellm.distributed import process_group
from pagellm.distributed.channel import Channel
from pagellm.layers.parallel import TensorParallelGroup
from pagellm.worker.spec import WorkerSpec

READY_KEY = "pagellm/ready/{rank}"


def pack(obj: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A dataclass (nested ones included) as (small Python values, tensors) for the channel,
    keyed by field path ("meta.slot_mapping"): every field travels, whatever fields it grows."""
    values: dict[str, Any] = {}
    tensors: dict[str, torch.Tensor] = {}

    def walk(o: Any, prefix: str) -> None:
        for f in dataclasses.fields(o):
            if f.init:
                v, key = getattr(o, f.name), prefix + f.name
                if isinstance(v, torch.Tensor):
                    tensors[key] = v
                elif dataclasses.is_dataclass(v):
                    walk(v, key + ".")
                else:
                    values[key] = v

    walk(obj, "")
    return values, tensors


def unpack(cls: type, values: dict[str, Any], tensors: dict[str, torch.Tensor], prefix: str = "") -> Any:
    """The inverse of `pack`, for an instance of `cls`."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        key = prefix + f.name
        if key in values:
            kwargs[f.name] = values[key]
        elif key in tensors:
            kwargs[f.name] = tensors[key]
        else:
            kwargs[f.name] = unpack(hints[f.name], values, tensors, key + ".")
    return cls(**kwargs)


class Worker:
    """What a worker does for rank 0: build its runner, load its own copy of the weights, run the
    steps rank 0 broadcasts; any other command is the ModelRunner method of that name, run with
    rank 0's arguments (so a new runner operation needs nothing here)."""

    def __init__(self, tp: TensorParallelGroup, device: torch.device, local_rank: int,
                 model_path: str | None = None) -> None:
        self.tp = tp
        self.device = device
        self.local_rank = local_rank
        self.model_path = model_path  # this machine's path to the model, if not rank 0's
        self.spec: WorkerSpec | None = None
        self.runner = None

    def call(self, command: str, args: tuple) -> Any:
        if command in ("init", "load_weights"):
            return getattr(self, command)(*args)
        if command.startswith("_") or self.runner is None or not callable(getattr(self.runner, command, None)):
            raise RuntimeError(f"unknown command {command!r} from rank 0")
        return getattr(self.runner, command)(*args)

    def init(self, spec: WorkerSpec) -> None:
        from pagellm.worker.model_runner import ModelRunner

        if spec.device_type != self.device.type:
            raise ValueError(f"rank 0 runs on {spec.device_type} but this rank on {self.device.type} "
                             "(start the workers with the same --device)")
        self.spec = spec
        torch.manual_seed(spec.seed)
        args, kwargs = spec.runner_arguments(self.device, self.tp)
        self.runner = ModelRunner(*args, **kwargs)
        warm_up_kernels(self.device)

    def load_weights(self) -> None:
        from pagellm.loader.source import load_model_source

        spec = self.spec
        path = self.model_path or spec.model_path
        source = load_model_source(path, spec.load_format, spec.quantization)
        if source.arch != spec.arch:
            raise ValueError(f"the model at {path} on this machine is not rank 0's model "
                             f"({source.arch} != {spec.arch})")
        self.runner.load_weights(source.weights())

    def step(self, values: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        from pagellm.worker.model_runner import StepInputs

        self.runner.run_step(unpack(StepInputs, values, tensors))


def serve(channel: Channel, tp: TensorParallelGroup, device: torch.device, local_rank: int,
          model_path: str | None = None) -> None:
    """Do rank 0's commands until it says "shutdown"."""
    worker = Worker(tp, device, local_rank, model_path)
    while True:
        command, args, tensors = channel.recv()
        if command == "step":
            worker.step(args, tensors)
        elif command == "shutdown":
            return
        else:
            try:
                value, error = worker.call(command, args), None
            except Exception as e:
                traceback.print_exc()
                value, error = None, f"tensor-parallel rank {tp.rank}: {type(e).__name__}: {e}"
            channel.answer(error, value)


def warm_up_kernels(device: torch.device) -> None:
    """Build the CPU decode kernel now, not inside the first step's collectives."""
    if device.type == "cpu":
        from pagellm.kernels import cpu as cpu_kernels

        cpu_kernels.available()


def _exit_with_parent(parent_pid: int) -> None:
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="pagellm-parent-watch", daemon=True).start()


def _run(rank: int, size: int, local_rank: int, device_type: str, store: dist.Store | None,
         model_path: str | None = None) -> None:
    try:
        device = process_group.local_device(device_type, local_rank)
        tp, channel = process_group.join(rank, size, device, store)
        serve(channel, tp, device, local_rank, model_path)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # skip teardown that would wait on peers that are gone
    process_group.leave()


def spawn_main(rank: int, size: int, host: str, port: int, device_type: str, parent_pid: int,
               num_threads: int) -> None:
    """Entry point of a rank the engine spawned on this machine."""
    _exit_with_parent(parent_pid)
    torch.set_num_threads(num_threads)
    store = dist.TCPStore(host, port, is_master=False, timeout=process_group.collective_timeout())
    store.set(READY_KEY.format(rank=rank), str(os.getpid()))
    _run(rank, size, rank, device_type, store)


def run_from_env(device_type: str | None = None, model_path: str | None = None) -> None:
    """Entry point of a worker rank torchrun started (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""
    env = envs.torchrun_env()
    if env is None:
        raise RuntimeError("not started by torchrun: RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT must be set")
    if env["rank"] == 0:
        raise RuntimeError("rank 0 runs the engine (e.g. `pagellm serve --tensor-parallel-size N`), not a worker")
    _exit_with_parent(os.getppid())
    torch.set_num_threads(process_group.threads_per_rank(env["local_world_size"]))
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    _run(env["rank"], env["world_size"], env["local_rank"], device_type, None, model_path)

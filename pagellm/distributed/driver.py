"""Rank 0's side of a tensor-parallel group: it starts the worker ranks (or finds them started
by torchrun), sends them commands, notices when one dies, and stops them. What the commands are
is the executor's business (pagellm/executor/tensor_parallel.py).
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import tempfile
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagellm import envs
from pagellm.distributed import process_group
from pagellm.distributed.worker import READY_KEY, spawn_main
from pagellm.errors import EngineFatalError

logger = logging.getLogger(__name__)
_START_TIMEOUT_S = 300.0
# Parent to spawned ranks: a file where a rank that cannot start writes why (see WorkerGroup.start).
_SPAWN_FAULT_FILE = "PAGELLM_TP_SPAWN_FAULT_FILE"
MAIN_GUARD_FAULT = (
    "a spawned tensor-parallel rank ran the script that creates the engine again: ranks start with "
    "multiprocessing's 'spawn', which imports the main script anew in each of them. Create the engine "
    "under `if __name__ == \"__main__\":` in that script (or run it with `python -m`, or under torchrun)")


class TensorParallelError(EngineFatalError):
    """A worker rank died or a collective failed; the engine cannot run another step."""


class WorkerGroup:
    """The worker ranks as rank 0 sees them: their processes (when rank 0 spawned them), the
    channel to them, and whether the group is still usable."""

    def __init__(self, device: torch.device, procs: list, saved_threads: int) -> None:
        self.device = device
        self.procs = procs
        self.tp = None
        self.channel = None
        self.error: str | None = None
        self.fault_file: str | None = None
        self._saved_threads = saved_threads
        self._closed = False

    @classmethod
    def start(cls, size: int, device_type: str) -> WorkerGroup:
        """Spawn ranks 1..size-1 on this machine, or, under torchrun, join the ranks it started."""
        if getattr(multiprocessing.current_process(), "_inheriting", False):
            # We are a rank being spawned, re-running the user's script while it bootstraps:
            # tell the parent why this rank is about to die, and stop here.
            fault_file = os.environ.get(_SPAWN_FAULT_FILE)
            if fault_file:
                with open(fault_file, "w") as f:
                    f.write(MAIN_GUARD_FAULT)
            raise RuntimeError(MAIN_GUARD_FAULT)
        env = envs.torchrun_env()
        if env is not None and env["world_size"] > 1:
            if env["rank"] != 0:
                raise RuntimeError(f"this process is rank {env['rank']} of a torchrun group; only rank 0 runs "
                                   "the engine, the others run `python -m pagellm.distributed.worker_main`")
            if env["world_size"] != size:
                raise ValueError(f"tensor_parallel_size ({size}) must equal torchrun's WORLD_SIZE "
                                 f"({env['world_size']})")
            group = cls(process_group.local_device(device_type, env["local_rank"]), [],
                        _set_threads(process_group.threads_per_rank(env["local_world_size"])))
            try:
                group.tp, group.channel = process_group.join(0, size, group.device)
            except BaseException:
                group.close()
                raise
            return group
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialized in this process; pagellm runs one "
                               "tensor-parallel engine per process (shut the other one down first)")
        device = process_group.local_device(device_type, 0)
        threads = process_group.threads_per_rank(size)
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                              timeout=process_group.collective_timeout())
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=spawn_main, name=f"pagellm-tp-rank{r}", daemon=True,
                             args=(r, size, "127.0.0.1", store.port, device_type, os.getpid(), threads))
                 for r in range(1, size)]
        group = cls(device, procs, _set_threads(threads))
        fd, group.fault_file = tempfile.mkstemp(prefix="pagellm-tp-start-")
        os.close(fd)
        try:
            os.environ[_SPAWN_FAULT_FILE] = group.fault_file  # inherited by the ranks spawned here
            try:
                for p in procs:
                    p.start()
            finally:
                del os.environ[_SPAWN_FAULT_FILE]
            group._wait_ready(store)
            group.tp, group.channel = process_group.join(0, size, device, store)
        except BaseException:
            group.close()
            raise
        return group

    def _wait_ready(self, store: dist.Store) -> None:
        keys = [READY_KEY.format(rank=r) for r in range(1, len(self.procs) + 1)]
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not store.check(keys):
            if self._dead():
                with open(self.fault_file) as f:
                    why = f.read()
                self._raise_if_dead(f"while starting: {why}" if why else "while starting")
            if time.monotonic() > deadline:
                raise TensorParallelError(f"tensor-parallel workers did not start within {_START_TIMEOUT_S:.0f} s")
            time.sleep(0.05)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    # ---- talking to the workers ------------------------------------------------------------
    def call(self, command: str, args: tuple, local: Callable[[], Any]) -> list[Any]:
        """Run `command` on every worker and `local()` here; every rank's value, rank 0 first.
        Rank 0's own exception is raised as it is; a worker's as TensorParallelError."""
        self.check()
        error, value = None, None
        try:
            self.channel.send(command, args)
            try:
                value = local()
            except Exception as e:
                error = e
            answers = self.channel.collect(None if error is None else f"rank 0: {error}", value)
        except Exception as e:
            raise self.failed(e) from e
        if error is not None:
            raise error
        failed = [e for e, _ in answers if e is not None]
        if failed:
            raise TensorParallelError("; ".join(failed))
        return [v for _, v in answers]

    def check(self) -> None:
        """Raise TensorParallelError when the group is no longer usable (checked before every step)."""
        if self.error is not None:
            raise TensorParallelError(self.error)
        self._raise_if_dead("")

    def _raise_if_dead(self, when: str) -> None:
        dead = self._dead()
        if dead:
            raise self._fail(f"{dead}{' ' + when if when else ''}")

    def _dead(self, wait: float = 0.0) -> str:
        deadline = time.monotonic() + wait
        while True:
            dead = [f"tensor-parallel worker rank {r} (pid {p.pid}) died with exit code {p.exitcode}"
                    for r, p in enumerate(self.procs, start=1) if not p.is_alive()]
            if dead or time.monotonic() >= deadline:
                return "; ".join(dead)
            time.sleep(0.05)

    def failed(self, cause: BaseException) -> TensorParallelError:
        """The error to raise after a collective failed: name a dead worker if there is one."""
        # A killed worker's sockets close before the process is reaped: give it a moment.
        dead = self._dead(wait=2.0) if self.procs else ""
        return self._fail(dead or f"tensor-parallel collective failed: {type(cause).__name__}: {cause}")

    def _fail(self, reason: str) -> TensorParallelError:
        self.error = f"{reason}; this engine cannot run any more steps (create a new one)"
        self.close()
        return TensorParallelError(self.error)

    # ---- stopping ------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the workers (asking first, when the group is still healthy) and leave the group.
        Idempotent; runs at engine shutdown, garbage collection and interpreter exit."""
        if self._closed:
            return
        self._closed = True
        if self.fault_file is not None:
            os.unlink(self.fault_file)
        graceful = self.error is None and self.channel is not None
        if self.error is None:
            self.error = "this tensor-parallel engine was shut down"
        if graceful:
            try:
                self.channel.send("shutdown")
            except Exception:
                graceful = False
        for p in self.procs:
            if p.pid is None:
                continue
            p.join(timeout=10 if graceful else 0.5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        try:
            process_group.leave()
        except Exception:  # a group whose peers are gone may not tear down cleanly; nothing is left to do
            pass
        torch.set_num_threads(self._saved_threads)


def _set_threads(n: int) -> int:
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    return saved

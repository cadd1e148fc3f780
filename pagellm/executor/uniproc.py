"""One process, one model runner: each operation runs on it directly."""
from __future__ import annotations

from typing import Any

from pagellm.executor.base import Executor
from pagellm.worker.model_runner import ModelRunner


class UniProcExecutor(Executor):
    def __init__(self, runner: ModelRunner) -> None:
        self.driver = runner

    def collective_rpc(self, method: str, args: tuple = (), local_args: tuple | None = None) -> list[Any]:
        return [getattr(self.driver, method)(*(args if local_args is None else local_args))]

    def shutdown(self) -> None:
        pass  # nothing outlives the runner

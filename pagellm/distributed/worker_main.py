"""`python -m pagellm.distributed.worker_main`: a worker rank started by torchrun.

Rank 0 runs the engine (`pagellm serve --tensor-parallel-size N ...`, or `LLM(...)` in a
script); every other rank runs this, with the same torchrun rendezvous. It accepts (and
ignores) the engine's other flags, so every machine can run the same command line;
`--model` is this machine's path to the model, when it is not where rank 0 has it.
`pagellm serve/generate/chat` run this themselves on ranks other than 0.
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from pagellm import envs


def is_torchrun_worker() -> bool:
    env = envs.torchrun_env()
    return env is not None and env["world_size"] > 1 and env["rank"] != 0


def run_worker(device: str = "auto", model: str | None = None) -> int:
    """Serve rank 0 until it shuts the group down; the process's exit status."""
    import torch

    from pagellm.distributed.worker import run_from_env

    device_type = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device.split(":")[0]
    run_from_env(device_type, model)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pagellm.distributed.worker_main",
                                description="A worker rank of a tensor-parallel pagellm engine, under torchrun.")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (the same kind as rank 0's)")
    p.add_argument("--model", default=None, help="this machine's path to the model (default: rank 0's path)")
    args, _ = p.parse_known_args(argv)
    return run_worker(args.device, args.model)


if __name__ == "__main__":
    sys.exit(main())

"""Which attention backend a model runner gets on a device."""
from __future__ import annotations


import torch

from pagellm import envs
from pagellm.attention.backend import AttentionBackend
from pagellm.attention.torch_backend import TorchAttentionBackend

BACKENDS = ("auto", "torch", "triton")


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # ImportError, or a broken install that fails while loading its driver
        return False
    return True


def select_backend(device: torch.device, name: str = "auto", batch_invariant: bool = False) -> AttentionBackend:
    """"auto": Triton on a CUDA device when Triton imports, torch otherwise; "torch"/"triton" insist.
    `batch_invariant`: the CPU backend in its batch-invariant mode (CPU only, so far).

    "triton" on a CPU works only under Triton's interpreter (TRITON_INTERPRET=1, set before
    Triton is imported): slow, for tests.
    """
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {name!r}")
    device = torch.device(device)
    if batch_invariant:
        if device.type != "cpu" or name == "triton":
            raise ValueError(f"batch-invariant mode runs on the CPU only so far (the Triton kernels' sums still "
                             f"depend on the batch); the device is {device}")
        return TorchAttentionBackend(batch_invariant=True)
    if name == "torch" or (name == "auto" and not (device.type == "cuda" and triton_available())):
        return TorchAttentionBackend()
    if not triton_available():
        raise ValueError("attention backend 'triton' was asked for but the triton package does not import "
                         "(pip install 'pagellm[gpu]')")
    if device.type != "cuda" and not envs.triton_interpreting():
        raise ValueError(f"attention backend 'triton' needs a CUDA device, got {device} "
                         "(or set TRITON_INTERPRET=1 before importing triton, for tests)")
    from pagellm.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()

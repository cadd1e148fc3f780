"""The kernels compile for sm_90 (H100/H200) with the GPU compiler, even on a machine with no GPU."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import triton  # noqa: E402,F401  (a test dependency on Linux: missing, these tests must fail)


def compile_for_hopper(*args: str) -> str:
    """compile_for_hopper.py's output, run without the interpreter (its kernels compile for sm_90)."""
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError:
        pytest.skip("this triton has no ahead-of-time compile API")
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("compile_for_hopper.py")), *args], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_each_kernel_compiles_for_hopper():
    """The first case of each kernel in bf16 and fp32: store, decode, prefill, combine, the two latent
    kernels, the GGUF product (the 8-bit caches' cases are the store's and decode's, in bf16)."""
    out = compile_for_hopper("--each-kernel")
    assert out.count("ok ") == 14, out
    assert "ok bf16 store:" in out and "ok fp32 gguf matmul" in out, out


@pytest.mark.slow
def test_kernels_compile_for_hopper():
    # 36 attention kernels, 9 more for 8-bit KV caches, 6 latent attention kernels, 10 GGUF products
    assert compile_for_hopper().count("ok ") == 61

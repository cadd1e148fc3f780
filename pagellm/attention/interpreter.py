"""Running the Triton kernels on a machine with no GPU, through Triton's interpreter.

For tests and CPU smoke runs only: the interpreter executes every program of a grid one after
another in NumPy, so it is correct but slow. It must be switched on before any kernel is
defined, that is before `pagellm.attention.triton_kernels` is imported.
"""
from __future__ import annotations

import os
import sys

import torch


def use_interpreter_without_gpu() -> bool:
    """Switch on TRITON_INTERPRET=1 when there is no CUDA device; True if kernels will be interpreted."""
    if torch.cuda.is_available():
        return False
    # triton.language's own helpers (tl.cdiv, ...) are jitted when it is imported, compiled or
    # interpreted as TRITON_INTERPRET then says: imported before, they fail inside interpreted kernels.
    early = [m for m in ("pagellm.attention.triton_kernels", "triton.language") if m in sys.modules]
    if early and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(f"{early[0]} was imported before TRITON_INTERPRET=1 was set; "
                           "switch the interpreter on first, or run in a fresh process")
    os.environ["TRITON_INTERPRET"] = "1"
    _fix_scalar_index()
    return True


def _fix_scalar_index() -> None:
    """Triton 3.6's interpreter keeps scalars as 1-element arrays and makes loop bounds of them
    with int(array), which NumPy >= 2.4 refuses ('only 0-dimensional arrays can be converted to
    Python scalars'). Fixed upstream after 3.6 (triton-lang/triton#9171); until then, read the
    one element explicitly. Touches only the interpreter, never compiled kernels."""
    try:
        from triton.runtime import interpreter
    except Exception:
        return
    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "_pagellm_scalar_index", False):
        return

    def patched(tensor, scope) -> None:
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._pagellm_scalar_index = True
    interpreter._patch_lang_tensor = patched

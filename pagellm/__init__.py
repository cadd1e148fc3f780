"""pagellm: an LLM serving engine built on PagedAttention.

Names are imported on first use, so `import pagellm.core...` (pure bookkeeping) does
not pull in torch or the model code.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from pagellm.version import __version__

_EXPORTS = {
    "LLM": "pagellm.entrypoints.llm",
    "LLMEngine": "pagellm.engine.llm_engine",
    "EngineConfig": "pagellm.config",
    "SamplingParams": "pagellm.sampling_params",
    "StructuredOutputsParams": "pagellm.sampling_params",
    "PoolingParams": "pagellm.pooling_params",
    "BeamSearchParams": "pagellm.beam_search",
    "BeamSearchOutput": "pagellm.beam_search",
    "RequestOutput": "pagellm.outputs",
    "CompletionOutput": "pagellm.outputs",
    "EmbeddingRequestOutput": "pagellm.outputs",
}
__all__ = ["__version__", *_EXPORTS]

if TYPE_CHECKING:
    from pagellm.beam_search import BeamSearchOutput, BeamSearchParams
    from pagellm.config import EngineConfig
    from pagellm.engine.llm_engine import LLMEngine
    from pagellm.entrypoints.llm import LLM
    from pagellm.outputs import CompletionOutput, EmbeddingRequestOutput, RequestOutput
    from pagellm.pooling_params import PoolingParams
    from pagellm.sampling_params import SamplingParams, StructuredOutputsParams


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pagellm' has no attribute {name!r}")

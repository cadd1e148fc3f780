"""Errors that say the engine itself cannot step any more, as opposed to one request failing.

The engine isolates any other failure to the request that caused it (see
`LLMEngine.step`); one of these ends every request, since no step can run after it.
"""
from __future__ import annotations


class EngineFatalError(RuntimeError):
    """The engine's machinery is broken (a tensor-parallel rank died, say); no retry can help."""

"""Grammar backends for structured outputs: the libraries that compile a constraint and mask the
vocabulary token by token. Each backend is one module that registers itself in `BACKENDS`:

- `xgrammar`: fast masks, the default; it drops a few JSON-schema keywords silently;
- `guidance` (llguidance): refuses what it does not enforce instead of dropping it.

`auto` (the default) picks per constraint (`choose_backend`): xgrammar unless the JSON schema uses
a keyword xgrammar does not enforce and guidance does; a keyword neither enforces is refused by name.
"""
from __future__ import annotations

import json
from dataclasses import replace

from pagellm.engine.grammars import guidance_backend, xgrammar_backend  # noqa: F401  (they register)
# The interface, re-exported for the engine's structured outputs.
from pagellm.engine.grammars.base import BACKENDS, GrammarBackend, Matcher  # noqa: F401
from pagellm.engine.grammars.json_schema import normalize_schema, unenforced_keywords
from pagellm.sampling_params import StructuredOutputsParams

BACKEND_NAMES = ("auto", "xgrammar", "guidance")


def choose_backend(spec: StructuredOutputsParams, requested: str, available: dict[str, frozenset[str]]) -> str:
    """The backend that enforces `spec`: `requested` if it is one, else (auto) the first of `available`
    (name -> its unenforced keywords, in order of preference) that enforces every keyword the JSON
    schema uses. ValueError naming the keyword when the requested backend, or every backend, would
    drop it."""
    used = unenforced_keywords(spec.json, frozenset().union(*available.values())) if spec.kind == "json" else set()
    if requested != "auto":
        dropped = sorted(used & available[requested])
        if dropped:
            others = [n for n, u in available.items() if n != requested and not (used & u)]
            hint = f"; backend {others[0]!r} enforces it" if others else ""
            raise ValueError(f"structured_outputs.json uses {', '.join(map(repr, dropped))}, which the {requested} "
                             f"backend does not enforce{hint}")
        return requested
    for name, unenforced in available.items():
        if not used & unenforced:
            return name
    every = sorted(set.intersection(*(used & u for u in available.values())))
    raise ValueError(f"structured_outputs.json uses {', '.join(map(repr, every))}, which no grammar backend here "
                     f"enforces ({', '.join(available)})")


def prepare(spec: StructuredOutputsParams) -> StructuredOutputsParams:
    """`spec` with its JSON schema normalised (json_schema.normalize_schema), as every backend compiles it."""
    if spec.kind != "json":
        return spec
    normalized = normalize_schema(json.loads(spec.json))
    return replace(spec, json=json.dumps(normalized))


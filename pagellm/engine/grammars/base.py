"""The interface every grammar backend implements and the table they register in; a backend module
imports this, and the package's __init__ imports the backends, so neither imports the other back."""
from __future__ import annotations

from typing import Any, Callable, Protocol

from pagellm.sampling_params import StructuredOutputsParams


class Matcher(Protocol):
    """One sequence's position in its grammar."""

    def accept(self, token_id: int) -> bool:
        """Advance past `token_id`; False if the grammar does not allow it."""

    def fork(self) -> Matcher:
        """An independent copy at the same position (n > 1, beams)."""

    @property
    def is_terminated(self) -> bool:
        """The output is complete and the stop token was accepted."""


class GrammarBackend(Protocol):
    name: str
    # JSON-schema keywords the backend compiles but does not enforce (they would be dropped).
    unenforced: frozenset[str]

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar; ValueError naming the field when the backend refuses it."""

    def matcher(self, compiled: Any) -> Matcher:
        """A fresh matcher at the grammar's start."""

    def fill(self, matchers: list[Matcher], bitmask: Any, rows: list[int]) -> None:
        """Write each matcher's allowed tokens into its row of the int32 `bitmask` [rows, ceil(V / 32)]."""


# name -> factory(tokenizer, vocab_size, eos_token_ids); filled by the backend modules, which the
# package's __init__ imports.
BACKENDS: dict[str, Callable[..., GrammarBackend]] = {}


def register(name: str) -> Callable:
    def add(factory: Callable[..., GrammarBackend]) -> Callable[..., GrammarBackend]:
        BACKENDS[name] = factory
        return factory
    return add

"""The interface every proposer implements."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence


class Proposer(ABC):
    @abstractmethod
    def propose(self, contexts: Sequence[Sequence[int]], num_tokens: Sequence[int]) -> list[list[int]]:
        """For each sequence, up to `num_tokens[i]` tokens to follow `contexts[i]` (its prompt and
        output so far), or [] when it has no guess."""

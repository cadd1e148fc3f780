"""Structured outputs: grammars compiled by a grammar backend (engine/grammars/), one matcher per
sequence, and the step's token bitmask.

Three jobs, each in one place:
- `GrammarCompiler.compile` normalises a `StructuredOutputsParams`, picks its backend (the
  request's, else the engine's; "auto" per constraint) and compiles it, or raises a ValueError
  that says what is wrong with the schema, regex or grammar or which keyword no backend enforces.
  Compiled grammars are cached by their spec, so the server compiles off the engine loop (in a
  thread, before the request is handed over) and the engine's own call is a cache hit.
- `Grammar` is a sequence's parser state. It lives on the `Request`, advances by the tokens
  the sequence appends, is forked with the sequence (n > 1) and needs nothing on preemption:
  a recomputed sequence keeps its tokens, so its state stays valid.
- `attach_bitmasks` fills the bitmask of every sampling row with a grammar, one call per backend,
  and hands each row to the sampler through the step plan; the sampler masks the logits in place
  (`worker/sampler.py`), so the model runner never imports a grammar library.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from pagellm.engine import grammars
from pagellm.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from pagellm.core.request import Request
    from pagellm.core.step_plan import StepPlan
    from pagellm.loader.tokenizer import Tokenizer

# Compiled grammars kept per engine: a JSON schema of an agent's tools compiles in milliseconds,
# but a large one takes seconds, and clients send the same few again and again.
CACHE_SIZE = 256
# The Python package each backend needs.
PACKAGES = {"xgrammar": "xgrammar", "guidance": "llguidance"}


def backend_available(name: str) -> bool:
    try:
        __import__(PACKAGES[name])
    except ImportError:
        return False
    return True


def xgrammar_available() -> bool:
    return backend_available("xgrammar")


class Grammar:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: grammars.Matcher, spec: StructuredOutputsParams, backend: str) -> None:
        self.matcher = matcher
        self.spec = spec
        self.backend = backend

    def accept(self, token_id: int) -> bool:
        """Advance past `token_id`; False if the grammar does not allow it."""
        return self.matcher.accept(token_id)

    def fork(self) -> Grammar:
        return Grammar(self.matcher.fork(), self.spec, self.backend)

    @property
    def is_terminated(self) -> bool:
        """The output is complete and the stop token was accepted: the sequence must end."""
        return self.matcher.is_terminated


class GrammarCompiler:
    """Compiles and caches grammars for one tokenizer and vocabulary (thread-safe). `backend`: the
    engine's default, "auto", "xgrammar" or "guidance"; backends are built on first use."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: frozenset[int],
                 backend: str = "auto", max_threads: int = 2) -> None:
        if backend != "auto" and not backend_available(backend):
            raise ValueError(f"the {backend} grammar backend needs the {PACKAGES[backend]} package: "
                             f"pip install {PACKAGES[backend]}")
        self.default_backend = backend
        self.vocab_size = vocab_size
        self._args = (tokenizer, vocab_size, eos_token_ids, max_threads)
        self._backends: dict[str, grammars.GrammarBackend] = {}
        self._cache: OrderedDict[StructuredOutputsParams, tuple[str, Any]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        # False lets every keyword through to the backend, as the library alone would (the corpus
        # bench measures what each one drops that way).
        self.screen_keywords = True

    def backend(self, name: str) -> grammars.GrammarBackend:
        with self._lock:
            if name not in self._backends:
                self._backends[name] = grammars.BACKENDS[name](*self._args)
            return self._backends[name]

    def choose(self, spec: StructuredOutputsParams) -> str:
        """The backend that compiles `spec` (grammars.choose_backend); ValueError naming a keyword no
        backend here enforces."""
        requested = spec.backend or self.default_backend
        if requested != "auto" and not backend_available(requested):
            raise ValueError(f"structured_outputs.backend {requested!r} needs the {PACKAGES[requested]} package, "
                             f"which is not installed here")
        available = {n: grammars.BACKENDS[n].unenforced if self.screen_keywords else frozenset()
                     for n in ("xgrammar", "guidance") if n == requested or backend_available(n)}
        return grammars.choose_backend(spec, requested, available)

    def compile(self, spec: StructuredOutputsParams) -> tuple[str, Any]:
        """(backend name, compiled grammar) of `spec`; ValueError naming the field when it is not valid."""
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                self.hits += 1
                return self._cache[spec]
        prepared = grammars.prepare(spec)
        name = self.choose(prepared)
        compiled = (name, self.backend(name).compile(prepared))
        with self._lock:
            self.misses += 1
            self._cache[spec] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def grammar(self, spec: StructuredOutputsParams) -> Grammar:
        """A fresh parser state for a new sequence."""
        name, compiled = self.compile(spec)
        return Grammar(self.backend(name).matcher(compiled), spec, name)

    def attach_bitmasks(self, plan: StepPlan, requests: dict[str, Request]) -> StepPlan:
        """The plan with a token bitmask on every sampling row whose sequence has a grammar."""
        rows = [(i, j) for i, s in enumerate(plan.seqs) for j, spec in enumerate(s.samplers)
                if requests[spec.request_id].grammar is not None]
        if not rows:
            return plan
        # Every bit set: a backend that fills no row leaves every token allowed (none does).
        bitmask = torch.full((len(rows), (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        by_backend: dict[str, tuple[list, list[int]]] = {}
        for row, (i, j) in enumerate(rows):
            grammar = requests[plan.seqs[i].samplers[j].request_id].grammar
            matchers, indices = by_backend.setdefault(grammar.backend, ([], []))
            matchers.append(grammar.matcher)
            indices.append(row)
        for name, (matchers, indices) in by_backend.items():
            self.backend(name).fill(matchers, bitmask, indices)
        seqs = list(plan.seqs)
        for row, (i, j) in enumerate(rows):
            samplers = list(seqs[i].samplers)
            samplers[j] = replace(samplers[j], token_bitmask=bitmask[row])
            seqs[i] = replace(seqs[i], samplers=samplers)
        return replace(plan, seqs=seqs)

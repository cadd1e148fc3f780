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
  a recomputed sequence keeps its tokens, so its state stays valid. With a reasoning section
  (a thinking model's reply), its `ReasoningGate` holds the grammar back until the reasoning
  ends: the grammar starts where the answer starts, as vLLM's `reasoning_ended` does.
- `attach_bitmasks` fills the bitmask of every sampling row with a grammar, one call per backend,
  and hands each row to the sampler through the step plan; the sampler masks the logits in place
  (`worker/sampler.py`), so the model runner never imports a grammar library.
"""
from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from pagellm.engine import grammars
from pagellm.sampling_params import ReasoningBudget, ReasoningSection, StructuredOutputsParams

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


class ReasoningGate:
    """Where a reply stands against its reasoning section, so that its grammar begins where the
    answer begins. Three states, read from the tokens accepted so far:
    - the lead (the prompt did not open the reasoning): the reply may open it with the start
      marker, or answer at once; its first token is either the marker's first or one the grammar
      allows, and once the marker is begun its rest is all that is allowed;
    - the reasoning: free text, until an end marker is written, or until the budget's forced close
      (the reasoning spent `budget.max_tokens` tokens, as ReasoningBudgetRule counts them) is done;
    - the answer: the grammar's."""

    def __init__(self, section: ReasoningSection, budget: ReasoningBudget | None) -> None:
        self.section = section
        self.budget = budget
        self.lead = 0 if section.start_token_ids else -1  # tokens of the start marker written; -1: past the lead
        self.thinking = not section.start_token_ids
        self.spent = 0  # reasoning tokens so far
        # With a budget, only the end its rule watches for: another spelling would leave the rule
        # forcing its close into an answer the grammar already holds.
        self.ends = (budget.end_token_ids,) if budget is not None else section.end_token_ids
        self.tail: list[int] = []  # the reasoning's last tokens, as long as the longest end marker
        self._keep = max(len(e) for e in self.ends)

    @property
    def answering(self) -> bool:
        return self.lead < 0 and not self.thinking

    def allowed_now(self) -> tuple[int | None, bool]:
        """(a token the mask must allow, whether the grammar's own mask applies beside it) while not
        answering: the start marker's next token, beside the grammar only before it is begun; in the
        reasoning (None, False): anything goes."""
        if self.lead >= 0:
            return self.section.start_token_ids[self.lead], self.lead == 0
        return None, False

    def accept(self, token_id: int) -> bool | None:
        """Advance past `token_id` when it belongs to the lead or the reasoning (True); None: it is
        the answer's, for the grammar."""
        if self.lead >= 0:
            start = self.section.start_token_ids
            if token_id != start[self.lead]:
                if self.lead > 0:
                    return False  # the mask allowed only the marker's next token
                self.lead = -1
                return None
            self.lead += 1
            if self.lead == len(start):
                self.lead, self.thinking = -1, True
            return True
        if not self.thinking:
            return None
        self.spent += 1
        budget = self.budget
        if budget is not None and self.spent > budget.max_tokens:
            # The close is being forced, whatever it spells; the answer starts after its last token.
            self.thinking = self.spent < budget.max_tokens + len(budget.close_token_ids)
            return True
        self.tail = (self.tail + [token_id])[-self._keep:]
        if any(self.tail[len(self.tail) - len(e):] == list(e) for e in self.ends if len(e) <= len(self.tail)):
            self.thinking = False
        return True

    def fork(self) -> ReasoningGate:
        twin = copy.copy(self)
        twin.tail = list(self.tail)
        return twin


class Grammar:
    """One sequence's position in its grammar, and (`gate`) in the reasoning before it."""

    def __init__(self, matcher: grammars.Matcher, spec: StructuredOutputsParams, backend: str,
                 gate: ReasoningGate | None = None) -> None:
        self.matcher = matcher
        self.spec = spec
        self.backend = backend
        self.gate = gate
        self.num_accepted = 0  # tokens accepted so far: the sequence's output tokens
        # The output's length when the grammar was complete (its stop token accepted), None before:
        # a verification may append tokens past it in one step, which the sequence must not keep.
        self.end: int | None = None

    def accept(self, token_id: int) -> bool:
        """Advance past `token_id`; False if the grammar does not allow it."""
        if not self._accept(token_id):
            return False
        self.num_accepted += 1
        if self.end is None and self.is_terminated:
            self.end = self.num_accepted
        return True

    def _accept(self, token_id: int) -> bool:
        if self.gate is not None and not self.gate.answering:
            taken = self.gate.accept(token_id)
            if taken is not None:
                return taken
        return self.matcher.accept(token_id)

    def fork(self) -> Grammar:
        twin = Grammar(self.matcher.fork(), self.spec, self.backend, self.gate and self.gate.fork())
        twin.num_accepted, twin.end = self.num_accepted, self.end
        return twin

    def along(self, token_ids: list[int]) -> list[Grammar | None]:
        """The states after each prefix of `token_ids` (proposed tokens), this one first: entry j is
        the grammar after token_ids[:j], a fork (this one is not moved); None from a token the
        grammar refuses on, and after the token that completes it: no token is expected there,
        and a verification keeps none."""
        states: list[Grammar | None] = [self]
        for token in token_ids:
            last = states[-1]
            nxt = None if last is None else last.fork()
            states.append(nxt if nxt is not None and nxt.accept(token) and nxt.end is None else None)
        return states

    @property
    def masks(self) -> bool:
        """Whether the next token is masked at all (not in the free reasoning)."""
        return self.gate is None or self.gate.answering or self.gate.allowed_now()[0] is not None

    def adjust(self, row: torch.Tensor) -> None:
        """The bitmask `row`, filled from the matcher, as the gate allows it now."""
        if self.gate is None or self.gate.answering:
            return
        token, with_grammar = self.gate.allowed_now()
        if not with_grammar:
            row.zero_()
        row[token // 32] |= _bit(token % 32)

    @property
    def is_terminated(self) -> bool:
        """The output is complete and the stop token was accepted: the sequence must end."""
        return (self.gate is None or self.gate.answering) and self.matcher.is_terminated


def _bit(i: int) -> int:
    """Bit i of an int32 word, as the signed value torch stores (bit 31 is the sign)."""
    return (1 << i) - (1 << 32 if i == 31 else 0)


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

    def grammar(self, spec: StructuredOutputsParams, reasoning: ReasoningSection | None = None,
                budget: ReasoningBudget | None = None) -> Grammar:
        """A fresh parser state for a new sequence; with `reasoning`, the grammar starts after it
        (`budget`: the reasoning budget that may close it)."""
        name, compiled = self.compile(spec)
        gate = ReasoningGate(reasoning, budget) if reasoning is not None else None
        return Grammar(self.backend(name).matcher(compiled), spec, name, gate)

    def attach_bitmasks(self, plan: StepPlan, requests: dict[str, Request]) -> StepPlan:
        """The plan with a token bitmask on every sampling row whose sequence has a grammar. A
        sequence verifying k proposed tokens gets k + 1 rows, [k + 1, ceil(V / 32)]: row j masks the
        token after proposals 0 .. j - 1, from the grammar's state after them, so a proposal the
        grammar refuses is never drawn at its position and ends the accepted run there (rows past
        it, or past the grammar's end, allow everything: the verification keeps nothing from them)."""
        # (seq, sampler, the grammar states of its rows); the states of a plain row: [its grammar]
        entries = []
        for i, s in enumerate(plan.seqs):
            for j, spec in enumerate(s.samplers):
                grammar = requests[spec.request_id].grammar
                if grammar is None:
                    continue
                states = grammar.along(list(s.draft_token_ids)) if s.draft_token_ids and j == 0 else [grammar]
                if any(g is not None and g.masks for g in states):
                    entries.append((i, j, states))
        if not entries:
            return plan
        # Every bit set: a row no backend fills (a state past a refused token, in free reasoning)
        # allows every token.
        bitmask = torch.full((sum(len(states) for _, _, states in entries), (self.vocab_size + 31) // 32), -1,
                             dtype=torch.int32)
        by_backend: dict[str, tuple[list, list[int]]] = {}
        gated: list[tuple[Grammar, int]] = []
        row = 0
        for _, _, states in entries:
            for g in states:
                if g is not None and g.masks:
                    matchers, indices = by_backend.setdefault(g.backend, ([], []))
                    matchers.append(g.matcher)
                    indices.append(row)
                    if g.gate is not None:
                        gated.append((g, row))
                row += 1
        for name, (matchers, indices) in by_backend.items():
            self.backend(name).fill(matchers, bitmask, indices)
        for g, r in gated:
            g.adjust(bitmask[r])
        seqs = list(plan.seqs)
        row = 0
        for i, j, states in entries:
            rows = bitmask[row] if len(states) == 1 else bitmask[row:row + len(states)]
            row += len(states)
            samplers = list(seqs[i].samplers)
            samplers[j] = replace(samplers[j], token_bitmask=rows)
            seqs[i] = replace(seqs[i], samplers=samplers)
        return replace(plan, seqs=seqs)

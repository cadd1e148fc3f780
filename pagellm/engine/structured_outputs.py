"""Structured outputs: grammars compiled by xgrammar, one matcher per sequence, and the
step's token bitmask.

Three jobs, each in one place:
- `GrammarCompiler.compile` turns a `StructuredOutputsParams` into a compiled grammar, or a
  ValueError that says what is wrong with the schema, regex or grammar. Compiled grammars
  are cached by their spec, so the server compiles off the engine loop (in a thread, before
  the request is handed over) and the engine's own call is a cache hit.
- `Grammar` is a sequence's parser state. It lives on the `Request`, advances by the tokens
  the sequence appends, is forked with the sequence (n > 1) and needs nothing on preemption:
  a recomputed sequence keeps its tokens, so its state stays valid.
- `attach_bitmasks` fills the bitmask of every sampling row with a grammar in one call to
  xgrammar and hands each row to the sampler through the step plan; the sampler masks the
  logits in place (`worker/sampler.py`), so the model runner never imports xgrammar.
"""
from __future__ import annotations

import re
import threading
from collections import OrderedDict
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from pagellm.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from pagellm.core.request import Request
    from pagellm.core.step_plan import StepPlan
    from pagellm.loader.tokenizer import Tokenizer

# Compiled grammars kept per engine: a JSON schema of an agent's tools compiles in milliseconds,
# but a large one takes seconds, and clients send the same few again and again.
CACHE_SIZE = 256
# xgrammar <= 0.2.9 writes one character of a string with minLength/maxLength as [^"\\\r\n], which
# admits raw control characters: invalid JSON, that strict parsers refuse (mlc-ai/xgrammar#800).
# Such rules are rewritten to exclude U+0000-U+001F as JSON does. (Escapes stay unreachable in
# those strings, as in xgrammar: an alternative with escapes makes every mask inside them ~30 ms.)
_BOUNDED_STRING_CHAR = re.compile(r'^(\S+_characters) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.M)
_JSON_CHAR = r'\1 ::= (([^\\0-\\x1f\\"\\\\]))'
# xgrammar prefixes its errors with a timestamp and its C++ source location.
_XGRAMMAR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*(Check failed: \(.*?\) is false:\s*)?")


def xgrammar_available() -> bool:
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return False
    return True


class Grammar:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: Any, spec: StructuredOutputsParams) -> None:
        self.matcher = matcher
        self.spec = spec

    def accept(self, token_id: int) -> bool:
        """Advance past `token_id`; False (state unchanged) if the grammar does not allow it."""
        return bool(self.matcher.accept_token(token_id))

    def fork(self) -> Grammar:
        return Grammar(self.matcher.fork(), self.spec)

    @property
    def is_terminated(self) -> bool:
        """The output is complete and the stop token was accepted: the sequence must end."""
        return bool(self.matcher.is_terminated())


class GrammarCompiler:
    """Compiles and caches grammars for one tokenizer and vocabulary (thread-safe)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: frozenset[int],
                 max_threads: int = 2) -> None:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        self._xgr = xgr
        # xgrammar reads the vocabulary's encoding (byte-level, byte-fallback) from a transformers tokenizer.
        hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=sorted(eos_token_ids))
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)
        self._batch = xgr.BatchGrammarMatcher(max_threads=max_threads)
        self._cache: OrderedDict[StructuredOutputsParams, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar of `spec`; ValueError naming the field when it is not valid."""
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                self.hits += 1
                return self._cache[spec]
        compiled = self._compile(spec)
        with self._lock:
            self.misses += 1
            self._cache[spec] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutputsParams) -> Any:
        c, kind = self._compiler, spec.kind
        any_ws = not spec.disable_any_whitespace
        try:
            if kind == "json":
                grammar = self._xgr.Grammar.from_json_schema(spec.json, any_whitespace=any_ws, strict_mode=True)
                return c.compile_grammar(_BOUNDED_STRING_CHAR.sub(_JSON_CHAR, str(grammar)))
            if kind == "json_object":
                return c.compile_json_schema('{"type": "object"}', any_whitespace=any_ws)
            if kind == "regex":
                return c.compile_regex(spec.regex)
            if kind == "choice":
                return c.compile_grammar(choice_grammar(spec.choice))
            return c.compile_grammar(spec.grammar)
        except (RuntimeError, ValueError) as e:
            reason = _XGRAMMAR_PREFIX.sub("", str(e).strip()).strip()
            raise ValueError(f"structured_outputs.{kind} is not valid: {reason}") from None

    def grammar(self, spec: StructuredOutputsParams) -> Grammar:
        """A fresh parser state for a new sequence."""
        return Grammar(self._xgr.GrammarMatcher(self.compile(spec)), spec)

    def attach_bitmasks(self, plan: StepPlan, requests: dict[str, Request]) -> StepPlan:
        """The plan with a token bitmask on every sampling row whose sequence has a grammar."""
        rows = [(i, j) for i, s in enumerate(plan.seqs) for j, spec in enumerate(s.samplers)
                if requests[spec.request_id].grammar is not None]
        if not rows:
            return plan
        bitmask = self._xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        matchers = [requests[plan.seqs[i].samplers[j].request_id].grammar.matcher for i, j in rows]
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask)
        seqs = list(plan.seqs)
        for row, (i, j) in enumerate(rows):
            samplers = list(seqs[i].samplers)
            samplers[j] = replace(samplers[j], token_bitmask=bitmask[row])
            seqs[i] = replace(seqs[i], samplers=samplers)
        return replace(plan, seqs=seqs)


def choice_grammar(choices: tuple[str, ...] | list[str]) -> str:
    """An EBNF grammar whose sentences are exactly `choices`."""
    def literal(text: str) -> str:
        escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r") \
            .replace("\t", "\\t")
        return f'"{escaped}"'
    return "root ::= " + " | ".join(literal(c) for c in choices)

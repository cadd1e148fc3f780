"""The xgrammar backend: fast token masks over a compiled grammar."""
from __future__ import annotations

import re
from typing import Any

from pagellm.engine.grammars.base import register
from pagellm.sampling_params import StructuredOutputsParams

# xgrammar <= 0.2.9 writes one character of a string with minLength/maxLength as [^"\\\r\n], which
# admits raw control characters: invalid JSON, that strict parsers refuse (mlc-ai/xgrammar#800).
# Such rules are rewritten to exclude U+0000-U+001F as JSON does. (Escapes stay unreachable in
# those strings, as in xgrammar: an alternative with escapes makes every mask inside them ~30 ms.)
_BOUNDED_STRING_CHAR = re.compile(r'^(\S+_characters) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.M)
_JSON_CHAR = r'\1 ::= (([^\\0-\\x1f\\"\\\\]))'
# xgrammar prefixes its errors with a timestamp and its C++ source location.
_XGRAMMAR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*(Check failed: \(.*?\) is false:\s*)?")
# Rows of a step's bitmask from which xgrammar's thread pool fills them (fill).
BATCH_FILL_FROM = 64
# What xgrammar compiles without enforcing (json_schema.features names them). `pagellm bench grammar
# --corpus` finds outputs that break the dropped ones, and xgrammar warns of the combinations.
UNENFORCED = frozenset({"uniqueItems", "not", "if", "then", "else", "dependentRequired", "dependentSchemas",
                        "contains", "minContains", "maxContains", "unevaluatedProperties", "propertyNames",
                        # approximated as anyOf: an output may match several branches
                        "oneOf", "multipleOf on numbers", "pattern with minLength/maxLength",
                        "format with minLength/maxLength"})


class XGrammarMatcher:
    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def accept(self, token_id: int) -> bool:
        return bool(self.matcher.accept_token(token_id))

    def fork(self) -> XGrammarMatcher:
        return XGrammarMatcher(self.matcher.fork())

    @property
    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())


@register("xgrammar")
class XGrammarBackend:
    name = "xgrammar"
    unenforced = UNENFORCED

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int], max_threads: int = 2) -> None:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        self._xgr = xgr
        # xgrammar reads the vocabulary's encoding (byte-level, byte-fallback) from a transformers tokenizer.
        hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=sorted(eos_token_ids))
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)
        self._batch = xgr.BatchGrammarMatcher(max_threads=max_threads)

    def compile(self, spec: StructuredOutputsParams) -> Any:
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

    def matcher(self, compiled: Any) -> XGrammarMatcher:
        return XGrammarMatcher(self._xgr.GrammarMatcher(compiled))

    def fill(self, matchers: list[XGrammarMatcher], bitmask: Any, rows: list[int]) -> None:
        # In the engine's step, BatchGrammarMatcher's threads wait on the cores torch's threads
        # still hold after the forward pass: 0.85-1.15 ms a call for 1 to 15 rows, where filling
        # them here took 0.02-0.14 ms (the bundled model under a JSON schema, one stream 120 ->
        # 132-138 tok/s, 16 streams 413 -> 439). Its threads are kept for steps of many rows.
        if len(matchers) < BATCH_FILL_FROM:
            for m, row in zip(matchers, rows):
                m.matcher.fill_next_token_bitmask(bitmask, row)
            return
        self._batch.batch_fill_next_token_bitmask([m.matcher for m in matchers], bitmask, indices=rows)


def choice_grammar(choices: tuple[str, ...] | list[str]) -> str:
    """An EBNF grammar whose sentences are exactly `choices`."""
    def literal(text: str) -> str:
        escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r") \
            .replace("\t", "\\t")
        return f'"{escaped}"'
    return "root ::= " + " | ".join(literal(c) for c in choices)

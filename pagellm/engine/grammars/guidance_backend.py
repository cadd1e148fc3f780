"""The guidance backend (llguidance): refuses a JSON-schema keyword it does not enforce rather
than compiling the schema without it."""
from __future__ import annotations

import json
from typing import Any

from pagellm.engine.grammars.base import register
from pagellm.engine.grammars.json_schema import closed_by_default
from pagellm.sampling_params import StructuredOutputsParams

# The keywords llguidance refuses ("Unimplemented keys"); choose_backend names them before it is asked.
# (An overlapping oneOf it refuses itself, naming oneOf.)
UNENFORCED = frozenset({"uniqueItems", "not", "if", "then", "else", "dependentRequired", "dependentSchemas",
                        "contains", "minContains", "maxContains", "unevaluatedProperties", "propertyNames"})


class GuidanceMatcher:
    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def accept(self, token_id: int) -> bool:
        return bool(self.matcher.consume_token(token_id)) and not self.matcher.is_error()

    def fork(self) -> GuidanceMatcher:
        return GuidanceMatcher(self.matcher.deep_copy())

    @property
    def is_terminated(self) -> bool:
        return bool(self.matcher.is_stopped())


@register("guidance")
class GuidanceBackend:
    name = "guidance"
    unenforced = UNENFORCED

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int], max_threads: int = 2) -> None:
        import llguidance
        import llguidance.hf
        from transformers import PreTrainedTokenizerFast

        self._llg = llguidance
        hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
        # llguidance ends a grammar with one stop token: the tokenizer's own where it names one.
        eos = tokenizer.eos_token_id if tokenizer.eos_token_id in eos_token_ids else min(eos_token_ids)
        self._tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size, eos_token=eos)
        self._executor = llguidance.LLExecutor(num_threads=max_threads)

    def compile(self, spec: StructuredOutputsParams) -> str:
        llg, kind = self._llg, spec.kind
        try:
            if kind in ("json", "json_object"):
                schema = json.dumps(closed_by_default(json.loads(spec.json))) if kind == "json" else '{"type": "object"}'
                grammar = llg.LLMatcher.grammar_from_json_schema(
                    schema, defaults={"whitespace_flexible": not spec.disable_any_whitespace})
            elif kind == "regex":
                grammar = llg.LLMatcher.grammar_from_regex(spec.regex)
            elif kind == "choice":
                grammar = llg.grammar_from("choice", json.dumps(list(spec.choice)))
            else:
                grammar = llg.grammar_from("gbnf", spec.grammar)
        except (RuntimeError, ValueError) as e:
            raise ValueError(f"structured_outputs.{kind} is not valid: {e}") from None
        failed, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, self._tokenizer)
        if failed:
            raise ValueError(f"structured_outputs.{kind} is not valid: {'; '.join(messages)}")
        return grammar

    def matcher(self, compiled: str) -> GuidanceMatcher:
        return GuidanceMatcher(self._llg.LLMatcher(self._tokenizer, compiled))

    def fill(self, matchers: list[GuidanceMatcher], bitmask: Any, rows: list[int]) -> None:
        import llguidance.torch

        llguidance.torch.fill_next_token_bitmask_par(self._executor, [(m.matcher, r) for m, r in zip(matchers, rows)],
                                                     bitmask)

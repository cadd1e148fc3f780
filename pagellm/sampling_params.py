"""Per-request sampling options, validated where they are built."""
from __future__ import annotations

import json as _json
import math
from dataclasses import dataclass, field
from typing import Any

# Below this a temperature means greedy: dividing logits by it would overflow.
_GREEDY_EPS = 1e-5
# The sampler computes in float32: a float field must stay finite there (1e39 is inf in float32).
FLOAT32_MAX = 3.4028234663852886e38  # numpy.finfo(numpy.float32).max
INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1
# A repetition penalty divides positive logits and multiplies negative ones: outside this range it
# overflows float32 logits or stops being a penalty worth the name (1e9 erases every seen token).
REPETITION_PENALTY_RANGE = (0.01, 100.0)
# Structured outputs' grammar backends (engine/grammars/), as vLLM names them.
GRAMMAR_BACKENDS = (None, "auto", "xgrammar", "guidance")


# The fields the OpenAI endpoints take under the same name and meaning (OpenAI's own and vLLM's
# extras): the server's request models and its conversion to SamplingParams are built from this
# list, so a new sampling field is one field below and one name here. (n, best_of, max_tokens,
# logprobs and logit_bias have shapes of their own in the API and are mapped by hand.)
OPENAI_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens",
                 "include_stop_str_in_output", "skip_special_tokens", "allowed_token_ids")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the generated text, enforced token by token by a grammar (xgrammar);
    named as in vLLM. Exactly one of json, regex, choice, grammar, json_object is set."""

    json: str | dict | None = None     # a JSON schema (as a dict or its JSON text)
    regex: str | None = None
    choice: list[str] | None = None    # the output is exactly one of these strings
    grammar: str | None = None         # an EBNF grammar (GBNF, as llama.cpp's) with a `root` rule
    json_object: bool = False          # any JSON object
    # The JSON forms allow any whitespace between tokens by default; True allows none (compact JSON).
    disable_any_whitespace: bool = False
    # The grammar backend for this request (engine/grammars/): None takes the engine's
    # structured_outputs_config; "auto" picks per constraint; "xgrammar" or "guidance" pins one.
    backend: str | None = None

    def __post_init__(self) -> None:
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object:
            kinds.append("json_object")
        _need(len(kinds) == 1, "structured_outputs", self.describe(),
              "exactly one of json, regex, choice, grammar and json_object")
        if self.json is not None:
            _need(isinstance(self.json, (str, dict)), "structured_outputs.json", self.json,
                  "a JSON schema (an object, or its JSON text)")
            # Frozen and hashable: the schema is kept as JSON text, properties in their order (outputs follow it).
            if isinstance(self.json, dict):
                object.__setattr__(self, "json", _json.dumps(self.json))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None:
                _need(isinstance(value, str) and value != "", f"structured_outputs.{name}", value, "a non-empty string")
                check_text(f"structured_outputs.{name}", value)
        if self.choice is not None:
            _need(isinstance(self.choice, (list, tuple)) and bool(self.choice)
                  and all(isinstance(c, str) and c for c in self.choice),
                  "structured_outputs.choice", self.choice, "a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        _need(self.backend in GRAMMAR_BACKENDS, "structured_outputs.backend", self.backend,
              f"one of {', '.join(b for b in GRAMMAR_BACKENDS if b)}")
        for name in ("json_object", "disable_any_whitespace"):
            _need(isinstance(getattr(self, name), bool), f"structured_outputs.{name}", getattr(self, name),
                  "true or false")

    @property
    def kind(self) -> str:
        return next(k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None) \
            if not self.json_object else "json_object"

    def describe(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v not in (None, False) and k != "backend"}


@dataclass(frozen=True)
class ReasoningBudget:
    """The most tokens a reply may spend inside its reasoning; once spent, `close_token_ids` (the
    reasoning's end as the chat template writes it, e.g. "\n</think>\n\n") are forced and the
    answer follows. Built by the server from its reasoning parser (`thinking_token_budget`)."""

    max_tokens: int
    close_token_ids: tuple[int, ...]
    # The marker that ends the reasoning by itself: written before the budget is spent, nothing is forced.
    end_token_ids: tuple[int, ...]
    # The marker that opens it at the start of the reply; empty: the prompt already opened it.
    start_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _integer("thinking_token_budget", self.max_tokens, 0)
        for name in ("close_token_ids", "end_token_ids", "start_token_ids"):
            ids = tuple(getattr(self, name))
            _need(all(_is_token_id(t) for t in ids) and (bool(ids) or name == "start_token_ids"),
                  f"reasoning_budget.{name}", ids, "a non-empty list of token ids >= 0")
            object.__setattr__(self, name, ids)


@dataclass(frozen=True)
class ReasoningSection:
    """How a reply's reasoning is marked, in token ids, so that a structured output's grammar
    starts where the answer starts (the reasoning is free text). Built by the server from its
    reasoning parser; the grammar applies at once when the prompt already closed the reasoning
    (thinking switched off), and the server then sends none."""

    # Each marker that ends the reasoning (a parser may know several spellings).
    end_token_ids: tuple[tuple[int, ...], ...]
    # The marker that opens it at the start of the reply; empty: the prompt already opened it.
    start_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        ends = tuple(tuple(e) for e in self.end_token_ids)
        _need(bool(ends) and all(e and all(_is_token_id(t) for t in e) for e in ends),
              "reasoning_section.end_token_ids", ends, "a non-empty list of non-empty lists of token ids >= 0")
        _need(all(_is_token_id(t) for t in self.start_token_ids), "reasoning_section.start_token_ids",
              self.start_token_ids, "a list of token ids >= 0")
        object.__setattr__(self, "end_token_ids", ends)
        object.__setattr__(self, "start_token_ids", tuple(self.start_token_ids))


@dataclass
class SamplingParams:
    """How to pick each next token, and when to stop; named as in vLLM."""

    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    # Per prompt token (from the second on): its logprob given the tokens before it, its rank
    # and this many top alternatives (0: the token's own only); as vLLM's prompt_logprobs.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Added to the logits of these token ids before picking; OpenAI's range, [-100, 100]:
    # -100 all but bans a token, +100 all but forces it.
    logit_bias: dict[int, float] | None = None
    # When set, only these token ids can be picked.
    allowed_token_ids: list[int] | None = None
    # The output must follow this schema, regex, choice or grammar (needs the xgrammar package).
    structured_outputs: StructuredOutputsParams | None = None
    # Close the reasoning once it has spent this many tokens (logits_processors.ReasoningBudgetRule).
    reasoning_budget: ReasoningBudget | None = None
    # Set with structured_outputs: the reply opens with reasoning marked so, and the grammar applies
    # after it (None: the grammar covers the whole reply).
    reasoning_section: ReasoningSection | None = None
    extra: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not isinstance(self.stop, (list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        self.stop = list(self.stop or [])
        _need(self.stop_token_ids is None or isinstance(self.stop_token_ids, (list, tuple)), "stop_token_ids",
              self.stop_token_ids, "a list of token ids")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:
            _need(isinstance(self.logit_bias, dict), "logit_bias", self.logit_bias,
                  "a mapping from token ids to numbers")
            self.logit_bias = dict(self.logit_bias) or None
        if self.allowed_token_ids is not None:
            _need(isinstance(self.allowed_token_ids, (list, tuple)), "allowed_token_ids", self.allowed_token_ids,
                  "a non-empty list of token ids")
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError:
                known = ", ".join(StructuredOutputsParams.__dataclass_fields__)
                raise ValueError(f"structured_outputs takes only {known}; got "
                                 f"{sorted(self.structured_outputs)}") from None
        _need(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
              "structured_outputs", self.structured_outputs, "a StructuredOutputsParams")
        _need(self.reasoning_budget is None or isinstance(self.reasoning_budget, ReasoningBudget),
              "reasoning_budget", self.reasoning_budget, "a ReasoningBudget")
        _need(self.reasoning_section is None or isinstance(self.reasoning_section, ReasoningSection),
              "reasoning_section", self.reasoning_section, "a ReasoningSection")
        # A grammar over the whole reply, reasoning included, would refuse the close the budget forces.
        _need(self.reasoning_budget is None or self.structured_outputs is None or self.reasoning_section is not None,
              "thinking_token_budget", self.reasoning_budget and self.reasoning_budget.max_tokens,
              "left out with structured outputs whose grammar covers the whole reply, its reasoning included "
              "(the server's structured_outputs_config enable_in_reasoning), as it would refuse the close that "
              "the budget forces")
        self._validate()

    def _validate(self) -> None:
        """Every field in its range, of its type, and finite as the float32 the sampler computes in:
        a value that passes here cannot make the sampler fail (for this request or its batch)."""
        _integer("n", self.n, 1)
        if self.best_of is not None:
            _integer("best_of", self.best_of, self.n, limit=f"an integer >= n ({self.n})")
        _real("temperature", self.temperature, 0.0, FLOAT32_MAX)
        _real("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _need(_is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1), "top_k", self.top_k,
              "-1 (disabled) or an integer >= 1")
        _real("min_p", self.min_p, 0.0, 1.0)
        _real("repetition_penalty", self.repetition_penalty, *REPETITION_PENALTY_RANGE)
        _real("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _real("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.seed is not None:
            # Sibling sample i uses seed + i, and every one of them must be an int64.
            siblings = (self.best_of or self.n) - 1
            last = INT64_MAX - siblings
            why = f" (seed + {siblings} is the last sample's seed and must fit in 64 bits)" if siblings else ""
            _integer("seed", self.seed, INT64_MIN, last, limit=f"an integer in [{INT64_MIN}, {last}]{why}")
        if self.max_tokens is not None:
            _integer("max_tokens", self.max_tokens, 1)
        _integer("min_tokens", self.min_tokens, 0, self.max_tokens,
                 limit=f"an integer in [0, max_tokens ({self.max_tokens})]" if self.max_tokens is not None else None)
        if self.logprobs is not None:
            _integer("logprobs", self.logprobs, 0)
        if self.prompt_logprobs is not None:
            _integer("prompt_logprobs", self.prompt_logprobs, 0)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            _need(isinstance(getattr(self, name), bool), name, getattr(self, name), "true or false")
        for s in self.stop:
            _need(isinstance(s, str) and s != "", "stop", self.stop, "a list of non-empty strings")
            check_text("stop", s)
        for t in self.stop_token_ids:
            _need(_is_token_id(t), "stop_token_ids", self.stop_token_ids, "a list of token ids >= 0")
        for token, bias in (self.logit_bias or {}).items():
            _need(_is_token_id(token), "logit_bias", token, "a mapping from token ids >= 0 (a key)")
            _real(f"logit_bias[{token}]", bias, -100.0, 100.0)
        if self.allowed_token_ids is not None:
            _need(bool(self.allowed_token_ids) and all(_is_token_id(t) for t in self.allowed_token_ids),
                  "allowed_token_ids", self.allowed_token_ids, "a non-empty list of token ids >= 0")

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse token ids the model has no logit for (the sampler could not honour them)."""
        for name, ids in (("logit_bias", self.logit_bias or ()), ("allowed_token_ids", self.allowed_token_ids or ()),
                          ("stop_token_ids", self.stop_token_ids)):
            out = sorted({t for t in ids if t >= vocab_size})
            if out:
                raise ValueError(f"{name} has token ids outside the vocabulary [0, {vocab_size}): "
                                 f"{out[:10]}{' ...' if len(out) > 10 else ''}")
        if self.top_k > vocab_size:
            raise ValueError(f"top_k must be -1 (disabled) or an integer in [1, {vocab_size}] (the vocabulary "
                             f"size), got {self.top_k}")

    def min_tokens_held_off(self, eos_token_ids: set[int] | list[int]) -> set[int]:
        """The token ids min_tokens keeps from being picked: the stop ids and, unless ignore_eos
        (which makes EOS an ordinary token), the model's EOS ids."""
        ids = set(self.stop_token_ids)
        return ids if self.ignore_eos else ids | set(eos_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token_id(value: object) -> bool:
    return _is_int(value) and value >= 0


def _need(ok: bool, name: str, value: object, limit: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {limit}, got {value!r}")


def _integer(name: str, value: object, low: int, high: int | None = None, limit: str | None = None) -> None:
    """An int (never a bool or a float) in [low, high]."""
    ok = _is_int(value) and value >= low and (high is None or value <= high)
    _need(ok, name, value, limit or (f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"))


def _real(name: str, value: object, low: float, high: float, low_open: bool = False) -> None:
    """A number (never a bool or a string) in its range and finite in float32."""
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
          and abs(value) <= FLOAT32_MAX and (low < value if low_open else low <= value) and value <= high)
    if not ok:
        interval = f"{'(' if low_open else '['}{_fmt(low)}, {_fmt(high)}]"
        raise ValueError(f"{name} must be a finite number in {interval}, got {value!r}")


def _fmt(x: float) -> str:
    return f"{x:.4g}" if abs(x) >= 1e6 else f"{x:g}"


def check_text(name: str, text: str) -> None:
    """Text must be valid Unicode that encodes to UTF-8: a lone surrogate ("\\ud800", which JSON can
    carry) cannot be tokenized."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} must be valid UTF-8 text; it holds {text[e.start:e.end]!r} at character "
                         f"{e.start}, a lone surrogate") from None

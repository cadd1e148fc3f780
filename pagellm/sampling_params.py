"""Per-request sampling options, validated where they are built."""
from __future__ import annotations

from dataclasses import dataclass, field

# Below this a temperature means greedy: dividing logits by it would overflow.
_GREEDY_EPS = 1e-5


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
    skip_special_tokens: bool = True
    # Added to the logits of these token ids before picking; OpenAI's range, [-100, 100]:
    # -100 all but bans a token, +100 all but forces it.
    logit_bias: dict[int, float] | None = None
    # When set, only these token ids can be picked.
    allowed_token_ids: list[int] | None = None
    extra: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:
            self.logit_bias = dict(self.logit_bias) or None
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, value: object, limit: str) -> None:
            raise ValueError(f"{name} must be {limit}, got {value!r}")

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", self.n, "an integer >= 1")
        if self.best_of is not None and (not isinstance(self.best_of, int) or self.best_of < self.n):
            bad("best_of", self.best_of, f"an integer >= n ({self.n})")
        if self.temperature < 0:
            bad("temperature", self.temperature, ">= 0")
        if not 0 < self.top_p <= 1:
            bad("top_p", self.top_p, "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k == 0 or self.top_k < -1:
            bad("top_k", self.top_k, "-1 (disabled) or an integer >= 1")
        if not 0 <= self.min_p <= 1:
            bad("min_p", self.min_p, "in [0, 1]")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", self.repetition_penalty, "> 0")
        if not -2 <= self.presence_penalty <= 2:
            bad("presence_penalty", self.presence_penalty, "in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            bad("frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", self.max_tokens, "an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", self.min_tokens, "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            bad("logprobs", self.logprobs, "an integer >= 0")
        if any(not s for s in self.stop):
            bad("stop", self.stop, "a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", self.stop_token_ids, "a list of token ids >= 0")
        for token, bias in (self.logit_bias or {}).items():
            if not _is_token_id(token):
                bad("logit_bias", token, "a mapping from token ids >= 0 (a key)")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
                bad(f"logit_bias[{token}]", bias, "a number in [-100, 100]")
        if self.allowed_token_ids is not None and (
                not self.allowed_token_ids or not all(_is_token_id(t) for t in self.allowed_token_ids)):
            bad("allowed_token_ids", self.allowed_token_ids, "a non-empty list of token ids >= 0")

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse token ids the model has no logit for (the sampler could not honour them)."""
        for name, ids in (("logit_bias", self.logit_bias or ()), ("allowed_token_ids", self.allowed_token_ids or ())):
            out = sorted({t for t in ids if t >= vocab_size})
            if out:
                raise ValueError(f"{name} has token ids outside the vocabulary [0, {vocab_size}): "
                                 f"{out[:10]}{' ...' if len(out) > 10 else ''}")

    def min_tokens_held_off(self, eos_token_ids: set[int] | list[int]) -> set[int]:
        """The token ids min_tokens keeps from being picked: the stop ids and, unless ignore_eos
        (which makes EOS an ordinary token), the model's EOS ids."""
        ids = set(self.stop_token_ids)
        return ids if self.ignore_eos else ids | set(eos_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0

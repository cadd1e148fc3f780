"""From what a caller hands the engine (a prompt, sampling parameters) to what its core runs:
token ids, checked against the model, the context and the KV pool. Every check of a request
that needs the model lives here; the parameters' own checks live in SamplingParams."""
from __future__ import annotations

from pagellm.core.kv import KVManager
from pagellm.loader.tokenizer import Tokenizer
from pagellm.sampling_params import SamplingParams, check_text

PromptType = str | list[int] | dict


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int, max_num_seqs: int,
                 kv: KVManager, eos_token_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.kv = kv
        self.eos_token_ids = eos_token_ids

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(text, token ids) of a string, a list of ids, or {"prompt": ...} / {"prompt_token_ids": ...}."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            check_text("prompt", prompt)
            return prompt, self.tokenizer.encode(prompt) if prompt else []
        if isinstance(prompt, list):
            return None, list(prompt)
        raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    @staticmethod
    def check_request_id(request_id: object) -> None:
        if not isinstance(request_id, str) or not request_id or "#" in request_id:
            raise ValueError(f"request_id must be a non-empty string without '#' (kept for sibling sequences), "
                             f"got {request_id!r}")

    def check_num_seqs(self, num_seqs: int) -> None:
        """Before anything is built per sequence (n = 2**64 once built that many ids)."""
        if num_seqs > self.max_num_seqs:
            raise ValueError(f"n, best_of and beam_width must be <= max_num_seqs ({self.max_num_seqs}), "
                             f"got {num_seqs}")

    def validate_pooling(self, ids: list[int]) -> None:
        """An embedding request's prompt: ids in the vocabulary, at most max_model_len of them (none
        is generated), and blocks for all of them."""
        if not ids:
            raise ValueError("prompt must not be empty")
        self._check_ids(ids)
        if len(ids) > self.max_model_len:
            raise ValueError(f"the input has {len(ids)} tokens; max_model_len is {self.max_model_len}: shorten it "
                             f"(or ask for truncate_prompt_tokens)")
        need = self.kv.blocks_for(len(ids))
        if need > self.kv.num_blocks:
            raise ValueError(f"the input needs {need} KV blocks ({len(ids)} tokens at block_size "
                             f"{self.kv.block_size}) but the whole KV pool has {self.kv.num_blocks}")

    def _check_ids(self, ids: list[int]) -> None:
        vocab = self.vocab_size
        bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids contains {bad!r}, outside the vocabulary [0, {vocab})")

    def validate(self, ids: list[int], params: SamplingParams, num_seqs: int | None = None,
                 seqs_at_once: int = 1) -> None:
        """The prompt and parameters against this model: ids in the vocabulary, room in the
        context for one more token, an allowed token left, and blocks for `seqs_at_once`
        sequences of the longest length the request can reach."""
        if not ids:
            raise ValueError("prompt must not be empty")
        vocab = self.vocab_size
        self._check_ids(ids)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}, "
                             f"which must hold the prompt plus at least one generated token")
        params.check_vocab(vocab)
        if params.allowed_token_ids and params.min_tokens:
            if params.min_tokens_held_off(self.eos_token_ids).issuperset(params.allowed_token_ids):
                raise ValueError(f"allowed_token_ids {params.allowed_token_ids} are all stop or end-of-sequence "
                                 f"tokens, which min_tokens ({params.min_tokens}) holds off: nothing could be picked")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > vocab:
                raise ValueError(f"{name} must be <= the vocabulary size ({vocab}), got {value}")
        self.check_num_seqs(num_seqs or params.best_of or params.n)
        longest = min(len(ids) + (params.max_tokens or self.max_model_len), self.max_model_len)
        need = self.kv.blocks_for(longest) * seqs_at_once
        if need > self.kv.num_blocks:
            raise ValueError(
                f"the request needs up to {need} KV blocks ({seqs_at_once} x {longest} tokens at block_size "
                f"{self.kv.block_size}) but the whole KV pool has {self.kv.num_blocks}; lower max_tokens or "
                f"enlarge the pool")


def resolve_max_model_len(asked: int | None, model_max: int) -> int:
    if asked is None:
        return model_max
    if asked > model_max:
        raise ValueError(f"max_model_len must be <= the model's context length ({model_max}), got {asked}")
    return asked

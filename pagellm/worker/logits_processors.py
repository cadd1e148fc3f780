"""The rules that change a step's logits before a token is picked: one class per rule, applied
in the order of LOGITS_PROCESSORS.

Each rule has two halves. `prepare` reads the step's requests once (on the host, before the
logits exist) and returns the rule's state for this batch, or None when no row uses it, so an
unused rule costs nothing; `apply` changes the [B, V] float32 logits in place. States are
sparse where the rule is: flat indices `row * V + token` into the logits and their values.

No rule keeps state between steps. What a rule needs is read from the request each step (its
tokens for the penalties, its output length for min_tokens), or is the request's own (a
structured-output grammar lives on the `Request`, is forked with it and stays valid when a
preempted request is recomputed, since its tokens do), so forking a sequence (n > 1, beams)
and recomputing one after preemption need nothing from here.

A new rule is one class here and one entry in LOGITS_PROCESSORS, plus its SamplingParams field.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch

from pagellm.sampling_params import SamplingParams


@dataclass(frozen=True)
class StepRequests:
    """What the rules may read about a step's sampling rows; row i is row i of the logits."""

    params: Sequence[SamplingParams]
    prompt_token_ids: Sequence[Sequence[int]]
    output_token_ids: Sequence[Sequence[int]]
    eos_token_ids: set[int]
    vocab_size: int
    device: torch.device
    token_bitmasks: Sequence[torch.Tensor | None] | None = None


class LogitsProcessor:
    """One rule. Subclasses implement both halves; see the module's docstring."""

    name = ""

    def prepare(self, step: StepRequests) -> Any | None:
        raise NotImplementedError

    def apply(self, logits: torch.Tensor, state: Any) -> None:
        raise NotImplementedError


def _long_tensor(seqs: Iterable[Sequence[int]], device: torch.device) -> torch.Tensor:
    """All of ``seqs`` concatenated, as one int64 tensor."""
    # array.fromlist converts a list in C, ~10x faster than torch.tensor(list).
    buf = array("q")
    for seq in seqs:
        buf.fromlist(seq if isinstance(seq, list) else list(seq))
    if not buf:
        return torch.empty(0, dtype=torch.long, device=device)
    return torch.frombuffer(buf, dtype=torch.int64).to(device, copy=True)


def flat_keys(rows: list[int], seqs: list[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """``row * V + token`` for every token of ``seqs[i]`` in row ``rows[i]``."""
    tokens = _long_tensor(seqs, device)
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.long, device=device)
    offsets = torch.tensor(rows, dtype=torch.long, device=device) * vocab_size
    row_offsets = torch.repeat_interleave(offsets, lengths)
    if tokens.numel() and int(tokens.max()) >= vocab_size:
        # An id the logits have no column for cannot be penalized.
        keep = tokens < vocab_size
        tokens, row_offsets = tokens[keep], row_offsets[keep]
    return tokens.add_(row_offsets)


class RepetitionPenalty(LogitsProcessor):
    """Tokens seen in the prompt or the output: positive logits divided by the penalty, negative
    ones multiplied (as transformers and vLLM)."""

    name = "repetition_penalty"

    def prepare(self, step: StepRequests) -> tuple[torch.Tensor, torch.Tensor] | None:
        rows = [i for i, p in enumerate(step.params) if p.repetition_penalty != 1.0]
        if not rows:
            return None
        keys = torch.unique(flat_keys(rows, [list(step.prompt_token_ids[i]) + list(step.output_token_ids[i])
                                             for i in rows], step.vocab_size, step.device))
        if not keys.numel():
            return None
        per_row = torch.tensor([p.repetition_penalty for p in step.params], dtype=torch.float32, device=step.device)
        return keys, per_row[keys // step.vocab_size]

    def apply(self, logits: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor]) -> None:
        index, penalty = state
        flat = logits.view(-1)
        values = flat[index]
        flat[index] = torch.where(values > 0, values / penalty, values * penalty)


class PresenceFrequencyPenalty(LogitsProcessor):
    """Tokens of the output: logit -= presence + frequency * count (OpenAI's formula)."""

    name = "presence_frequency_penalty"

    def prepare(self, step: StepRequests) -> tuple[torch.Tensor, torch.Tensor] | None:
        rows = [i for i, p in enumerate(step.params) if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0]
        if not rows:
            return None
        keys, counts = torch.unique(flat_keys(rows, [step.output_token_ids[i] for i in rows], step.vocab_size,
                                              step.device), return_counts=True)
        if not keys.numel():
            return None
        presence = torch.tensor([p.presence_penalty for p in step.params], dtype=torch.float32, device=step.device)
        frequency = torch.tensor([p.frequency_penalty for p in step.params], dtype=torch.float32, device=step.device)
        row = keys // step.vocab_size
        return keys, presence[row] + frequency[row] * counts.to(torch.float32)

    def apply(self, logits: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor]) -> None:
        index, amount = state
        flat = logits.view(-1)
        flat[index] = flat[index] - amount


class LogitBias(LogitsProcessor):
    """OpenAI's logit_bias: logit += bias for the listed tokens."""

    name = "logit_bias"

    def prepare(self, step: StepRequests) -> tuple[torch.Tensor, torch.Tensor] | None:
        v = step.vocab_size
        pairs = [(i * v + t, b) for i, p in enumerate(step.params) if p.logit_bias
                 for t, b in p.logit_bias.items() if t < v]
        if not pairs:
            return None
        return (torch.tensor([k for k, _ in pairs], dtype=torch.long, device=step.device),
                torch.tensor([b for _, b in pairs], dtype=torch.float32, device=step.device))

    def apply(self, logits: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor]) -> None:
        index, amount = state
        logits.view(-1).index_add_(0, index, amount)


class AllowedTokenIds(LogitsProcessor):
    """allowed_token_ids: every other token of the row to -inf."""

    name = "allowed_token_ids"

    def prepare(self, step: StepRequests) -> tuple[torch.Tensor, torch.Tensor] | None:
        rows = [i for i, p in enumerate(step.params) if p.allowed_token_ids]
        if not rows:
            return None
        return (torch.tensor(rows, dtype=torch.long, device=step.device),
                torch.unique(flat_keys(rows, [step.params[i].allowed_token_ids for i in rows], step.vocab_size,
                                       step.device)))

    def apply(self, logits: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor]) -> None:
        rows, allowed = state
        flat = logits.view(-1)
        kept = flat[allowed]
        logits.index_fill_(0, rows, float("-inf"))
        flat[allowed] = kept


class MinTokens(LogitsProcessor):
    """min_tokens: the stop ids (and EOS, unless ignore_eos) to -inf until that many tokens exist."""

    name = "min_tokens"

    def prepare(self, step: StepRequests) -> torch.Tensor | None:
        v, eos = step.vocab_size, step.eos_token_ids
        banned = [i * v + t for i, p in enumerate(step.params) if len(step.output_token_ids[i]) < p.min_tokens
                  for t in p.min_tokens_held_off(eos) if 0 <= t < v]
        return torch.tensor(banned, dtype=torch.long, device=step.device) if banned else None

    def apply(self, logits: torch.Tensor, state: torch.Tensor) -> None:
        logits.view(-1)[state] = float("-inf")


# Byte value -> its 8 bits as additive logit masks (0.0: allowed, -inf: not), low bit first.
_BYTE_MASKS = torch.tensor([[0.0 if (b >> i) & 1 else float("-inf") for i in range(8)] for b in range(256)])


def bitmask_to_additive(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, ceil(V / 32)] int32 rows, bit t % 32 of word t // 32 set when token t is allowed
    (xgrammar's layout), as [R, V] float32: 0.0 where allowed, -inf where not.

    Added to the logits rather than used with masked_fill: a random boolean mask makes
    masked_fill (and where) ~5 ms for [32, 49k] on 2 cores; a table lookup per byte and an add
    take ~1 ms. (Bytes in memory order: little-endian, as x86, ARM and CUDA devices are.)
    """
    rows = bitmask.shape[0]
    table = _BYTE_MASKS.to(bitmask.device)
    index = bitmask.contiguous().view(torch.uint8).reshape(-1).to(torch.int32)
    return torch.index_select(table, 0, index).view(rows, -1)[:, :vocab_size]


class GrammarMask(LogitsProcessor):
    """Structured outputs: the tokens the row's grammar does not allow next to -inf. The engine
    core filled each row's bitmask from the sequence's grammar state (engine/structured_outputs.py)."""

    name = "grammar"

    def prepare(self, step: StepRequests) -> tuple[torch.Tensor, torch.Tensor] | None:
        masks = step.token_bitmasks or ()
        rows = [i for i, m in enumerate(masks) if m is not None]
        if not rows:
            return None
        bitmask = torch.stack([masks[i] for i in rows]).to(step.device)
        return torch.tensor(rows, dtype=torch.long, device=step.device), bitmask_to_additive(bitmask, step.vocab_size)

    def apply(self, logits: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor]) -> None:
        rows, additive = state
        # x + 0 = x and x - inf = -inf: exact (rows with a non-finite logit never get here).
        if additive.shape[0] == logits.shape[0]:
            logits.add_(additive)  # every row has a grammar: rows are 0 .. B-1 in order
        else:
            logits.index_add_(0, rows, additive)


def _find(seq: Sequence[int], marker: Sequence[int], start: int = 0, stop: int | None = None) -> int:
    """Index just after the first `marker` in seq[start:stop], or -1."""
    n, stop = len(marker), len(seq) if stop is None else stop
    first = marker[0]
    for i in range(start, stop - n + 1):
        if seq[i] == first and tuple(seq[i:i + n]) == marker:
            return i + n
    return -1


# A reply's reasoning opens at its start, after at most this many tokens of whitespace (as the
# reasoning parsers read it); further on, a start marker is text, not the reasoning's opening.
_LEADING_TOKENS = 4


class ReasoningBudgetRule(LogitsProcessor):
    """thinking_token_budget: once the reasoning has spent its tokens without closing, the row's
    next tokens are its close sequence, one a step, whatever the other rules allowed.

    Where the row stands is read from its output each step: the reasoning begins after the start
    marker (or at the output's start when the prompt opened it), the budget is spent `max_tokens`
    tokens later, and the k-th token after that is the close's k-th. Only those len(close) steps
    read the output, and only up to the spent point, so a long reasoning costs nothing per step."""

    name = "reasoning_budget"

    def prepare(self, step: StepRequests) -> tuple[torch.Tensor, torch.Tensor] | None:
        rows, tokens = [], []
        for i, p in enumerate(step.params):
            budget = p.reasoning_budget
            if budget is None:
                continue
            out = step.output_token_ids[i]
            begin = 0
            if budget.start_token_ids:
                begin = _find(out, budget.start_token_ids, 0, min(len(out), len(budget.start_token_ids)
                                                                  + _LEADING_TOKENS))
                if begin < 0:
                    continue
            spent_at = begin + budget.max_tokens
            k = len(out) - spent_at
            if not 0 <= k < len(budget.close_token_ids) or _find(out, budget.end_token_ids, begin, spent_at) >= 0:
                continue
            if budget.close_token_ids[k] < step.vocab_size:
                rows.append(i)
                tokens.append(budget.close_token_ids[k])
        if not rows:
            return None
        return (torch.tensor(rows, dtype=torch.long, device=step.device),
                torch.tensor(tokens, dtype=torch.long, device=step.device))

    def apply(self, logits: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor]) -> None:
        rows, tokens = state
        logits.index_fill_(0, rows, float("-inf"))
        logits[rows, tokens] = 0.0


# In this order: penalties on the model's logits, then bias, then the rules that rule tokens out;
# last the reasoning budget, whose forced close overrides them all.
LOGITS_PROCESSORS: tuple[LogitsProcessor, ...] = (RepetitionPenalty(), PresenceFrequencyPenalty(), LogitBias(),
                                                  AllowedTokenIds(), MinTokens(), GrammarMask(),
                                                  ReasoningBudgetRule())

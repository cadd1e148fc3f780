"""Verification of proposed tokens: which of a sequence's drafts the target model keeps.

A deterministic proposer (prompt lookup) proposes with a point-mass draft distribution q on its
token d. Rejection sampling then accepts d with probability min(1, p(d) / q(d)) = p(d), and on a
rejection draws from the residual max(0, p - q), normalized: p with d removed and renormalized.
One draw t ~ p, compared with d, is both halves at once: t == d has probability p(d), and t given
t != d is distributed as p without d, renormalized. So each verified position's token is drawn by
the ordinary sampler from p, the target's distribution after its logits processors (penalties,
bias, min_tokens, ... applied as if the drafts before it were already output) and its
temperature and truncation, with the uniform a seeded request would use for that token without
speculation; drafts are accepted while they equal the drawn tokens. The first drawn token that
differs is the correction; when every draft is accepted, the draw after the last one is the bonus
token. Greedy is the case p = one-hot at the argmax: exact match. The output is thus distributed
as without speculation, and a seeded request's text is the same token for token.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from pagellm.core.step_plan import SampleSpec


def verification_specs(spec: SampleSpec, draft_token_ids: Sequence[int]) -> list[SampleSpec]:
    """The k + 1 sampling rows of a sequence verifying k drafts: row j samples the token after
    drafts 0 .. j-1, so its penalties, min_tokens and seeded uniform see them as output."""
    output = list(spec.output_token_ids)
    return [replace(spec, output_token_ids=output + list(draft_token_ids[:j])) for j in range(len(draft_token_ids) + 1)]


def num_accepted(draft_token_ids: Sequence[int], sampled_token_ids: Sequence[int]) -> int:
    """How many leading drafts are kept: draft j is when the token drawn at position j (from the
    target's distribution given drafts 0 .. j-1) equals it. The sequence then receives
    sampled_token_ids[:accepted + 1]: the accepted drafts and the correction or bonus token."""
    accepted = 0
    for draft, sampled in zip(draft_token_ids, sampled_token_ids):
        if draft != sampled:
            break
        accepted += 1
    return accepted

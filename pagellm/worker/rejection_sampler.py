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

A proposer that samples its drafts from a real distribution q (a draft model on a sampled
request) has them verified by rejection sampling proper (`accept_drafts`): draft j is accepted
with probability min(1, p_j(d_j) / q_j(d_j)); the first rejected one is replaced by a draw from
the residual max(0, p_j - q_j), normalized; when all are accepted, the ordinary draw from p_k is
the bonus token. Its output is distributed as the target's too (Leviathan et al., Chen et al.,
2023), and accepts more than the point-mass comparison would (sum min(p, q) instead of sum p q).
A seeded request's uniforms for the acceptance tests and the residual draws are functions of its
seed and token index, so its text is reproducible, though not that of plain decoding.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import torch

from pagellm.core.step_plan import SampleSpec
from pagellm.worker.sampler import SamplerOutput, SamplingMetadata, sampling_probs, seeded_uniform

# Streams of a seeded request's uniforms besides its ordinary draws (sampler.seeded_uniform's):
# the draft model's draws, the acceptance tests and the residual draws, by token index.
DRAFT_STREAM, ACCEPT_STREAM, RESIDUAL_STREAM = 0x5EED_D4AF, 0x5EED_ACC7, 0x5EED_4E51


def verification_specs(spec: SampleSpec, draft_token_ids: Sequence[int]) -> list[SampleSpec]:
    """The k + 1 sampling rows of a sequence verifying k drafts: row j samples the token after
    drafts 0 .. j-1, so its penalties, min_tokens and seeded uniform see them as output, and a
    grammar's mask is row j of the sequence's [k + 1, words] bitmask (its state after them)."""
    output, k, masks = list(spec.output_token_ids), len(draft_token_ids), spec.token_bitmask
    if masks is not None and masks.shape[0] != k + 1:
        raise ValueError(f"a sequence verifying {k} drafts needs {k + 1} bitmask rows, got {tuple(masks.shape)}")
    return [replace(spec, output_token_ids=output + list(draft_token_ids[:j]),
                    token_bitmask=None if masks is None else masks[j]) for j in range(k + 1)]


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


def stream_uniforms(seed: int | None, stream: int, first_index: int, n: int,
                    generator: torch.Generator) -> torch.Tensor:
    """n uniforms in [0, 1) for token indices first_index .. + n - 1: from the request's seed
    (a function of seed, stream and index alone), or from `generator` for an unseeded request."""
    if seed is None:
        return torch.rand(n, generator=generator, device=generator.device).cpu()
    return torch.tensor([seeded_uniform(seed ^ stream, first_index + i) for i in range(n)])


def accept_drafts(p: torch.Tensor, q: torch.Tensor, drafts: Sequence[int], accept_u: torch.Tensor,
                  residual_u: torch.Tensor) -> tuple[int, int | None]:
    """Rejection sampling of k drafts drawn from q [k, V] against the target's p [k + 1, V]:
    (how many leading drafts are accepted, the token drawn from the residual at the first rejected
    position, or None when all were accepted: the bonus token is then the ordinary draw from p[k])."""
    k = len(drafts)
    if k == 0:
        return 0, None
    d = torch.tensor(list(drafts))
    rows = torch.arange(k)
    pd, qd = p[rows, d], q[rows, d]
    # u < p/q, written without the division; a draft q gave no mass to is never accepted.
    ok = ((accept_u * qd < pd) & (qd > 0)).tolist()
    accepted = ok.index(False) if False in ok else k
    if accepted == k:
        return k, None
    residual = (p[accepted] - q[accepted]).clamp_(min=0.0)
    if not float(residual.sum()) > 0.0:  # p <= q everywhere only by rounding: p itself
        residual = p[accepted].clone()
    cdf = residual.cumsum(0)
    token = int(torch.searchsorted(cdf, residual_u[accepted] * cdf[-1], right=True).clamp_(max=len(cdf) - 1))
    while residual[token] <= 0 and token > 0:  # rounding landed on a zero-mass tail: step back
        token -= 1
    return accepted, token


def verify_with_draft_probs(sampled: SamplerOutput, logits: torch.Tensor, row: int, specs: Sequence[SampleSpec],
                            drafts: Sequence[int], q: torch.Tensor, eos_token_ids: set[int], vocab_size: int,
                            generator: torch.Generator) -> None:
    """Replace, in place, the sampled tokens of one speculating sequence's rows row .. row + k (their
    `specs` from verification_specs) by rejection sampling against the draft's q [k, V]: the
    accepted drafts, then the residual's token or the bonus draw, so that num_accepted finds them.
    Each changed row's logprob (and rank) is recomputed from the raw logits."""
    k = len(drafts)
    if sampled.errors and any(r in sampled.errors for r in range(row, row + k + 1)):
        return  # such a sequence fails its request: nothing to verify
    meta = SamplingMetadata.build([s.params for s in specs], [s.prompt_token_ids for s in specs],
                                  [s.output_token_ids for s in specs], eos_token_ids, vocab_size, logits.device,
                                  [s.token_bitmask for s in specs])
    raw = logits[row:row + k + 1].float()
    p = sampling_probs(raw, meta).cpu()
    seed, first = specs[0].params.seed, len(specs[0].output_token_ids)
    accepted, token = accept_drafts(p, q[:k].float().cpu(), drafts,
                                    stream_uniforms(seed, ACCEPT_STREAM, first, k, generator),
                                    stream_uniforms(seed, RESIDUAL_STREAM, first, k, generator))
    tokens = list(drafts[:accepted]) + ([] if token is None else [token])
    if not tokens:
        return
    changed = [row + j for j, t in enumerate(tokens) if sampled.token_ids[row + j] != t]
    for j, t in enumerate(tokens):
        sampled.token_ids[row + j] = t
    if not changed:
        return
    picked = torch.tensor(changed)
    sub = logits[picked].float()
    chosen = sub.gather(1, torch.tensor([sampled.token_ids[r] for r in changed])[:, None]).squeeze(1)
    logprobs = (chosen - torch.logsumexp(sub, -1)).tolist()
    ranks = ((sub > chosen[:, None]).sum(-1) + 1).tolist()
    for i, r in enumerate(changed):
        sampled.logprobs[r] = logprobs[i]
        if sampled.ranks is not None and sampled.ranks[r]:
            sampled.ranks[r] = ranks[i]

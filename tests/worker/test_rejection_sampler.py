"""Speculative decoding's worker half: prompt-lookup proposals, and verification by rejection
sampling, whose output must be distributed as the target model's."""
from __future__ import annotations

import pytest
import torch

from pagellm.core.step_plan import SampleSpec
from pagellm.sampling_params import SamplingParams
from pagellm.worker.proposers.ngram import NgramProposer, lookup, vouched
from pagellm.worker.rejection_sampler import accept_drafts, num_accepted, verification_specs
from pagellm.worker.sampler import Sampler, SamplingMetadata, sampling_probs


@pytest.mark.parametrize("tokens, k, expected", [
    ([1, 2, 3, 4, 5, 1, 2, 3, 4], 3, [5, 1, 2]),     # the longest suffix found: 1 2 3 4
    ([9, 4, 2, 3, 5, 9, 4, 2, 3, 7, 9, 4, 2, 3], 2, [7, 9]),  # its latest earlier occurrence
    ([5, 6, 7, 8, 5, 6, 7, 8], 9, [5, 6, 7, 8]),     # fewer than k tokens follow it
    ([1, 2, 3, 4], 3, []),                           # no suffix of 2 or more occurs earlier
    ([1, 2, 3, 4, 5, 6, 1, 2, 3], 4, [4]),           # a match of 3 < 4 tokens vouches for 1 (vouched)
    ([1, 2, 3, 4, 5, 6, 7, 8, 2, 3], 4, [4]),        # ... of 2 for 1
    ([256, 1, 0, 0, 9, 1, 0], 2, [0]),               # a byte match across token boundaries is no match
])
def test_prompt_lookup(tokens, k, expected):
    assert lookup(tokens, k, 2, 4) == expected
    assert NgramProposer(2, 4).propose([tokens, [7]], [k, k]) == [expected, []]


def test_a_match_proposes_by_its_length():
    """All that was asked after a match of prompt_lookup_max tokens, at most half its length (at
    least 1) after a shorter one."""
    assert [vouched(n, 8, 8) for n in range(1, 9)] == [1, 1, 1, 2, 2, 3, 3, 8]
    assert [vouched(n, 4, 2) for n in range(1, 5)] == [1, 1, 1, 2]
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4, 5, 6]
    assert lookup(tokens, 8, 1, 6) == [7, 8, 9, 1, 2, 3, 4, 5]  # 6 = max: all 8 asked
    assert lookup(tokens, 8, 1, 7) == [7, 8, 9]  # 6 < 7: three


def test_each_verified_position_sees_the_drafts_before_it_as_output():
    spec = SampleSpec("r", SamplingParams(presence_penalty=1.0), [1, 2], [3])
    rows = verification_specs(spec, [7, 8])
    assert [list(r.output_token_ids) for r in rows] == [[3], [3, 7], [3, 7, 8]]
    assert all(r.prompt_token_ids == [1, 2] and r.params is spec.params for r in rows)
    assert [num_accepted([7, 8], t) for t in ([7, 8, 9], [7, 5, 9], [6, 8, 9])] == [2, 1, 0]


def test_rejection_sampling_keeps_the_target_distribution():
    """A draft d at position 0 of a tiny vocabulary: over thousands of draws (one batch, from a
    seeded sampler), the sequence receives x != d alone with probability p0(x) (rejected, corrected),
    and d then y with probability p0(d) * p1(y) (accepted, then the bonus token): the target's own
    distribution."""
    vocab, draft, n = 5, 1, 6000
    logits = torch.tensor([[0.5, 1.2, -0.3, 0.9, 0.0], [1.0, -1.0, 0.3, 0.2, 0.6]])
    p0, p1 = torch.softmax(logits, -1)
    expected = {(x,): float(p0[x]) for x in range(vocab) if x != draft}
    expected.update({(draft, y): float(p0[draft] * p1[y]) for y in range(vocab)})
    rows = verification_specs(SampleSpec("r", SamplingParams(temperature=1.0), [3], []), [draft]) * n
    meta = SamplingMetadata.build([r.params for r in rows], [r.prompt_token_ids for r in rows],
                                  [r.output_token_ids for r in rows], set(), vocab)
    tokens = Sampler(seed=0)(logits.repeat(n, 1), meta).token_ids
    counts = dict.fromkeys(expected, 0)
    for i in range(0, 2 * n, 2):
        pair = tokens[i:i + 2]
        counts[tuple(pair[:num_accepted([draft], pair) + 1])] += 1
    chi2 = sum((counts[o] - n * p) ** 2 / (n * p) for o, p in expected.items())
    # 8 degrees of freedom: P(chi2 > 26.12) = 0.001 for a sampler that keeps the distribution.
    assert chi2 < 26.12, (chi2, counts)
    # And the test can fail: accepting d with probability 1/2 instead of p0(d) is far outside the bound.
    biased = {o: 0.5 * float(p1[o[1]]) if len(o) == 2 else 0.5 * p / (1 - float(p0[draft]))
              for o, p in expected.items()}
    assert sum((n * biased[o] - n * p) ** 2 / (n * p) for o, p in expected.items()) > 26.12


def _chi2(counts: dict, expected: dict, n: int) -> float:
    return sum((counts.get(o, 0) - n * p) ** 2 / (n * p) for o, p in expected.items() if p > 0)


def test_rejection_sampling_with_a_real_draft_distribution_keeps_the_target_distribution():
    """A draft d drawn from q at position 0, then accepted with probability min(1, p0(d)/q0(d)) or
    replaced by a draw from the residual max(0, p0 - q0); accepted, the bonus comes from p1. Over
    thousands of seeded draws the outcomes are the target's: x alone (rejected, corrected) with
    probability p0(x) - min(p0, q0)(x), x then y with min(p0, q0)(x) * p1(y), so the first token is
    distributed as p0 (and accepted more often than a point-mass comparison would: sum min(p, q))."""
    vocab, n = 5, 6000
    p = torch.softmax(torch.tensor([[0.5, 1.2, -0.3, 0.9, 0.0], [1.0, -1.0, 0.3, 0.2, 0.6]]), -1)
    q0 = torch.tensor([0.05, 0.5, 0.1, 0.15, 0.2])  # wrong where it matters: too sure of token 1
    both = torch.minimum(p[0], q0)
    expected = {(x,): float(p[0, x] - both[x]) for x in range(vocab)}
    expected.update({(x, y): float(both[x] * p[1, y]) for x in range(vocab) for y in range(vocab)})
    gen = torch.Generator().manual_seed(0)
    drafts = torch.multinomial(q0, n, replacement=True, generator=gen).tolist()
    bonus = torch.multinomial(p[1], n, replacement=True, generator=gen).tolist()
    counts: dict = {}
    for d, y in zip(drafts, bonus):
        accepted, token = accept_drafts(p, q0[None], [d], torch.rand(1, generator=gen), torch.rand(1, generator=gen))
        outcome = (d, y) if accepted else (token,)
        counts[outcome] = counts.get(outcome, 0) + 1
    # 27 possible outcomes (two tokens alone, where p0 > q0; 25 pairs): 26 degrees of freedom,
    # P(chi2 > 54.05) = 0.001 for a sampler that keeps the distribution.
    assert sum(1 for v in expected.values() if v > 0) == 27
    assert _chi2(counts, expected, n) < 54.05, (counts, expected)
    # The test can fail: drawing the correction from p itself (not the residual) is far outside it.
    wrong = {(x,): float((1 - both.sum()) * p[0, x]) for x in range(vocab)}
    wrong.update({o: v for o, v in expected.items() if len(o) == 2})
    assert _chi2({o: n * v for o, v in wrong.items()}, expected, n) > 54.05


def test_sampling_probs_are_what_the_sampler_draws_from():
    """The distribution rejection sampling compares (temperature, penalties, top-k, top-p, min-p) is the
    one the sampler draws from: a chi-square bound on seeded draws, per row."""
    vocab, n = 8, 4000
    logits = torch.tensor([[0.3, 1.5, -0.2, 0.9, 0.1, 1.4, -1.0, 0.6]])
    rows = [SamplingParams(temperature=0.7, top_k=5, top_p=0.9), SamplingParams(temperature=1.3, min_p=0.2),
            SamplingParams(temperature=1.0, presence_penalty=0.8), SamplingParams(temperature=0.0)]
    outputs = [[1, 5], [], [1, 1, 3], []]
    meta = SamplingMetadata.build(rows, [[2]] * len(rows), outputs, set(), vocab)
    probs = sampling_probs(logits.repeat(len(rows), 1), meta)
    assert torch.allclose(probs.sum(-1), torch.ones(len(rows)))
    assert probs[0].count_nonzero() <= 5 and probs[1, 6] == 0 and probs[3].tolist() == [0, 1, 0, 0, 0, 0, 0, 0]
    big = [r for r in rows for _ in range(n)]
    meta = SamplingMetadata.build(big, [[2]] * len(big), [o for o in outputs for _ in range(n)], set(), vocab)
    tokens = Sampler(seed=1)(logits.repeat(len(big), 1), meta).token_ids
    for i in range(3):
        counts = torch.bincount(torch.tensor(tokens[i * n:(i + 1) * n]), minlength=vocab)
        expected = {t: float(probs[i, t]) for t in range(vocab)}
        assert all(counts[t] == 0 for t, v in expected.items() if v == 0)
        # <= 7 degrees of freedom: P(chi2 > 24.3) = 0.001.
        assert _chi2({t: int(counts[t]) for t in range(vocab)}, expected, n) < 24.3, (i, counts, probs[i])

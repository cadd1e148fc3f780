"""Speculative decoding's worker half: prompt-lookup proposals, and verification by rejection
sampling, whose output must be distributed as the target model's."""
from __future__ import annotations

import pytest
import torch

from pagellm.core.step_plan import SampleSpec
from pagellm.sampling_params import SamplingParams
from pagellm.worker.proposers.ngram import NgramProposer, lookup
from pagellm.worker.rejection_sampler import num_accepted, verification_specs
from pagellm.worker.sampler import Sampler, SamplingMetadata


@pytest.mark.parametrize("tokens, k, expected", [
    ([1, 2, 3, 4, 5, 1, 2, 3], 3, [4, 5, 1]),        # the longest suffix found: 1 2 3
    ([1, 2, 9, 4, 2, 3, 7, 2, 3], 2, [7, 2]),        # its latest earlier occurrence
    ([5, 6, 7, 8, 1, 6, 7], 9, [8, 1, 6, 7]),        # fewer than k tokens follow it
    ([1, 2, 3, 4], 3, []),                           # no suffix of 2 or more occurs earlier
    ([256, 1, 0, 0, 9, 1, 0], 2, [0, 9]),            # a byte match across token boundaries is no match
])
def test_prompt_lookup(tokens, k, expected):
    assert lookup(tokens, k, 2, 4) == expected
    assert NgramProposer(2, 4).propose([tokens, [7]], [k, k]) == [expected, []]


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

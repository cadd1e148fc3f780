"""Tests for the batched sampler: greedy, truncation, seeds, penalties, logprobs."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagellm.sampling_params import SamplingParams
from pagellm.worker.sampler import Sampler, SamplingMetadata, apply_logits_processors_

EOS = 0


def meta_for(params: list[SamplingParams], vocab: int, *, prompts=None, outputs=None,
             eos=(EOS,)) -> SamplingMetadata:
    b = len(params)
    return SamplingMetadata.build(
        params,
        prompts if prompts is not None else [[] for _ in range(b)],
        outputs if outputs is not None else [[] for _ in range(b)],
        list(eos), vocab)


def allowed_mask(logits: torch.Tensor, p: SamplingParams, slack: float = 1e-4) -> torch.Tensor:
    """Tokens top-k, then top-p, then min-p may keep for one row (float64, ties kept)."""
    x = (logits.float() / p.temperature).double()  # the sampler scales in float32
    keep = torch.ones_like(x, dtype=torch.bool)
    if p.top_k > 0:
        keep &= x >= x.topk(min(p.top_k, x.numel())).values[-1]
    probs = torch.softmax(x.masked_fill(~keep, float("-inf")), -1)
    if p.top_p < 1:
        # Mass of strictly more likely tokens must be below p.
        ascending = probs.sort().values
        at_most = torch.cat([torch.zeros(1, dtype=probs.dtype), ascending.cumsum(0)])
        before = at_most[-1] - at_most[torch.searchsorted(ascending, probs, right=True)]
        keep &= before < p.top_p + slack
    keep &= probs >= p.min_p * probs.max() * (1 - slack)
    return keep


def test_greedy_is_argmax_and_logprobs_are_raw() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 3
    out = Sampler(seed=0)(logits, meta_for([SamplingParams(temperature=0)] * 6, 50))
    assert out.token_ids == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1).gather(1, logits.argmax(-1, keepdim=True)).squeeze(1)
    torch.testing.assert_close(torch.tensor(out.logprobs), expected)
    assert out.top_logprobs is None and out.ranks is None


def test_truncation_to_one_token_equals_greedy() -> None:
    logits = torch.randn(16, 300, generator=torch.Generator().manual_seed(1)) * 2
    greedy = logits.argmax(-1).tolist()
    sampler = Sampler(seed=1)
    for kw in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}, {"top_k": 5, "top_p": 1e-6}):
        for temperature in (0.3, 1.0, 1.7):
            params = [SamplingParams(temperature=temperature, **kw)] * 16
            for _ in range(3):
                assert sampler(logits, meta_for(params, 300)).token_ids == greedy, kw


def test_seeded_rows_ignore_batch_and_row_index() -> None:
    vocab, steps = 40_000, 6
    rng = torch.Generator().manual_seed(2)
    steps_logits = [torch.randn(vocab, generator=rng) for _ in range(steps)]
    mine = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)

    def run(batch: int, row: int, sampler_seed: int) -> list[int]:
        sampler, tokens = Sampler(seed=sampler_seed), []
        for k, step_logits in enumerate(steps_logits):
            logits = torch.randn(batch, vocab, generator=rng) * 5
            logits[row] = step_logits
            params = [SamplingParams(temperature=0.7, top_k=20) for _ in range(batch)]
            if batch > 1:
                params[(row + 1) % batch] = SamplingParams(temperature=1.0, seed=99)
            params[row] = mine
            outputs = [[5] * k for _ in range(batch)]  # the k-th token of every row
            tokens.append(sampler(logits, meta_for(params, vocab, outputs=outputs)).token_ids[row])
        return tokens

    alone = run(1, 0, 0)
    assert run(5, 3, 7) == alone
    assert run(9, 0, 8) == alone
    assert len(set(alone)) > 1  # really sampled


def test_unseeded_rows_follow_the_sampler_seed() -> None:
    logits = torch.randn(32, 100, generator=torch.Generator().manual_seed(3))
    meta = meta_for([SamplingParams(temperature=1.0)] * 32, 100)
    assert Sampler(seed=5)(logits, meta).token_ids == Sampler(seed=5)(logits, meta).token_ids


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    support = expected > 0
    assert counts[~support].sum() == 0, "sampled a token of probability 0"
    return float(((counts[support] - expected[support]) ** 2 / expected[support]).sum())


def sample_counts(logits_row: torch.Tensor, params: SamplingParams, n: int = 20_000) -> torch.Tensor:
    vocab, batch = logits_row.numel(), 5_000
    sampler = Sampler(seed=11)
    meta = meta_for([params] * batch, vocab)
    counts = torch.zeros(vocab)
    for _ in range(n // batch):
        tokens = torch.tensor(sampler(logits_row.expand(batch, vocab), meta).token_ids)
        counts += torch.bincount(tokens, minlength=vocab)
    return counts


LOGITS8 = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0])


def test_temperature_one_matches_softmax() -> None:
    counts = sample_counts(LOGITS8, SamplingParams(temperature=1.0))
    assert chi_square(counts, torch.softmax(LOGITS8, -1)) < 24.3  # df=7, p=0.001


def test_temperature_half_matches_sharpened_softmax() -> None:
    counts = sample_counts(LOGITS8, SamplingParams(temperature=0.5))
    assert chi_square(counts, torch.softmax(LOGITS8 / 0.5, -1)) < 24.3


def test_top_k_and_top_p_renormalize() -> None:
    top3 = torch.softmax(LOGITS8.masked_fill(torch.arange(8) >= 3, float("-inf")), -1)
    assert chi_square(sample_counts(LOGITS8, SamplingParams(top_k=3)), top3) < 13.9  # df=2
    # softmax(LOGITS8) = .53 .20 .12 ...: the 0.75 nucleus is the top 3 tokens.
    assert chi_square(sample_counts(LOGITS8, SamplingParams(top_p=0.75)), top3) < 13.9


def test_wide_nucleus_and_wide_top_k() -> None:
    """Rows whose nucleus or top-k exceeds the first candidate windows."""
    vocab = 6_000
    rng = torch.Generator().manual_seed(4)
    flat = torch.randn(vocab, generator=rng) * 0.1
    params = [SamplingParams(top_p=0.9), SamplingParams(top_k=300, top_p=0.99),
              SamplingParams(top_k=5_000), SamplingParams(top_p=0.5, min_p=0.9),
              SamplingParams(top_k=40, temperature=0.5)]
    logits = flat.expand(len(params) * 40, vocab).clone()
    all_params = [p for p in params for _ in range(40)]
    tokens = Sampler(seed=4)(logits, meta_for(all_params, vocab)).token_ids
    for i, p in enumerate(params):
        allowed = allowed_mask(flat, p)
        assert all(allowed[t] for t in tokens[i * 40:(i + 1) * 40]), p


def test_penalties_follow_the_formulas() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0, 1.0],
                           [1.0, 1.0, -2.0, 0.25, -0.75, 0.0]])
    params = [SamplingParams(temperature=0, repetition_penalty=2.0, presence_penalty=0.5,
                             frequency_penalty=0.25),
              SamplingParams(temperature=0, repetition_penalty=1.0, frequency_penalty=-1.0)]
    prompts, outputs = [[0, 1, 1], [0]], [[2, 3, 3, 3], [4, 4, 1]]
    meta = meta_for(params, 6, prompts=prompts, outputs=outputs)
    got = apply_logits_processors_(logits.clone(), meta)

    expected = logits.clone()
    # Row 0: repetition over prompt+output {0,1,2,3}, then presence/frequency over outputs.
    expected[0, 0] = 2.0 / 2.0
    expected[0, 1] = -1.0 * 2.0
    expected[0, 2] = 0.5 / 2.0 - (0.5 + 0.25 * 1)
    expected[0, 3] = -0.5 * 2.0 - (0.5 + 0.25 * 3)
    # Row 1: no repetition penalty, frequency only (negative: rewards repeats); prompt ignored.
    expected[1, 4] = -0.75 + 1.0 * 2
    expected[1, 1] = 1.0 + 1.0 * 1
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)

    original = logits.clone()
    out = Sampler(seed=0)(logits, meta)
    assert torch.equal(logits, original), "the caller's logits were modified"
    assert out.token_ids == expected.argmax(-1).tolist() == [4, 1]
    # Reported logprobs stay those of the raw logits.
    raw = torch.log_softmax(logits, -1)
    torch.testing.assert_close(torch.tensor(out.logprobs), raw[[0, 1], [4, 1]])


def test_min_tokens_holds_off_eos_and_stop_ids() -> None:
    vocab, stop_id = 10, 7
    logits = torch.zeros(3, vocab)
    logits[:, EOS], logits[:, stop_id], logits[:, 3] = 9.0, 8.0, 1.0
    params = [SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[stop_id]),
              SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[stop_id], ignore_eos=True),
              SamplingParams(temperature=0.5, min_tokens=3, stop_token_ids=[stop_id])]
    out = Sampler(seed=0)(logits, meta_for(params, vocab, outputs=[[5, 5]] * 3))
    assert out.token_ids[:2] == [3, EOS]  # ignore_eos: eos is no stop, only stop ids are held
    assert out.token_ids[2] not in (EOS, stop_id)
    out = Sampler(seed=0)(logits[:2], meta_for(params[:2], vocab, outputs=[[5, 5, 5]] * 2))
    assert out.token_ids == [EOS, EOS]


def test_min_tokens_with_several_eos_ids() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]])
    meta = meta_for([SamplingParams(temperature=0, min_tokens=1)], 4, eos={0, 1})
    assert Sampler()(logits, meta).token_ids == [2]


def test_logit_bias_moves_the_pick_but_not_the_reported_logprobs() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]] * 3)
    params = [SamplingParams(temperature=0, logit_bias={4: 100.0}),   # forces the least likely token
              SamplingParams(temperature=0, logit_bias={0: -100.0}),  # bans the argmax
              SamplingParams(temperature=0, logit_bias={2: 2.5, 0: -0.25})]
    meta = meta_for(params, 5)
    got = apply_logits_processors_(logits.clone(), meta)
    expected = logits.clone()
    expected[0, 4] += 100.0
    expected[1, 0] -= 100.0
    expected[2, 2] += 2.5
    expected[2, 0] -= 0.25
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    out = Sampler(seed=0)(logits, meta)
    assert out.token_ids == [4, 1, 2]
    raw = torch.log_softmax(logits, -1)
    torch.testing.assert_close(torch.tensor(out.logprobs), raw[[0, 1, 2], [4, 1, 2]])


def test_allowed_token_ids_restrict_only_their_own_row() -> None:
    vocab = 40
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(9)) * 3
    allowed = [5, 17, 33]
    params = [SamplingParams(temperature=0, allowed_token_ids=allowed),
              SamplingParams(temperature=0),
              SamplingParams(temperature=1.5, allowed_token_ids=allowed),
              SamplingParams(temperature=1.5, seed=3, allowed_token_ids=[8])]
    sampler = Sampler(seed=0)
    seen = set()
    for _ in range(60):
        out = sampler(logits, meta_for(params, vocab))
        assert out.token_ids[0] == allowed[int(logits[0, allowed].argmax())]
        assert out.token_ids[1] == int(logits[1].argmax())  # its neighbours' sets do not reach it
        assert out.token_ids[2] in allowed and out.token_ids[3] == 8
        seen.add(out.token_ids[2])
    assert len(seen) > 1, "a temperature of 1.5 over three allowed tokens should draw more than one"


def test_allowed_tokens_then_min_tokens_ban() -> None:
    vocab, stop_id = 10, 7
    logits = torch.arange(vocab, dtype=torch.float32)[None].expand(2, vocab).contiguous()
    params = [SamplingParams(temperature=0, allowed_token_ids=[2, stop_id], min_tokens=2,
                             stop_token_ids=[stop_id])] * 2
    out = Sampler()(logits, meta_for(params, vocab, outputs=[[1], [1, 1]]))
    assert out.token_ids == [2, stop_id]  # held off before min_tokens, allowed after


def test_top_logprobs_and_ranks() -> None:
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(5)) * 2
    params = [SamplingParams(temperature=1.0, logprobs=3), SamplingParams(temperature=0),
              SamplingParams(temperature=0.8, logprobs=0, repetition_penalty=1.5),
              SamplingParams(temperature=0, logprobs=5)]
    out = Sampler(seed=5)(logits, meta_for(params, 30, outputs=[[1, 2]] * 4))
    lp = torch.log_softmax(logits, -1)
    for row, tok in enumerate(out.token_ids):
        assert abs(out.logprobs[row] - float(lp[row, tok])) < 1e-5
    assert out.top_logprobs is not None and out.ranks is not None
    for row, k in ((0, 3), (2, 0), (3, 5)):
        order = lp[row].argsort(descending=True).tolist()
        assert [t for t, _ in out.top_logprobs[row]] == order[:k]
        for t, v in out.top_logprobs[row]:
            assert abs(v - float(lp[row, t])) < 1e-5
        assert out.ranks[row] == order.index(out.token_ids[row]) + 1
    assert out.top_logprobs[1] == [] and out.ranks[1] == 0  # not requested
    assert out.ranks[3] == 1  # greedy picks the most likely


def test_mixed_batch_views_and_half_precision() -> None:
    vocab = 64
    wide = torch.randn(8, vocab + 10, generator=torch.Generator().manual_seed(6))
    logits = wide[:, :vocab]  # a non-contiguous view
    params = [SamplingParams(temperature=0) if i % 2 else SamplingParams(top_k=1) for i in range(8)]
    expected = logits.argmax(-1).tolist()
    assert Sampler(seed=0)(logits, meta_for(params, vocab)).token_ids == expected
    half = logits.to(torch.bfloat16)
    assert Sampler(seed=0)(half, meta_for(params, vocab)).token_ids == half.float().argmax(-1).tolist()


def test_empty_batch() -> None:
    out = Sampler()(torch.empty(0, 10), meta_for([], 10))
    assert out.token_ids == [] and out.logprobs == []


@st.composite
def sampling_case(draw):
    vocab = draw(st.integers(2, 60))
    logits = draw(st.lists(st.floats(-8, 8, width=32), min_size=vocab, max_size=vocab))
    params = SamplingParams(
        temperature=draw(st.floats(0.05, 3.0)),
        top_k=draw(st.one_of(st.just(-1), st.integers(1, vocab + 2))),
        top_p=draw(st.one_of(st.just(1.0), st.floats(1e-3, 1.0))),
        min_p=draw(st.one_of(st.just(0.0), st.floats(0.0, 1.0))),
        seed=draw(st.one_of(st.none(), st.integers(0, 2**31))),
    )
    return torch.tensor(logits), params


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=sampling_case())
def test_sampled_tokens_stay_in_the_allowed_set(case) -> None:
    logits_row, params = case
    batch, vocab = 48, logits_row.numel()
    meta = meta_for([params] * batch, vocab)
    tokens = Sampler(seed=0)(logits_row.expand(batch, vocab), meta).token_ids
    allowed = allowed_mask(logits_row, params)
    assert all(allowed[t] for t in tokens), (tokens, allowed.nonzero().flatten().tolist())


# ---- a row that cannot be sampled fails alone -------------------------------------------------
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=0.7, top_p=0.9, min_p=0.05),
    SamplingParams(temperature=1.0, repetition_penalty=1.3, seed=4),
    SamplingParams(temperature=0, logprobs=3),
])
def test_non_finite_logits_fail_their_row_only(poison, params) -> None:
    vocab = 300
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(12)) * 2
    healthy = SamplingParams(temperature=0, logprobs=2)
    rows = [healthy, params, healthy, params]
    alone = Sampler(seed=3)(logits, meta_for(rows, vocab, outputs=[[7]] * 4))
    poisoned = logits.clone()
    poisoned[1, 17] = poison
    out = Sampler(seed=3)(poisoned, meta_for(rows, vocab, outputs=[[7]] * 4))
    assert out.errors == {1: "non_finite_logits"}
    for row in (0, 2, 3):  # the rows beside it are sampled as if it were fine
        assert out.token_ids[row] == alone.token_ids[row]
        assert out.logprobs[row] == pytest.approx(alone.logprobs[row], abs=1e-6)
    assert all(math.isfinite(x) for x in out.logprobs)
    assert 0 <= out.token_ids[1] < vocab


def test_a_row_with_nothing_left_to_pick_fails_alone() -> None:
    vocab = 20
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(13))
    # Only token 4 is allowed, and min_tokens holds it off as a stop token: nothing is left.
    trapped = SamplingParams(temperature=0.8, allowed_token_ids=[4], stop_token_ids=[4], min_tokens=3)
    out = Sampler(seed=0)(logits, meta_for([SamplingParams(temperature=0), trapped, SamplingParams(temperature=0)],
                                           vocab))
    assert out.errors == {1: "no_token_allowed"}
    assert out.token_ids[0] == int(logits[0].argmax()) and out.token_ids[2] == int(logits[2].argmax())


def test_inverse_cdf_stays_in_range_on_nan_weights() -> None:
    from pagellm.worker.sampler import _inverse_cdf_

    weights = torch.tensor([[0.1, float("nan"), 0.3], [0.0, 0.0, 0.0]])
    picked = _inverse_cdf_(weights, torch.tensor([0.5, 0.5]))
    assert picked.tolist()[0] in range(3) and picked.tolist()[1] in range(3)


def test_seeded_uniform_is_a_pure_uniform_function_of_seed_and_index() -> None:
    from pagellm.worker.sampler import seeded_uniform

    assert seeded_uniform(7, 3) == seeded_uniform(7, 3)
    draws = [seeded_uniform(seed, k) for seed in (-2**63, -1, 0, 1, 2**63 - 1) for k in range(2000)]
    assert all(0.0 <= u < 1.0 for u in draws)
    assert len(set(draws)) > 0.99 * len(draws)
    counts = torch.histc(torch.tensor(draws, dtype=torch.float64), bins=10, min=0, max=1)
    assert chi_square(counts, torch.full((10,), 0.1)) < 27.9  # df=9, p=0.001


def test_each_logits_rule_is_used_only_by_the_rows_that_ask() -> None:
    """A rule no row uses has no state this step (it costs nothing); one row using it gives
    exactly that rule a state."""
    import torch as _torch

    from pagellm.sampling_params import ReasoningBudget, StructuredOutputsParams
    from pagellm.worker.logits_processors import LOGITS_PROCESSORS

    vocab = 8
    plain = SamplingParams(temperature=0)
    asks = {"repetition_penalty": SamplingParams(repetition_penalty=1.5),
            "presence_frequency_penalty": SamplingParams(presence_penalty=0.5),
            "logit_bias": SamplingParams(logit_bias={3: 1.0}),
            "allowed_token_ids": SamplingParams(allowed_token_ids=[2, 3]),
            "min_tokens": SamplingParams(min_tokens=2, max_tokens=4),
            "grammar": SamplingParams(structured_outputs=StructuredOutputsParams(regex="a")),
            # The budget of 1 is spent by the one output token: the close's first token is due.
            "reasoning_budget": SamplingParams(reasoning_budget=ReasoningBudget(1, (6, 7), (7,)))}
    assert set(asks) == {rule.name for rule in LOGITS_PROCESSORS}
    assert not meta_for([plain, plain], vocab, outputs=[[4], [5]]).adjustments
    for name, params in asks.items():
        masks = [None, _torch.tensor([0b1010], dtype=_torch.int32)] if name == "grammar" else None
        meta = SamplingMetadata.build([plain, params], [[1, 2], [1, 2]], [[4], [5]], {EOS}, vocab,
                                      token_bitmasks=masks)
        assert [rule.name for rule, _ in meta.adjustments] == [name]


def test_the_reasoning_budget_forces_the_close_once_spent_and_only_then() -> None:
    """Budget 2 inside <think> (id 3), close "</think>" (6, 7): two free tokens, then 6 and 7 are
    forced whatever the logits (even against allowed_token_ids), then the answer is free again; a
    reasoning that closed by itself (7) before the budget is spent is left alone."""
    from pagellm.sampling_params import ReasoningBudget

    vocab = 8
    budget = ReasoningBudget(2, close_token_ids=(6, 7), end_token_ids=(7,), start_token_ids=(3,))
    logits = torch.zeros(1, vocab)
    logits[0, 4] = 5.0

    def picked(output: list[int], **kwargs) -> int:
        params = SamplingParams(temperature=0, reasoning_budget=budget, **kwargs)
        meta = meta_for([params], vocab, outputs=[output])
        return int(apply_logits_processors_(logits.clone(), meta)[0].argmax())

    assert picked([3, 4]) == 4                     # one token spent of two
    assert picked([3, 4, 4]) == 6                  # spent: the close begins
    assert picked([3, 4, 4, 6], allowed_token_ids=[4, 5]) == 7
    assert picked([3, 4, 4, 6, 7]) == 4            # closed: the answer runs
    assert picked([3, 7, 4]) == 4                  # closed by itself before the budget
    assert picked([4, 4, 4]) == 4                  # never opened: no reasoning to bound
    opened = ReasoningBudget(0, close_token_ids=(6, 7), end_token_ids=(7,))  # the prompt opened it
    meta = meta_for([SamplingParams(temperature=0, reasoning_budget=opened)], vocab, outputs=[[]])
    assert int(apply_logits_processors_(logits.clone(), meta)[0].argmax()) == 6
    with pytest.raises(ValueError, match="thinking_token_budget"):
        from pagellm.sampling_params import StructuredOutputsParams

        SamplingParams(reasoning_budget=budget, structured_outputs=StructuredOutputsParams(regex="a"))

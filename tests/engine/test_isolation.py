"""One request can never fail another: a step whose batch raises is bisected until the
request that fails alone is found; logits that cannot be sampled fail their own row."""
from __future__ import annotations

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.errors import EngineFatalError

PROMPTS = [[3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13, 14], [15, 16], [17, 18, 19, 20], [21, 22, 23]]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(tiny_llama_dir, block_size=4, num_kv_blocks=96, max_model_len=256)


def requests() -> list[tuple[str, list[int], SamplingParams]]:
    """Greedy, seeded, and n > 1 requests side by side."""
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=8, ignore_eos=True)
    forked = SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    kinds = [greedy, seeded, forked, greedy, seeded, greedy]
    return [(f"r{i}", p, kinds[i]) for i, p in enumerate(PROMPTS)]


def run(llm: LLM, reqs) -> dict:
    eng = llm.engine
    for rid, prompt, params in reqs:
        eng.add_request(rid, {"prompt_token_ids": prompt}, params)
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    s = llm.stats()
    assert s["free_blocks"] == s["total_blocks"] and s["num_running"] == s["num_waiting"] == 0
    return done


def tokens(out) -> list[list[int]]:
    return [c.token_ids for c in out.outputs]


@pytest.fixture()
def clean(llm) -> dict:
    return {rid: tokens(out) for rid, out in run(llm, requests()).items()}


def poison_runner(monkeypatch, llm: LLM, fails) -> list[int]:
    """Make the runner raise, as a bug deep in the model would, on any batch `fails(ids)` picks."""
    runner = llm.engine.runner
    real = runner.execute
    sizes = []

    def execute(plan, eos):
        sizes.append(len(plan.seqs))
        if fails({s.user_request_id for s in plan.seqs}):
            raise RuntimeError("kernel fault")
        return real(plan, eos)

    monkeypatch.setattr(runner, "execute", execute)
    return sizes


@pytest.mark.parametrize("culprits", [{"r2"}, {"r0", "r4"}])
def test_a_request_that_breaks_the_batch_fails_alone(llm, clean, monkeypatch, culprits):
    eng = llm.engine
    before = eng.stats()
    sizes = poison_runner(monkeypatch, llm, lambda ids: bool(ids & culprits))
    done = run(llm, requests())
    for rid, out in done.items():
        if rid in culprits:
            assert out.error == "RuntimeError: kernel fault" and out.outputs == []
        else:  # every other request, greedy or seeded, gives exactly what it gives in a clean run
            assert out.error is None and tokens(out) == clean[rid], rid
    after = eng.stats()
    assert after.request_failures.get("step_error", 0) - before.request_failures.get("step_error", 0) \
        == len(culprits)
    assert after.num_step_failures > before.num_step_failures
    assert max(sizes) == len(PROMPTS)  # the batch really ran whole before the fault was found


def test_a_fault_of_the_whole_batch_only_is_worked_around(llm, clean, monkeypatch):
    """A fault no single request causes (here: any batch of more than two sequences) fails no one:
    the step's halves ran clean, and their results are the step's."""
    poison_runner(monkeypatch, llm, lambda ids: len(ids) > 2)
    done = run(llm, requests())
    assert {rid: tokens(out) for rid, out in done.items()} == clean
    assert all(out.error is None for out in done.values())


def test_fatal_errors_are_not_bisected(llm, monkeypatch):
    calls = []

    def execute(plan, eos):
        calls.append(len(plan.seqs))
        raise EngineFatalError("a rank died")

    monkeypatch.setattr(llm.engine.runner, "execute", execute)
    llm.engine.add_request("fatal", {"prompt_token_ids": [3, 4]}, SamplingParams(max_tokens=2))
    with pytest.raises(EngineFatalError):
        llm.engine.step()
    assert calls == [1]
    llm.engine.abort_request("fatal")


def test_non_finite_logits_fail_their_request_and_leave_no_trace(llm, clean):
    """A model that produces NaN for one sequence (here: a token whose embedding is NaN) fails that
    request only; its KV blocks, full of NaN, go back to the pool, and the requests that reuse them
    still give the clean tokens."""
    embed = llm.engine.runner.model.embed_tokens.weight
    poison = 200
    saved = embed[poison].clone()
    try:
        with torch.no_grad():
            embed[poison] = float("nan")
        reqs = requests()
        reqs.insert(3, ("nan", [3, 4, poison, 5, 6, 7], SamplingParams(temperature=0.8, max_tokens=8)))
        done = run(llm, reqs)
        assert "not finite" in done["nan"].error
        for rid, toks in clean.items():
            assert done[rid].error is None and tokens(done[rid]) == toks, rid
        assert llm.stats()["request_failures"]["non_finite_logits"] >= 1
    finally:
        with torch.no_grad():
            embed[poison] = saved
    # Every block of the pool has been handed out by now (96 blocks, the run above reused them);
    # a second run over blocks that held NaN still matches.
    again = run(llm, requests() + [(f"fill{i}", [30 + i] * 40, SamplingParams(temperature=0, max_tokens=4))
                                   for i in range(5)])
    for rid, toks in clean.items():
        assert tokens(again[rid]) == toks, rid


def test_abort_in_the_middle_of_a_chunked_prefill(tiny_llama_dir):
    """A long prompt prefilled 8 tokens a step is aborted half way: its blocks are back at once,
    and the request beside it gives transformers' tokens."""
    import transformers

    from tests.conftest import hf_greedy

    llm = LLM(tiny_llama_dir, block_size=4, num_kv_blocks=64, max_num_batched_tokens=8)
    eng = llm.engine
    long, short = list(range(3, 63)), [70, 71, 72, 73, 74]
    eng.add_request("long", {"prompt_token_ids": long}, SamplingParams(max_tokens=4))
    eng.add_request("short", {"prompt_token_ids": short}, SamplingParams(temperature=0, max_tokens=6,
                                                                         ignore_eos=True))
    for _ in range(3):
        eng.step()
    req = eng.scheduler.requests["long"]
    assert 0 < req.num_computed_tokens < len(long)  # really mid-prefill
    held = len(eng.kv.block_table("long"))
    free = llm.stats()["free_blocks"]
    eng.abort_request("long")
    assert llm.stats()["free_blocks"] == free + held
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            done[out.request_id] = out
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    assert done["short"].outputs[0].token_ids == hf_greedy(hf, short, 6)
    assert "long" not in done
    s = llm.stats()
    assert s["free_blocks"] == s["total_blocks"]


def test_a_row_that_cannot_be_sampled_fails_its_whole_request_and_only_it(llm, clean, monkeypatch):
    """The sampler gives up on one sequence of an n=2 request (its sibling sampled fine): the whole
    request fails, the sibling's token is not applied, and every other request is untouched."""
    runner = llm.engine.runner
    real = runner.execute

    def execute(plan, eos):
        result = real(plan, eos)
        if "r2#1" in result.request_ids:
            result.sampled.errors = {**(result.sampled.errors or {}), result.request_ids.index("r2#1"):
                                     "non_finite_logits"}
        return result

    monkeypatch.setattr(runner, "execute", execute)
    done = run(llm, requests())
    assert "not finite" in done["r2"].error
    for rid, toks in clean.items():
        if rid != "r2":
            assert done[rid].error is None and tokens(done[rid]) == toks, rid

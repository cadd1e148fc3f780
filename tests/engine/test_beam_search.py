"""Beam search against Hugging Face transformers, and its use of shared blocks."""
from __future__ import annotations

import random

import pytest
import torch
import transformers

from pagellm import LLM, BeamSearchParams


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 320) for _ in range(n)]


def hf_beam(model, prompt: list[int], width: int, max_tokens: int, length_penalty: float, eos) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width, do_sample=False,
                             early_stopping=True, length_penalty=length_penalty, max_new_tokens=max_tokens,
                             eos_token_id=eos, pad_token_id=0)
    gen = out[0, len(prompt):].tolist()
    if eos is not None and eos in gen:
        gen = gen[:gen.index(eos) + 1]
    return gen


@pytest.fixture(scope="module")
def models(tiny_llama_dir):
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    return hf, LLM(tiny_llama_dir, block_size=4, num_kv_blocks=600)


@pytest.mark.parametrize("width, length_penalty", [(2, 1.0), (4, 1.0), (3, 0.5)])
def test_best_beam_matches_transformers(models, width, length_penalty):
    hf, llm = models
    prompts = [_ids(30 + i, 5 + 7 * i) for i in range(3)]
    params = BeamSearchParams(beam_width=width, max_tokens=10, length_penalty=length_penalty, ignore_eos=True)
    results = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, res in zip(prompts, results):
        assert res.sequences[0].token_ids == hf_beam(hf, prompt, width, 10, length_penalty, None)
        scores = [s.score for s in res.sequences]
        assert scores == sorted(scores, reverse=True) and len(scores) == width
    s = llm.stats()
    assert s["used_blocks"] == 0 and not any(llm.engine.kv.pool.ref_cnt)


def test_beams_stop_at_eos_like_transformers(tiny_llama_dir, models):
    """The tiny model never predicts its real eos, so make a token it often predicts
    the eos on both sides: beams then end early, and finished hypotheses compete."""
    hf, _ = models
    prompts = [_ids(100 + seed, 6) for seed in range(12)]
    counts: dict[int, int] = {}
    for p in prompts:
        for t in hf_beam(hf, p, 3, 12, 1.0, None):
            counts[t] = counts.get(t, 0) + 1
    eos = max(counts, key=counts.get)
    llm = LLM(tiny_llama_dir, block_size=4, num_kv_blocks=600)
    llm.engine.eos_token_ids = frozenset({eos})
    best_ended = hyps_ended = 0
    for p in prompts:
        want = hf_beam(hf, p, 3, 12, 1.0, eos)
        res = llm.beam_search({"prompt_token_ids": p}, BeamSearchParams(3, 12))[0]
        assert res.sequences[0].token_ids == want
        best_ended += want[-1] == eos and len(want) < 12
        hyps_ended += sum(s.token_ids[-1] == eos for s in res.sequences)
    assert best_ended >= 1 and hyps_ended >= 3
    assert llm.stats()["used_blocks"] == 0


def test_beams_share_blocks_by_reference(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, block_size=4, num_kv_blocks=300)
    eng = llm.engine
    eng.add_beam_request("b", {"prompt_token_ids": _ids(9, 21)}, BeamSearchParams(4, 12, ignore_eos=True))
    peak_shared, best_saving = 0, 0.0
    while eng.has_unfinished_requests():
        eng.step()
        ref = eng.kv.pool.ref_cnt
        peak_shared = max(peak_shared, sum(1 for c in ref if c > 1))
        tables = list(eng.kv.block_tables.values())
        held = [b for t in tables for b in t]
        # In use: exactly the distinct blocks the beams' tables hold, each counted once however
        # many beams hold it (reference counts match); unshared, every beam would hold its own.
        assert llm.stats()["used_blocks"] == len(set(held))
        assert all(ref[b] == held.count(b) for b in set(held))
        if len(tables) == 4:
            best_saving = max(best_saving, 1 - len(set(held)) / len(held))
    assert peak_shared >= 5  # the 5 full prompt blocks are shared by every beam
    assert best_saving >= 0.5  # at some step, 4 beams held at most half the blocks they would alone
    assert llm.stats()["used_blocks"] == 0


def test_beam_search_under_preemption_matches_transformers(tiny_llama_dir):
    """Four beam searches of width 3 in a pool that cannot hold them all: beams are preempted and
    recomputed, and each best beam is still transformers' best beam."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    prompts = [_ids(40 + i, 9 + 4 * i) for i in range(4)]
    llm = LLM(tiny_llama_dir, block_size=4, num_kv_blocks=40)
    results = llm.beam_search([{"prompt_token_ids": p} for p in prompts], BeamSearchParams(3, 14, ignore_eos=True))
    assert llm.stats()["num_preemptions"] > 0
    for p, res in zip(prompts, results):
        assert res.sequences[0].token_ids == hf_beam(hf, p, 3, 14, 1.0, None)
    assert llm.stats()["used_blocks"] == 0


def test_beam_search_bad_params():
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(0, 5)
    with pytest.raises(ValueError, match="max_tokens"):
        BeamSearchParams(2, 0)

"""The prefix cache's second tier on disk, through the engine: contexts that outgrow the pool
come back from the tier instead of being recomputed, with the tokens of a run without it; a tier
file corrupted or truncated while the engine runs costs recomputation, never wrong tokens; a
persisted tier warms a restarted engine; what it cannot serve is refused at start-up."""
from __future__ import annotations

import os
import random

import pytest

from pagellm import LLM, SamplingParams

# The second tier's file, far above what these tiny models' blocks need: the default (4 GiB) is
# allocated on disk for each test, and the runs pytest keeps filled the disk.
TIER_BYTES = 64 << 20
ENGINE = dict(block_size=4, num_kv_blocks=40)
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)


def _rounds() -> list[list[dict]]:
    """Six 60-token documents (15 blocks each, 90 blocks against a pool of 40), asked about twice:
    the second round's contexts were evicted from the pool by the time they come back."""
    rng = random.Random(0)
    docs = [[rng.randrange(3, 320) for _ in range(60)] for _ in range(6)]
    return [[{"prompt_token_ids": d + [rng.randrange(3, 320) for _ in range(5)]} for d in docs] for _ in range(2)]


def _run(llm: LLM, prompts: list[dict]) -> list:
    outs = []
    for p in prompts:  # one at a time, as turns of separate conversations arrive
        outs += llm.generate([p], PARAMS, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                                           o.outputs[0].token_ids)]) for o in outs]


def _assert_same(want, got) -> None:
    for (wt, wl), (gt, gl) in zip(want, got, strict=True):
        assert gt == wt
        assert gl == pytest.approx(wl, abs=1e-4)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, **ENGINE)
    first, second = _rounds()
    out = _run(llm, first), _run(llm, second), llm.stats()
    llm.shutdown()
    return out


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_evicted_prefixes_come_back_from_the_tier(tiny_llama_dir, tmp_path, reference, kv_cache_dtype):
    first, second = _rounds()
    plain = LLM(tiny_llama_dir, kv_cache_dtype=kv_cache_dtype, **ENGINE)
    want = _run(plain, first) + _run(plain, second)
    without = plain.stats()["prompt_tokens_computed"]
    plain.shutdown()
    llm = LLM(tiny_llama_dir, kv_cache_dtype=kv_cache_dtype,
              kv_offload_size=TIER_BYTES, kv_offload_dir=str(tmp_path), **ENGINE)
    got = _run(llm, first) + _run(llm, second)
    stats = llm.stats()
    _assert_same(want, got)
    tier = stats["kv_offload"]
    assert tier["demoted_blocks"] > 0 and tier["promoted_blocks"] >= 6 * 14 and tier["corrupt"] == 0
    # Each second-round prompt recomputes only its last, partial block (and a token of the last
    # full one), not its 60-token document.
    assert stats["prompt_tokens_computed"] <= without - 6 * 14 * 4
    path = tier["path"]
    llm.shutdown()
    assert not os.path.exists(path)


def _first_round_on_a_small_tier(tiny_llama_dir, tmp_path, reference):
    """An engine with a 1 MiB tier (128 slots: the default 4 GiB would be 524,288 slots of this
    model's blocks to damage one by one) after the first round, checked and written out: (the
    second round's expected outputs, its prompts, the engine, its tier)."""
    want_first, want_second, _ = reference
    first, second = _rounds()
    llm = LLM(tiny_llama_dir, kv_offload_dir=str(tmp_path), kv_offload_size=1 << 20, **ENGINE)
    _assert_same(want_first, _run(llm, first))
    tier = llm.engine.kv_tier
    tier.flush()
    return want_second, second, llm, tier


@pytest.mark.parametrize("damage", ["corrupt", "truncate"])
def test_a_damaged_tier_file_costs_recomputation_not_tokens(tiny_llama_dir, tmp_path, reference, damage):
    want_second, second, llm, tier = _first_round_on_a_small_tier(tiny_llama_dir, tmp_path, reference)
    if damage == "corrupt":  # every slot's payload overwritten while the engine runs
        with open(tier.path, "r+b") as f:
            for slot in range(tier.num_slots):
                f.seek(slot * tier.slot_bytes + 4096)
                f.write(os.urandom(64))
    else:
        os.truncate(tier.path, 0)
    _assert_same(want_second, _run(llm, second))
    # Every damaged entry read was refused (blocks demoted after the damage still come back).
    assert llm.stats()["kv_offload"]["corrupt"] > 0
    llm.shutdown()


def test_a_full_disk_skips_writes_and_serves_the_same_tokens(tiny_llama_dir, tmp_path, reference, caplog):
    """The volume fills up under a running engine (/dev/full put under the tier's descriptor: the
    kernel answers ENOSPC to every write, zeros to every read): blocks are no longer kept, each
    skipped write is counted, one warning says why, and the tokens are those of a run without it."""
    want_second, second, llm, tier = _first_round_on_a_small_tier(tiny_llama_dir, tmp_path, reference)
    full = os.open("/dev/full", os.O_RDWR)
    os.dup2(full, tier._fd)
    os.close(full)
    _assert_same(want_second, _run(llm, second))
    tier.flush()
    stats = llm.stats()["kv_offload"]
    assert stats["write_errors_by_cause"].keys() == {"ENOSPC"} and stats["write_errors"] > 10
    assert stats["corrupt"] > 0  # what was on the "disk" reads back as zeros: refused, recomputed
    warnings = [r for r in caplog.records if r.levelname == "WARNING" and "ENOSPC" in r.getMessage()]
    assert len(warnings) == 1
    llm.shutdown()


def test_a_persisted_file_damaged_between_runs_keeps_its_intact_entries(tiny_llama_dir, tmp_path, reference):
    """Between two runs, some slots of the persisted file are overwritten and its end is cut off:
    the restarted engine starts, refuses those entries by their checksums, brings the others back,
    and answers with the same tokens."""
    want_first, want_second, _ = reference
    first, second = _rounds()
    tier_args = dict(kv_offload_dir=str(tmp_path), kv_offload_persist=True, kv_offload_size=1 << 20)  # 128 slots
    llm = LLM(tiny_llama_dir, **tier_args, **ENGINE)
    _assert_same(want_first, _run(llm, first))
    tier = llm.engine.kv_tier
    tier.flush()  # demoted blocks are written by the tier's thread: count them once they are on disk
    path, slot_bytes, stored = tier.path, tier.slot_bytes, tier.stats().blocks
    llm.shutdown()
    with open(path, "r+b") as f:
        for slot in range(0, 24, 3):  # every third of the first 24 slots: a payload byte flipped
            f.seek(slot * slot_bytes + 4096 + 7)
            b = f.read(1)
            f.seek(slot * slot_bytes + 4096 + 7)
            f.write(bytes([b[0] ^ 0x55]))
    os.truncate(path, 60 * slot_bytes + 5000)  # a crash while the file was copied: the rest is gone
    assert stored > 60
    again = LLM(tiny_llama_dir, **tier_args, **ENGINE)
    _assert_same(want_second, _run(again, second))
    tier = again.stats()["kv_offload"]
    assert tier["corrupt"] > 0 and tier["promoted_blocks"] >= 30
    again.shutdown()


def test_a_persisted_tier_warms_a_restarted_engine(tiny_llama_dir, tmp_path, reference):
    want_first, want_second, ref_stats = reference
    first, second = _rounds()
    llm = LLM(tiny_llama_dir,
              kv_offload_size=TIER_BYTES, kv_offload_dir=str(tmp_path), kv_offload_persist=True, **ENGINE)
    _assert_same(want_first, _run(llm, first))
    llm.shutdown()
    again = LLM(tiny_llama_dir,
                kv_offload_size=TIER_BYTES, kv_offload_dir=str(tmp_path), kv_offload_persist=True, **ENGINE)
    _assert_same(want_second, _run(again, second))
    stats = again.stats()
    assert stats["kv_offload"]["promoted_blocks"] >= 6 * 14
    assert stats["prompt_tokens_computed"] < ref_stats["prompt_tokens_computed"] / 2
    again.shutdown()


def test_a_sliding_window_model_gets_the_tokens_of_a_run_without_the_tier(tmp_path_factory):
    """Gemma 2 (a window of 8 beside full layers, in two KV groups): evicted prefixes come back from
    the tier, every full block and the sliding blocks inside the window, with the tokens of a run
    without it."""
    from tests.models.families import build

    path = str(build("gemma2", tmp_path_factory.mktemp("gemma2")))
    rng = random.Random(1)
    docs = [[rng.randrange(3, 320) for _ in range(40)] for _ in range(4)]
    rounds = [[{"prompt_token_ids": d + [rng.randrange(3, 320) for _ in range(3)]} for d in docs] for _ in range(2)]
    engine = dict(block_size=4, num_kv_blocks=20)  # 40 block ids of one group: about two documents
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1)

    def run(**kw):
        llm = LLM(path, **engine, **kw)
        outs = []
        for p in rounds[0] + rounds[1]:
            outs += llm.generate([p], params, use_tqdm=False)
        stats = llm.stats()
        llm.shutdown()
        return [(list(o.outputs[0].token_ids), [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                                              o.outputs[0].token_ids)])
                for o in outs], stats

    want, without = run()
    got, stats = run(kv_offload_size=TIER_BYTES, kv_offload_dir=str(tmp_path_factory.mktemp("tier")))
    _assert_same(want, got)
    assert [g["kind"] for g in stats["kv_groups"]] == ["full", "sliding"]
    tier = stats["kv_offload"]
    # Per second-round document: its 10 full blocks and the 2 sliding ones its window needs.
    assert tier["promoted_blocks"] >= 4 * 12 and tier["corrupt"] == 0
    assert stats["prompt_tokens_computed"] <= without["prompt_tokens_computed"] - 4 * 36


# Qwen3.5's state is the same kind of blocks as LFM2's: the slow sweep adds it.
@pytest.mark.parametrize("family", ["lfm2", pytest.param("qwen3_5", marks=pytest.mark.slow)])
def test_a_recurrent_model_swaps_and_offloads_its_state(family, tmp_path_factory):
    """LFM2 (short convolutions) and Qwen3.5 (Gated DeltaNet) keep a state per sequence in the pool.
    Swapped, a victim's state goes to the tier with its attention blocks and comes back with them:
    the tokens of a run that never preempts. LFM2's state is one block a group, so a victim always
    finds room to bring it back and computes no token twice; Qwen3.5's takes several, and a victim
    admitted while the pool cannot hold its checkpoint beside its own state blocks resumes from an
    earlier checkpoint, recomputing less than preemption by recomputation would. Then the same
    prompts again after others pushed them out: their blocks and the checkpoints at their ends come
    back from the tier."""
    from tests.models.families import build

    path = str(build(family, tmp_path_factory.mktemp(family)))
    rng = random.Random(5)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 320) for _ in range(rng.randrange(9, 20))]} for _ in range(6)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=1)

    def run(rounds: int = 1, **kw):
        llm = LLM(path, **{**ENGINE, "num_kv_blocks": 16, **kw})  # block ids a group: 16 of the pool's 48
        outs = []
        for _ in range(rounds):
            outs += llm.generate(prompts, params, use_tqdm=False)
        stats = llm.stats()
        llm.shutdown()
        return [(list(o.outputs[0].token_ids), [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                                              o.outputs[0].token_ids)])
                for o in outs], stats

    want, roomy = run(num_kv_blocks=256)
    got, swap = run(
                    kv_offload_size=TIER_BYTES, kv_offload_dir=str(tmp_path_factory.mktemp("tier")),
                    preemption_mode="swap")
    _assert_same(want, got)
    assert roomy["num_preemptions"] == 0 and swap["num_swaps"] == swap["num_preemptions"] > 0
    if family == "lfm2":
        assert swap["tokens_computed"] == roomy["tokens_computed"]
    else:
        _, recompute = run(kv_offload_size=TIER_BYTES, kv_offload_dir=str(tmp_path_factory.mktemp("tier-r")))
        assert roomy["tokens_computed"] <= swap["tokens_computed"] < recompute["tokens_computed"]
    again, stats = run(rounds=2, kv_offload_size=TIER_BYTES, kv_offload_dir=str(tmp_path_factory.mktemp("tier2")))
    _assert_same(want + want, again)
    assert stats["kv_offload"]["promoted_blocks"] > 0 and stats["kv_offload"]["corrupt"] == 0


def test_what_the_tier_cannot_serve_is_refused(tiny_llama_dir, tmp_path):
    with pytest.raises(ValueError, match="kv_offload_dir needs enable_prefix_caching"):
        LLM(tiny_llama_dir, kv_offload_size=TIER_BYTES, kv_offload_dir=str(tmp_path), enable_prefix_caching=False)
    with pytest.raises(ValueError, match="kv_offload_dir needs kv_policy 'paged'"):
        LLM(tiny_llama_dir, kv_offload_size=TIER_BYTES, kv_offload_dir=str(tmp_path), kv_policy="contiguous-max")
    with pytest.raises(ValueError, match="kv_offload_size must be a byte count"):
        LLM(tiny_llama_dir, kv_offload_dir=str(tmp_path), kv_offload_size=0.5)


def test_swapped_requests_resume_from_the_tier_with_the_tokens_of_recomputation(tiny_llama_dir, tmp_path):
    """Six sequences that grow to 14 blocks each in a pool of 40 preempt one another; swapped, a
    victim's blocks (its last, partial one included) come back from the tier when it resumes, so
    its context is not computed again; the tokens are those of preemption by recomputation."""
    rng = random.Random(4)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 320) for _ in range(rng.randrange(9, 20))]} for _ in range(6)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1)

    def run(**kw):  # int8 KV: the blocks moved hold codes and scales
        llm = LLM(tiny_llama_dir, kv_cache_dtype="int8", **{**ENGINE, **kw})
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.stats()
        llm.shutdown()
        return [(list(o.outputs[0].token_ids), [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                                              o.outputs[0].token_ids)])
                for o in outs], stats

    want, roomy = run(num_kv_blocks=256)  # no preemption
    recomputed, recompute = run(kv_offload_size=TIER_BYTES, kv_offload_dir=str(tmp_path / "r"))
    got, swap = run(kv_offload_size=TIER_BYTES, kv_offload_dir=str(tmp_path / "s"), preemption_mode="swap")
    _assert_same(want, recomputed)
    _assert_same(want, got)
    assert roomy["num_preemptions"] == 0
    assert recompute["num_preemptions"] > 0 and recompute["num_swaps"] == 0
    assert swap["num_swaps"] == swap["num_preemptions"] > 0
    assert swap["kv_offload"]["swapped_out_requests"] == swap["num_swaps"]
    # A swapped victim computes no token twice: exactly the forward passes of a run that never
    # preempts. Recomputation computes what its victims' blocks held again.
    assert swap["tokens_computed"] == roomy["tokens_computed"] < recompute["tokens_computed"]
    auto_out, auto = run(kv_offload_size=TIER_BYTES, kv_offload_dir=str(tmp_path / "a"), preemption_mode="auto")
    _assert_same(want, auto_out)
    assert auto["num_preemptions"] > 0


def test_swapping_needs_the_tier(tiny_llama_dir):
    with pytest.raises(ValueError, match="preemption_mode 'swap' moves KV blocks to the second tier: it needs "
                                         "kv_offload_dir"):
        LLM(tiny_llama_dir, preemption_mode="swap")

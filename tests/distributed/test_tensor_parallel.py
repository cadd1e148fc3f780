"""Tensor parallelism on the CPU with gloo: 2 ranks give the tokens and logits of 1 rank,
hold half the weights and KV, and fail fast (and leave no process behind) when a rank dies."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from pagellm import LLM, BeamSearchParams, SamplingParams
from pagellm.config import EngineConfig
from pagellm.distributed.driver import TensorParallelError
from pagellm.config import engine_kwargs
from pagellm.cli import build_parser
from pagellm.loader.synthetic import write_dummy_model_dir
from tests.conftest import _save

# The second tier's file, far above what these tiny models' blocks need: the default (4 GiB) is
# allocated on disk for each test, and the runs pytest keeps filled the disk.
TIER_BYTES = 64 << 20
ENGINE = dict(block_size=4, num_kv_blocks=40, max_num_seqs=8)
PREFIX = list(range(3, 30))  # 27 tokens: 6 full blocks of 4 that later prompts share


def _prompts(salt: int) -> list[dict]:
    return [{"prompt_token_ids": PREFIX + [40 + salt + i, 50 + i, 60 + 2 * i]} for i in range(6)]


def _run(llm: LLM) -> tuple[list, dict]:
    """A workload that preempts (40 blocks for 6 sequences that grow to 12 blocks each), hits
    the prefix cache (the second batch shares the first's prefix), and forks sequences that
    copy-on-write their shared last block (n=2)."""
    greedy = SamplingParams(temperature=0, max_tokens=16, logprobs=3, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": PREFIX}], greedy, use_tqdm=False)
    outs += llm.generate(_prompts(0), greedy, use_tqdm=False)
    outs += llm.generate(_prompts(1)[:2], SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=8,
                                                           ignore_eos=True, logprobs=2), use_tqdm=False)
    beams = llm.beam_search([{"prompt_token_ids": PREFIX[:11]}, {"prompt_token_ids": PREFIX[5:]}],
                            BeamSearchParams(3, 10, ignore_eos=True))
    return outs, llm.stats(), beams


def _assert_same(ref: list, got: list, atol: float = 1e-4) -> None:
    for a, b in zip(ref, got, strict=True):
        assert a.num_cached_tokens == b.num_cached_tokens
        for ca, cb in zip(a.outputs, b.outputs, strict=True):
            assert ca.token_ids == cb.token_ids
            for la, lb in zip(ca.logprobs, cb.logprobs, strict=True):
                assert la.keys() == lb.keys()
                for tok in la:
                    assert la[tok].logprob == pytest.approx(lb[tok].logprob, abs=atol)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_gone(pid: int, seconds: float = 15.0) -> bool:
    deadline = time.monotonic() + seconds
    while not _gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.fixture(scope="module")
def odd_vocab_llama_dir(tmp_path_factory) -> str:
    """A Llama whose vocabulary (321) does not divide by 2, so the last rank's rows are padding."""
    import transformers

    torch.manual_seed(2)
    cfg = transformers.LlamaConfig(vocab_size=321, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    return str(_save(transformers.LlamaForCausalLM(cfg).eval(), tmp_path_factory.mktemp("odd-vocab")))


# Llama with a 16-bit cache runs with the slow sweeps: its model is in the int8 case, its cache in Qwen2's.
@pytest.mark.parametrize("model, kv_cache_dtype", [pytest.param("tiny_llama_dir", "auto", marks=pytest.mark.slow),
                                                   ("tiny_qwen2_dir", "auto"), ("tiny_llama_dir", "int8")])
def test_two_ranks_match_one_through_preemption_prefix_caching_and_forks(model, kv_cache_dtype, request):
    """With an 8-bit KV cache too: each rank stores its own heads' codes and scales. (Its logprobs
    agree to 5e-3 rather than 1e-4: the ranks' all-reduce sums in another order, and a K/V value
    that moves by an ulp across a rounding boundary moves its code by a whole step.)"""
    path = request.getfixturevalue(model)
    engine = dict(ENGINE, kv_cache_dtype=kv_cache_dtype)
    ref, ref_stats, ref_beams = _run(LLM(path, **engine))
    with LLM(path, tensor_parallel_size=2, **engine) as llm:
        got, stats, beams = _run(llm)
        pids = llm.engine.executor.worker_pids
    assert ref_stats["num_preemptions"] > 0 and ref_stats["prefix_cache_hits"] > 0
    for key in ("num_preemptions", "prefix_cache_hits", "prompt_tokens_computed", "generation_tokens"):
        assert stats[key] == ref_stats[key]
    atol = 1e-4 if kv_cache_dtype == "auto" else 5e-3
    _assert_same(ref, got, atol)
    for a, b in zip(ref_beams, beams, strict=True):  # beam search: the same beams, in the same order
        assert [s.token_ids for s in a.sequences] == [s.token_ids for s in b.sequences]
        assert [s.cumulative_logprob for s in a.sequences] == pytest.approx(
            [s.cumulative_logprob for s in b.sequences], abs=10 * atol)
    assert len(pids) == 1 and all(_wait_gone(p) for p in pids)


def test_two_ranks_with_a_disk_tier_match_one(tiny_llama_dir, tmp_path):
    """Each rank keeps its own shard of every demoted block in a file of its own: prefixes evicted
    from the pool come back from both ranks' tiers, with the tokens of one rank without a tier."""
    rng = random.Random(0)
    docs = [[rng.randrange(3, 320) for _ in range(48)] for _ in range(4)]  # 48 blocks of 4 for a pool of 40
    prompts = [{"prompt_token_ids": d + [rng.randrange(3, 320)]} for d in docs * 2]
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=2, ignore_eos=True)

    def run(llm: LLM) -> tuple[list, dict]:
        outs = [o for p in prompts for o in llm.generate([p], params, use_tqdm=False)]
        return outs, llm.stats()

    with LLM(tiny_llama_dir, kv_offload_size=TIER_BYTES, kv_offload_dir=str(tmp_path / "one"), **ENGINE) as one:
        ref, ref_stats = run(one)
    with LLM(tiny_llama_dir, tensor_parallel_size=2,
             kv_offload_size=TIER_BYTES, kv_offload_dir=str(tmp_path / "two"), **ENGINE) as llm:
        got, stats = run(llm)
        files = list((tmp_path / "two").glob("pagellm-kv-*.bin"))
    _assert_same(ref, got)  # the tokens, logprobs and cached tokens of one rank
    assert len(files) == 2  # one a rank
    assert stats["kv_offload"]["promoted_blocks"] == ref_stats["kv_offload"]["promoted_blocks"] > 4 * 8
    assert stats["kv_offload"]["corrupt"] == 0 and stats["prompt_tokens_computed"] == ref_stats["prompt_tokens_computed"]


def test_memory_per_rank_is_half_and_shutdown_leaves_nothing(tiny_llama_dir):
    threads = torch.get_num_threads()
    [one] = LLM(tiny_llama_dir, **ENGINE).engine.memory_report()
    llm = LLM(tiny_llama_dir, tensor_parallel_size=2, **ENGINE)
    report = llm.engine.memory_report()
    pids = llm.engine.executor.worker_pids
    assert [r["rank"] for r in report] == [0, 1]
    # Replicated on every rank: the RMSNorm weights (2 per layer and the final one).
    replicated = (2 * 2 + 1) * 64 * 4
    for r in report:
        assert r["num_kv_heads"] == 1 and one["num_kv_heads"] == 2
        assert r["kv_cache_bytes"] * 2 == one["kv_cache_bytes"]
        assert r["weight_bytes"] == (one["weight_bytes"] - replicated) // 2 + replicated
        assert r["peak_rss_bytes"] > 0
    assert torch.get_num_threads() == max(1, len(os.sched_getaffinity(0)) // 2)
    llm.shutdown()
    llm.shutdown()  # idempotent
    assert all(_wait_gone(p) for p in pids)
    assert torch.get_num_threads() == threads
    with pytest.raises(TensorParallelError):
        llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)


def test_replicated_kv_heads_keep_a_full_head_per_rank(tiny_qwen2_dir):
    # tiny_qwen2 has one KV head: both ranks hold it (as vLLM does), and half the query heads.
    with LLM(tiny_qwen2_dir, tensor_parallel_size=2, **ENGINE) as llm:
        report = llm.engine.memory_report()
    [one] = LLM(tiny_qwen2_dir, **ENGINE).engine.memory_report()
    assert [r["num_kv_heads"] for r in report] == [1, 1]
    assert all(r["kv_cache_bytes"] == one["kv_cache_bytes"] for r in report)


def test_killed_worker_fails_fast_and_leaves_no_orphan(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, tensor_parallel_size=2, **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=4)
    assert llm.generate("hello", params, use_tqdm=False)[0].outputs[0].token_ids
    [pid] = llm.engine.executor.worker_pids
    os.kill(pid, signal.SIGKILL)
    errors: list[BaseException] = []

    def generate() -> None:
        try:
            llm.generate(["hello", "world"], params, use_tqdm=False)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=generate, daemon=True)
    t.start()
    t.join(timeout=60)
    assert not t.is_alive(), "generate hung after a worker died"
    assert len(errors) == 1 and isinstance(errors[0], TensorParallelError)
    assert f"rank 1 (pid {pid}) died" in str(errors[0])
    assert _gone(pid)  # reaped, not a zombie left behind
    assert not llm.engine.has_unfinished_requests()  # the failed requests were aborted
    with pytest.raises(TensorParallelError, match="cannot run any more steps"):
        llm.generate("again", params, use_tqdm=False)
    llm.shutdown()


def test_workers_exit_when_the_engine_process_dies(tiny_llama_dir, tmp_path):
    script = tmp_path / "engine.py"
    script.write_text(textwrap.dedent(f"""
        import os, signal, sys
        from pagellm import LLM

        if __name__ == "__main__":
            llm = LLM({tiny_llama_dir!r}, tensor_parallel_size=2, block_size=4, num_kv_blocks=16)
            print(*llm.engine.executor.worker_pids, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)  # no atexit, no finalizer: the workers must notice alone
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    pids = [int(p) for p in proc.stdout.split()]
    assert len(pids) == 1
    assert all(_wait_gone(p) for p in pids)


def test_torchrun_ranks_match_one_rank(odd_vocab_llama_dir):
    """Two ranks started by torchrun (as on two machines), both running `pagellm generate`:
    rank 0 runs the engine, rank 1 serves it. The vocabulary is padded for the split."""
    args = ["--model", odd_vocab_llama_dir, "--prompt", "The capital of France is", "--max-tokens", "12",
            "--num-kv-blocks", "32", "--block-size", "8"]
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("OMP_NUM_THREADS", None)
    two = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "pagellm", "generate",
                          "--tensor-parallel-size", "2", *args], capture_output=True, text=True, timeout=240, env=env)
    assert two.returncode == 0, two.stderr[-3000:]
    one = LLM(odd_vocab_llama_dir, num_kv_blocks=32, block_size=8).generate(
        "The capital of France is", SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
    assert two.stdout.rstrip("\n") == one[0].outputs[0].text


def test_heads_that_do_not_split_are_a_clear_error(tmp_path):
    path = write_dummy_model_dir(tmp_path / "m", "tiny")  # 4 heads, 2 KV heads
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 .*num_attention_heads \(4\) must be divisible"):
        LLM(path, load_format="dummy", tensor_parallel_size=3, num_kv_blocks=8)
    path = write_dummy_model_dir(tmp_path / "k", "tiny", hidden_size=96, num_attention_heads=6, num_key_value_heads=3)
    with pytest.raises(ValueError, match=r"num_key_value_heads \(3\) must be divisible by 2, or divide it"):
        LLM(path, load_format="dummy", tensor_parallel_size=2, num_kv_blocks=8)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        EngineConfig(tensor_parallel_size=0)


def test_tensor_parallel_size_flag():
    args = build_parser().parse_args(["generate", "--tensor-parallel-size", "2"])
    assert engine_kwargs(args)["tensor_parallel_size"] == 2
    assert engine_kwargs(build_parser().parse_args(["serve"]))["tensor_parallel_size"] == 1


def test_a_script_without_the_main_guard_is_told_the_fix(tiny_llama_dir, tmp_path):
    """spawn re-imports the main script in each rank; a script that creates the engine at top
    level makes the rank try to start ranks of its own and die. The error says so, and how to fix it."""
    script = tmp_path / "no_guard.py"
    script.write_text(textwrap.dedent(f"""
        from pagellm import LLM
        llm = LLM({tiny_llama_dir!r}, tensor_parallel_size=2, num_kv_blocks=16)
        print("started")
    """))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert r.returncode != 0 and "started" not in r.stdout
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("pagellm.distributed.driver.TensorParallelError"), r.stderr[-3000:]
    assert "while starting" in last and 'if __name__ == "__main__":' in last


# SmolLM3 (NoPE layers) and Granite (scalar multipliers) add nothing to shard: each rank applies
# them to its own heads as one rank would; tests/models covers them on one rank.
# The slow sweeps add the families whose sharding another one here already has: Mistral's (Llama's
# with a window), Qwen3's per-head norms (Qwen3.5's), OLMo 3's all-heads norm (OLMo 2's), Gemma 2's
# norms and tied head (Gemma 3's), Mixtral's experts (Qwen3-MoE's), Qwen3.5-MoE's (Qwen3.5's layers,
# Qwen3-MoE's experts, DeepSeek-V3's shared expert); and Gemma 4, ~20 s on 2 cores.
SHARDING_COVERED = ("mistral", "qwen3", "olmo3", "gemma2", "mixtral", "gemma4", "qwen3_5_moe")
# Two ranks sum a row's halves in another order than one rank does. A recurrent state carries that
# float32 rounding into every later token, and Qwen3.5-MoE's experts (routed and shared) add two
# more sums per layer, so its logprobs drift by about 1e-4 over the run: tokens must still be equal.
ATOL = {"qwen3_5_moe": 3e-4}


@pytest.mark.parametrize("family", [
    pytest.param(f, marks=pytest.mark.slow) if f in SHARDING_COVERED else f
    for f in ("mistral", "qwen3", "olmo2", "olmo3", "phi3", "gemma2", "gemma3", "ministral3", "lfm2", "qwen3_5",
              "mixtral", "qwen3_moe", "gpt_oss", "llama4", "deepseek_v3", "gemma4", "qwen3_5_moe",
              "granite_moe_hybrid")])
def test_families_on_two_ranks_match_one(family, tmp_path_factory):
    """The sharding each family adds: per-head q/k norms (Qwen3), a norm over all heads whose
    sum of squares crosses ranks (OLMo 2), checkpoints with q/k/v and gate/up already fused
    (Phi-3), Gemma's norms, tied head and two rotary tables, OLMo 3's all-heads norm beside a
    window, Ministral 3's queries scaled per token on each rank's heads, convolution channels and
    their state (LFM2), Gated DeltaNet's key and value heads with their state and Qwen3.5's gated
    attention (q and its gate kept per head), experts split by their intermediate dimension
    (Mixtral, Qwen3-MoE; gpt-oss's out of interleaved gate/up, with biases, the down projection's
    added once), attention sinks split by head (gpt-oss), Llama 4's shared expert beside experts that
    scale their inputs, and its q/k pairs permuted per head before the heads are split, latent
    attention's heads split with the latent row cached whole on each rank, and shared experts beside
    grouped routing (DeepSeek-V3); per-layer embeddings split by vocabulary, KV-shared layers' queries
    split by head, and one full-layer KV head replicated on both ranks (Gemma 4); Mamba-2's heads, groups
    and convolution channels with their state, beside experts and a shared MLP (Granite 4 hybrid)."""
    from tests.models.families import build

    path = str(build(family, tmp_path_factory.mktemp(family)))
    one = LLM(path, **ENGINE)
    ref, ref_stats, ref_beams = _run(one)
    with LLM(path, tensor_parallel_size=2, **ENGINE) as llm:
        got, stats, beams = _run(llm)
    assert stats["num_preemptions"] == ref_stats["num_preemptions"]
    # Sliding-window layers give back a block as they take one: in this pool only the families
    # without them run short and preempt.
    assert ref_stats["num_preemptions"] > 0 or one.engine.runner.kv_groups.hybrid
    _assert_same(ref, got, ATOL.get(family, 1e-4))
    for a, b in zip(ref_beams, beams, strict=True):
        assert [s.token_ids for s in a.sequences] == [s.token_ids for s in b.sequences]

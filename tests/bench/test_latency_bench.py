"""`pagellm bench latency` and the roofline figures every benchmark reports."""
from __future__ import annotations

import json
import statistics

import pytest

from pagellm import cpu_features
from pagellm.cli import main


def test_latency_bench_tiny(tmp_path, tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("PAGELLM_LLAMA_CPP_BIN", str(tmp_path / "nowhere"))
    stem = tmp_path / "latency"
    rc = main(["bench", "latency", "--model", tiny_llama_dir, "--systems", "pagellm-paged,pagellm-paged-bf16,llama-bench",
               "--input-len", "12", "--output-len", "6", "--repeat", "2", "--profile", "--out", str(stem)])
    assert rc == 0
    data = json.loads(stem.with_suffix(".json").read_text())
    assert data["benchmark"] == "latency" and data["command"]
    assert "GGUF" in data["skipped"]["llama-bench"]  # a safetensors directory
    limits = data["machine_limits"]
    assert limits["memory_gbps"] > 0 and limits["gemm_gflops_float32"] > 0
    if cpu_features.has_bf16():
        assert set(data["systems"]) == {"pagellm-paged", "pagellm-paged-bf16"}
        assert limits["gemm_gflops_bfloat16"] > 0
    else:  # refused there, and its GEMM rate not measured (minutes of emulation)
        assert set(data["systems"]) == {"pagellm-paged"} and "bfloat16" in data["skipped"]["pagellm-paged-bf16"]
        assert limits["gemm_gflops_bfloat16"] is None
    for name, s in data["systems"].items():
        assert len(s["pp_runs_s"]) == len(s["tg_runs_s"]) == 2
        assert s["tg_tokens_per_s"] == pytest.approx(6 / statistics.median(s["tg_runs_s"]))
        tg = s["roofline_tg"]
        # One stream: one step per token, so GB/s = bytes per step x tokens/s.
        assert tg["weight_gbps"] == pytest.approx(tg["weight_bytes_per_step"] * s["tg_tokens_per_s"] / 1e9, rel=1e-2,
                                                  abs=0.01)
        assert tg["gflops"] == pytest.approx(tg["flops_per_token"] * s["tg_tokens_per_s"] / 1e9, rel=1e-2, abs=0.01)
    # Profiled decode steps: output_len decode steps + one one-token prefill step, per repeat.
    phases = data["systems"]["pagellm-paged"]["decode_phases"]
    assert phases["steps"] == 2 * (6 + 1)
    # bf16 weights are half the bytes of fp32 ones.
    if cpu_features.has_bf16():
        fp32 = data["systems"]["pagellm-paged"]["roofline_tg"]["weight_bytes_per_step"]
        bf16 = data["systems"]["pagellm-paged-bf16"]["roofline_tg"]["weight_bytes_per_step"]
        assert bf16 * 2 == fp32


def test_model_cost_counts_what_transformers_counts(tiny_llama_dir):
    """FLOPs per token are 2 x the weights a token multiplies: transformers' parameter count less
    the norms (and the embedding, whose lookup is no product, unless it is the tied head)."""
    import torch
    import transformers

    from pagellm import LLM

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    multiplied = sum(p.numel() for n, p in hf.named_parameters() if "norm" not in n)
    if not hf.config.tie_word_embeddings:
        multiplied -= hf.get_input_embeddings().weight.numel()
    llm = LLM(tiny_llama_dir, dtype="float32", device="cpu")
    cost = llm.engine.model_cost()
    assert cost["flops_per_token"] == 2 * multiplied
    assert cost["weight_bytes_per_step"] == 4 * multiplied


def test_latency_bench_skips_bfloat16_on_a_cpu_without_it(tmp_path, tiny_llama_dir, monkeypatch):
    """Where the CPU has no bfloat16 instructions the bf16 system is skipped with the reason, and the
    machine's bfloat16 GEMM rate is not measured (torch's emulation would take minutes)."""
    monkeypatch.setattr(cpu_features, "has_bf16", lambda: False)
    stem = tmp_path / "latency"
    rc = main(["bench", "latency", "--model", tiny_llama_dir, "--systems", "pagellm-paged,pagellm-paged-bf16",
               "--input-len", "8", "--output-len", "3", "--repeat", "1", "--out", str(stem)])
    assert rc == 0
    data = json.loads(stem.with_suffix(".json").read_text())
    assert set(data["systems"]) == {"pagellm-paged"}
    assert "bfloat16" in data["skipped"]["pagellm-paged-bf16"]
    assert data["machine_limits"]["gemm_gflops_bfloat16"] is None


def test_moe_model_cost_counts_one_tokens_experts(tmp_path):
    """A decode step of one sequence reads its token's top-k experts, not all of them: the cost's
    weight bytes per step are the dense layers' and head's plus top_k / experts of the experts',
    and a step of many tokens (roofline.step_weight_bytes) approaches every expert."""
    from pagellm import LLM
    from pagellm.bench import roofline
    from pagellm.layers.moe import FusedMoE
    from tests.models.families import FAMILIES, build

    path = build("gpt_oss", tmp_path / "gpt_oss")
    llm = LLM(str(path), dtype="float32", device="cpu")
    model = llm.engine.runner.model
    cost = llm.engine.model_cost()
    experts = sum(p.numel() * 4 for m in model.modules() if isinstance(m, FusedMoE) for p in m.parameters())
    overrides = FAMILIES["gpt_oss"][2]
    share = overrides["num_experts_per_tok"] / overrides["num_local_experts"]
    assert cost["expert_weight_bytes"] == experts > 0 and cost["expert_share"] == share
    dense = cost["weight_bytes_per_step"] - round(experts * share)
    assert 0 < dense < cost["weight_bytes_per_step"]
    assert roofline.step_weight_bytes(cost, 1) == cost["weight_bytes_per_step"]
    two = roofline.step_weight_bytes(cost, 2)  # 1 - (1 - 1/4)^2 of the experts
    assert two == dense + round(experts * (1 - (1 - share) ** 2))
    assert roofline.step_weight_bytes(cost, 512) == pytest.approx(dense + experts, rel=1e-6)
    tg = roofline.achieved(cost, 8, 8, 1.0, None)
    assert tg["weight_bytes_per_step"] == cost["weight_bytes_per_step"]
    llm.shutdown()


def test_dense_model_step_bytes_do_not_depend_on_tokens():
    from pagellm.bench import roofline

    cost = {"flops_per_token": 10, "weight_bytes_per_step": 1000}
    assert roofline.step_weight_bytes(cost, 1) == roofline.step_weight_bytes(cost, 64) == 1000

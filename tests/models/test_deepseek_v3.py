"""DeepSeek-V3's parts beyond latent attention (tests/layers/test_mla.py): the mixture of experts
against transformers' DeepseekV3MoE (sigmoid routing with correction bias, groups, scaling,
shared experts), and the pool holding one latent row per token per layer."""
from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE as ReferenceMoE

from pagellm import LLM
from pagellm.models.deepseek_v3 import DeepseekV3MoE
from tests.models.families import build


def reference(norm_topk_prob: bool) -> tuple[DeepseekV3Config, ReferenceMoE]:
    cfg = DeepseekV3Config(hidden_size=32, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=3,
                           n_group=4, topk_group=2, n_shared_experts=2, routed_scaling_factor=2.5,
                           norm_topk_prob=norm_topk_prob)
    torch.manual_seed(0)
    moe = ReferenceMoE(cfg).eval()
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.3)
        moe.gate.e_score_correction_bias.normal_(0.0, 0.3)
    return cfg, moe


def load(cfg: DeepseekV3Config, moe: ReferenceMoE) -> DeepseekV3MoE:
    block = DeepseekV3MoE(cfg, "silu", None)
    e = block.experts
    e.weight_loader(e.w13, moe.experts.gate_up_proj.detach(), ("all", "w13"))
    e.weight_loader(e.w2, moe.experts.down_proj.detach(), ("all", "w2"))
    block.gate.weight_loader(block.gate.weight, moe.gate.weight.detach())
    block.e_score_correction_bias.copy_(moe.gate.e_score_correction_bias)
    shared, ref_shared = block.shared_experts, moe.shared_experts
    for i, name in enumerate(("gate_proj", "up_proj")):
        shared.gate_up_proj.weight_loader(shared.gate_up_proj.weight, getattr(ref_shared, name).weight.detach(), i)
    shared.down_proj.weight_loader(shared.down_proj.weight, ref_shared.down_proj.weight.detach())
    return block


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_moe_equals_transformers(norm_topk_prob):
    cfg, moe = reference(norm_topk_prob)
    x = torch.randn(41, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = moe(x[None])[0]
        _, _, experts = moe.gate(x)
        got = load(cfg, moe)(x)
    # Routing that depends on the groups: some token's experts span two groups (topk_group 2) and
    # no token's come from more than two.
    groups = {frozenset((experts[t] // 2).tolist()) for t in range(41)}
    assert max(map(len, groups)) == 2
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_pool_holds_one_latent_row_per_token_per_layer_and_fp8_checkpoints_are_refused(tmp_path):
    llm = LLM(str(build("deepseek_v3", tmp_path / "ds")), num_kv_blocks=8, block_size=4)
    runner = llm.engine.runner
    k, v = runner.kv_caches[0]
    assert tuple(k.shape) == (8, 4, 1, 32 + 8) and v.numel() == 0  # kv_lora_rank + qk_rope_head_dim
    assert runner.bytes_per_block(4) == 2 * 4 * 40 * 4  # 2 layers, 4 tokens, 40 float32s
    [report] = llm.engine.memory_report()
    assert report["kv_cache_bytes"] == 8 * runner.bytes_per_block(4) and report["num_kv_heads"] == 1
    # Stats and /metrics name the group by what it holds.
    assert llm.stats()["kv_groups"] == [{"kind": "latent", "window": None, "used_blocks": 0}]
    with pytest.raises(ValueError, match="q_a_proj.weight_scale_inv' is an FP8 block scale"):
        runner.model.load_weights([("model.layers.0.self_attn.q_a_proj.weight_scale_inv", torch.ones(1))])
    with pytest.raises(ValueError, match="kv_cache_dtype 'int8' is not read by latent attention"):
        LLM(str(tmp_path / "ds"), num_kv_blocks=8, kv_cache_dtype="int8")

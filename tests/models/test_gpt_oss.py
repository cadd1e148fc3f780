"""gpt-oss's pieces, each against transformers' own module on random inputs: the clamped
SwiGLU, the mixture of experts (router bias, softmax over the top-k logits, interleaved gate/up,
expert biases; split over two ranks, its biases counted once), YaRN's rotary tables, and the
sinks' loading per rank. The whole model against transformers: tests/models/test_families.py."""
from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.gpt_oss import modeling_gpt_oss as ref

from pagellm.layers.activation import ClampedSwiGLU, act_and_mul
from pagellm.layers.attention import Attention
from pagellm.layers.moe import SparseMoeBlock, route_interleaved_expert_weight
from pagellm.layers.parallel import TensorParallelGroup
from pagellm.layers.rotary import get_rope

H, INTER, E, TOP_K = 32, 24, 6, 2


def config(**changes) -> transformers.GptOssConfig:
    fields = dict(hidden_size=H, intermediate_size=INTER, num_local_experts=E, num_experts_per_tok=TOP_K,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, swiglu_limit=1.5,
                  num_hidden_layers=2, vocab_size=64)
    return transformers.GptOssConfig(**{**fields, **changes})


def reference_mlp(seed: int = 0) -> ref.GptOssMLP:
    torch.manual_seed(seed)
    mlp = ref.GptOssMLP(config()).eval()
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0.0, 0.5)  # biases too (transformers starts the experts' at zero)
    return mlp


class _SummedRanks:
    """A tensor-parallel group whose all-reduce leaves each rank's partial sum as it is: the
    test adds the ranks' outputs itself."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


def load_block(mlp: ref.GptOssMLP, tp=None, weights=None) -> SparseMoeBlock:
    """Our block loaded from `mlp`'s checkpoint tensors (or `weights`, named as in the checkpoint)."""
    cfg = mlp.experts
    h, inter = mlp.router.weight.shape[1], cfg.down_proj.shape[1]
    block = SparseMoeBlock(E, TOP_K, h, inter, ClampedSwiGLU(cfg.alpha, cfg.limit), renormalize=False, tp=tp,
                           softmax_after_topk=True, bias=True)
    params = {f"mlp.{name}": p for name, p in block.named_parameters()}
    for name, tensor in weights or [(f"mlp.{name}", t) for name, t in mlp.state_dict().items()]:
        routed = route_interleaved_expert_weight(name)
        if routed is None:  # the router
            param = params[name.replace(".router.", ".gate.")]
            param.weight_loader(param, tensor)
        else:
            target, part = routed
            params[target].weight_loader(params[target], tensor, part)
    return block


def test_clamped_swiglu_is_transformers_gate():
    experts = ref.GptOssExperts(config())
    torch.manual_seed(0)
    gate_up = torch.randn(50, 2 * INTER) * 3  # well past the limit, both ways
    gate, up = gate_up[:, ::2], gate_up[:, 1::2]
    ours = act_and_mul(torch.cat([gate, up], dim=-1), ClampedSwiGLU(experts.alpha, experts.limit))
    assert torch.equal(ours, experts._apply_gate(gate_up))
    assert (gate > experts.limit).any() and (up.abs() > experts.limit).any()


def test_moe_block_equals_transformers_gpt_oss_mlp():
    mlp = reference_mlp()
    x = torch.randn(37, H)
    with torch.no_grad():
        want, _ = mlp(x[None])
    torch.testing.assert_close(load_block(mlp)(x), want[0], rtol=1e-5, atol=1e-5)


def test_moe_block_of_one_token_equals_transformers():
    """A decode step of one sequence: its top-k experts' outputs all add into row 0 (FusedMoE's
    one-token path), each token on its own against transformers."""
    mlp = reference_mlp(2)
    block = load_block(mlp)
    x = torch.randn(5, H)
    with torch.no_grad():
        for i in range(x.shape[0]):
            want, _ = mlp(x[None, i:i + 1])
            torch.testing.assert_close(block(x[i:i + 1]), want[0], rtol=1e-5, atol=1e-5)


def test_two_ranks_sum_to_one_with_the_biases_once():
    """Each rank holds half of every expert's gate and up features (picked out of the interleaved
    checkpoint) and of its down inputs; the down bias is added by rank 0 alone."""
    mlp = reference_mlp(1)
    x = torch.randn(19, H)
    one = load_block(mlp)
    ranks = [load_block(mlp, _SummedRanks(r, 2)) for r in range(2)]
    half = INTER // 2
    gate_up = mlp.experts.gate_up_proj.detach()  # [E, H, 2I], gate and up alternating
    assert torch.equal(ranks[1].experts.w13[:, :half], gate_up[..., 0::2][..., half:].transpose(1, 2))
    assert torch.equal(ranks[1].experts.w13_bias[:, half:], mlp.experts.gate_up_proj_bias[:, 1::2][:, half:])
    torch.testing.assert_close(ranks[0](x) + ranks[1](x), one(x), rtol=1e-5, atol=1e-5)


def test_yarn_tables_equal_transformers():
    cfg = config(max_position_embeddings=256,
                 rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "beta_fast": 32.0,
                                  "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 32})
    rope = get_rope(cfg, cfg.head_dim, 256)
    positions = torch.arange(256)
    cos, sin = rope.cos_sin(positions, torch.float32)
    want_cos, want_sin = ref.GptOssRotaryEmbedding(cfg)(torch.zeros(1), positions[None])
    half = cfg.head_dim // 2  # transformers keeps one half; rotate-half tables repeat it
    for ours, want in ((cos, want_cos[0]), (sin, want_sin[0])):
        assert torch.equal(ours[:, :half], want) and torch.equal(ours[:, half:], want)
    assert rope.cos[1, 0] != torch.cos(torch.tensor(1.0))  # the attention factor scales the tables


def test_sinks_load_per_rank_by_head():
    sinks = torch.arange(8.0)
    for rank in range(2):
        attn = Attention(4, 1, 16, backend=None, sinks=True, tp=TensorParallelGroup(rank, 2))
        attn.sinks.weight_loader(attn.sinks, sinks)
        assert torch.equal(attn.sinks, sinks[4 * rank:4 * rank + 4])
    with pytest.raises(ValueError, match=r"expected \(8,\)"):
        attn.sinks.weight_loader(attn.sinks, sinks[:4])
    assert Attention(4, 1, 16, backend=None).sinks is None


def openai_mxfp4(rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random experts' matrices as OpenAI's MXFP4 checkpoints store them: blocks uint8 [E, rows,
    cols / 32, 16] (any codes), scales uint8 [E, rows, cols / 32] (exponents 2^-6 .. 2^0)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 256, (E, rows, cols // 32, 16), generator=g, dtype=torch.uint8),
            torch.randint(121, 128, (E, rows, cols // 32), generator=g, dtype=torch.uint8))


def test_openai_mxfp4_experts_are_served_in_blocks():
    """A checkpoint's MXFP4 experts (`*_blocks`, `*_scales`) load as GGUF MXFP4 blocks whose values
    are exactly transformers' own dequantization of them, and the block computes what it computes
    with those values dense; split over two ranks, down's inputs must cut at its 32-value blocks."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from pagellm.loader.mxfp4 import join_mxfp4

    h, inter = 64, 32
    torch.manual_seed(2)
    mlp = ref.GptOssMLP(config(hidden_size=h, intermediate_size=inter)).eval()
    packed = {"gate_up_proj": openai_mxfp4(2 * inter, h, 0), "down_proj": openai_mxfp4(h, inter, 1)}
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0.0, 0.5)
        for name, (blocks, scales) in packed.items():  # transformers' values, [E, in, out]
            getattr(mlp.experts, name).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    checkpoint = [(f"mlp.{name}", t) for name, t in mlp.state_dict().items() if not name.endswith("_proj")]
    checkpoint += [(f"mlp.experts.{name}{suffix}", t) for name, pair in packed.items()
                   for suffix, t in zip(("_blocks", "_scales"), pair)]
    joined = dict(join_mxfp4(checkpoint))
    for name in packed:
        widened = joined[f"mlp.experts.{name}"].dequantize()  # [E, out, in]
        assert torch.equal(widened.transpose(1, 2), getattr(mlp.experts, name).detach())
    ours = load_block(mlp, weights=list(joined.items()))
    assert ours.experts.block_types == {"w13": 39, "w2": 39} and ours.experts.w13.dtype == torch.uint8
    x = torch.randn(9, h)
    torch.testing.assert_close(ours(x), load_block(mlp)(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"cannot split MXFP4 rows of 32 values at \[16, 32\)"):
        load_block(mlp, _SummedRanks(1, 2), weights=list(joined.items()))
"""The fused mixture-of-experts layer: every checkpoint layout loads to the same stacked
weights, a tensor-parallel rank holds its slice of every expert's intermediate dimension, the
output equals a per-token reference, and the experts run as one matrix product each per step
(the profile shows it), never once per token."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from pagellm.layers.parallel import TensorParallelGroup
from pagellm.layers.moe import FusedMoE, SparseMoeBlock, route_expert_weight

E, TOP_K, H, INTER = 4, 2, 16, 12


def experts(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"gate": torch.randn(E, INTER, H, generator=g), "up": torch.randn(E, INTER, H, generator=g),
            "down": torch.randn(E, H, INTER, generator=g)}


def load(layer: FusedMoE, tensors: list[tuple[str, torch.Tensor]]) -> set:
    params = dict(layer.named_parameters())
    filled: dict[str, set] = {}
    for name, t in tensors:
        target, part = route_expert_weight(f"mlp.experts.{name}")
        target = target.removeprefix("mlp.experts.")
        params[target].weight_loader(params[target], t, part)
        filled.setdefault(target, set()).update(layer.expand_part(part))
    return {name for name, p in params.items() if p.parts_needed <= filled.get(name, set())}


LAYOUTS = {
    # Mixtral's files: one tensor per expert and matrix.
    "per_expert": lambda w: [(f"{e}.{n}.weight", w[k][e]) for e in range(E)
                             for n, k in (("w1", "gate"), ("w3", "up"), ("w2", "down"))],
    # transformers 5: gate and up fused, every expert stacked.
    "stacked_gate_up": lambda w: [("gate_up_proj", torch.cat([w["gate"], w["up"]], dim=1)),
                                  ("down_proj", w["down"])],
    # Each matrix stacked over experts.
    "stacked_each": lambda w: [("gate_proj", w["gate"]), ("up_proj", w["up"]), ("down_proj", w["down"])],
    # GGUF ffn_{gate,up,down}_exps, as the GGUF loader names them.
    "gguf": lambda w: [("w1", w["gate"]), ("w3", w["up"]), ("w2", w["down"])],
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_layout_loads_the_same_stack(layout):
    w = experts()
    layer = FusedMoE(E, TOP_K, H, INTER, "silu")
    assert load(layer, LAYOUTS[layout](w)) == {"w13", "w2"}
    assert torch.equal(layer.w13, torch.cat([w["gate"], w["up"]], dim=1))
    assert torch.equal(layer.w2, w["down"])


@pytest.mark.parametrize("rank", [0, 1])
def test_gguf_stacked_biases_load_per_rank(rank):
    """gpt-oss GGUF files: every expert's gate, up and down biases stacked apart (ffn_*_exps.bias);
    the gate and up biases split by rank as w13, the down bias whole on every rank."""
    g = torch.Generator().manual_seed(1)
    gate, up, down = torch.randn(E, INTER, generator=g), torch.randn(E, INTER, generator=g), torch.randn(E, H, generator=g)
    layer = FusedMoE(E, TOP_K, H, INTER, "silu", TensorParallelGroup(rank, 2), bias=True)
    w = experts()
    filled = load(layer, LAYOUTS["gguf"](w) + [("w1_bias", gate), ("w3_bias", up), ("w2_bias", down)])
    assert filled == {"w13", "w2", "w13_bias", "w2_bias"}
    half = slice(rank * INTER // 2, (rank + 1) * INTER // 2)
    assert torch.equal(layer.w13_bias, torch.cat([gate[:, half], up[:, half]], dim=1))
    assert torch.equal(layer.w2_bias, down)


def test_half_a_stack_is_not_complete():
    w = experts()
    layer = FusedMoE(E, TOP_K, H, INTER, "silu")
    assert load(layer, [("gate_proj", w["gate"]), ("down_proj", w["down"])]) == {"w2"}  # no up_proj


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_tensor_parallel_rank_holds_its_slice_of_every_expert(layout):
    w = experts()
    half = INTER // 2
    layer = FusedMoE(E, TOP_K, H, INTER, "silu", TensorParallelGroup(1, 2))
    load(layer, LAYOUTS[layout](w))
    assert torch.equal(layer.w13[:, :half], w["gate"][:, half:])
    assert torch.equal(layer.w13[:, half:], w["up"][:, half:])
    assert torch.equal(layer.w2, w["down"][:, :, half:])


def reference(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """Token by token, expert by expert: the definition."""
    probs = F.softmax(block.gate(x), dim=-1)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        weights, chosen = torch.topk(probs[t], TOP_K)
        weights = weights / weights.sum()
        for wt, e in zip(weights, chosen.tolist()):
            gate_up = block.experts.w13[e] @ x[t]
            out[t] += wt * (block.experts.w2[e] @ (F.silu(gate_up[:INTER]) * gate_up[INTER:]))
    return out


def block_with_weights() -> SparseMoeBlock:
    torch.manual_seed(0)
    block = SparseMoeBlock(E, TOP_K, H, INTER, "silu", renormalize=True)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_()
    return block


def test_output_equals_the_per_token_reference():
    block = block_with_weights()
    x = torch.randn(37, H)
    torch.testing.assert_close(block(x), reference(block, x), rtol=1e-5, atol=1e-4)


def test_experts_run_as_one_matrix_product_each_whatever_the_token_count():
    """Per step: a router product, then per expert with tokens two (w13, w2); a loop over
    tokens would make 2 * tokens * top_k."""
    block = block_with_weights()
    for tokens in (8, 256):
        x = torch.randn(tokens, H)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            block(x)
        linears = sum(e.count for e in prof.key_averages() if e.key == "aten::linear")
        assert linears <= 1 + 2 * E, (tokens, linears)


def test_gguf_experts_are_built_in_the_model_dtype_so_to_dtype_writes_no_dense_copy() -> None:
    """The runner builds a model and then calls .to(dtype): experts whose GGUF blocks replace
    the dense placeholders must already be in that dtype, or .to writes a dense copy of every
    expert (gpt-oss-20b in bfloat16: 38 GB) that is thrown away at load."""
    from pagellm.layers.quant import linear_methods

    with linear_methods("gguf", torch.bfloat16):
        layer = FusedMoE(E, TOP_K, H, INTER, "silu", bias=True)
    before = {name: p.data_ptr() for name, p in layer.named_parameters()}
    layer.to(torch.bfloat16)
    assert {name: p.data_ptr() for name, p in layer.named_parameters()} == before
    assert layer.w13.dtype == layer.w2.dtype == torch.bfloat16

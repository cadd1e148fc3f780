"""Multi-head latent attention against transformers' DeepseekV3Attention with random weights,
fp32: prompts batched, a prompt in chunks then decode steps beside another sequence's prefill,
q_proj without a low-rank query (q_lora_rank None), the cache holding one latent row per token,
and the layer split over two ranks."""
from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

from pagellm.attention.backend import AttentionMetadata
from pagellm.attention.torch_backend import TorchAttentionBackend
from pagellm.kernels import cpu
from pagellm.layers.mla import MultiHeadLatentAttention, mla_softmax_scale
from pagellm.layers.parallel import TensorParallelGroup
from pagellm.layers.rotary import get_rope
from tests.layers.recurrent_checks import _Holder, run_ranks

ATOL = 1e-5
BS, BLOCKS_PER_SEQ = 4, 16
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.707}


def config(q_lora_rank: int | None = 48) -> DeepseekV3Config:
    return DeepseekV3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
                            q_lora_rank=q_lora_rank, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                            max_position_embeddings=128, rope_parameters=YARN, num_hidden_layers=1)


def reference(cfg: DeepseekV3Config, seed: int = 0) -> DeepseekV3Attention:
    torch.manual_seed(seed)
    module = DeepseekV3Attention(cfg, 0).eval()
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.normal_(1.0, 0.3) if "layernorm" in name else p.normal_(0.0, 0.2)
    return module


def build(cfg: DeepseekV3Config, ref: DeepseekV3Attention, tp: TensorParallelGroup | None = None,
          backend: TorchAttentionBackend | None = None):
    layer = MultiHeadLatentAttention(64, 4, cfg.q_lora_rank, 32, 16, 8, 16, backend or TorchAttentionBackend(),
                                     mla_softmax_scale(cfg.rope_parameters, 24), tp=tp)
    _Holder(layer).load_weights((f"model.layer.{n}", p.detach()) for n, p in ref.named_parameters())
    return layer


def ref_out(cfg, ref, x: torch.Tensor) -> torch.Tensor:
    """The reference's outputs for one whole sequence x [L, hidden], causal."""
    n = x.shape[0]
    pos = torch.arange(n)[None]
    cos_sin = DeepseekV3RotaryEmbedding(cfg)(x[None], pos)
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        return ref(x[None], cos_sin, mask)[0][0]


class Pool:
    """A paged cache of latent rows and each sequence's blocks (its own BLOCKS_PER_SEQ ids)."""

    def __init__(self, layer: MultiHeadLatentAttention, cfg: DeepseekV3Config, num_seqs: int) -> None:
        self.layer = layer
        self.cache = (torch.zeros(num_seqs * BLOCKS_PER_SEQ, BS, 1, 40), torch.zeros(num_seqs * BLOCKS_PER_SEQ, BS, 1, 0))
        self.tables = torch.arange(num_seqs * BLOCKS_PER_SEQ).view(num_seqs, BLOCKS_PER_SEQ)
        self.rope = get_rope(cfg, 8, 128)

    def step(self, work: list[tuple[int, torch.Tensor, int]]) -> list[torch.Tensor]:
        """work: (sequence, its tokens' inputs [n, hidden], first position), decodes first."""
        slots, positions = [], []
        for seq, x, start in work:
            for p in range(start, start + x.shape[0]):
                slots.append(int(self.tables[seq, p // BS]) * BS + p % BS)
                positions.append(p)
        seq_lens = [start + x.shape[0] for _, x, start in work]
        meta = AttentionMetadata(torch.tensor(slots), self.tables[[s for s, _, _ in work]],
                                 [x.shape[0] for _, x, _ in work], seq_lens, torch.tensor(seq_lens),
                                 sum(x.shape[0] == 1 for _, x, _ in work), BS)
        with torch.no_grad():
            out = self.layer(self.rope.cos_sin(torch.tensor(positions), torch.float32),
                             torch.cat([x for _, x, _ in work]), self.cache, meta)
        return list(out.split([x.shape[0] for _, x, _ in work]))


def make(q_lora_rank: int | None = 48, backend: TorchAttentionBackend | None = None):
    cfg = config(q_lora_rank)
    ref = reference(cfg)
    return cfg, ref, build(cfg, ref, backend=backend)


# The torch reference; the compiled kernel reading the rows in place for decodes; the kernel for
# every token at fixed runs (batch-invariant mode).
BACKENDS = {"torch": dict(compiled_decode=False), "compiled": dict(compiled_decode=True),
            "invariant": dict(batch_invariant=True)}


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=ATOL)


@pytest.mark.parametrize("q_lora_rank", [48, None])
def test_prompts_batched_equal_each_alone(q_lora_rank):
    cfg, ref, layer = make(q_lora_rank)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(n, 64, generator=g) for n in (1, 6, 30)]
    pool = Pool(layer, cfg, 3)
    outs = pool.step([(i, x, 0) for i, x in enumerate(xs)])
    for x, out in zip(xs, outs):
        close(out, ref_out(cfg, ref, x))
    # The cache holds each token's latent row and nothing else: [c_kv normalised, k_rope rotated].
    assert pool.cache[1].numel() == 0
    c_kv = pool.cache[0][pool.tables[2, :8]].reshape(-1, 40)[:30, :32]
    close(c_kv, layer.kv_a_layernorm(layer.kv_a_proj_with_mqa(xs[2])[:, :32]))


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_chunks_then_decodes_beside_a_prefill(backend, monkeypatch):
    """Sequence 0 in chunks of 7 then one token a step; sequence 1 decodes beside it; sequence 2
    arrives mid-way as a prefill in the same steps as the decodes."""
    calls = []
    kernel = cpu.paged_attention
    monkeypatch.setattr(cpu, "paged_attention", lambda *a, **k: calls.append(a[0].shape[0]) or kernel(*a, **k))
    cfg, ref, layer = make(backend=TorchAttentionBackend(**BACKENDS[backend]))
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(n, 64, generator=g) for n in (25, 12, 9)]
    want = [ref_out(cfg, ref, x) for x in xs]
    pool = Pool(layer, cfg, 3)
    got: dict[int, list[torch.Tensor]] = {0: [], 1: [], 2: []}
    got[1] += pool.step([(1, xs[1][:8], 0)])
    for start in range(0, 21, 7):  # sequence 0's prompt: 0-6, 7-13, 14-20; sequence 1 decodes
        work = [(1, xs[1][8 + start // 7:9 + start // 7], 8 + start // 7), (0, xs[0][start:start + 7], start)]
        o1, o0 = pool.step(work)
        got[1].append(o1)
        got[0].append(o0)
    o1, o2 = pool.step([(1, xs[1][11:12], 11), (2, xs[2], 0)])
    got[1].append(o1)
    got[2].append(o2)
    for p in range(21, 25):  # sequence 0's decodes, now alone
        got[0] += pool.step([(0, xs[0][p:p + 1], p)])
    for i in range(3):
        close(torch.cat(got[i]), want[i])
    if backend == "torch" or not cpu.available():
        assert calls == []
    else:  # decodes alone (1 token), beside prefills (1), or every token of each step
        assert calls == ([8, 8, 8, 8, 10, 1, 1, 1, 1] if backend == "invariant" else [1, 1, 1, 1, 1, 1, 1, 1])


def test_two_ranks_sum_to_one():
    cfg, ref, layer = make()
    x = torch.randn(11, 64, generator=torch.Generator().manual_seed(3))
    want = ref_out(cfg, ref, x)

    def on_rank(group: TensorParallelGroup) -> torch.Tensor:
        part = build(cfg, ref, group)
        assert part.num_heads == 2
        return Pool(part, cfg, 1).step([(0, x, 0)])[0]

    for out in run_ranks(2, on_rank):
        close(out, want)

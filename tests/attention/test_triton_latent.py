"""The Triton latent-attention kernels (attention/triton_latent.py) against the torch reference
(attention/latent.py), through TritonAttentionBackend.forward_latent as a latent layer calls it.

On a CPU they run under Triton's interpreter (tests/attention/conftest.py switches it on), in fp32:
outputs within 1e-4 of the reference's (both sum the same fp32 products, in another order),
and the cache bytes equal."""
from __future__ import annotations

import random

import pytest
import torch

import triton  # noqa: F401  (a test dependency on Linux: missing, these tests must fail)

from pagellm.attention import latent
from pagellm.attention.metadata import AttentionMetadata
from pagellm.attention.torch_backend import TorchAttentionBackend
from pagellm.attention.triton_backend import TritonAttentionBackend
from pagellm.attention.triton_latent import LatentConfig, latent_decode
from pagellm.kv_format import resolve_kv_format

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# fp32 everywhere; bf16 only where it is compiled (the interpreter's numpy has no bf16), against the
# reference in fp32 on the same bf16 inputs.
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def pool(shapes: list[tuple[int, int]], heads: int, lora: int, rope: int, block_size: int, seed: int,
         num_blocks: int = 48, dtype: torch.dtype = torch.float32):
    """Sequences (rows already cached, rows computed this step), decodes first, their blocks
    scattered over a pool holding garbage elsewhere: (q, this step's rows, cache, metadata)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    row = lora + rope
    cache = torch.randn(num_blocks, block_size, 1, row, generator=gen)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables, slots, new_rows, qs = [], [], [], []
    for cached, new in shapes:
        ctx = cached + new
        table = [free.pop() for _ in range(-(-ctx // block_size))]
        rows = torch.randn(ctx, row, generator=gen)
        for p in range(cached):
            cache[table[p // block_size], p % block_size, 0] = rows[p]
        slots += [table[p // block_size] * block_size + p % block_size for p in range(cached, ctx)]
        new_rows.append(rows[cached:])
        qs.append(torch.randn(new, heads, row, generator=gen))
        tables.append(table)
    width = max(map(len, tables)) + 1  # a spare column: padding the kernels must never read
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=DEVICE)
    seq_lens = [c + n for c, n in shapes]
    meta = AttentionMetadata(torch.tensor(slots, device=DEVICE), block_tables, [n for _, n in shapes], seq_lens,
                             torch.tensor(seq_lens, device=DEVICE), sum(n == 1 for _, n in shapes), block_size)
    return (torch.cat(qs).to(DEVICE, dtype), torch.cat(new_rows).to(DEVICE, dtype), cache.to(DEVICE, dtype),
            meta)


def run_both(shapes, heads, lora, rope, block_size, seed=0, dtype=torch.float32, **backend_args):
    """(Triton's output, the reference's), both as float32."""
    q, rows, cache, meta = pool(shapes, heads, lora, rope, block_size, seed, dtype=dtype)
    scale = (lora + rope) ** -0.5
    want_cache, got_cache = cache.float(), cache.clone()
    want = latent.latent_attention(q.float(), rows.float(), want_cache, meta, scale, lora)
    got = TritonAttentionBackend(**backend_args).forward_latent(q, rows, got_cache, meta, scale, lora)
    assert got.dtype == dtype
    assert torch.equal(got_cache.float(), want_cache)  # the rows went to their slots, nothing else moved
    return got.float(), want


# Decodes whose contexts end inside a block, on its last slot, and one past it; then a fresh prompt,
# a chunk whose earlier chunks are cached (crossing block boundaries), and a prompt with a cached prefix.
MIXED = [(4, 1), (7, 1), (8, 1), (0, 9), (13, 7), (16, 5)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,lora,rope", [(4, 32, 8), (20, 24, 8)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_mixed_batch_matches_reference(heads, lora, rope, num_splits, dtype):
    """Block size 4 so every tile of rows spans several pages; 20 heads are two head blocks, the
    second mostly padding; 24 latent features pad to 32 (the padding masked)."""
    got, want = run_both(MIXED, heads, lora, rope, block_size=4, num_splits=num_splits, dtype=dtype)
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_prefill_tiles_of_several_tokens_and_long_decodes():
    """Prefill programs of 4 tokens x 4 heads, decodes over 40 rows in 16-row tiles and 2 splits
    (a split holding several tiles), prompts of every length 1-6 beside a long chunk."""
    shapes = [(39, 1), (40, 1), (0, 2), (3, 3), (30, 17), (1, 6)]
    got, want = run_both(shapes, 4, 32, 8, block_size=8, seed=1, num_splits=2,
                         latent_config=LatentConfig(block_n=16, block_h=4, rows=16))
    torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_decode_of_empty_context_is_zero_and_bad_inputs_are_refused():
    q, _, cache, meta = pool([(5, 1), (9, 1)], 4, 32, 8, block_size=4, seed=2)
    out = latent_decode(q, cache, meta.block_tables, torch.tensor([0, 9], device=DEVICE), 0.1, 32, num_splits=2)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and out[1].abs().sum() > 0
    with pytest.raises(ValueError, match="do not fit latent rows of 40 features"):
        latent_decode(q[..., :36], cache, meta.block_tables, meta.seq_lens_tensor, 0.1, 32)
    with pytest.raises(ValueError, match="8-bit formats are not read by latent layers"):
        latent_decode(q, cache.to(torch.uint8), meta.block_tables, meta.seq_lens_tensor, 0.1, 32)
    backend = TritonAttentionBackend()
    backend.kv_format = resolve_kv_format("int8", torch.float32)
    with pytest.raises(ValueError, match="kv_cache_dtype 'int8' is not read by latent attention"):
        backend.forward_latent(q, q[:, 0], cache, meta, 0.1, 32)



@pytest.mark.slow  # about 15 s under the interpreter on a loaded 2-core machine
def test_deepseek_v3_through_the_triton_backend_equals_the_torch_backend(tmp_path, monkeypatch):
    """The small DeepSeek-V3 model (tests/models/families.py: 4 heads, rows of 32 + 8) served with
    the Triton backend: a prompt in chunks of 8 tokens, then two prompts beside each other, one
    whose first block comes from the prefix cache, decodes beside prefills. Greedy tokens equal
    the torch backend's (itself checked against transformers in tests/models/test_families.py),
    logprobs within 1e-4."""
    from pagellm import LLM, SamplingParams
    from pagellm.worker import model_runner
    from tests.models.families import build

    path = str(build("deepseek_v3", tmp_path / "ds"))
    first = [[5, 17, 42, 9, 100, 3, 77, 12, 8, 61, 2, 19, 33]]
    then = [[5, 17, 42, 9, 250, 6], [7, 300, 11]]
    params = SamplingParams(max_tokens=5, temperature=0.0, logprobs=1, ignore_eos=True)
    args = dict(num_kv_blocks=32, block_size=4, max_num_batched_tokens=8, enforce_eager=True, dtype="float32")

    def run(llm):
        outs = [o for prompts in (first, then)
                for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
        assert llm.stats()["prefix_cache_hits"] > 0
        return [o.outputs[0] for o in outs]

    served = []

    def served_with(make_backend):
        # Each engine gets the backend named here (on a GPU "auto" would pick Triton for both).
        monkeypatch.setattr(model_runner, "select_backend", lambda *a, **k: served.append(make_backend()) or served[-1])
        return run(LLM(path, **args))

    want = served_with(TorchAttentionBackend)
    got = served_with(lambda: TritonAttentionBackend(num_splits=2))
    assert [type(b).__name__ for b in served] == ["TorchAttentionBackend", "TritonAttentionBackend"]
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        for lg, lw in zip(g.logprobs, w.logprobs):
            [(tok, lp)] = [(t, x.logprob) for t, x in lg.items() if t in lw]
            assert abs(lp - lw[tok].logprob) < 1e-4

"""CUDAGraphRunner: padding a decode batch into static buffers must not change a single output
or cache entry. Without a GPU the padded forward runs eagerly (and the Triton kernels under the
interpreter); on a GPU the captured graphs are replayed."""
from __future__ import annotations

import pytest
import torch

from pagellm.attention.interpreter import use_interpreter_without_gpu

use_interpreter_without_gpu()
import triton  # noqa: E402,F401  (a test dependency on Linux: missing, these tests must fail)

from pagellm.attention.backend import AttentionMetadata  # noqa: E402
from pagellm.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from pagellm.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from pagellm.models.arch import ModelArchConfig  # noqa: E402
from pagellm.models.llama import LlamaForCausalLM  # noqa: E402
from pagellm.worker.cuda_graphs import CUDAGraphRunner, graph_batch_sizes  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BLOCK = 4
MAX_LEN = 64


def test_batch_size_ladder():
    assert graph_batch_sizes(256) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(1) == [1]


def tiny_model(dtype=torch.float32):
    arch = ModelArchConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_LEN)
    backend = TritonAttentionBackend(num_splits=2)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = LlamaForCausalLM(arch, backend, MAX_LEN).to(dtype).eval()
    with torch.no_grad():  # parameters are created empty: give them small random values
        for p in model.parameters():
            p.copy_(torch.randn(p.shape) * 0.2)
    caches = [(torch.zeros(32, BLOCK, 2, arch.head_dim, dtype=dtype, device=DEVICE),
               torch.zeros(32, BLOCK, 2, arch.head_dim, dtype=dtype, device=DEVICE)) for _ in range(2)]
    return model, backend, caches


def decode_step(tables: list[list[int]], lens: list[int], gen: torch.Generator):
    """Metadata, token ids and positions for one decode token per sequence at position len - 1."""
    width = max(len(t) for t in tables)
    slots = [t[(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK for t, n in zip(tables, lens)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=DEVICE),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], device=DEVICE),
        query_lens=[1] * len(lens), seq_lens=list(lens), seq_lens_tensor=torch.tensor(lens, device=DEVICE),
        num_decodes=len(lens), block_size=BLOCK)
    ids = torch.randint(0, 64, (len(lens),), generator=gen).to(DEVICE)
    return ids, torch.tensor([n - 1 for n in lens], device=DEVICE), meta


def clone(caches):
    return [(k.clone(), v.clone()) for k, v in caches]


@torch.inference_mode()
def test_padded_decode_equals_eager_and_leaves_other_slots_alone():
    model, backend, caches = tiny_model()
    gen = torch.Generator().manual_seed(1)
    # Earlier steps' K/V: random contents everywhere, so a stray write or read would show.
    for k, v in caches:
        k.copy_(torch.randn(k.shape, generator=gen))
        v.copy_(torch.randn(v.shape, generator=gen))
    tables = [[3, 9], [5], [17, 2, 30]]
    ids, pos, meta = decode_step(tables, [6, 2, 11], gen)

    eager_caches = clone(caches)
    expected = model(ids, pos, eager_caches, meta)

    runner = CUDAGraphRunner(model, caches, backend=backend, block_size=BLOCK, max_model_len=MAX_LEN,
                             max_num_seqs=8, device=DEVICE)
    runner.capture()
    assert runner.padded_size(3) == 4
    # Stale slots from an earlier, larger step must not leak into the padded row.
    runner.slot_mapping.fill_(0)
    runner.seq_lens.fill_(MAX_LEN)
    out = runner(ids, pos, caches, meta)
    tol = dict(atol=1e-4, rtol=1e-4) if DEVICE.type == "cpu" else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(out, expected, **tol)
    # The step's own slots hold the same K/V up to the rounding of a batch of 4 instead of 3
    # (the projections' matrix products may block differently); every other slot is untouched.
    written = torch.zeros(32 * BLOCK, dtype=torch.bool, device=DEVICE)
    written[meta.slot_mapping] = True
    for pair, eager_pair in zip(caches, eager_caches):
        for got, want in zip(pair, eager_pair):
            got, want = got.flatten(0, 1), want.flatten(0, 1)
            torch.testing.assert_close(got[written], want[written], **tol)
            torch.testing.assert_close(got[~written], want[~written], atol=0, rtol=0)


@torch.inference_mode()
def test_non_decode_steps_run_eagerly():
    model, backend, caches = tiny_model()
    runner = CUDAGraphRunner(model, caches, backend=backend, block_size=BLOCK, max_model_len=MAX_LEN,
                             max_num_seqs=2, device=DEVICE)
    gen = torch.Generator().manual_seed(2)
    ids, pos, meta = decode_step([[1], [2], [4]], [1, 1, 1], gen)  # three decodes: more than captured
    assert not runner.can_run(3, meta)
    torch.testing.assert_close(runner(ids, pos, caches, meta), model(ids, pos, clone(caches), meta))


def test_rejects_a_backend_that_cannot_be_captured():
    model, _, caches = tiny_model()
    with pytest.raises(ValueError, match="cannot be captured"):
        CUDAGraphRunner(model, caches, backend=TorchAttentionBackend(), block_size=BLOCK, max_model_len=MAX_LEN,
                        max_num_seqs=4, device=DEVICE)


@pytest.mark.gpu
@torch.inference_mode()
def test_graph_replay_over_several_steps_matches_eager():
    """Real capture: steps of varying batch size replayed from graphs, against the eager model."""
    model, backend, caches = tiny_model(torch.bfloat16)
    eager_caches = clone(caches)
    runner = CUDAGraphRunner(model, caches, backend=backend, block_size=BLOCK, max_model_len=MAX_LEN,
                             max_num_seqs=8, device=DEVICE)
    runner.capture()
    assert set(runner.graphs) == {1, 2, 4, 8}
    gen = torch.Generator().manual_seed(3)
    tables = [[i * 4 + j for j in range(4)] for i in range(8)]
    for step, n in enumerate([5, 8, 1, 3, 2]):
        lens = [step + 1 + i for i in range(n)]
        ids, pos, meta = decode_step(tables[:n], lens, gen)
        out = runner(ids, pos, caches, meta).clone()
        expected = model(ids, pos, eager_caches, meta)
        torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
    for (k, v), (ek, ev) in zip(caches, eager_caches):
        torch.testing.assert_close(k, ek, atol=2e-2, rtol=2e-2)

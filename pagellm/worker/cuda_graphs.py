"""Decode steps replayed from CUDA graphs, one graph captured per batch size of a ladder.

A decode step of an 8B model launches hundreds of small kernels; at small batch each runs for
microseconds, so launching them from Python costs more than running them. A captured graph
replays the whole forward with one launch. Graphs bake in tensor addresses and shapes, so the
step's inputs go into static buffers sized for the largest batch and the longest context
(block tables of `ceil(max_model_len / block_size)` columns), and a batch is padded up to the
next captured size. Padded rows get slot -1 (the store kernel skips negative slots, so they
never touch the KV cache) and context length 0 (the decode kernel reads nothing for them).

Only a backend whose decode path reads tensors and shapes alone, never Python lists of lengths,
can be captured: `backend.supports_cuda_graphs`. The KV cache tensors must not be reallocated
after capture. Off CUDA (`use_graphs=False`) the same padding runs eagerly, which is how the
padding is tested without a GPU.
"""
from __future__ import annotations

import bisect

import torch
from torch import nn

from pagellm.attention.backend import AttentionBackend, AttentionMetadata

# Dense at the bottom, where one padded row is a large share of the batch; sparser above.
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def graph_batch_sizes(max_num_seqs: int, ladder: tuple[int, ...] = DEFAULT_BATCH_SIZES) -> list[int]:
    """The ladder up to `max_num_seqs`, topped with `max_num_seqs` itself so every decode batch fits."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    return sorted({s for s in ladder if s < max_num_seqs} | {max_num_seqs})


class CUDAGraphRunner:
    """Runs decode-only steps through captured graphs; anything else through the eager model.

    Call it like the model: `runner(input_ids, positions, kv_caches, meta) -> hidden [T, hidden]`.
    A replayed step returns a view of the graph's static output, valid until the next replay.
    """

    def __init__(self, model: nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], *,
                 backend: AttentionBackend, block_size: int, max_model_len: int, max_num_seqs: int,
                 device: torch.device, batch_sizes: list[int] | None = None, use_graphs: bool | None = None) -> None:
        if not backend.supports_cuda_graphs:
            raise ValueError(f"attention backend {type(backend).__name__} cannot be captured in a CUDA graph "
                             "(its decode path reads Python lists); use the Triton backend")
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = torch.device(device)
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        self.batch_sizes = sorted(batch_sizes) if batch_sizes else graph_batch_sizes(max_num_seqs)
        self.max_blocks = -(-max_model_len // block_size)
        n = self.batch_sizes[-1]
        with torch.device(self.device):
            self.input_ids = torch.zeros(n, dtype=torch.long)
            self.positions = torch.zeros(n, dtype=torch.long)
            self.slot_mapping = torch.full((n,), -1, dtype=torch.long)
            self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.long)
            self.seq_lens = torch.zeros(n, dtype=torch.long)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    def padded_size(self, n: int) -> int:
        """The smallest captured batch size holding n rows."""
        i = bisect.bisect_left(self.batch_sizes, n)
        if i == len(self.batch_sizes):
            raise ValueError(f"a decode batch of {n} exceeds the largest captured size {self.max_batch_size}")
        return self.batch_sizes[i]

    def can_run(self, num_tokens: int, meta: AttentionMetadata) -> bool:
        """A decode-only step that fits the static buffers."""
        return (meta.num_decodes == meta.num_seqs == num_tokens
                and 0 < num_tokens <= self.max_batch_size
                and meta.block_tables.shape[1] <= self.max_blocks)

    # ---- capture -------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per batch size, largest first so the smaller ones reuse its memory pool.

        The buffers hold slot -1 and length 0 while capturing, so the warm-up runs write and read
        no cache entry.
        """
        if not self.use_graphs:
            return
        self.slot_mapping.fill_(-1)
        self.seq_lens.zero_()
        pool = None
        for bs in reversed(self.batch_sizes):
            meta = self._meta(bs)
            # Outside the graph first: compiles the kernels for these shapes and settles the allocator.
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self._forward(bs, meta)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bs] = self._forward(bs, meta)
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.device)

    # ---- one step --------------------------------------------------------------------------------
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        if kv_caches is not self.kv_caches:
            raise ValueError("the KV caches changed since the graphs were captured")
        n = input_ids.shape[0]
        if not self.can_run(n, meta):
            return self.model(input_ids, positions, kv_caches, meta)
        bs = self.fill(input_ids, positions, meta)
        if self.use_graphs:
            if bs not in self.graphs:
                raise RuntimeError("CUDAGraphRunner.capture() must run before the first decode step")
            self.graphs[bs].replay()
            return self.outputs[bs][:n]
        return self._forward(bs, self._meta(bs))[:n]

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> int:
        """Copy a decode step into the static buffers, padded to a captured size; returns that size.

        Rows past n keep stale token ids and positions (valid indices, harmless), and get slot -1
        and length 0 so they neither write nor read the cache. Block-table columns past the step's
        width keep stale ids too: no position below a row's length reaches them.
        """
        n = input_ids.shape[0]
        bs = self.padded_size(n)
        width = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.slot_mapping[n:bs].fill_(-1)
        self.seq_lens[:n].copy_(meta.seq_lens_tensor, non_blocking=True)
        self.seq_lens[n:bs].zero_()
        self.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        return bs

    def _meta(self, bs: int) -> AttentionMetadata:
        # The list fields are placeholders: a capturable backend reads the tensors alone.
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            block_tables=self.block_tables[:bs],
            query_lens=[1] * bs,
            seq_lens=[1] * bs,
            seq_lens_tensor=self.seq_lens[:bs],
            num_decodes=bs,
            block_size=self.block_size,
        )

    def _forward(self, bs: int, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(self.input_ids[:bs], self.positions[:bs], self.kv_caches, meta)

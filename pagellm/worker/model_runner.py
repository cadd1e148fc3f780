"""Turns a step plan into tensors, runs the model once, and samples.

Owns the model, the KV cache tensors and the sampler. Receives the step plan
(pagellm.core.step_plan: per sequence, the tokens to compute, their first position,
its block table, who samples from it); knows nothing of how it was chosen.
"""
from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass, field, replace
from collections.abc import Sequence
from typing import Any, Callable

import torch

from pagellm import cpu_features
from pagellm.attention import select_backend
from pagellm.attention.backend import AttentionBackend, AttentionMetadata
from pagellm.kv_format import resolve_kv_format
from pagellm.core.kv.groups import STATE, group_names, plan_kv_groups
from pagellm.core.step_plan import PlannedSeq, PromptLogprobs, SampleSpec, StepPlan
from pagellm.layers.parallel import TensorParallelGroup, rank_and_size
from pagellm.kernels import cpu as cpu_kernels
from pagellm.layers.attention import Attention
from pagellm.layers.moe import FusedMoE
from pagellm.layers.quant import linear_methods
from pagellm.layers.recurrent import RecurrentMixer, blocks_for_state, read_state, roll_back_states, write_state
from pagellm.models.arch import ModelArchConfig
from pagellm.models.registry import build_model
from pagellm.timing import PhaseTimer, phase
from pagellm.worker.cuda_graphs import CUDAGraphRunner
from pagellm.worker.kv_tier import DiskKVTier
from pagellm.worker.proposers import Proposal, ProposalQuery, Proposer
from pagellm.worker.rejection_sampler import num_accepted, verification_specs, verify_with_draft_probs
from pagellm.worker.sampler import Sampler, SamplerOutput, SamplingMetadata

# With no budget given, the CPU path takes this much for KV, or half the free memory if less.
_DEFAULT_CPU_KV_BYTES = 1 << 30


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} was asked for but no CUDA device is available")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """A name of config.DTYPES as a torch dtype (the names are torch's own). bfloat16 on a CPU
    without bfloat16 instructions is refused: torch would run it hundreds of times slower."""
    if dtype == "auto":
        # fp32 on the CPU: it matches the reference to the token; bf16 there is the opt-in fast mode.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype == "bfloat16" and device.type == "cpu" and not cpu_features.has_bf16():
        raise ValueError("dtype 'bfloat16' needs a CPU with bfloat16 instructions (AVX-512 BF16 or AMX); this "
                         "one has none, and torch's bfloat16 products run hundreds of times slower than float32 "
                         "without them. Use dtype 'float32' (the CPU's default, 'auto')")
    return getattr(torch, dtype)


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


@dataclass
class StepInputs:
    """A step's tensor work, the same on every tensor-parallel rank (which get it packed field by
    field: pagellm.distributed.worker.pack)."""

    block_copies: list[tuple[int, int]]  # copy-on-write, before the forward pass
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    rows: list[int]  # the rows of the hidden states that need logits: the sampling rows, then prompt rows
    # Embedding requests' chunks: (first row, end row, reduction) of the hidden states to pool.
    pool_rows: list[tuple[int, int, str]] = field(default_factory=list)


@dataclass
class StepResult:
    """What one step sampled: `request_ids[i]` drew `sampled.token_ids[i]` (a speculating sequence
    draws several tokens, in consecutive rows, in order); the prompt logprobs it computed, by
    sequence id; each embedding request's chunk reduced as its plan said (PlannedSeq.pool: a
    float32 [hidden] vector), by sequence id; and the tokens proposed for each speculating
    sequence's next step to verify."""

    request_ids: list[str]
    sampled: SamplerOutput | None
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    pooled: dict[str, torch.Tensor] = field(default_factory=dict)
    drafts: dict[str, list[int]] = field(default_factory=dict)

    @classmethod
    def concat(cls, parts: list[StepResult]) -> StepResult:
        """The results of disjoint parts of one step, as if it had run whole."""
        prompt = {rid: p for part in parts for rid, p in part.prompt_logprobs.items()}
        pooled = {rid: p for part in parts for rid, p in part.pooled.items()}
        drafts = {rid: d for part in parts for rid, d in part.drafts.items()}
        parts = [p for p in parts if p.sampled is not None]
        if not parts:
            return cls([], None, prompt, pooled, drafts)
        return cls([rid for p in parts for rid in p.request_ids], SamplerOutput.concat([p.sampled for p in parts]),
                   prompt, pooled, drafts)


# Rank 0's way to run a step's tensor work (StepInputs -> run_step's value) on every rank: it is
# handed the inputs and this runner's own run_step.
StepMirror = Callable[["StepInputs", Callable[["StepInputs"], Any]], Any]
# How rank 0 runs a ModelRunner method on every rank: (its name, its arguments, rank 0's own call)
# -> every rank's value, rank 0's first (distributed/driver.py, WorkerGroup.call).
RankCall = Callable[[str, tuple, Callable[[], Any]], list[Any]]


class ModelRunner:
    def __init__(self, arch: ModelArchConfig, device: torch.device, dtype: torch.dtype, max_model_len: int,
                 backend: AttentionBackend | None = None, seed: int = 0,
                 tp: TensorParallelGroup | None = None, weight_format: str = "dense",
                 batch_invariant: bool = False, sliding_kv: bool = False, kv_cache_dtype: str = "auto",
                 activation_quantization: str = "none", proposer: Proposer | None = None,
                 mirror: StepMirror | None = None, mirror_call: RankCall | None = None,
                 model_class: type | None = None) -> None:
        """`weight_format` "gguf": linear layers keep the GGUF blocks they are loaded with.
        `batch_invariant`: a token's logits do not depend on what else runs (layers/invariant.py).
        `sliding_kv`: sliding-window layers get their own KV groups (block tables whose slid-out
        blocks the KV manager frees, core/kv/coordinator.py); otherwise every layer is in one group.
        `kv_cache_dtype`: how K/V are stored (kv_format.py; auto: as `dtype`).
        `activation_quantization` "int8" / "int8x2": GGUF products round their activations to int8
        codes (layers/quant/gguf.py).
        `proposer`: speculative decoding's, on the rank that samples (None: no speculation).
        `mirror`: how rank 0 of a tensor-parallel engine runs a step's tensor work on every rank
        (pagellm/executor/tensor_parallel.py), `mirror_call` any other runner method (a verification's
        roll-back of the recurrent states every rank traced); None: on this one alone.
        `model_class`: the model to build instead of `arch`'s family (an MTP layer, built as the
        family is: `model_class(arch, backend, max_model_len, tp)`)."""
        self.arch = arch
        self.device = device
        self.dtype = dtype
        self.backend = backend or select_backend(device, batch_invariant=batch_invariant)
        self.kv_format = resolve_kv_format(kv_cache_dtype, dtype)
        if self.kv_format.quantized and not self.backend.reads_8bit_kv:
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not read by the {type(self.backend).__name__} "
                             f"yet (8-bit KV runs on the CPU backend so far); use kv_cache_dtype 'auto'")
        self.backend.kv_format = self.kv_format
        self.max_model_len = max_model_len
        self.cuda_graphs: CUDAGraphRunner | None = None
        with torch.device(device), linear_methods(weight_format, dtype, batch_invariant, activation_quantization):
            model = (build_model(arch, self.backend, max_model_len, tp) if model_class is None else
                     model_class(arch, self.backend, max_model_len, tp))
            self.model = model.to(dtype)
        if batch_invariant and any(isinstance(m, FusedMoE) for m in self.model.modules()):
            raise ValueError(f"batch-invariant mode does not cover mixture-of-experts models yet ({arch.architecture}: "
                             f"each expert multiplies the tokens routed to it, a batch-dependent set)")
        self.model.eval()
        # The layers that cache something, in the order the model hands them kv_caches.
        layers = [m for m in self.model.modules() if isinstance(m, (Attention, RecurrentMixer))]
        self.recurrent = [m for m in layers if isinstance(m, RecurrentMixer)]
        if self.recurrent and not sliding_kv:
            raise ValueError(f"{arch.architecture} has recurrent layers: their state needs KV groups (sliding_kv)")
        if self.kv_format.quantized and any(getattr(m, "latent", False) for m in layers):
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not read by latent attention layers "
                             f"({arch.architecture}: their rows are read whole by every head, unscaled); use "
                             f"kv_cache_dtype 'auto'")
        windows = [STATE if isinstance(m, RecurrentMixer) else m.options.sliding_window if sliding_kv else None
                   for m in layers]
        self.kv_groups = plan_kv_groups(windows, max_model_len)
        # How stats name each group: latent rows and chunked attention beside the window kinds.
        self.kv_group_names = group_names(self.kv_groups, [
            "latent" if getattr(m, "latent", False) else
            "chunked" if isinstance(m, Attention) and m.options.attention_chunk is not None else None
            for m in layers])
        # (heads, K row, V row) of each caching layer's tokens: one shape for most models.
        self.layer_rows = [self.model.layer_kv_rows(m) for m in layers]
        # Each recurrent layer with its index in kv_caches (read_states, write_states).
        self._state_layers = [(i, m) for i, m in enumerate(layers) if isinstance(m, RecurrentMixer)]
        self.state_groups = frozenset(g for g, w in enumerate(self.kv_groups.windows) if w == STATE)
        for layer, group in zip(layers, self.kv_groups.layer_group):
            layer.kv_group = group
        if device.type == "cpu":
            cpu_kernels.available()  # built (once) at start-up, not on the first request
        self.sampler = Sampler(seed=seed, device=device)
        self.proposer = proposer
        # A proposer that reads the target's hidden states (MTP) is shown each step's (observe).
        self._step_hidden: torch.Tensor | None = None
        # The draft distributions of the proposals made last step, by sequence, for their verification.
        self._draft_probs: dict[str, Proposal] = {}
        self.mirror = mirror
        self.mirror_call = mirror_call
        # The recurrent layers' states the last step traced while verifying (roll_back_verified).
        self._traced_states: list = []
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._kv_slots: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.block_size = 0
        self._rank_size = rank_and_size(tp)
        # This rank's second tier (open_kv_tier), and blocks loaded from it for the next promotions.
        self.kv_tier: DiskKVTier | None = None
        self._staged_blocks: dict[bytes, torch.Tensor] = {}
        self.timer: PhaseTimer | None = None  # see attach_timer

    # ---- weights -------------------------------------------------------------------
    def load_weights(self, weights) -> None:
        with torch.no_grad():
            self.model.load_weights((n, t.to(self.dtype)) for n, t in weights)

    def init_dummy_weights(self, seed: int = 0) -> None:
        """Random weights of a realistic scale, for benchmarks of shapes with no checkpoint."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).mul_(0.02).to(p.dtype))

    # ---- KV cache --------------------------------------------------------------------
    def bytes_per_block(self, block_size: int) -> int:
        """K and V of one block id: `kv_groups.slots` layers (all of them with one group)."""
        # A latent layer's one row is in K, none in V (layers/mla.py; 8-bit formats refused for it).
        # Layers of different shapes share a slot (one of each group): it is sized by the largest.
        row = self.kv_format.bytes_per_row
        k = max(heads * row(k_row) for heads, k_row, _ in self.layer_rows)
        v = max(heads * row(v_row) if v_row else 0 for heads, _, v_row in self.layer_rows)
        return self.kv_groups.bytes_per_block(block_size, 1, k, v)

    def state_blocks(self, block_size: int) -> int:
        """Blocks of one recurrent group that hold a sequence's state (its largest layer's); 0
        without recurrent layers."""
        per_layer = self.bytes_per_block(block_size) // self.kv_groups.slots  # K and V of one slot
        return max((blocks_for_state(m.state_bytes, per_layer) for m in self.recurrent), default=0)

    def read_states(self, tables: Sequence[list[int]]) -> list[torch.Tensor]:
        """One sequence's recurrent states as its state blocks hold them now, a copy per recurrent
        layer (`tables`: its block table in each KV group); write_states puts them back."""
        return [read_state(self.kv_caches[i], torch.tensor([tables[m.kv_group]], device=self.device))
                for i, m in self._state_layers]

    def write_states(self, tables: Sequence[list[int]], states: list[torch.Tensor]) -> None:
        """read_states' copies back into the sequence's state blocks."""
        for (i, m), raw in zip(self._state_layers, states):
            write_state(self.kv_caches[i], torch.tensor([tables[m.kv_group]], device=self.device), raw)

    def num_blocks_for_budget(self, block_size: int, kv_cache_memory: float | int | None) -> int:
        if kv_cache_memory is None:
            free = free_memory_bytes(self.device)
            budget = int(0.9 * free) if self.device.type == "cuda" else min(_DEFAULT_CPU_KV_BYTES, free // 2)
        elif isinstance(kv_cache_memory, float):
            budget = int(kv_cache_memory * free_memory_bytes(self.device))
        else:
            budget = int(kv_cache_memory)
        n = budget // self.bytes_per_block(block_size)
        if n < 1:
            raise ValueError(f"kv_cache_memory={kv_cache_memory!r} holds no KV block "
                             f"(one block takes {self.bytes_per_block(block_size)} bytes)")
        return n

    def allocate_kv_cache(self, num_blocks: int, block_size: int, asked_by: str = "the KV budget") -> None:
        """Allocate the pool, after checking the machine has the memory (the kernel's OOM killer
        would end the process without a word). `asked_by` names the option that set its size.
        The weights are loaded by now, so the memory available is what is left beside them."""
        per_block = self.bytes_per_block(block_size)
        need, free = num_blocks * per_block, free_memory_bytes(self.device)
        if need > free:
            gib = 1 << 30
            where = "this host" if self.device.type == "cpu" else str(self.device)
            raise ValueError(f"{asked_by} asks for a KV cache of {need} bytes ({need / gib:.2f} GiB: {num_blocks} "
                             f"blocks of {per_block} bytes) but {where} has {free} bytes ({free / gib:.2f} GiB) "
                             f"available beside the weights{' (MemAvailable)' if where == 'this host' else ''}; "
                             f"lower kv_cache_memory (e.g. 0.5 of free memory) or num_kv_blocks")
        # Zeroed, not empty: attention reads padding slots (and the KV manager's null block) under a
        # mask, and 0 * NaN is NaN. One pair per slot, shared by one layer of each KV group.
        if len(set(self.layer_rows)) == 1:
            heads, k_row, v_row = self.layer_rows[0]
            shapes = [self.backend.kv_cache_shape(num_blocks, block_size, heads, row) for row in (k_row, v_row)]
            self._kv_slots = [
                tuple(torch.zeros(shape, dtype=self.kv_format.storage_dtype, device=self.device) for shape in shapes)
                for _ in range(self.kv_groups.slots)
            ]
            self.kv_caches = [self._kv_slots[slot] for slot in self.kv_groups.layer_slot]
        else:
            self._allocate_mixed_shapes(num_blocks, block_size)
        self.block_size = block_size

    def _allocate_mixed_shapes(self, num_blocks: int, block_size: int) -> None:
        """Layers whose rows differ (Gemma 4's full and sliding layers): each slot is a flat
        [num_blocks, largest block] tensor, and each layer sees the first part of every block as
        its [num_blocks, block_size, heads, row] cache, a strided view where its block is smaller
        (the backends read such a view through torch, the compiled kernels taking contiguous caches)."""
        shapes = [[self.backend.kv_cache_shape(num_blocks, block_size, heads, row) for row in (k_row, v_row)]
                  for heads, k_row, v_row in self.layer_rows]
        per_block = [max(math.prod(layer[i][1:]) for layer in shapes) for i in (0, 1)]
        self._kv_slots = [
            tuple(torch.zeros(num_blocks, n, dtype=self.kv_format.storage_dtype, device=self.device)
                  for n in per_block)
            for _ in range(self.kv_groups.slots)
        ]
        self.kv_caches = [
            tuple(flat[:, :math.prod(shape[1:])].view(shape) for flat, shape in zip(self._kv_slots[slot], layer))
            for slot, layer in zip(self.kv_groups.layer_slot, shapes)
        ]

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: give each new block the contents of the shared one it replaces."""
        src = torch.tensor([a for a, _ in copies], device=self.device)
        dst = torch.tensor([b for _, b in copies], device=self.device)
        for k_cache, v_cache in self._kv_slots:
            k_cache.index_copy_(0, dst, k_cache.index_select(0, src))
            v_cache.index_copy_(0, dst, v_cache.index_select(0, src))

    # ---- a second tier (core/kv/tiered.py, worker/kv_tier.py) -----------------------------------
    def read_block(self, block: int) -> torch.Tensor:
        """One block id's K/V bytes (every slot tensor pair), as a new uint8 CPU tensor."""
        parts = [t[block].reshape(-1).view(torch.uint8) for pair in self._kv_slots for t in pair]
        return torch.cat(parts).cpu()

    def write_block(self, block: int, payload: torch.Tensor) -> None:
        """Put bytes from read_block back into block id `block`."""
        payload = payload.to(self.device)
        start = 0
        for pair in self._kv_slots:
            for t in pair:
                dst = t[block].reshape(-1).view(torch.uint8)
                dst.copy_(payload[start:start + dst.numel()])
                start += dst.numel()
        if start != payload.numel():
            raise ValueError(f"a KV tier payload of {payload.numel()} bytes for blocks of {start}")

    def open_kv_tier(self, directory: str, capacity_bytes: int, fingerprint: bytes, persist: bool) -> None:
        """This rank's disk tier: its own file (of its shard of each block) in an equal part of
        `capacity_bytes`, so that every rank of a tensor-parallel engine keeps the same blocks."""
        rank, size = self._rank_size
        if size > 1:
            fingerprint = hashlib.blake2b(fingerprint + f"rank {rank} of {size}".encode(), digest_size=16).digest()
        self.kv_tier = DiskKVTier(directory, capacity_bytes // size, self.bytes_per_block(self.block_size),
                                  fingerprint, persist=persist)

    def stage_tier_block(self, key: bytes) -> bool:
        """Load the block stored under `key` from this rank's tier, to be written into the pool by
        the next apply_tier_ops' promotion; False: the tier misses it (absent, or failing its checks)."""
        payload = self.kv_tier.load(key)
        if payload is None:
            return False
        self._staged_blocks[key] = payload
        return True

    def unstage_tier_block(self, key: bytes) -> None:
        """Forget a staged block (another rank missed it: the coordinator recomputes it)."""
        self._staged_blocks.pop(key, None)

    @torch.inference_mode()
    def apply_tier_ops(self, ops: list) -> None:
        """Make the KV manager's moves, in order: demotions copy a block out to this rank's tier,
        promotions write a staged block in."""
        for op in ops:
            if op.kind == "demote":
                self.kv_tier.store(op.key, self.read_block(op.block))
            else:
                self.write_block(op.block, self._staged_blocks[op.key])
        self._staged_blocks.clear()

    def close_kv_tier(self, cached_blocks: list[tuple[int, bytes]]) -> None:
        """Close this rank's tier, writing what it has queued; a persisted one first keeps
        `cached_blocks` (block, key), the pool's cached prefixes, so a restart finds them warm."""
        tier = self.kv_tier
        if tier is None or not tier.is_open:
            return
        if tier.persist:
            for block, key in cached_blocks:
                tier.store(key, self.read_block(block), wait=True)
        tier.close()

    def capture_cuda_graphs(self, max_num_seqs: int) -> None:
        """Record decode steps for a ladder of batch sizes (CUDA only; after the KV
        cache is allocated, which must never be reallocated afterwards)."""
        if self.device.type == "cuda" and self.backend.supports_cuda_graphs and self._plain_attention():
            self.cuda_graphs = CUDAGraphRunner(self.model, self.kv_caches, backend=self.backend,
                                               block_size=self.block_size, max_model_len=self.max_model_len,
                                               max_num_seqs=max_num_seqs, device=self.device)
            self.cuda_graphs.capture()

    def _plain_attention(self) -> bool:
        """No layer needs more than causal attention (no window, soft-cap, sinks or latent rows,
        whose torch decode reads the step's lengths as Python ints). The Triton
        kernels take those options, but capturing them in a graph has not run on a GPU yet, so
        such models decode eagerly until it has."""
        return not self.recurrent and all(m.options.plain and m.sinks is None and not m.latent
                                          for m in self.model.modules() if isinstance(m, Attention))

    def attach_timer(self, timer: PhaseTimer | None) -> None:
        """Report the runner's phases, and the attention backend's, to `timer` (None: stop)."""
        self.timer = timer
        self.backend.timer = timer

    # ---- one step ----------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, plan: StepPlan, eos_token_ids: set[int]) -> StepResult:
        with phase(self.timer, "execute"):
            return self._execute(plan, eos_token_ids)

    def _execute(self, plan: StepPlan, eos_token_ids: set[int]) -> StepResult:
        seqs = [plan.seqs[i] for i in decodes_first(plan.seqs)]
        with phase(self.timer, "prepare_inputs"):
            inputs = self._prepare(seqs, plan.block_copies)
        # Only the last position of each sampling sequence needs logits (forked siblings sample
        # from the same row as their parent), and each verified position of a speculating one.
        samplers = [spec for s in seqs for spec in
                    (verification_specs(s.samplers[0], s.draft_token_ids) if s.draft_token_ids else s.samplers)]
        logits, pooled_rows = self.run_step(inputs) if self.mirror is None else self.mirror(inputs, self.run_step)
        if self._step_hidden is not None:
            hidden, self._step_hidden = self._step_hidden, None
            with phase(self.timer, "propose"):
                self.proposer.observe(seqs, hidden)
        pooled = {} if pooled_rows is None else dict(zip([s.request_id for s in seqs if s.pool], pooled_rows))
        if logits is None:
            return StepResult([], None, pooled=pooled)
        prompt = _prompt_logprobs([s for s in seqs if s.prompt_targets], logits[len(samplers):])
        if not samplers:
            return StepResult([], None, prompt, pooled)
        logits = logits[:len(samplers)]
        sampling = SamplingMetadata.build(
            params=[s.params for s in samplers],
            prompt_token_ids=[s.prompt_token_ids for s in samplers],
            output_token_ids=[s.output_token_ids for s in samplers],
            eos_token_ids=eos_token_ids,
            vocab_size=self.arch.vocab_size,
            device=self.device,
            token_bitmasks=[s.token_bitmask for s in samplers],
        )
        with phase(self.timer, "sampler"):
            sampled = self.sampler(logits, sampling)
            if self._draft_probs:
                self._verify_with_draft_probs(seqs, logits, samplers, sampled, eos_token_ids)
        accepted = _accepted(seqs, sampled)
        if inputs.meta.state_rollbacks:  # recurrent layers: back to the state after the kept tokens, on every rank
            tokens_kept = {i: a + 1 for i, a in enumerate(accepted) if a is not None}
            if self.mirror_call is None:
                self.roll_back_verified(tokens_kept)
            else:
                self.mirror_call("roll_back_verified", (tokens_kept,), lambda: self.roll_back_verified(tokens_kept))
        kept = _kept_rows(seqs, accepted)
        result = StepResult([samplers[i].request_id for i in kept], sampled.select(kept), prompt, pooled)
        if any(s.num_proposals for s in seqs):
            with phase(self.timer, "propose"):
                result.drafts = self._propose(seqs, result)
        return result

    def _verify_with_draft_probs(self, seqs: list[PlannedSeq], logits: torch.Tensor, samplers: list[SampleSpec],
                                 sampled: SamplerOutput, eos_token_ids: set[int]) -> None:
        """Sampled requests whose drafts came with their draft distribution: rejection sampling
        against it replaces the point-mass comparison (rejection_sampler.py)."""
        row = 0
        for s in seqs:
            k = len(s.draft_token_ids)
            # Taken whatever this step does: a distribution is only ever for the step after its proposal.
            proposal = self._draft_probs.pop(s.request_id, None)
            if (proposal is not None and proposal.probs is not None and not s.samplers[0].params.greedy
                    and proposal.token_ids[:k] == list(s.draft_token_ids)):
                verify_with_draft_probs(sampled, logits, row, samplers[row:row + k + 1], s.draft_token_ids,
                                        proposal.probs, eos_token_ids, self.arch.vocab_size, self.sampler.generator)
            row += k + 1 if k else len(s.samplers)

    def _propose(self, seqs: list[PlannedSeq], result: StepResult) -> dict[str, list[int]]:
        """Proposals for the next step of the sequences that asked for them, from their tokens
        with what this step gave them (a draft distribution is kept for that step's verification)."""
        new: dict[str, list[int]] = {}
        errors = result.sampled.errors or {}
        for i, (rid, token) in enumerate(zip(result.request_ids, result.sampled.token_ids)):
            if i not in errors:
                new.setdefault(rid, []).append(token)
        asking = [s for s in seqs if s.num_proposals and s.request_id in new]
        queries = []
        for s in asking:
            spec = s.samplers[0]
            output = [*spec.output_token_ids, *new[s.request_id]]
            # No grammar mask: the runner cannot know the grammar's state after this step's tokens,
            # so proposals are drawn freely and the verification's rows mask them (a refused one
            # ends the accepted run; a draft model's q stays the distribution they came from).
            queries.append(ProposalQuery(s.request_id, [*spec.prompt_token_ids, *output], s.num_proposals,
                                         replace(spec, output_token_ids=output, token_bitmask=None)))
        proposals = self.proposer.propose_for(queries)
        for s, p in zip(asking, proposals):
            if p.probs is not None and p.token_ids:
                self._draft_probs[s.request_id] = p
            else:
                self._draft_probs.pop(s.request_id, None)
        return {s.request_id: p.token_ids for s, p in zip(asking, proposals) if p.token_ids}

    def roll_back_verified(self, kept: dict[int, int]) -> None:
        """The last step's verifying rows (`kept`: row -> tokens kept, its last token and its accepted
        proposals) back to their states after the kept tokens, in every recurrent layer of this rank
        (rank 0 has every rank do it: each holds its shard of the states)."""
        roll_back_states(self._traced_states, kept)
        self._traced_states = []

    @torch.inference_mode()
    def run_step(self, inputs: StepInputs) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """A step's tensor work: copy-on-write block copies, the forward pass, the logits of the
        rows that sample, and the embedding chunks' pooled rows.

        Every tensor-parallel rank runs this with the same inputs (pagellm.distributed);
        rank 0 uses what it returns: (logits or None when no row samples, [pool_rows, hidden]
        float32 or None when nothing pools).
        """
        if inputs.block_copies:
            self.copy_blocks(inputs.block_copies)
        # A captured graph replays decode-only steps; anything else runs eagerly.
        with phase(self.timer, "model_forward"):
            hidden = (self.cuda_graphs or self.model)(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        self._traced_states = inputs.meta.state_rollbacks
        if self.proposer is not None and self.proposer.reads_hidden_states:
            self._step_hidden = hidden
        pooled = _pool_chunks(hidden, inputs.pool_rows) if inputs.pool_rows else None
        if not inputs.rows:
            return None, pooled
        with phase(self.timer, "logits"):
            return self.model.compute_logits(hidden[torch.tensor(inputs.rows, device=self.device)]), pooled

    @torch.inference_mode()
    def last_logits(self, seqs: list[PlannedSeq]) -> torch.Tensor:
        """A forward pass over `seqs` (one sampler each) without sampling: the logits of each one's
        last position, [len(seqs), vocab], in their order (a draft model's step)."""
        order, inputs = self._prepare_decodes_first(seqs)
        logits, _ = self.run_step(inputs)
        return logits[torch.tensor(order, device=logits.device).argsort()]

    @torch.inference_mode()
    def forward_hidden(self, seqs: list[PlannedSeq], previous_hidden: torch.Tensor) -> torch.Tensor:
        """A forward pass over `seqs` of a model that reads a row per token beside the token (an MTP
        layer: the hidden state that predicted it, `previous_hidden`, rows in `seqs`' token order),
        without logits: every token's output row, [tokens, hidden], in the same order."""
        order, inputs = self._prepare_decodes_first(seqs)
        offsets = [0]
        for s in seqs:
            offsets.append(offsets[-1] + len(s.token_ids))
        rows = torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in order]).to(self.device)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, previous_hidden[rows])
        out = torch.empty_like(hidden)
        out[rows] = hidden
        return out

    def release_sequences(self, request_ids: list[str]) -> None:
        """Sequences that finished or were preempted: the proposer gives back what it kept for them."""
        for rid in request_ids:
            self._draft_probs.pop(rid, None)
        if self.proposer is not None:
            self.proposer.release(request_ids)

    def memory_report(self) -> dict:
        """What this rank holds: its weight and KV cache bytes, and its peak memory so far (the
        process's peak RSS on the CPU, the allocator's peak on CUDA)."""
        import resource

        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        # The pool's own tensors: layers of different KV groups share them, or views of them.
        kv = sum(t.numel() * t.element_size() for pair in self._kv_slots for t in pair)
        report = {"rank": self._rank_size[0], "device": str(self.device), "weight_bytes": weights,
                  "kv_cache_bytes": kv, "num_kv_heads": self.model.num_kv_heads, **self.model.compute_cost(),
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        if self.device.type == "cuda":
            report["peak_device_bytes"] = torch.cuda.max_memory_allocated(self.device)
        return report

    def _prepare_decodes_first(self, seqs: list[PlannedSeq]) -> tuple[list[int], StepInputs]:
        """The inputs of a forward pass over `seqs` outside the scheduler's steps (a proposer's
        model), the sequences taken in decodes_first order; and that order, indices into `seqs`,
        to put what the pass returns back in theirs."""
        order = decodes_first(seqs)
        return order, self._prepare([seqs[i] for i in order], [])

    def _prepare(self, seqs: list[PlannedSeq], block_copies: list[tuple[int, int]]) -> StepInputs:
        bs = self.block_size
        groups = self.kv_groups.num_groups
        state_groups = self.state_groups
        state_tables: list[list[list[int]]] = [[] for _ in range(groups)]
        fresh_states: list[int] = []
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[list[int]] = [[] for _ in range(groups)]
        query_lens, seq_lens, rows, prompt_rows = [], [], [], []
        pool_rows: list[tuple[int, int, str]] = []
        tables: list[list[list[int]]] = [[] for _ in range(groups)]
        num_decodes = 0
        for s in seqs:
            start, n = s.start, len(s.token_ids)
            if n == 1:
                num_decodes += 1
            end = start + n
            tokens.extend(s.token_ids)
            positions.extend(range(start, end))
            for g, table in enumerate(s.block_tables):
                if g in state_groups:  # not positions: the sequence's state blocks
                    slots[g].extend([0] * n)
                    tables[g].append([])
                    state_tables[g].append(table)
                    continue
                slots[g].extend(table[p // bs] * bs + p % bs for p in range(start, end))
                tables[g].append(table)
            if start == 0:
                fresh_states.append(len(query_lens))
            query_lens.append(n)
            seq_lens.append(end)
            if s.draft_token_ids:  # the position before the drafts and each draft's: one sampler, k + 1 rows
                rows.extend(range(len(tokens) - 1 - len(s.draft_token_ids), len(tokens)))
            else:
                rows.extend([len(tokens) - 1] * len(s.samplers))
            if s.prompt_targets:
                first = len(tokens) - n + s.prompt_logprob_start - start
                prompt_rows.extend(range(first, first + len(s.prompt_targets)))
            if s.pool:
                pool_rows.append((len(tokens) - n, len(tokens), s.pool))
        # Every group's tables have one length per sequence: one width for all.
        width = max(len(t) for t in tables[0])
        padded = [[t + [0] * (width - len(t)) for t in group] for group in tables]
        dev = self.device
        slot_mapping = torch.tensor(slots, dtype=torch.long, device=dev)
        block_tables = torch.tensor(padded, dtype=torch.long, device=dev)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping[0],
            block_tables=block_tables[0],
            query_lens=query_lens,
            seq_lens=seq_lens,
            seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.long, device=dev),
            num_decodes=num_decodes,
            block_size=bs,
            group_slot_mappings=slot_mapping if groups > 1 else None,
            group_block_tables=block_tables if groups > 1 else None,
        )
        if state_groups:
            m = max(len(t) for g in state_groups for t in state_tables[g])
            rows_of = [state_tables[g] if g in state_groups else [[0] * m] * len(seqs) for g in range(groups)]
            meta.state_block_ids = torch.tensor(rows_of, dtype=torch.long, device=dev)
            meta.fresh_states = torch.tensor(fresh_states, dtype=torch.long, device=dev)
            meta.verifying = [i for i, s in enumerate(seqs) if s.draft_token_ids] or None
        return StepInputs(block_copies, torch.tensor(tokens, dtype=torch.long, device=dev),
                          torch.tensor(positions, dtype=torch.long, device=dev), meta, rows + prompt_rows, pool_rows)


def decodes_first(seqs: Sequence[PlannedSeq]) -> list[int]:
    """Indices of `seqs` in the order a forward pass takes them: decodes (one query token each)
    first, as AttentionMetadata's num_decodes expects, so the backend batches them in one product;
    otherwise in their order."""
    return sorted(range(len(seqs)), key=lambda i: len(seqs[i].token_ids) != 1)


def _pool_chunks(hidden: torch.Tensor, pool_rows: list[tuple[int, int, str]]) -> torch.Tensor:
    """Each chunk's hidden rows [first, end) reduced as asked (pagellm.pooling_params.chunk_reduction),
    in float32: [len(pool_rows), hidden]."""
    reduce = {"sum": lambda first, end: hidden[first:end].float().sum(dim=0),
              "last": lambda first, end: hidden[end - 1].float(),
              "first": lambda first, end: hidden[first].float()}
    return torch.stack([reduce[how](first, end) for first, end, how in pool_rows])


def _accepted(seqs: list[PlannedSeq], sampled: SamplerOutput) -> list[int | None]:
    """Per sequence, how many of its drafts were accepted (rejection_sampler.py); None for one
    that verified none."""
    out, row = [], 0
    for s in seqs:
        k = len(s.draft_token_ids)
        out.append(num_accepted(s.draft_token_ids, sampled.token_ids[row:row + k + 1]) if k else None)
        row += k + 1 if k else len(s.samplers)
    return out


def _kept_rows(seqs: list[PlannedSeq], accepted: list[int | None]) -> list[int]:
    """The rows of the sampler's output whose tokens the sequences receive: every row of a plain
    sequence; of a speculating one, its accepted drafts' and the correction or bonus token's."""
    kept, row = [], 0
    for s, a in zip(seqs, accepted):
        if a is None:
            kept.extend(range(row, row + len(s.samplers)))
            row += len(s.samplers)
            continue
        kept.extend(range(row, row + a + 1))
        row += len(s.draft_token_ids) + 1
    return kept


def _prompt_logprobs(seqs: list[PlannedSeq], logits: torch.Tensor) -> dict[str, PromptLogprobs]:
    """Score each sequence's prompt targets against its rows of `logits` (in `seqs` order)."""
    out: dict[str, PromptLogprobs] = {}
    row = 0
    for s in seqs:
        n = len(s.prompt_targets)
        logprobs = torch.log_softmax(logits[row:row + n].float(), dim=-1)
        row += n
        targets = torch.tensor(s.prompt_targets, device=logprobs.device)
        chosen = logprobs.gather(1, targets[:, None]).squeeze(1)
        ranks = (logprobs > chosen[:, None]).sum(dim=1) + 1
        top: list[list[tuple[int, float]]] = [[] for _ in range(n)]
        if s.prompt_logprobs:
            values, ids = logprobs.topk(s.prompt_logprobs, dim=-1)
            top = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
        out[s.request_id] = PromptLogprobs(s.prompt_logprob_start, list(s.prompt_targets), chosen.tolist(),
                                           ranks.tolist(), top)
    return out


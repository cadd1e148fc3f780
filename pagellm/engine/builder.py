"""Putting an engine together: the model's files, the executor and its runners, the KV cache
and its second tier, the scheduler and the engine core, each constructed with the finished
collaborators it needs (nothing is set on an object after it is built)."""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

from pagellm.config import EngineConfig
from pagellm.core.kv import KVManager, make_kv_manager
from pagellm.core.scheduler import Scheduler
from pagellm.engine.core import EngineCore
from pagellm.engine.draft import load_draft_proposer, split_kv_budget
from pagellm.engine.mtp import load_mtp_proposer
from pagellm.engine.input_processor import resolve_max_model_len
from pagellm.engine.swap_cost import SwapCost
from pagellm.executor.base import Executor
from pagellm.executor.uniproc import UniProcExecutor
from pagellm.layers.quant import quantized_on_load
from pagellm.layers.quant.gguf import resolve_activation_quantization
from pagellm.loader.pooler_config import read_pooler_config
from pagellm.loader.source import load_model_source
from pagellm.loader.tokenizer import Tokenizer
from pagellm.models.arch import ModelArchConfig
from pagellm.pooling_params import PoolerConfig
from pagellm.worker.kv_tier import DiskKVTier, RunnerTier, model_fingerprint
from pagellm.worker.model_runner import ModelRunner, resolve_device, resolve_dtype
from pagellm.worker.proposers import Proposer, make_proposer
from pagellm.worker.spec import WorkerSpec

logger = logging.getLogger("pagellm.engine")


@dataclass
class EngineParts:
    model_path: str
    tokenizer: Tokenizer
    arch: ModelArchConfig
    pooler_config: PoolerConfig  # how embeddings are made: the model's own files, then --pooler-config
    max_model_len: int
    device: torch.device
    dtype: torch.dtype
    activation_quantization: str  # as resolved: what the products run
    executor: Executor
    kv: KVManager
    kv_tier: DiskKVTier | None  # the second tier (--kv-offload-dir), rank 0's, if any
    scheduler: Scheduler
    core: EngineCore
    eos_token_ids: frozenset[int]


def build_engine_parts(config: EngineConfig) -> EngineParts:
    started = time.monotonic()
    device = resolve_device(config.device)
    # A GPU gets a GGUF file dequantized: the Triton GGUF product is not wired into the layers yet.
    fmt = quantized_on_load(config.quantization)
    if fmt is not None and device.type not in fmt.devices:
        raise ValueError(f"quantization {config.quantization!r} runs on {', '.join(fmt.devices)} only for now; "
                         f"the device is {device}")
    quantization = config.quantization if device.type == "cpu" else "none"
    source = load_model_source(config.model, config.load_format, quantization)
    logger.info("loading %s (%s, %s family, %s on disk)", source.path, source.format, source.arch.architecture,
                _disk_size(source.path))
    activations, line = resolve_activation_quantization(config.activation_quantization, source.weight_format,
                                                        config.batch_invariant, device.type)
    if line:
        logger.info(line)
    pooler_config = read_pooler_config(source.path).with_overrides(config.pooler_config)
    max_model_len = resolve_max_model_len(config.max_model_len, source.arch.max_position_embeddings)
    dtype = resolve_dtype(config.dtype, device)
    torch.manual_seed(config.seed)
    spec = WorkerSpec.from_config(config, source, device, dtype, max_model_len, quantization, activations)
    eos = set(source.arch.eos_token_ids)
    if source.tokenizer.eos_token_id is not None:
        eos.add(source.tokenizer.eos_token_id)
    eos_token_ids = frozenset(eos)
    # Only rank 0 samples, so only its runner proposes.
    draft = proposer = None
    if config.speculative is not None and config.speculative.method == "draft_model":
        proposer = draft = load_draft_proposer(config, source, device, dtype, max_model_len, set(eos_token_ids))
    elif config.speculative is not None and config.speculative.method == "mtp":
        proposer = draft = load_mtp_proposer(config, source, device, dtype, max_model_len, set(eos_token_ids))
    elif config.speculative is not None:
        proposer = make_proposer(config.speculative)
    executor = _start_executor(config, spec, device, proposer)
    try:
        if source.weights is None:
            executor.collective_rpc("init_dummy_weights", (config.seed,))
        else:
            executor.load_weights(_with_progress(source.weights(), source.path))
        runner = executor.driver
        if config.num_kv_blocks:
            # Blocks of every layer, as without KV groups: the same memory whatever the model's
            # windows. A block id of a KV group holds only that group's layers, so more ids fit.
            groups = runner.kv_groups
            num_blocks = config.num_kv_blocks * len(groups.layer_group) // groups.slots
            asked_by = f"num_kv_blocks={config.num_kv_blocks}"
        else:
            num_blocks = executor.num_blocks_for_budget(config.block_size, config.kv_cache_memory)
            asked_by = "the default KV budget" if config.kv_cache_memory is None else \
                f"kv_cache_memory={config.kv_cache_memory}"
        if draft is not None:  # the draft model's (or MTP layer's) cache takes its share of the same budget
            num_blocks = split_kv_budget(config, runner, draft, num_blocks)
        executor.collective_rpc("allocate_kv_cache", (num_blocks, config.block_size, asked_by))
        if not config.enforce_eager:
            executor.capture_cuda_graphs(config.max_num_seqs)
        kv_tier = None if config.kv_offload_dir is None else _open_kv_tier(config, executor, source.path,
                                                                               source.arch)
        # One group of layers per cache kind (sliding windows give back what slid out), over one
        # pool, with the second tier behind its prefix cache (core/kv/coordinator.py).
        kv = make_kv_manager(config.kv_policy, num_blocks, config.block_size, max_model_len,
                             enable_prefix_caching=config.enable_prefix_caching, windows=runner.kv_groups.windows,
                             max_chunk_tokens=config.max_num_batched_tokens,
                             state_blocks=runner.state_blocks(config.block_size), group_names=runner.kv_group_names,
                             tier=None if kv_tier is None else RunnerTier(executor))
        if config.preemption_mode != "recompute" and kv_tier is None:
            raise ValueError(f"preemption_mode {config.preemption_mode!r} moves KV blocks to the second tier: it "
                             f"needs kv_offload_dir")
        if config.speculative is not None:
            _check_speculation(config)
    except BaseException:
        executor.shutdown()  # tensor-parallel workers must not outlive a failed start
        raise
    costs = SwapCost(kv_tier)
    scheduler = Scheduler(kv, config.max_num_seqs, config.max_num_batched_tokens, config.preemption_mode,
                          config.speculative, swap_cheaper=costs)
    core = EngineCore(executor, kv, scheduler, eos_token_ids, kv_tier=kv_tier, costs=costs)
    logger.info("ready in %.1f s: %d KV blocks of %d tokens, max_model_len %d", time.monotonic() - started,
                num_blocks, config.block_size, max_model_len)
    return EngineParts(source.path, source.tokenizer, source.arch, pooler_config, max_model_len, device, dtype,
                       activations, executor, kv, kv_tier, scheduler, core, eos_token_ids)


def _start_executor(config: EngineConfig, spec: WorkerSpec, device: torch.device,
                    proposer: Proposer | None) -> Executor:
    if config.tensor_parallel_size > 1:
        if config.batch_invariant:
            raise ValueError("batch_invariant does not cover tensor parallelism yet (its all-reduce adds the "
                             "ranks' partial sums in the transport's order); use tensor_parallel_size 1")
        from pagellm.executor.tensor_parallel import TensorParallelExecutor

        return TensorParallelExecutor(config.tensor_parallel_size, spec, proposer=proposer)
    args, kwargs = spec.runner_arguments(device, None)
    return UniProcExecutor(ModelRunner(*args, batch_invariant=config.batch_invariant, proposer=proposer, **kwargs))


def _check_speculation(config: EngineConfig) -> None:
    """Speculative decoding rolls rejected tokens back by shortening block tables, and recurrent
    layers' states by writing back the state traced after the last accepted token (layers/recurrent.py;
    every tensor-parallel rank its shard): refuse what cannot be rolled back that way."""
    if config.kv_policy != "paged":
        raise ValueError(f"speculative_config needs kv_policy 'paged' (rejected tokens are dropped from block "
                         f"tables), got {config.kv_policy!r}")


def _open_kv_tier(config: EngineConfig, executor: Executor, model_path: str, arch: ModelArchConfig) -> DiskKVTier:
    """The second tier on disk (core/kv/tiered.py, worker/kv_tier.py): each rank's runner opens
    its own; the coordinator sees them as one. Rank 0's is returned: its stats and costs stand
    for every rank's."""
    runner = executor.driver
    unsupported = [why for why, bad in (
        ("kv_policy 'paged'", config.kv_policy != "paged"),
        ("enable_prefix_caching (the tier keeps blocks by their prefix hash)", not config.enable_prefix_caching)) if bad]
    if unsupported:
        raise ValueError(f"kv_offload_dir needs {', '.join(unsupported)}")
    block_bytes = runner.bytes_per_block(config.block_size)
    fingerprint = model_fingerprint(model_path, arch.hf_config or vars(arch), runner.kv_format.name,
                                    config.block_size, block_bytes)
    executor.collective_rpc("open_kv_tier", (config.kv_offload_dir, config.kv_offload_size, fingerprint,
                                             config.kv_offload_persist))
    return runner.kv_tier


def _disk_size(path: str) -> str:
    files = [path] if os.path.isfile(path) else [os.path.join(path, f) for f in os.listdir(path)]
    size = sum(os.path.getsize(f) for f in files if os.path.isfile(f))
    return f"{size / (1 << 30):.2f} GiB" if size >= 1 << 30 else f"{size / (1 << 20):.0f} MiB"


def _with_progress(weights, path: str):
    """The weights, with a progress bar on a terminal (a large model takes a while to read)."""
    import sys

    if not sys.stderr.isatty():
        return weights
    from tqdm.auto import tqdm

    return tqdm(weights, desc=f"loading {os.path.basename(path)}", unit=" tensors", leave=False)

"""A draft model for speculative decoding (method "draft_model"): loading it beside the target,
refusing what it cannot propose for, and splitting the KV budget between the two caches."""
from __future__ import annotations

import logging

import torch

from pagellm.config import EngineConfig
from pagellm.layers.quant.gguf import resolve_activation_quantization
from pagellm.loader.source import ModelSource, load_model_source
from pagellm.loader.tokenizer import Tokenizer
from pagellm.worker.model_runner import ModelRunner
from pagellm.worker.proposers.draft_model import DraftModelProposer
from pagellm.worker.proposers.mtp import MTPProposer

logger = logging.getLogger("pagellm.engine")


def load_draft_proposer(config: EngineConfig, target: ModelSource, device: torch.device, dtype: torch.dtype,
                        max_model_len: int, eos_token_ids: set[int]) -> DraftModelProposer:
    """The draft model of `config.speculative`, weights loaded, as a proposer (its cache comes with
    split_kv_budget). ValueError for a draft the engine cannot use (another vocabulary). Under tensor
    parallelism it runs whole on rank 0, between the ranks' steps."""
    spec = config.speculative
    # A GGUF draft keeps its quantized blocks on the CPU (cheap steps), whatever the target does.
    source = load_model_source(spec.model, "auto", "auto" if device.type == "cpu" else "none")
    check_same_vocabulary(target, source)
    mode = config.activation_quantization if source.weight_format == "gguf" else "auto"
    activations, _ = resolve_activation_quantization(mode, source.weight_format, config.batch_invariant,
                                                     device.type)
    runner = ModelRunner(source.arch, device, dtype, max_model_len, seed=config.seed,
                         weight_format=source.weight_format, batch_invariant=config.batch_invariant,
                         sliding_kv=True, kv_cache_dtype=config.kv_cache_dtype,
                         activation_quantization=activations)
    runner.load_weights(source.weights())
    logger.info("draft model %s (%s, %s family, %s products)", source.path, source.format,
                source.arch.architecture, activations)
    return DraftModelProposer(runner, eos_token_ids, seed=config.seed)


def check_same_vocabulary(target: ModelSource, draft: ModelSource) -> None:
    """Refuse a draft whose token ids mean other tokens than the target's: its proposals would be
    other text. The message names both sizes, or the first id that differs."""
    where = f"speculative_config model {draft.path!r}"
    sizes = (target.arch.vocab_size, draft.arch.vocab_size)
    if sizes[0] != sizes[1]:
        raise ValueError(f"{where} has a vocabulary of {sizes[1]} tokens, the target model {sizes[0]}: a draft "
                         f"model needs the target's tokenizer")
    # An id only one of them names (a special token added to one checkpoint's files) is tolerated:
    # proposals are only ever guesses, and the logits of both cover every id.
    mine, theirs = _id_to_token(target.tokenizer), _id_to_token(draft.tokenizer)
    for i, (a, b) in enumerate(zip(mine, theirs)):
        if a != b and a is not None and b is not None:
            raise ValueError(f"{where}'s tokenizer differs from the target's at token id {i} ({b!r} in the draft, "
                             f"{a!r} in the target; {len(theirs)} and {len(mine)} tokens): a draft model needs the "
                             f"target's tokenizer")


def _id_to_token(tokenizer: Tokenizer) -> list[str | None]:
    vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
    out: list[str | None] = [None] * (max(vocab.values(), default=-1) + 1)
    for token, i in vocab.items():
        out[i] = token
    return out


def split_kv_budget(config: EngineConfig, target: ModelRunner, draft: DraftModelProposer | MTPProposer,
                    target_blocks: int) -> int:
    """Give the draft (a draft model, or the target's MTP layer) its cache and return the target's
    block count. A byte budget (kv_cache_memory or the default) is shared: both pools get the same
    number of blocks, the two together within it, since a sequence holds about as many of each.
    num_kv_blocks counts the target's blocks; the draft then gets as many, beside them."""
    bs = config.block_size
    target_bytes, draft_bytes = target.bytes_per_block(bs), draft.runner.bytes_per_block(bs)
    if config.num_kv_blocks:
        groups = draft.runner.kv_groups
        draft_blocks = config.num_kv_blocks * len(groups.layer_group) // groups.slots
        asked_by = f"num_kv_blocks={config.num_kv_blocks} (as many {draft.label} blocks as the target's)"
        how = f"num_kv_blocks sizes the target's pool; the {draft.label}'s has as many blocks, beside it"
    else:
        budget = target_blocks * target_bytes
        share = budget // (target_bytes + draft_bytes)
        if share < 1:
            raise ValueError(f"the KV budget of {budget} bytes holds no block of the target ({target_bytes} bytes) "
                             f"and one of the {draft.label} ({draft_bytes} bytes) together; raise kv_cache_memory")
        target_blocks = draft_blocks = share
        asked_by = f"the {draft.label}'s share of the KV budget"
        how = f"a budget of {budget / (1 << 20):.1f} MiB split between them"
    draft.allocate_cache(draft_blocks, bs, config.max_num_batched_tokens, asked_by)
    logger.info("KV cache: target %d blocks of %d bytes (%.1f MiB), %s %d blocks of %d bytes (%.1f MiB): %s",
                target_blocks, target_bytes, target_blocks * target_bytes / (1 << 20), draft.label, draft_blocks,
                draft_bytes, draft_blocks * draft_bytes / (1 << 20), how)
    return target_blocks

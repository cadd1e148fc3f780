"""The target's own multi-token-prediction layer for speculative decoding (method "mtp"): which
checkpoints have one this engine can run, refusing the others with what is missing, and loading
the layer beside the target (its cache takes a share of the KV budget as a draft model's does:
engine/draft.py split_kv_budget)."""
from __future__ import annotations

import logging

import torch

from pagellm.config import EngineConfig
from pagellm.loader.hf_loader import hf_weight_names, iter_hf_weights
from pagellm.loader.source import ModelSource
from pagellm.models.deepseek_v3 import DeepseekV3MTP
from pagellm.worker.model_runner import ModelRunner
from pagellm.worker.proposers.mtp import MTPProposer

logger = logging.getLogger("pagellm.engine")

# The MTP layer's own tensors (after `model.layers.{N}.`): without them there is no layer to run.
_MTP_TENSORS = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")
# Families whose checkpoints ship MTP layers that this engine does not run yet, and why.
_NOT_YET = {
    "qwen3_5": "its checkpoints' mtp.* layer (its own norms, projection and attention layer beside the target's "
               "Gated DeltaNet and attention stack) is not loaded by this engine yet",
}
_NOT_YET["qwen3_5_moe"] = _NOT_YET["qwen3_5"]


def load_mtp_proposer(config: EngineConfig, target: ModelSource, device: torch.device, dtype: torch.dtype,
                      max_model_len: int, eos_token_ids: set[int]) -> MTPProposer:
    """The target's first MTP layer, weights loaded, as a proposer (its cache comes with
    split_kv_budget). ValueError, naming what is missing or why, for a target without one, a GGUF
    file, a family whose MTP layers are not run yet, or tensor parallelism."""
    arch = target.arch
    where = f"speculative_config method 'mtp' on {target.path!r} ({arch.architecture})"
    if target.format == "gguf":
        raise ValueError(f"{where}: a GGUF file carries no MTP layer pagellm reads (llama.cpp's converter drops "
                         f"DeepSeek-V3's, and the loader skips any a file keeps); serve the Hugging Face "
                         f"checkpoint for method 'mtp'")
    if arch.architecture in _NOT_YET:
        raise ValueError(f"{where}: its MTP layers are not run yet: {_NOT_YET[arch.architecture]}; use method "
                         f"'ngram'")
    if arch.architecture != "deepseek_v3":
        raise ValueError(f"{where}: this family has no multi-token-prediction layers pagellm runs (it runs "
                         f"DeepSeek-V3's, num_nextn_predict_layers); use method 'ngram' or 'draft_model'")
    if config.tensor_parallel_size > 1:
        raise ValueError(f"{where}: not with tensor_parallel_size {config.tensor_parallel_size} yet (the MTP layer "
                         f"would run on rank 0 alone, outside the ranks' step); use tensor_parallel_size 1")
    layers = int(getattr(arch.hf, "num_nextn_predict_layers", 0) or 0)
    if layers < 1:
        raise ValueError(f"{where}: its config's num_nextn_predict_layers is {layers}: this checkpoint has no MTP "
                         f"layer")
    prefix = f"model.layers.{arch.num_hidden_layers}."
    names = set(hf_weight_names(target.path))
    missing = [prefix + t for t in _MTP_TENSORS if prefix + t not in names]
    if missing or not any(n.startswith(prefix + "self_attn.") for n in names):
        missing += [] if missing else [prefix + "self_attn.*"]
        raise ValueError(f"{where}: config.json names {layers} MTP layer(s) but the weights lack "
                         f"{', '.join(missing)} (a checkpoint saved without its MTP layer, as transformers saves "
                         f"DeepSeek-V3)")
    runner = ModelRunner(arch, device, dtype, max_model_len, seed=config.seed, batch_invariant=config.batch_invariant,
                         sliding_kv=True, kv_cache_dtype=config.kv_cache_dtype, model_class=DeepseekV3MTP)
    # Only the layer's tensors and the embedding and head it shares are read again.
    wanted = (prefix, "model.embed_tokens.", "lm_head.")
    runner.load_weights(iter_hf_weights(target.path, keep=lambda n: n.startswith(wanted)))
    logger.info("MTP layer %d of %s (%d in the checkpoint; the first proposes every token of a chain)",
                arch.num_hidden_layers, target.path, layers)
    return MTPProposer(runner, eos_token_ids, seed=config.seed)

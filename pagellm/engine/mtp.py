"""The target's own multi-token-prediction layer for speculative decoding (method "mtp"): which
checkpoints have one this engine can run (DeepSeek-V3's, Qwen3.5's; the layer models are built on
models/mtp.py), refusing the others with what is missing, and loading the layer beside the target
(its cache takes a share of the KV budget as a draft model's does: engine/draft.py
split_kv_budget)."""
from __future__ import annotations

import logging

import torch

from pagellm.config import EngineConfig
from pagellm.loader.hf_loader import hf_weight_names, iter_hf_weights
from pagellm.loader.source import ModelSource
from pagellm.models.deepseek_v3 import DeepseekV3MTP
from pagellm.models.mtp import MultiTokenPredictor
from pagellm.models.qwen3_5 import Qwen3_5MTP
from pagellm.models.qwen3_5_moe import Qwen3_5MoeMTP
from pagellm.worker.model_runner import ModelRunner
from pagellm.worker.proposers.mtp import MTPProposer

logger = logging.getLogger("pagellm.engine")

# The families whose MTP layers this engine runs, by architecture.
MTP_MODELS: dict[str, type[MultiTokenPredictor]] = {
    "deepseek_v3": DeepseekV3MTP, "qwen3_5": Qwen3_5MTP, "qwen3_5_moe": Qwen3_5MoeMTP,
}
# What llama.cpp's converter (convert_hf_to_gguf.py) does with each family's MTP layer.
_GGUF = {
    "deepseek_v3": "llama.cpp's converter drops DeepSeek-V3's MTP layer",
    "qwen3_5": "llama.cpp's converter keeps Qwen3.5's MTP layer (as the block after the stack, "
               "nextn_predict_layers), but pagellm's GGUF loader skips it",
}
_GGUF["qwen3_5_moe"] = _GGUF["qwen3_5"]


def load_mtp_proposer(config: EngineConfig, target: ModelSource, device: torch.device, dtype: torch.dtype,
                      max_model_len: int, eos_token_ids: set[int]) -> MTPProposer:
    """The target's first MTP layer, weights loaded, as a proposer (its cache comes with
    split_kv_budget). ValueError, naming what is missing or why, for a target without one, a GGUF
    file or a family whose MTP layers are not run. Under tensor parallelism it runs whole on rank 0."""
    arch = target.arch
    where = f"speculative_config method 'mtp' on {target.path!r} ({arch.architecture})"
    if target.format == "gguf":
        why = _GGUF.get(arch.architecture, "pagellm's GGUF loader skips any MTP layer a file keeps")
        raise ValueError(f"{where}: a GGUF file carries no MTP layer pagellm reads ({why}); serve the Hugging Face "
                         f"checkpoint for method 'mtp'")
    model_class = MTP_MODELS.get(arch.architecture)
    if model_class is None:
        raise ValueError(f"{where}: this family has no multi-token-prediction layers pagellm runs (it runs "
                         f"DeepSeek-V3's, num_nextn_predict_layers, and Qwen3.5's, mtp_num_hidden_layers); use method "
                         f"'ngram' or 'draft_model'")
    field = model_class.layers_field
    layers = model_class.num_layers(arch)
    if layers < 1:
        raise ValueError(f"{where}: its config's {field} is {layers}: this checkpoint has no MTP layer")
    prefix = model_class.prefix(arch)
    names = set(hf_weight_names(target.path))
    missing = [t for t in model_class.required_tensors(arch) if t not in names]
    block = prefix + model_class.block_prefix + "self_attn."
    if missing or not any(n.startswith(block) for n in names):
        missing += [] if missing else [block + "*"]
        raise ValueError(f"{where}: config.json names {layers} MTP layer(s) ({field}) but the weights lack "
                         f"{', '.join(missing)} (a checkpoint saved without its MTP layer, as transformers saves "
                         f"{arch.architecture})")
    runner = ModelRunner(arch, device, dtype, max_model_len, seed=config.seed, batch_invariant=config.batch_invariant,
                         sliding_kv=True, kv_cache_dtype=config.kv_cache_dtype, model_class=model_class)
    # Only the layer's tensors and the embedding and head it shares are read again.
    wanted = (prefix, "model.embed_tokens.", "lm_head.")
    runner.load_weights(iter_hf_weights(target.path, keep=lambda n: n.startswith(wanted), mtp=True))
    logger.info("MTP layer %s* of %s (%d in the checkpoint; the first proposes every token of a chain)",
                prefix, target.path, layers)
    return MTPProposer(runner, eos_token_ids, seed=config.seed)

"""Reading a Hugging Face model directory: config.json (+ generation_config.json) and safetensors weights.

transformers reads config.json (so its defaults are the reference's); this module finds the
family, the stop tokens and the weight files, and owns the rule that pickled weights are never opened.
An image-text checkpoint (models.registry.MULTIMODAL) is read as its text model: its text_config,
its language model's weights renamed as the text family names them, nothing else read. The
multi-token-prediction layers a checkpoint stores beside the model (`mtp.*`: Qwen3.5, in its text
and image-text checkpoints alike) are read only when asked for (speculative decoding, engine/mtp.py).
"""
from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from safetensors import safe_open

from pagellm.layers.quant.gguf import ExpertBlocks
from pagellm.loader.mxfp4 import join_mxfp4
from pagellm.models.arch import ModelArchConfig, arch_from_hf
from pagellm.models.registry import (HF_ARCHITECTURES, SEQUENCE_CLASSIFIERS, Multimodal, causal_lm_of_base,
                                     family_for_hf, multimodal_for_hf)

logger = logging.getLogger(__name__)
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
_INDEX_FILE = "model.safetensors.index.json"
# Where Qwen3.5 stores its MTP layer, outside the language model's names in either layout.
MTP_PREFIX = "mtp."


def read_hf_config(model_dir: str) -> ModelArchConfig:
    """The architecture described by `model_dir/config.json`, refusing what no family runs.

    transformers reads the config (its defaults for keys the file leaves out are the
    reference's); the family then reads its own details from it when the model is built."""
    config_path = os.path.join(model_dir, "config.json")
    raw = _read_json(config_path)
    family = family_for_hf(raw, config_path)
    config = _transformers_config(model_dir, config_path, raw, family.model_types[0])
    hf = config.get_text_config()
    multimodal = multimodal_for_hf(raw)
    if multimodal is not None:
        logger.info("%s: serving the %s text model of this %s; its image inputs are not served",
                    model_dir, family.name, raw["architectures"][0])
        if not multimodal.tie_from_text:
            hf.tie_word_embeddings = config.tie_word_embeddings
        # Token ids may be in either config (Gemma 3 and Mistral 3 keep them in the text one).
        raw = {**raw.get("text_config", {}), **{k: v for k, v in raw.items() if v is not None}}
    names = raw.get("architectures") or [""]
    return arch_from_hf(hf, family.name, bos_token_id=raw.get("bos_token_id"),
                        eos_token_ids=_eos_ids(raw, model_dir), model_name=model_dir,
                        has_lm_head=(causal_lm_of_base(names[0]) not in HF_ARCHITECTURES
                                     and names[0] not in SEQUENCE_CLASSIFIERS))


def _transformers_config(model_dir: str, config_path: str, raw: dict, model_type: str):
    from transformers import AutoConfig

    try:
        if "model_type" in raw:
            return AutoConfig.from_pretrained(model_dir, local_files_only=True)
        # Older hand-written configs name only the architecture; the family says the type.
        return AutoConfig.for_model(model_type, **raw)
    except (ValueError, KeyError, TypeError, OSError) as exc:
        raise ValueError(f"{config_path}: transformers cannot read this config: {exc}") from None


def iter_hf_weights(model_dir: str, keep: Callable[[str], bool] | None = None, mtp: bool = False
                    ) -> Iterator[tuple[str, torch.Tensor | ExpertBlocks]]:
    """Yield `(name, tensor)` from the directory's safetensors files, one tensor at a time, as stored
    (an image-text checkpoint's text weights alone, named as its text family names them; the
    others are never read, nor the shards that hold only them), but OpenAI's MXFP4 experts
    (`<name>_blocks`, `<name>_scales`) joined as `<name>` in GGUF blocks (loader/mxfp4.py).

    `keep`: only the tensors whose names it accepts are read (an MTP layer's, beside the target's).
    `mtp`: the `mtp.*` tensors too, under their stored names (never read otherwise).
    The weight files are found before this returns, so a directory without usable weights fails here.
    """
    config_path = os.path.join(model_dir, "config.json")
    config = _read_json(config_path) if os.path.isfile(config_path) else {}
    multimodal = multimodal_for_hf(config)
    # A cross-encoder's score head is not the decoder's: loader/score_head.py reads it.
    head = (config.get("architectures") or [""])[0] in SEQUENCE_CLASSIFIERS
    # OpenAI's MXFP4 experts (gpt-oss) come as GGUF MXFP4 blocks, which FusedMoE keeps.
    return join_mxfp4(_tensors(_safetensors_files(model_dir, multimodal, mtp), multimodal, head, keep, mtp))


def hf_weight_names(model_dir: str) -> list[str]:
    """The names of the tensors in the directory's safetensors files, none of them read."""
    names = []
    for path in _safetensors_files(model_dir):
        with safe_open(path, framework="pt") as handle:
            names.extend(handle.keys())
    return names


def _text_name(stored: str, multimodal: Multimodal | None, mtp: bool) -> str | None:
    """The name a stored tensor is read under; None: not read."""
    if stored.startswith(MTP_PREFIX):
        return stored if mtp else None
    return stored if multimodal is None else multimodal.text_name(stored)


def _tensors(files: list[str], multimodal: Multimodal | None, skip_score_head: bool = False,
             keep: Callable[[str], bool] | None = None, mtp: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        with safe_open(path, framework="pt") as handle:
            for stored in handle.keys():
                if skip_score_head and stored.startswith("score."):
                    continue
                name = _text_name(stored, multimodal, mtp)
                if name is not None and (keep is None or keep(name)):
                    yield name, handle.get_tensor(stored)


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} should hold a JSON object")
    return data


def _eos_ids(cfg: dict, model_dir: str) -> list[int]:
    ids: list[int] = []
    sources = [cfg.get("eos_token_id")]
    generation_path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(generation_path):
        # Instruct models often list extra stop tokens (end of turn) only here.
        sources.append(_read_json(generation_path).get("eos_token_id"))
    for value in sources:
        for token_id in value if isinstance(value, list) else [value]:
            if token_id is not None and int(token_id) not in ids:
                ids.append(int(token_id))
    return ids


def _safetensors_files(model_dir: str, multimodal: Multimodal | None = None, mtp: bool = True) -> list[str]:
    """The weight files; with an index, only the shards holding a tensor that is read."""
    index_path = os.path.join(model_dir, _INDEX_FILE)
    if os.path.isfile(index_path):
        weight_map: dict[str, Any] = _read_json(index_path).get("weight_map") or {}
        weight_map = {k: v for k, v in weight_map.items() if _text_name(k, multimodal, mtp) is not None}
        root = os.path.realpath(model_dir)
        files = []
        for shard in dict.fromkeys(weight_map.values()):  # unique, in first-use order
            path = os.path.realpath(os.path.join(model_dir, shard))
            if os.path.dirname(path) != root:
                raise ValueError(f"{index_path}: shard {shard!r} is outside the model directory")
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{path} (listed in {index_path}) not found")
            files.append(path)
        return files
    files = sorted(glob.glob(os.path.join(glob.escape(model_dir), "*.safetensors")))
    if files:
        return files
    if any(name.endswith(_PICKLE_SUFFIXES) for name in os.listdir(model_dir)):
        raise ValueError(
            f"{model_dir} has only pickled PyTorch weights (.bin/.pt/.pth); pickled weights are never loaded "
            "because unpickling can run arbitrary code. Convert them to safetensors first."
        )
    raise FileNotFoundError(f"no *.safetensors weights found in {model_dir}")

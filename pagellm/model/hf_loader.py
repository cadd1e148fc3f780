"""Reading a Hugging Face model directory: config.json (+ generation_config.json) and safetensors weights.

This module owns turning transformers' config spellings (v4 `rope_scaling`/`rope_theta`, v5
`rope_parameters`) into a ModelArchConfig, and the rule that pickled weights are never opened.
"""
from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import safe_open

from pagellm.model.config import ModelArchConfig
from pagellm.models.registry import family_for_hf

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
_INDEX_FILE = "model.safetensors.index.json"


def read_hf_config(model_dir: str) -> ModelArchConfig:
    """The architecture described by `model_dir/config.json`, refusing what no family runs.

    transformers reads the config (its defaults for keys the file leaves out are the
    reference's); the family then reads its own details from it when the model is built."""
    config_path = os.path.join(model_dir, "config.json")
    raw = _read_json(config_path)
    family = family_for_hf(raw, config_path)
    hf = _transformers_config(model_dir, config_path, raw, family.model_types[0])
    max_positions = int(getattr(hf, "max_position_embeddings", None) or 4096)
    rope_theta, rope_scaling = _rope(hf.to_dict(), config_path)
    heads = int(hf.num_attention_heads)
    return ModelArchConfig(
        vocab_size=int(hf.vocab_size),
        hidden_size=int(hf.hidden_size),
        intermediate_size=int(getattr(hf, "intermediate_size", 0) or 0),
        num_hidden_layers=int(hf.num_hidden_layers),
        num_attention_heads=heads,
        num_key_value_heads=int(getattr(hf, "num_key_value_heads", None) or heads),
        head_dim=getattr(hf, "head_dim", None),
        rms_norm_eps=float(getattr(hf, "rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases and its config has no key for them.
        attention_bias=family.name == "qwen2" or bool(getattr(hf, "attention_bias", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_eos_ids(raw, model_dir),
        architecture=family.name,
        hf_config=hf.to_dict(),
        model_name=model_dir,
    )


def _transformers_config(model_dir: str, config_path: str, raw: dict, model_type: str):
    from transformers import AutoConfig

    try:
        if "model_type" in raw:
            config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        else:  # older hand-written configs name only the architecture; the family says the type
            config = AutoConfig.for_model(model_type, **raw)
    except (ValueError, KeyError, TypeError, OSError) as exc:
        raise ValueError(f"{config_path}: transformers cannot read this config: {exc}") from None
    return config.get_text_config()


def iter_hf_weights(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(name, tensor)` from the directory's safetensors files, one tensor at a time, as stored.

    The weight files are found before this returns, so a directory without usable weights fails here.
    """
    return _tensors(_safetensors_files(model_dir))


def _tensors(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        with safe_open(path, framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


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


def _rope(cfg: dict, config_path: str) -> tuple[float, dict | None]:
    """`(rope_theta, HF-style rope_scaling or None)` from either the v4 or the v5 spelling."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]  # one dict per layer type (Gemma 3): the global layers' here
    if not isinstance(params, dict):
        raise ValueError(f"{config_path}: rope parameters should be a JSON object, got {params!r}")
    params = dict(params)
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    if "type" in params:  # v4's older name for rope_type
        params.setdefault("rope_type", params.pop("type"))
    params.pop("partial_rotary_factor", None)  # the family reads it from the whole config
    if params.get("rope_type", "default") == "default":
        return theta, None
    return theta, params


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


def _safetensors_files(model_dir: str) -> list[str]:
    index_path = os.path.join(model_dir, _INDEX_FILE)
    if os.path.isfile(index_path):
        weight_map: dict[str, Any] = _read_json(index_path).get("weight_map") or {}
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

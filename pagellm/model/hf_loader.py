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

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
_MODEL_TYPES = {arch: name for name, arch in ARCHITECTURES.items()}
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
_INDEX_FILE = "model.safetensors.index.json"


def read_hf_config(model_dir: str) -> ModelArchConfig:
    """The architecture described by `model_dir/config.json`, refusing what the engine cannot run."""
    config_path = os.path.join(model_dir, "config.json")
    cfg = _read_json(config_path)
    names = cfg.get("architectures") or []
    # A config saved from a config object alone lists no architectures; model_type still says which.
    arch_name = names[0] if names else _MODEL_TYPES.get(cfg.get("model_type"), cfg.get("model_type"))
    if arch_name not in ARCHITECTURES:
        raise ValueError(
            f"{config_path}: architecture {arch_name!r} is not supported "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )
    arch = ARCHITECTURES[arch_name]

    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{config_path}: hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
    if cfg.get("mlp_bias"):
        raise ValueError(f"{config_path}: MLP biases (mlp_bias=true) are not supported")
    max_positions = int(cfg.get("max_position_embeddings", 4096))
    _refuse_sliding_window(cfg, arch, max_positions, config_path)
    rope_theta, rope_scaling = _rope(cfg, config_path)

    heads = int(cfg["num_attention_heads"])
    return ModelArchConfig(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_hidden_layers=int(cfg["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=cfg.get("head_dim"),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_positions,
        # All three config classes default to untied when the key is absent.
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases and its config has no key for them.
        attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_ids(cfg, model_dir),
        architecture=arch,
    )


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


def _refuse_sliding_window(cfg: dict, arch: str, max_positions: int, config_path: str) -> None:
    window = cfg.get("sliding_window")
    # Qwen2 keeps a window size in its config even when it is switched off by use_sliding_window.
    enabled = cfg.get("use_sliding_window", False) if arch == "qwen2" else True
    if "sliding_attention" in (cfg.get("layer_types") or []):
        enabled, window = True, window or 0
    if enabled and window is not None and window < max_positions:
        raise ValueError(
            f"{config_path}: sliding-window attention (sliding_window={window} < "
            f"max_position_embeddings={max_positions}) is not supported"
        )


def _rope(cfg: dict, config_path: str) -> tuple[float, dict | None]:
    """`(rope_theta, HF-style rope_scaling or None)` from either the v4 or the v5 spelling."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"{config_path}: per-layer-type rope parameters are not supported")
    params = dict(params)
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    if "type" in params:  # v4's older name for rope_type
        params.setdefault("rope_type", params.pop("type"))
    if params.get("rope_type", "default") == "default":
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"{config_path}: partial rotary embeddings are not supported")
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

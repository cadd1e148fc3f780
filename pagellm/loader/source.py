"""Resolving the user's `model` argument to a ModelSource: format, architecture, tokenizer, weights.

This module owns the decision of which reader handles a path, and the rule that nothing is ever
fetched from a model hub: a model is a local GGUF file, a local Hugging Face directory, or the
bundled default.
"""
from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

import torch

from pagellm.config import LOAD_FORMATS
from pagellm.layers.quant import quantized_on_load
from pagellm.loader.bundled import default_model_path
from pagellm.models.arch import ModelArchConfig
from pagellm.loader.gguf_loader import has_native_blocks, iter_gguf_weights, open_gguf, read_gguf_config
from pagellm.loader.hf_loader import iter_hf_weights, read_hf_config
from pagellm.loader.tokenizer import Tokenizer

# "org/name" with nothing that a local path would usually have.
_HUB_ID_RE = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


@dataclass
class ModelSource:
    """Everything needed to build a model: where it is, its shapes, its tokenizer, and its weights."""

    path: str
    format: str  # "gguf" | "hf"
    arch: ModelArchConfig
    tokenizer: Tokenizer
    # "gguf": quantized matrices are yielded as their GGUF blocks (and the model is built to keep
    # them); "dense": every weight is a tensor, dequantized if the file stores it quantized.
    weight_format: str
    # Called once by the model loader; a fresh one-tensor-at-a-time iterator. None for load_format="dummy".
    weights: Callable[[], Iterator[tuple[str, torch.Tensor]]] | None


def load_model_source(model: str | None, load_format: str = "auto", quantization: str = "auto") -> ModelSource:
    """Find and read the model's config and tokenizer; weights are only read when `weights()` is called.

    `model` None means the bundled SmolLM2-135M-Instruct GGUF. `load_format` "gguf" and "safetensors"
    insist on that format, "dummy" reads config and tokenizer only (for random-weight runs).
    `quantization` "auto" keeps a GGUF file's quantized matrices in their blocks; "none" dequantizes;
    "int8" and "int4" quantize a dense (safetensors) checkpoint's linear layers as they load.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is not one of {', '.join(LOAD_FORMATS)}")
    path = default_model_path() if model is None else os.path.abspath(os.path.expanduser(model))
    if not os.path.exists(path):
        raise FileNotFoundError(_missing_message(model, path))

    fmt = _detect_format(path)
    if load_format == "gguf" and fmt != "gguf":
        raise ValueError(f"load_format 'gguf' needs a .gguf file, but {path} is not one")
    if load_format == "safetensors" and fmt != "hf":
        raise ValueError(f"load_format 'safetensors' needs a Hugging Face model directory, but {path} is not one")

    quantizes_on_load = quantized_on_load(quantization) is not None
    if quantizes_on_load and fmt == "gguf":
        raise ValueError(f"quantization {quantization!r} quantizes a safetensors checkpoint as it loads; a GGUF file "
                         f"is served in its own blocks (quantization 'auto') or dequantized ('none')")
    if fmt == "gguf":
        reader = open_gguf(path)  # parsed once for the config and the weights
        arch, tokenizer = read_gguf_config(path, reader), Tokenizer.from_gguf(path)
        auto = quantization == "auto"
        layers_format = "gguf" if auto and has_native_blocks(reader) else "dense"
        # keep_blocks also when no matrix has a kernel (all MXFP4, say): it warns of the dequantized types.
        weights = partial(iter_gguf_weights, path, reader, arch, keep_blocks=auto)
    else:
        arch, tokenizer = read_hf_config(path), Tokenizer.from_hf_dir(path)
        weights = partial(iter_hf_weights, path)
        layers_format = quantization if quantizes_on_load else "dense"
    return ModelSource(
        path=path,
        format=fmt,
        arch=arch,
        tokenizer=tokenizer,
        weight_format="dense" if load_format == "dummy" else layers_format,
        weights=None if load_format == "dummy" else weights,
    )


def _detect_format(path: str) -> str:
    if os.path.isfile(path):
        if path.lower().endswith(".gguf"):
            return "gguf"
        raise ValueError(f"{path} is a file but not a .gguf file; pass a .gguf file or a model directory")
    if os.path.isfile(os.path.join(path, "config.json")):
        return "hf"
    raise ValueError(
        f"{path} is a directory without config.json; expected a Hugging Face model directory "
        "(config.json, tokenizer.json, *.safetensors) or a path to a .gguf file"
    )


def _missing_message(model: str | None, path: str) -> str:
    message = f"model path not found: {path}" if model in (None, path) else f"model path not found: {model} ({path})"
    if model is not None and _HUB_ID_RE.fullmatch(model):
        message += (
            f". {model!r} looks like a model hub id, but pagellm never downloads from a model hub; "
            "download the model yourself and pass its local path"
        )
    return message

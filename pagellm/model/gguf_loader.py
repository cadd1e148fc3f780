"""Reading Llama-family GGUF files: the architecture from metadata, the weights as HF-named float32 tensors.

This module owns the mapping from llama.cpp's conventions (tensor names, dimension order, the q/k row
permutation of its rope layout, rope scaling stored as a `rope_freqs` tensor) back to Hugging Face's, so
everything downstream sees one layout whatever file the model came from.
"""
from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize

from pagellm.model.config import ModelArchConfig
from pagellm.models.registry import family_for_gguf

# llama.cpp's converter reorders q/k rows for these (its non-NeoX rope); Qwen2 is stored as in HF.
_PERMUTED_ARCHS = ("llama", "mistral")

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Per-frequency llama3 rope factors; folded into the config by read_gguf_config, not a parameter.
_ROPE_FREQS = "rope_freqs.weight"

# llama.cpp's names for rope scaling keys that Hugging Face spells differently.
_ROPE_SCALING_KEYS = {
    "original_context_length": "original_max_position_embeddings",
    "attn_factor": "attention_factor",
    "yarn_beta_fast": "beta_fast",
    "yarn_beta_slow": "beta_slow",
}

_MISSING = object()


def read_gguf_config(path: str, reader: GGUFReader | None = None) -> ModelArchConfig:
    """The architecture described by a GGUF file's `{arch}.*` and `tokenizer.ggml.*` metadata.

    `reader`: the file already opened by `open_gguf` (parsing the metadata takes seconds for a
    large vocabulary, so a caller that also reads the weights opens it once).
    """
    reader = reader or open_gguf(path)
    arch = _architecture(reader, path)

    def key(name: str, default: Any = _MISSING) -> Any:
        value = _value(reader, f"{arch}.{name}")
        if value is None:
            if default is _MISSING:
                raise ValueError(f"{path}: required metadata key {arch}.{name} is missing")
            return default
        return value

    if key("expert_count", 0):
        raise ValueError(f"{path}: mixture-of-experts models are not supported")
    hidden = _as_int(key("embedding_length"), f"{arch}.embedding_length", path)
    heads = _as_int(key("attention.head_count"), f"{arch}.attention.head_count", path)
    kv_heads = _as_int(key("attention.head_count_kv", heads), f"{arch}.attention.head_count_kv", path)
    head_dim = key("attention.key_length", hidden // heads)
    if key("attention.value_length", head_dim) != head_dim:
        raise ValueError(f"{path}: key and value head sizes differ, which Llama attention does not support")
    if key("rope.dimension_count", head_dim) != head_dim:
        raise ValueError(f"{path}: partial rotary embeddings (rope on part of each head) are not supported")
    context = key("context_length", 4096)
    window = key("attention.sliding_window", None)
    if window is not None and window < context:
        raise ValueError(
            f"{path}: sliding-window attention (window {window} < context {context}) is not supported"
        )
    theta = key("rope.freq_base", 10000.0)

    tensor_names = {t.name for t in reader.tensors}
    eos_ids: list[int] = []
    for name in ("eos_token_id", "eot_token_id", "eom_token_id"):
        token_id = _value(reader, f"tokenizer.ggml.{name}")
        if token_id is not None and token_id not in eos_ids:
            eos_ids.append(int(token_id))

    return ModelArchConfig(
        vocab_size=_vocab_size(reader, arch, path),
        hidden_size=hidden,
        intermediate_size=_as_int(key("feed_forward_length"), f"{arch}.feed_forward_length", path),
        num_hidden_layers=_as_int(key("block_count"), f"{arch}.block_count", path),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=int(head_dim),
        rms_norm_eps=key("attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=theta,
        rope_scaling=_rope_scaling(reader, arch, int(head_dim), theta, path),
        max_position_embeddings=int(context),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias=arch == "qwen2" or "blk.0.attn_q.bias" in tensor_names,
        bos_token_id=_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=eos_ids,
        architecture=family_for_gguf(arch, path).name,
        model_name=path,
    )


def iter_gguf_weights(path: str, reader: GGUFReader | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_name, float32 tensor in HF shape)` one tensor at a time, dequantizing from the mmap.

    The file is opened and checked before this returns, so a bad path fails here, not at first use.
    `reader`: as for read_gguf_config.
    """
    reader = reader or open_gguf(path)
    arch = _architecture(reader, path)
    heads = _as_int(_value(reader, f"{arch}.attention.head_count"), f"{arch}.attention.head_count", path)
    kv_heads = _value(reader, f"{arch}.attention.head_count_kv") or heads
    return _weights(reader, arch in _PERMUTED_ARCHS, heads, kv_heads, path)


def _weights(
    reader: GGUFReader, permuted: bool, heads: int, kv_heads: int, path: str
) -> Iterator[tuple[str, torch.Tensor]]:
    for tensor in reader.tensors:
        name = _hf_name(tensor.name, path)
        if name is None:
            continue
        weight = _to_torch(tensor, path)
        if permuted and ".q_proj." in name:
            weight = _unpermute(weight, heads, name, path)
        elif permuted and ".k_proj." in name:
            weight = _unpermute(weight, kv_heads, name, path)
        yield name, weight


def open_gguf(path: str) -> GGUFReader:
    """Parse a GGUF file's header and metadata (the tensors stay in the mmap) and check it is whole."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        reader = GGUFReader(path)
    except Exception as exc:  # garbage input fails in many ways (bad magic, short reads, bad enums)
        raise ValueError(f"{path} is not a valid GGUF file (corrupt or truncated?): {exc}") from exc
    if reader.byte_order != "I":
        raise ValueError(f"{path} is a GGUF file of the other byte order, which is not supported")
    file_size = len(reader.data)
    for tensor in reader.tensors:
        # A truncated file can still parse when a tensor's view silently comes back short.
        if tensor.data_offset + tensor.n_bytes > file_size or tensor.data.nbytes != tensor.n_bytes:
            raise ValueError(f"{path} is truncated: tensor {tensor.name} runs past the end of the file")
    return reader


def _value(reader: GGUFReader, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return None
    value = field.contents()
    if field.types == [GGUFValueType.FLOAT32]:
        # The shortest decimal that round-trips in float32, so 1e-5 reads back as 1e-5.
        return float(str(np.float32(value)))
    return value


def _as_int(value: Any, key: str, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{path}: metadata key {key} should be one integer, got {value!r}")
    return value


def _architecture(reader: GGUFReader, path: str) -> str:
    arch = _value(reader, "general.architecture")
    family_for_gguf(arch, path)
    return arch


def _vocab_size(reader: GGUFReader, arch: str, path: str) -> int:
    size = _value(reader, f"{arch}.vocab_size")
    if size is not None:
        return int(size)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        return len(tokens.data)  # one index per array element; avoids decoding every token string
    for tensor in reader.tensors:
        if tensor.name == "token_embd.weight":
            return int(tensor.shape[-1])
    raise ValueError(f"{path}: cannot tell the vocabulary size (no vocab_size, token list or embedding)")


def _rope_scaling(reader: GGUFReader, arch: str, head_dim: int, theta: float, path: str) -> dict | None:
    prefix = f"{arch}.rope.scaling."
    raw = {key[len(prefix):]: _value(reader, key) for key in reader.fields if key.startswith(prefix)}
    kind = raw.pop("type", None)
    raw.pop("finetuned", None)
    if kind not in (None, "none"):
        scaling = {"rope_type": kind}
        scaling.update({_ROPE_SCALING_KEYS.get(k, k): v for k, v in raw.items()})
        return scaling
    linear = _value(reader, f"{arch}.rope.scale_linear")  # older files' spelling of linear scaling
    if linear is not None and linear != 1.0:
        return {"rope_type": "linear", "factor": linear}
    for tensor in reader.tensors:
        if tensor.name == _ROPE_FREQS:
            factors = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float64).reshape(-1)
            return _llama3_scaling_from_factors(factors, head_dim, theta, path)
    return None


def _llama3_rope_factors(head_dim: int, theta: float, scaling: dict) -> np.ndarray:
    """The per-frequency divisors llama.cpp stores as `rope_freqs` for Llama 3 rope scaling."""
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    smooth = np.clip((old_len / wavelen - low) / (high - low), 0.0, 1.0)
    return 1.0 / ((1.0 - smooth) / factor + smooth)


def _llama3_scaling_from_factors(factors: np.ndarray, head_dim: int, theta: float, path: str) -> dict | None:
    """Recover HF llama3 rope parameters from the factors llama.cpp precomputed.

    Inside the blend band, 1/f = (1 - s)/factor + s with s linear in 1/wavelength. Only the ratios
    original_len/low and original_len/high matter, so pinning low_freq_factor = 1 makes the line's
    slope and intercept give the rest; the result is checked by recomputing every factor.
    """
    if factors.shape != (head_dim // 2,):
        raise ValueError(f"{path}: {_ROPE_FREQS} has {factors.size} entries, expected {head_dim // 2}")
    factor = float(factors.max())
    if np.allclose(factors, 1.0):
        return None
    unsupported = ValueError(f"{path}: {_ROPE_FREQS} does not match Llama 3 rope scaling; not supported")
    if factors.min() < 1.0 - 1e-6 or factor <= 1.0:
        raise unsupported
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    smooth = (1.0 / factors - 1.0 / factor) / (1.0 - 1.0 / factor)
    band = (smooth > 1e-4) & (smooth < 1.0 - 1e-4)
    if band.sum() < 2:
        raise unsupported
    slope, intercept = np.polyfit(inv_freq[band] / (2 * math.pi), smooth[band], 1)
    if slope <= 0 or intercept >= 0:
        raise unsupported
    scaling = {
        "rope_type": "llama3",
        "factor": float(str(np.float32(factor))),
        "low_freq_factor": 1.0,
        "high_freq_factor": round(float(1.0 - 1.0 / intercept), 4),
        "original_max_position_embeddings": int(round(float(-slope / intercept))),
    }
    if not np.allclose(_llama3_rope_factors(head_dim, theta, scaling), factors, rtol=1e-3, atol=0):
        raise unsupported
    return scaling


def _hf_name(gguf_name: str, path: str) -> str | None:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    if gguf_name == _ROPE_FREQS:
        return None
    match = _LAYER_TENSOR_RE.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_TENSORS:
        layer, kind, suffix = match.groups()
        return f"model.layers.{layer}.{_LAYER_TENSORS[kind]}.{suffix}"
    # Failing beats silently dropping a weight the model would then run without.
    raise ValueError(f"{path}: tensor {gguf_name!r} has no place in a Llama-family model")


def _to_torch(tensor: Any, path: str) -> torch.Tensor:
    try:
        values = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise ValueError(
            f"{path}: tensor {tensor.name} has type {tensor.tensor_type.name}, which cannot be dequantized"
        ) from None
    # GGUF lists dimensions fastest-varying first; HF shapes are the reverse.
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    values = np.asarray(values, dtype=np.float32).reshape(shape)
    if not values.flags.writeable:
        values = values.copy()  # F32 comes back as a view of the read-only mmap
    return torch.from_numpy(values)


def _unpermute(weight: torch.Tensor, n_head: int, name: str, path: str) -> torch.Tensor:
    """Undo convert_hf_to_gguf's `permute`: rows (pair, half) within each head back to (half, pair)."""
    rows = weight.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"{path}: {name} has {rows} rows, not a multiple of 2 x {n_head} heads")
    rest = weight.shape[1:]
    return weight.reshape(n_head, rows // n_head // 2, 2, *rest).transpose(1, 2).reshape(weight.shape).contiguous()

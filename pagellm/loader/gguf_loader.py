"""Reading GGUF files: the architecture from metadata as a Hugging Face config, the weights as
HF-named float32 tensors.

This module owns the mapping from llama.cpp's conventions back to Hugging Face's: metadata keys
to config fields (plus what llama.cpp fixes in code per architecture rather than storing), tensor
names (read backwards through the converter's own table, `gguf.TensorNameMap`), dimension order,
the q/k row permutation of its rope layout, Gemma's norms stored as `1 + w`, and Llama 3 rope
scaling stored as a `rope_freqs` tensor. Everything downstream sees one layout whatever file the
model came from.
"""
from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGUFValueType
from gguf.quants import dequantize

from pagellm.layers.quant.gguf import NATIVE_TYPES, ExpertBlocks, GGUFBlocks
from pagellm.loader.gguf_file import ByteOrderError, GGUFFile
from pagellm.models.arch import ModelArchConfig, arch_from_hf
from pagellm.models.registry import family_for_gguf

logger = logging.getLogger(__name__)

# llama.cpp's converter reorders q/k rows for these architectures (its non-NeoX rope).
_PERMUTED_ARCHS = ("llama", "smollm3", "granite", "mistral3")
# llama.cpp's converter stores these architectures' `1 + w` RMSNorm weights with the 1 added
# (Qwen3.5's gated norm inside the delta-rule layers is a plain `w` norm, stored as it is).
_NORM_PLUS_ONE_ARCHS = ("gemma2", "gemma3", "qwen35", "qwen35moe")
_PLAIN_NORMS = (".linear_attn.norm.weight",)
# Qwen3.5's delta-rule layers, whose value heads the converter reorders (dense and MoE).
_QWEN35_ARCHS = ("qwen35", "qwen35moe")

# `{arch}.<key>` metadata -> Hugging Face config field, for every architecture.
_CONFIG_KEYS = {
    "block_count": "num_hidden_layers",
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "vocab_size": "vocab_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.sliding_window": "sliding_window",
    "attn_logit_softcapping": "attn_logit_softcapping",
    "final_logit_softcapping": "final_logit_softcapping",
    "expert_count": "num_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
    "embedding_scale": "embedding_multiplier",     # Granite
    "residual_scale": "residual_multiplier",
    "attention.scale": "attention_multiplier",
    "logit_scale": "logits_scaling",
}
_REQUIRED = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count")

# What llama.cpp fixes in its code for an architecture instead of reading it from the file; the
# Hugging Face defaults differ, so a GGUF model is served as llama.cpp serves it.
_LLAMA_CPP_FIXED: dict[str, dict[str, Any]] = {
    "smollm3": {"no_rope_layer_interval": 4},   # every fourth layer without rope
    "gemma3": {"sliding_window_pattern": 6},    # five local layers, then one global
    "qwen3moe": {"norm_topk_prob": True},       # top-k routing weights renormalized
    "gpt-oss": {"swiglu_limit": 7.0},           # the experts' clamp (and alpha 1.702, as transformers)
}


def _lfm2_fields(value: Callable[[str], Any], per_layer: dict[str, list], fields: dict[str, Any], path: str) -> None:
    """LFM2: the convolution layers are those with no key/value heads; the file's feed-forward
    length is the MLP's width after transformers' adjustment (so none is applied again)."""
    kv_heads = per_layer.pop("attention.head_count_kv")
    fields["layer_types"] = ["full_attention" if n else "conv" for n in kv_heads]
    fields["num_key_value_heads"] = _one_value({n for n in kv_heads if n}, "attention.head_count_kv", path)
    fields["conv_L_cache"] = value("shortconv.l_cache")
    fields["norm_eps"] = fields.pop("rms_norm_eps")
    fields["block_auto_adjust_ff_dim"] = False


def _qwen35_fields(value: Callable[[str], Any], per_layer: dict[str, list], fields: dict[str, Any], path: str) -> None:
    """Qwen3.5 (and Qwen3.5-MoE): the delta-rule layers are the recurrent ones; their sizes come as
    llama.cpp's state-space keys (state size = key head size, group count = key heads, time-step
    rank = value heads, inner size = all value heads)."""
    recurrent = value("attention.recurrent_layers")
    if recurrent is None:
        raise ValueError(f"{path}: required metadata key attention.recurrent_layers is missing")
    fields["layer_types"] = ["linear_attention" if r else "full_attention"
                             for r in recurrent[:fields["num_hidden_layers"]]]
    value_heads = value("ssm.time_step_rank")
    fields.update(linear_conv_kernel_dim=value("ssm.conv_kernel"), linear_key_head_dim=value("ssm.state_size"),
                  linear_num_key_heads=value("ssm.group_count"), linear_num_value_heads=value_heads,
                  linear_value_head_dim=value("ssm.inner_size") // value_heads)
    # The converter tiles the value heads across key heads; the loader groups them back in every
    # tensor but out_proj, whose columns stay tiled (_qwen35_grouped_value_heads).
    fields["linear_out_proj_tiled"] = value_heads != fields["linear_num_key_heads"]
    if value("expert_shared_feed_forward_length") is not None:  # Qwen3.5-MoE's gated shared expert
        fields["shared_expert_intermediate_size"] = value("expert_shared_feed_forward_length")


def _granitehybrid_fields(value: Callable[[str], Any], per_layer: dict[str, list], fields: dict[str, Any],
                          path: str) -> None:
    """Granite 4 hybrid: the Mamba-2 layers are those with no key/value heads, sized from llama.cpp's
    state-space keys (time-step rank = heads, inner size = expand x hidden); its attention has no
    rotary embedding unless rope.scaling.finetuned says so (what llama.cpp's graph reads)."""
    kv_heads = per_layer.pop("attention.head_count_kv")
    fields["layer_types"] = ["full_attention" if n else "linear_attention" for n in kv_heads]
    fields["num_key_value_heads"] = _one_value({n for n in kv_heads if n}, "attention.head_count_kv", path)
    heads, inner, hidden = value("ssm.time_step_rank"), value("ssm.inner_size"), fields["hidden_size"]
    if inner % hidden or inner % heads:
        raise ValueError(f"{path}: granitehybrid.ssm.inner_size {inner} is not a multiple of the hidden size "
                         f"({hidden}) and of ssm.time_step_rank ({heads})")
    fields.update(mamba_d_conv=value("ssm.conv_kernel"), mamba_d_state=value("ssm.state_size"),
                  mamba_n_groups=value("ssm.group_count"), mamba_n_heads=heads, mamba_expand=inner // hidden,
                  mamba_d_head=inner // heads, shared_intermediate_size=value("expert_shared_feed_forward_length"),
                  position_embedding_type="rope" if value("rope.scaling.finetuned") else "nope")
    if "num_experts" in fields:
        fields["num_local_experts"] = fields.pop("num_experts")


def _gpt_oss_fields(value: Callable[[str], Any], per_layer: dict[str, list], fields: dict[str, Any], path: str) -> None:
    """gpt-oss: llama.cpp fixes the window on every other layer, the first included."""
    fields["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                             for i in range(fields["num_hidden_layers"])]
    fields["num_local_experts"] = fields.pop("num_experts")


def _llama4_fields(value: Callable[[str], Any], per_layer: dict[str, list], fields: dict[str, Any], path: str) -> None:
    """Llama 4: the file's feed-forward length is the dense MLP's and the experts' length is
    transformers' intermediate_size (the shared expert's too). What llama.cpp fixes in code: chunks
    of 8192 on three layers of four, the fourth without rope, its queries scaled by position (floor
    8192, scale 0.1), and q/k norms except with 128 experts (Maverick)."""
    if value("attention.sliding_window") == 0:  # llama.cpp's switch for a model without chunked layers
        raise ValueError(f"{path}: llama4.attention.sliding_window is 0 (MobileLLM's layout: no chunked layers), "
                         "which is not supported; Llama 4 Scout and Maverick files have no such key")
    fields["intermediate_size_mlp"] = fields.pop("intermediate_size")
    fields["intermediate_size"] = fields.pop("moe_intermediate_size")
    fields["num_local_experts"] = fields.pop("num_experts")
    fields["interleave_moe_layer_step"] = value("interleave_moe_layer_step")
    fields.pop("sliding_window", None)
    fields.update(use_qk_norm=fields["num_local_experts"] != 128, no_rope_layer_interval=4,
                  attention_chunk_size=8192, attn_temperature_tuning=True, floor_scale=8192, attn_scale=0.1)


def _deepseek2_fields(value: Callable[[str], Any], per_layer: dict[str, list], fields: dict[str, Any],
                      path: str) -> None:
    """DeepSeek-V3: llama.cpp writes latent attention as one key/value head whose key is the latent
    row plus the rotary key (key_length) and gives the heads' own sizes as key_length_mla and
    value_length_mla (older files: key_length and value_length themselves); the routed experts'
    gate comes as expert_gating_func, which llama.cpp takes as softmax when it is missing."""
    gating = value("expert_gating_func")
    if gating != int(gguf.ExpertGatingFuncType.SIGMOID):
        names = {int(t): t.name.lower() for t in gguf.ExpertGatingFuncType}
        shown = "missing (llama.cpp then takes softmax)" if gating is None else f"{gating} ({names.get(gating)})"
        raise ValueError(f"{path}: deepseek2.expert_gating_func is {shown}, DeepSeek-V2's router; only "
                         "DeepSeek-V3's sigmoid router (2) is supported")
    if value("attention.temperature_scale"):
        raise ValueError(f"{path}: deepseek2.attention.temperature_scale (Mistral Large 3's query scaling) "
                         "is not supported")
    rope = value("rope.dimension_count")
    key = value("attention.key_length_mla") or value("attention.key_length")
    fields.update(kv_lora_rank=value("attention.kv_lora_rank"), q_lora_rank=value("attention.q_lora_rank"),
                  qk_rope_head_dim=rope, qk_nope_head_dim=key - rope, head_dim=rope,
                  v_head_dim=value("attention.value_length_mla") or value("attention.value_length"),
                  num_key_value_heads=fields["num_attention_heads"], rope_interleave=True,
                  first_k_dense_replace=value("leading_dense_block_count") or 0,
                  n_routed_experts=fields.pop("num_experts"), n_shared_experts=value("expert_shared_count") or 0,
                  n_group=value("expert_group_count") or 1, topk_group=value("expert_group_used_count") or 1,
                  routed_scaling_factor=value("expert_weights_scale") or 1.0,
                  norm_topk_prob=bool(value("expert_weights_norm")))
def _gemma4_fields(value: Callable[[str], Any], per_layer: dict[str, list], fields: dict[str, Any], path: str) -> None:
    """Gemma 4: the sliding layers' head size and KV heads come as the `_swa` keys and per-layer
    lists, the full layers' as the plain keys; the KV-shared layers' MLPs are double wide in the
    feed-forward list; experts' counts under Gemma 4's own names. (Its rope and attention_k_eq_v,
    which need the file's tensors: _gemma4_rope_and_kv.)"""
    pattern = value("attention.sliding_window_pattern") or [True] * fields["num_hidden_layers"]
    kv_heads = per_layer.pop("attention.head_count_kv", None) or [fields.pop("num_key_value_heads")] * len(pattern)
    ffn = per_layer.pop("feed_forward_length", None)
    swa_kv = {n for n, swa in zip(kv_heads, pattern) if swa} or set(kv_heads)
    full_kv = {n for n, swa in zip(kv_heads, pattern) if not swa} or set(kv_heads)
    fields["num_key_value_heads"] = _one_value(swa_kv, "attention.head_count_kv", path)
    fields["num_global_key_value_heads"] = _one_value(full_kv, "attention.head_count_kv", path)
    fields["global_head_dim"] = fields["head_dim"]
    fields["head_dim"] = value("attention.key_length_swa") or fields["head_dim"]
    shared = value("attention.shared_kv_layers") or 0
    fields["num_kv_shared_layers"] = shared
    if ffn is not None:
        fields["intermediate_size"] = ffn[0]
        fields["use_double_wide_mlp"] = shared > 0 and ffn[-1] == 2 * ffn[0]
        if any(n != ffn[0] * (2 if fields["use_double_wide_mlp"] and i >= len(ffn) - shared else 1)
               for i, n in enumerate(ffn)):
            raise ValueError(f"{path}: gemma4.feed_forward_length {ffn} is neither one width nor the KV-shared "
                             f"layers' double width")
    fields["hidden_size_per_layer_input"] = value("embedding_length_per_layer_input") or 0
    if "num_experts" in fields:
        fields["enable_moe_block"] = True
        fields["top_k_experts"] = fields.pop("num_experts_per_tok")


def _gemma4_rope_and_kv(reader: GGUFFile, fields: dict[str, Any], path: str) -> None:
    """Gemma 4's full layers rotate part of each head by frequencies of the whole ("proportional"):
    llama.cpp writes rope_freqs as 1 for the rotated frequencies and 1e30 for the others. A full
    layer without attn_v takes v from k's projection (attention_k_eq_v). The per-layer embedding
    table has the vocabulary's rows."""
    names = {t.name: t for t in reader.tensors}
    freqs = names.get(_ROPE_FREQS)
    full = fields["global_head_dim"]
    rotated = full // 2
    if freqs is not None:
        values = np.asarray(dequantize(freqs.data, freqs.tensor_type), dtype=np.float64).reshape(-1)
        rotated = int((values == 1.0).sum())
        if values.size != full // 2 or rotated + int((values >= 1e29).sum()) != values.size:
            raise ValueError(f"{path}: rope_freqs is not Gemma 4's proportional rope (1 then 1e30 per frequency)")
    rope = fields["rope_parameters"]
    rope["full_attention"] = {"rope_type": "proportional", "partial_rotary_factor": 2 * rotated / full,
                              "rope_theta": rope["full_attention"]["rope_theta"]}
    fields.pop("partial_rotary_factor", None)  # the generic reading's, of the full layers' rope.dimension_count
    first_full = fields["layer_types"].index("full_attention")
    fields["attention_k_eq_v"] = f"blk.{first_full}.attn_v.weight" not in names
    if not fields["attention_k_eq_v"] and fields["num_global_key_value_heads"] != fields["num_key_value_heads"]:
        raise ValueError(f"{path}: the full layers have {fields['num_global_key_value_heads']} KV heads and the "
                         f"sliding ones {fields['num_key_value_heads']}, with v projections: transformers' Gemma 4 "
                         f"has other KV head counts only where v comes from k (attention_k_eq_v)")
    fields["vocab_size_per_layer_input"] = fields["vocab_size"]


# Family fields that llama.cpp writes in its own shape (per-layer lists, its own keys):
# fn(value of `{arch}.<key>`, the per-layer lists (fn takes those it reads), fields so far, path).
_ARCH_FIELDS: dict[str, Callable[[Callable[[str], Any], dict[str, list], dict[str, Any], str], None]] = {
    "lfm2": _lfm2_fields,
    "qwen35": _qwen35_fields,
    "granitehybrid": _granitehybrid_fields,
    "gpt-oss": _gpt_oss_fields,
    "qwen35moe": _qwen35_fields,
    "llama4": _llama4_fields,
    "deepseek2": _deepseek2_fields,
    "gemma4": _gemma4_fields,
}

# Tensors whose GGUF names the name table cannot map back (the converter renamed them first):
# arch -> {name within a block: HF name within a layer}.
_LAYER_TENSORS = {
    "qwen35": {"ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias"},
    "granitehybrid": {"ssm_a": "mamba.A_log", "ssm_d": "mamba.D", "ssm_dt.bias": "mamba.dt_bias",
                      # the shared MLP's input_linear, split into its gate and up halves
                      "ffn_gate_shexp.weight": "shared_mlp.gate_proj.weight",
                      "ffn_up_shexp.weight": "shared_mlp.up_proj.weight",
                      # the checkpoint's name (transformers' module is `router`)
                      "ffn_gate_inp.weight": "block_sparse_moe.router.layer.weight"},
    "gpt-oss": {"attn_sinks.weight": "self_attn.sinks"},
    "qwen35moe": {"ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias"},
    # kv_b_proj split per head into k_b (transposed) and v_b: joined again by _deepseek2_kv_b.
    "deepseek2": {"attn_k_b.weight": "self_attn.k_b_proj.weight", "attn_v_b.weight": "self_attn.v_b_proj.weight",
                  "exp_probs_b.bias": "mlp.gate.e_score_correction_bias"},
    "gemma4": {"ffn_gate_up_exps.weight": "experts.gate_up_proj", "ffn_down_exps.weight": "experts.down_proj",
               "ffn_down_exps.scale": "router.per_expert_scale", "ffn_gate_inp.weight": "router.proj.weight",
               "ffn_gate_inp.scale": "router.scale", "layer_output_scale.weight": "layer_scalar"},
}
# Latent attention: key and value sizes differ, and the family's fields read the shared experts.
_LATENT_ARCHS = ("deepseek2",)
# The module holding an architecture's experts, where not `mlp`.
_EXPERTS_MODULE = {"granitehybrid": "block_sparse_moe"}

# llama.cpp's OLMo 3 graph ("olmo2" with a window) rotates its sliding-window layers unscaled with the
# global base, whatever rope.freq_base_swa says.
_SWA_GLOBAL_BASE_ARCHS = ("olmo2",)

# Stacked expert tensors -> the name of every expert's matrices at once ([out, in] each, which
# FusedMoE loads as w1, w3 and w2); not gate_proj etc., which gpt-oss's checkpoints use for [in, out].
_EXPERT_TENSORS = {"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(.+)")
_EXPERT_TENSOR_RE = re.compile(r"blk\.(\d+)\.(ffn_(?:gate|up|down)_exps)\.(weight|bias)")
# Per-frequency llama3 rope factors; folded into the config by read_gguf_config, not a parameter.
_ROPE_FREQS = "rope_freqs.weight"
# Phi-3's LongRoPE factor lists, folded into the config likewise.
_LONGROPE_FACTORS = {"rope_factors_long.weight": "long_factor", "rope_factors_short.weight": "short_factor"}

# llama.cpp's names for rope scaling keys that Hugging Face spells differently.
_ROPE_SCALING_KEYS = {
    "original_context_length": "original_max_position_embeddings",
    "attn_factor": "attention_factor",
    "yarn_beta_fast": "beta_fast",
    "yarn_beta_slow": "beta_slow",
    "yarn_log_multiplier": "mscale_all_dim",
}


def read_gguf_config(path: str, reader: GGUFFile | None = None) -> ModelArchConfig:
    """The architecture described by a GGUF file's `{arch}.*` and `tokenizer.ggml.*` metadata,
    as the Hugging Face config of its family.

    `reader`: the file already opened by `open_gguf` (parsing the metadata takes seconds for a
    large vocabulary, so a caller that also reads the weights opens it once).
    """
    from transformers import AutoConfig

    reader = reader or open_gguf(path)
    arch = _value(reader, "general.architecture")
    family = family_for_gguf(arch, path, experts=bool(_value(reader, f"{arch}.expert_count")),
                             sliding=bool(_value(reader, f"{arch}.attention.sliding_window")))
    fields = _hf_fields(reader, arch, path)
    if family.name == "mixtral":
        fields["num_local_experts"] = fields.pop("num_experts")
    try:
        hf = AutoConfig.for_model(family.model_types[0], **fields)
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: its metadata does not make a {family.name} config: {exc}") from None
    eos_ids: list[int] = []
    for name in ("eos_token_id", "eot_token_id", "eom_token_id"):
        token_id = _value(reader, f"tokenizer.ggml.{name}")
        if token_id is not None and token_id not in eos_ids:
            eos_ids.append(int(token_id))
    tensor_names = {t.name for t in reader.tensors}
    return arch_from_hf(hf, family.name, bos_token_id=_value(reader, "tokenizer.ggml.bos_token_id"),
                        eos_token_ids=eos_ids, model_name=path,
                        attention_bias="blk.0.attn_q.bias" in tensor_names)


def _hf_fields(reader: GGUFFile, arch: str, path: str) -> dict[str, Any]:
    """The Hugging Face config fields the metadata gives (transformers fills in the rest)."""
    for key in _REQUIRED:
        if _value(reader, f"{arch}.{key}") is None:
            raise ValueError(f"{path}: required metadata key {arch}.{key} is missing")
    fields: dict[str, Any] = {}
    per_layer: dict[str, list] = {}
    for key, field in _CONFIG_KEYS.items():
        value = _value(reader, f"{arch}.{key}")
        if key == "attention.sliding_window" and value == 0:
            value = None  # what the converter writes for "no window" (Phi-3)
        if isinstance(value, list):  # per-layer values: the hybrid families read theirs
            per_layer[key] = value
        elif value is not None:
            fields[field] = value
    for key in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads"):
        if key in fields:  # else a per-layer list, which its family reads (Gemma 4's feed-forward widths)
            fields[key] = _as_int(fields[key], key, path)
    # Multi-token-prediction layers follow the model's own in the block count; they are not served.
    fields["num_hidden_layers"] -= _value(reader, f"{arch}.nextn_predict_layers") or 0
    if arch in _ARCH_FIELDS:
        _ARCH_FIELDS[arch](lambda key: _value(reader, f"{arch}.{key}"), per_layer, fields, path)
    for key, value in per_layer.items():
        raise ValueError(f"{path}: metadata key {arch}.{key} varies per layer ({value[:4]}...), "
                         "which no supported family of this architecture does")
    fields.setdefault("vocab_size", _vocab_size(reader, arch, path))
    heads = fields["num_attention_heads"]
    head_dim = int(fields.get("head_dim") or fields["hidden_size"] // heads)
    fields["head_dim"] = head_dim
    if arch not in _LATENT_ARCHS and _value(reader, f"{arch}.attention.value_length") not in (
            None, _value(reader, f"{arch}.attention.key_length") or head_dim):
        raise ValueError(f"{path}: key and value head sizes differ "
                         f"({head_dim} vs {_value(reader, f'{arch}.attention.value_length')}), "
                         "which no supported family does")
    if arch not in _LATENT_ARCHS and _value(reader, f"{arch}.expert_shared_count"):
        raise ValueError(f"{path}: shared experts ({arch}.expert_shared_count) are not supported")
    rotary = _value(reader, f"{arch}.rope.dimension_count")
    if rotary is not None and rotary != head_dim:
        fields["partial_rotary_factor"] = rotary / head_dim
    theta = _value(reader, f"{arch}.rope.freq_base") or 10000.0
    # Gemma 4's rope_freqs are its proportional rope's (_gemma4_rope_and_kv), not a scaling's.
    scaling = (_rope_scaling(reader, arch, head_dim, theta, path) if arch != "gemma4" else None) or {}
    rope = {"rope_type": "default", "rope_theta": theta, **scaling}
    if "original_max_position_embeddings" in scaling:  # Phi-3's config also keeps it at the top level
        fields["original_max_position_embeddings"] = scaling["original_max_position_embeddings"]
    temperature = _value(reader, f"{arch}.attention.temperature_scale")
    if temperature:  # Ministral 3's query scaling, stepping (in llama.cpp too) at the YaRN original context
        rope["llama_4_scaling_beta"] = temperature
    local_theta = _value(reader, f"{arch}.rope.freq_base_swa")
    if arch in _SWA_GLOBAL_BASE_ARCHS and fields.get("sliding_window"):
        local_theta = theta
    if local_theta is not None:  # Gemma 3: the sliding-window layers rotate with their own base
        rope = {"full_attention": rope, "sliding_attention": {"rope_type": "default", "rope_theta": local_theta}}
    fields["rope_parameters"] = rope
    pattern = _value(reader, f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        fields["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
    for field, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                       ("pad_token_id", "padding_token_id")):
        # The file's tokenizer decides (a family's default, e.g. SmolLM3's pad 128004, may not exist).
        fields[field] = _value(reader, f"tokenizer.ggml.{key}")
    fields["tie_word_embeddings"] = all(t.name != "output.weight" for t in reader.tensors)
    fields.update(_LLAMA_CPP_FIXED.get(arch, {}))
    if arch == "gemma4":
        _gemma4_rope_and_kv(reader, fields, path)
    if arch in ("gemma2", "gemma3"):
        # llama.cpp scales Gemma's attention by 1/sqrt(head_dim), except in the 27B models
        # (46 and 62 layers), where it is 1/sqrt(hidden / heads): their query_pre_attn_scalar.
        big = fields["num_hidden_layers"] == {"gemma2": 46, "gemma3": 62}[arch]
        fields["query_pre_attn_scalar"] = fields["hidden_size"] // heads if big else head_dim
    return fields


def iter_gguf_weights(path: str, reader: GGUFFile | None = None, cfg: ModelArchConfig | None = None,
                      keep_blocks: bool = False) -> Iterator[tuple[str, torch.Tensor | GGUFBlocks]]:
    """Yield `(hf_name, float32 tensor in HF shape)` one tensor at a time, dequantizing from the mmap;
    with `keep_blocks`, a matrix of a type the CPU kernels multiply (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K,
    Q6_K, MXFP4, IQ4_NL, IQ4_XS) comes as its GGUF blocks instead (stacked experts as ExpertBlocks),
    and one warning names the quantized types that are dequantized all the same.

    The file is opened and checked, and every tensor's name mapped, before this returns, so a bad
    file or a tensor with no place in the model fails here, not at first use. `reader`, `cfg`: the
    file already opened by `open_gguf` and its read_gguf_config, when the caller has them.
    """
    reader = reader or open_gguf(path)
    cfg = cfg or read_gguf_config(path, reader)
    arch = _value(reader, "general.architecture")
    names, shapes = _hf_names(reader, arch, cfg, path)
    if keep_blocks:
        widened = sorted({t.tensor_type.name for t in reader.tensors if names.get(t.name) and not _as_blocks(t)
                          and t.tensor_type.name not in ("F32", "F16", "BF16", "F64")})
        if widened:
            logger.warning("pagellm: %s: %s weights have no quantized kernel here and are dequantized to the "
                           "model's dtype at load", os.path.basename(path), ", ".join(widened))
    weights = _weights(reader, names, shapes, arch, cfg, path, keep_blocks)
    return _deepseek2_kv_b(weights, path) if arch == "deepseek2" else weights


def has_native_blocks(reader: GGUFFile) -> bool:
    """Whether the file has a matrix that would be served in its blocks."""
    return any(_as_blocks(t) for t in reader.tensors)


def _as_blocks(tensor: Any) -> bool:
    """Whether a file tensor is served in its blocks: a matrix, or every expert's matrices stacked
    (ffn_*_exps), of a type with a kernel."""
    shape_ok = len(tensor.shape) == 2 or (len(tensor.shape) == 3 and _EXPERT_TENSOR_RE.fullmatch(tensor.name))
    return bool(shape_ok) and int(tensor.tensor_type) in NATIVE_TYPES


def _weights(reader: GGUFFile, names: dict[str, str], shapes: dict[str, torch.Size], arch: str,
             cfg: ModelArchConfig, path: str, keep_blocks: bool) -> Iterator[tuple[str, torch.Tensor | GGUFBlocks]]:
    permuted = arch in _PERMUTED_ARCHS
    for tensor in reader.tensors:
        name = names.get(tensor.name)
        if name is None:
            continue
        if keep_blocks and _as_blocks(tensor):
            # A copy out of the read-only mmap: [rows, row_bytes] as the file lays them out.
            rows = [int(d) for d in reversed(tensor.shape[1:])]  # [experts,] rows
            data = torch.from_numpy(np.array(tensor.data, dtype=np.uint8).reshape(*rows, -1))
            blocks = GGUFBlocks if len(rows) == 1 else ExpertBlocks
            weight = blocks(data, int(tensor.tensor_type), int(tensor.shape[0]))
        else:
            weight = _in_reference_shape(_to_torch(tensor, path), shapes.get(name))
        if permuted and ".q_proj." in name:
            weight = _unpermute(weight, cfg.num_attention_heads, name, path)
        elif permuted and ".k_proj." in name:
            weight = _unpermute(weight, cfg.num_key_value_heads, name, path)
        elif arch in _NORM_PLUS_ONE_ARCHS and name.endswith("norm.weight") and not name.endswith(_PLAIN_NORMS):
            weight -= 1.0
        if name.endswith(".A_log"):  # stored as A = -exp(A_log)
            weight = torch.log(-weight)
        if arch in _QWEN35_ARCHS and ".linear_attn." in name:
            weight = _qwen35_grouped_value_heads(weight, name, cfg.hf_config)
        yield name, weight


def _deepseek2_kv_b(weights: Iterator[tuple[str, torch.Tensor | GGUFBlocks]],
                    path: str) -> Iterator[tuple[str, torch.Tensor | GGUFBlocks]]:
    """Latent attention's kv_b_proj ([heads x (nope + v), kv_lora] in the checkpoint) from the two
    parts the converter splits it into for llama.cpp's absorbed attention: k_b [heads, kv_lora, nope]
    (each head's block transposed) and v_b [heads, v, kv_lora]. (3-D, so never kept in blocks.)"""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, weight in weights:
        if not name.endswith((".k_b_proj.weight", ".v_b_proj.weight")):
            yield name, weight
            continue
        prefix, kind, _ = name.rsplit(".", 2)
        layer = parts.setdefault(prefix, {})
        layer[kind] = weight
        if len(layer) == 2:
            k_b, v_b = layer["k_b_proj"], layer["v_b_proj"]
            kv_b = torch.cat([k_b.transpose(1, 2), v_b], dim=1)
            yield f"{prefix}.kv_b_proj.weight", kv_b.reshape(-1, kv_b.shape[-1]).contiguous()
            del parts[prefix]
    if parts:
        raise ValueError(f"{path}: latent attention's attn_k_b and attn_v_b come in pairs; "
                         f"unpaired in {', '.join(sorted(parts))}")


def _hf_names(reader: GGUFFile, arch: str, cfg: ModelArchConfig,
              path: str) -> tuple[dict[str, str], dict[str, torch.Size]]:
    """GGUF tensor name -> Hugging Face name, and each HF name's shape in the reference model.
    The converter maps HF names forward through `gguf.TensorNameMap`, which knows many spellings
    of each tensor; of those, the one the reference model of this family has (transformers' own
    module names) is the way back."""
    import transformers

    with torch.device("meta"):
        reference = transformers.AutoModelForCausalLM.from_config(cfg.hf)
    shapes = {name: p.shape for name, p in reference.state_dict().items()}
    modules = {name.rsplit(".", 1)[0] for name in shapes}
    table = gguf.get_tensor_name_map(_MODEL_ARCHS[arch], cfg.num_hidden_layers)
    back = {gguf_name: hf_name for hf_name, (_, gguf_name) in table.mapping.items() if hf_name in modules}
    renamed = _LAYER_TENSORS.get(arch, {})
    prediction_layers = bool(_value(reader, f"{arch}.nextn_predict_layers"))
    names: dict[str, str] = {}
    for tensor in reader.tensors:
        if tensor.name == _ROPE_FREQS or tensor.name in _LONGROPE_FACTORS:
            continue  # folded into the config
        block = _BLOCK_RE.fullmatch(tensor.name)
        if block and prediction_layers and int(block.group(1)) >= cfg.num_hidden_layers:
            continue  # a multi-token-prediction layer (not served)
        base, _, suffix = tensor.name.rpartition(".")
        expert = _EXPERT_TENSOR_RE.fullmatch(tensor.name)
        if block and block.group(2) in renamed:
            names[tensor.name] = f"model.layers.{block.group(1)}.{renamed[block.group(2)]}"
        elif expert and cfg.hf_config.get("num_experts_per_tok"):
            module = _EXPERTS_MODULE.get(arch, "mlp")
            bias = "_bias" if expert.group(3) == "bias" else ""  # every expert's biases stacked (gpt-oss)
            names[tensor.name] = (f"model.layers.{expert.group(1)}.{module}.experts."
                                  f"{_EXPERT_TENSORS[expert.group(2)]}{bias}")
        elif base in back:
            names[tensor.name] = f"{back[base]}.{suffix}"
        else:
            # Failing beats silently dropping a weight the model would then run without.
            raise ValueError(f"{path}: tensor {tensor.name!r} has no place in a {cfg.architecture} model")
    return names, shapes


_MODEL_ARCHS = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}


def open_gguf(path: str) -> GGUFFile:
    """Parse a GGUF file's header and metadata (the tensors stay in the mmap) and check it is whole."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        reader = GGUFFile(path)
    except ByteOrderError:
        raise ValueError(f"{path} is a GGUF file of the other byte order, which is not supported") from None
    except Exception as exc:  # garbage input fails in many ways (bad magic, short reads, bad enums)
        raise ValueError(f"{path} is not a valid GGUF file (corrupt or truncated?): {exc}") from exc
    file_size = len(reader.data)
    for tensor in reader.tensors:
        # A truncated file can still parse when a tensor's view silently comes back short.
        if tensor.data_offset + tensor.n_bytes > file_size or tensor.data.nbytes != tensor.n_bytes:
            raise ValueError(f"{path} is truncated: tensor {tensor.name} runs past the end of the file")
    return reader


def _value(reader: GGUFFile, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return None
    value = field.contents()
    if field.types == [GGUFValueType.FLOAT32]:
        # The shortest decimal that round-trips in float32, so 1e-5 reads back as 1e-5.
        return float(str(np.float32(value)))
    return value


def _one_value(values: set, key: str, path: str) -> Any:
    """The one value a per-layer list holds where it is set (ValueError if it holds several)."""
    if len(values) != 1:
        raise ValueError(f"{path}: metadata key {key} holds {sorted(values)} in different layers; "
                         "one value is supported")
    return values.pop()


def _as_int(value: Any, key: str, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{path}: metadata key {key} should be one integer, got {value!r}")
    return value


def _vocab_size(reader: GGUFFile, arch: str, path: str) -> int:
    size = _value(reader, f"{arch}.vocab_size")
    if size is not None:
        return int(size)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        return int(tokens.value)  # a string array is kept as its length
    for tensor in reader.tensors:
        if tensor.name == "token_embd.weight":
            return int(tensor.shape[-1])
    raise ValueError(f"{path}: cannot tell the vocabulary size (no vocab_size, token list or embedding)")


def _rope_scaling(reader: GGUFFile, arch: str, head_dim: int, theta: float, path: str) -> dict | None:
    prefix = f"{arch}.rope.scaling."
    raw = {key[len(prefix):]: _value(reader, key) for key in reader.fields if key.startswith(prefix)}
    kind = raw.pop("type", None)
    raw.pop("finetuned", None)
    factors = {t.name: t for t in reader.tensors if t.name in _LONGROPE_FACTORS}
    if factors:  # Phi-3's LongRoPE: its two factor lists are stored as tensors
        scaling = {"rope_type": "longrope"}
        scaling.update({_ROPE_SCALING_KEYS.get(k, k): v for k, v in raw.items()})
        for name, key in _LONGROPE_FACTORS.items():
            if name not in factors:
                raise ValueError(f"{path}: has {', '.join(factors)} but not {name} (LongRoPE needs both)")
            values = dequantize(factors[name].data, factors[name].tensor_type).reshape(-1)
            scaling[key] = [float(v) for v in values]
        return scaling
    if kind not in (None, "none"):
        scaling = {"rope_type": kind}
        if kind == "yarn":
            # llama.cpp computes YaRN's attention factor from the factor and yarn_log_multiplier
            # (mscale_all_dim, with mscale taken as 1), not from this key.
            raw.pop("yarn_attn_factor", None)
            if "yarn_log_multiplier" in raw:
                scaling["mscale"] = 1.0
            if "yarn_log_multiplier" in raw and arch == "deepseek2":
                # Written as 0.1 x mscale_all_dim, and llama.cpp takes mscale equal to it (DeepSeek-V2-Lite's).
                raw["yarn_log_multiplier"] = float(np.float32(raw["yarn_log_multiplier"]) / np.float32(0.1))
                scaling["mscale"] = raw["yarn_log_multiplier"]
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


def _qwen35_grouped_value_heads(weight: torch.Tensor | GGUFBlocks, name: str,
                                hf: dict) -> torch.Tensor | GGUFBlocks:
    """Undo the converter's reordering of Qwen3.5's delta-rule value heads: it stores them tiled
    across key heads ([v0 of every key head, v1 of every key head, ...]) where the checkpoint
    groups them by key head; rows of value heads go back to grouped. out_proj's columns stay
    tiled (moving them would cut through its quantized blocks): the layer hands it its heads in
    that order (linear_out_proj_tiled, _qwen35_fields)."""
    key_heads, value_heads = hf["linear_num_key_heads"], hf["linear_num_value_heads"]
    if key_heads == value_heads:
        return weight
    per_key, head_dim, qk = value_heads // key_heads, hf["linear_value_head_dim"], 2 * key_heads * hf["linear_key_head_dim"]

    def grouped(t: torch.Tensor | GGUFBlocks, size: int) -> torch.Tensor | GGUFBlocks:  # rows, along dim 0
        if isinstance(t, GGUFBlocks):  # a row is whole blocks: reorder them the same way
            return t.with_rows(grouped(t.data, size))
        return t.reshape(per_key, key_heads, size, *t.shape[1:]).transpose(0, 1).reshape(t.shape)

    if name.endswith((".in_proj_qkv.weight", ".conv1d.weight")):
        if isinstance(weight, GGUFBlocks):
            return weight.with_rows(torch.cat([weight.data[:qk], grouped(weight.data[qk:], head_dim)]))
        return torch.cat([weight[:qk], grouped(weight[qk:], head_dim)])
    if name.endswith(".in_proj_z.weight"):
        return grouped(weight, head_dim)
    if name.endswith((".in_proj_a.weight", ".in_proj_b.weight", ".A_log", ".dt_bias")):
        return grouped(weight, 1)
    return weight


def _in_reference_shape(weight: torch.Tensor, shape: torch.Size | None) -> torch.Tensor:
    """The weight in its reference shape where the converter only squeezed out or added dimensions
    of size 1 (convolution kernels [channels, 1, K] stored as [channels, K], Mamba-2's A and D
    as [heads, 1]) or stored a vector as rows (Mamba-2's norm, one row per group)."""
    if shape is None or weight.shape == shape:
        return weight
    squeezed = [d for d in shape if d != 1] == [d for d in weight.shape if d != 1]
    if squeezed or (len(shape) == 1 and weight.numel() == shape[0]):
        return weight.reshape(shape)
    return weight


def _unpermute(weight: torch.Tensor | GGUFBlocks, n_head: int, name: str, path: str) -> torch.Tensor | GGUFBlocks:
    """Undo convert_hf_to_gguf's `permute`: rows (pair, half) within each head back to (half, pair)."""
    if isinstance(weight, GGUFBlocks):  # rows are whole runs of blocks: reorder them the same way
        return weight.with_rows(_unpermute(weight.data, n_head, name, path))
    rows = weight.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"{path}: {name} has {rows} rows, not a multiple of 2 x {n_head} heads")
    rest = weight.shape[1:]
    return weight.reshape(n_head, rows // n_head // 2, 2, *rest).transpose(1, 2).reshape(weight.shape).contiguous()

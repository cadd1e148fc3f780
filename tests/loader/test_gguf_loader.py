"""GGUF reading: files written the way llama.cpp's converter writes them must read back as the HF model."""
from __future__ import annotations

import math
import os
import re

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from transformers import LlamaConfig, LlamaForCausalLM

from pagellm.loader.bundled import default_model_path
from pagellm.loader.gguf_loader import iter_gguf_weights, read_gguf_config
from pagellm.loader.source import load_model_source

# Every matmul input width is a multiple of 256 so that K-quants (256-value blocks) fit.
HIDDEN, FFN, HEADS, KV_HEADS, LAYERS, VOCAB = 256, 256, 4, 2, 2, 300
HEAD_DIM = HIDDEN // HEADS

HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER_PARTS = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in HF_TO_GGUF:
        return HF_TO_GGUF[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    part, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{LAYER_PARTS[part]}.{suffix}"


def rope_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter layout for q/k rows: within each head, interleave the two rotary halves."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_state_dict(tie: bool = False) -> dict[str, np.ndarray]:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, tie_word_embeddings=tie,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # norms are all ones at init; make them distinguishable
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    sd = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    if tie:
        sd.pop("lm_head.weight")
    return sd


def write_gguf(path, tensors: dict[str, tuple[np.ndarray, Q | None]], arch: str = "llama", head_dim: int = HEAD_DIM,
               theta: float = 10000.0, context: int = 2048, extra=None,
               kv_heads: int | list[int] = KV_HEADS) -> None:
    """A GGUF with llama.cpp's metadata keys; `tensors` maps GGUF names to (data, raw_dtype)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(context)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(theta)
    w.add_rope_dimension_count(head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(VOCAB)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if extra:
        extra(w)
    for name, (data, raw_dtype) in tensors.items():
        w.add_tensor(name, data, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def stored_layout(sd: dict[str, np.ndarray], permute: bool = True) -> dict[str, np.ndarray]:
    """HF tensors as the converter stores them (q/k rows permuted), keyed by GGUF name."""
    out = {}
    for name, value in sd.items():
        if permute and ".q_proj." in name:
            value = rope_permute(value, HEADS)
        elif permute and ".k_proj." in name:
            value = rope_permute(value, KV_HEADS)
        out[gguf_name(name)] = np.ascontiguousarray(value)
    return out


def random_k_quant_blocks(rows: int, cols: int, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Random but valid K-quant bytes: arbitrary quants and scales, finite small f16 super-block scales."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows, cols // block_size, type_size), dtype=np.uint8)
    scale = lambda: rng.uniform(1e-3, 1e-2, size=(rows, cols // block_size)).astype(np.float16)  # noqa: E731
    if qtype == Q.Q4_K:  # d then dmin open the block
        blocks[..., 0:2] = scale()[..., None].view(np.uint8)
        blocks[..., 2:4] = scale()[..., None].view(np.uint8)
    else:  # Q6_K: d closes the block
        blocks[..., -2:] = scale()[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


def encode_as(value: np.ndarray, qtype: Q, rng: np.random.Generator) -> tuple[np.ndarray, Q | None]:
    if value.ndim == 1 or qtype == Q.F32:  # llama.cpp keeps norms in F32
        return value.astype(np.float32), None
    if qtype == Q.F16:
        return value.astype(np.float16), None
    if qtype in (Q.Q4_K, Q.Q6_K):  # the gguf package cannot quantize these
        return random_k_quant_blocks(*value.shape, qtype, rng), qtype
    return quantize(value.astype(np.float32), qtype), qtype


@pytest.fixture(scope="module")
def llama_sd() -> dict[str, np.ndarray]:
    return hf_state_dict()


def test_f32_round_trips_exactly(tmp_path, llama_sd):
    path = tmp_path / "f32.gguf"
    write_gguf(path, {k: (v, None) for k, v in stored_layout(llama_sd).items()})
    loaded = dict(iter_gguf_weights(str(path)))
    assert set(loaded) == set(llama_sd)
    for name, value in llama_sd.items():
        assert loaded[name].dtype == torch.float32
        assert torch.equal(loaded[name], torch.from_numpy(value)), name
    cfg = read_gguf_config(str(path))
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (LAYERS, HIDDEN, FFN)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (HEADS, KV_HEADS, HEAD_DIM)
    assert cfg.vocab_size == VOCAB and cfg.rms_norm_eps == 1e-6 and cfg.max_position_embeddings == 2048
    assert not cfg.tie_word_embeddings and cfg.rope_scaling is None and cfg.architecture == "llama"
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == [2]


# Tolerances relative to each row's largest magnitude, per the formats' step sizes.
QUANT_TOLERANCE = {Q.F16: 1e-3, Q.BF16: 1e-2, Q.Q8_0: 1e-2, Q.Q4_0: 0.15, Q.Q4_1: 0.15}


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_quantized_tensors_dequantize_and_unpermute(tmp_path, llama_sd, qtype):
    rng = np.random.default_rng(1)
    stored = {k: encode_as(v, qtype, rng) for k, v in stored_layout(llama_sd).items()}
    path = tmp_path / f"{qtype.name}.gguf"
    write_gguf(path, stored)
    loaded = dict(iter_gguf_weights(str(path)))
    assert set(loaded) == set(llama_sd)
    for name, tensor in loaded.items():
        data, raw = stored[gguf_name(name)]
        expected = dequantize(data, raw) if raw is not None else data.astype(np.float32)
        assert np.isfinite(expected).all()
        assert tuple(tensor.shape) == llama_sd[name].shape, name
        got = tensor.numpy()
        # Re-applying the converter's permutation must give back exactly the stored (dequantized) rows.
        if ".q_proj." in name:
            got = rope_permute(got, HEADS)
        elif ".k_proj." in name:
            got = rope_permute(got, KV_HEADS)
        np.testing.assert_array_equal(got, expected.reshape(got.shape), err_msg=name)
        if qtype in QUANT_TOLERANCE:  # and it is the original weight, up to quantization error
            original = llama_sd[name]
            scale = np.abs(original).max(axis=-1, keepdims=True)
            assert np.all(np.abs(tensor.numpy() - original) <= QUANT_TOLERANCE[qtype] * scale), name


def test_tied_embeddings_yield_no_lm_head(tmp_path):
    sd = hf_state_dict(tie=True)
    path = tmp_path / "tied.gguf"
    write_gguf(path, {k: (v, None) for k, v in stored_layout(sd).items()})
    assert read_gguf_config(str(path)).tie_word_embeddings
    assert set(dict(iter_gguf_weights(str(path)))) == set(sd)


def test_qwen2_is_not_permuted_and_has_biases(tmp_path, llama_sd):
    sd = dict(llama_sd)
    rng = np.random.default_rng(2)
    for i in range(LAYERS):
        for proj, rows in (("q", HIDDEN), ("k", KV_HEADS * HEAD_DIM), ("v", KV_HEADS * HEAD_DIM)):
            sd[f"model.layers.{i}.self_attn.{proj}_proj.bias"] = rng.standard_normal(rows).astype(np.float32)
    path = tmp_path / "qwen2.gguf"
    write_gguf(path, {k: (v, None) for k, v in stored_layout(sd, permute=False).items()}, arch="qwen2")
    loaded = dict(iter_gguf_weights(str(path)))
    assert set(loaded) == set(sd)
    for name, value in sd.items():
        assert torch.equal(loaded[name], torch.from_numpy(value)), name
    cfg = read_gguf_config(str(path))
    assert cfg.architecture == "qwen2" and cfg.attention_bias


def test_llama_q_bias_is_unpermuted_too(tmp_path, llama_sd):
    sd = dict(llama_sd)
    sd["model.layers.0.self_attn.q_proj.bias"] = np.arange(HIDDEN, dtype=np.float32)
    path = tmp_path / "bias.gguf"
    write_gguf(path, {k: (v, None) for k, v in stored_layout(sd).items()})
    loaded = dict(iter_gguf_weights(str(path)))
    assert torch.equal(loaded["model.layers.0.self_attn.q_proj.bias"], torch.arange(HIDDEN, dtype=torch.float32))
    assert read_gguf_config(str(path)).attention_bias


def test_metadata_extras(tmp_path, llama_sd):
    def extra(w: gguf.GGUFWriter) -> None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(4.0)
        w.add_uint32("tokenizer.ggml.eot_token_id", 7)
        w.add_key_length(HEAD_DIM)

    path = tmp_path / "extras.gguf"
    write_gguf(path, {"token_embd.weight": (llama_sd["model.embed_tokens.weight"], None)}, extra=extra)
    cfg = read_gguf_config(str(path))
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert cfg.eos_token_ids == [2, 7]
    assert cfg.tie_word_embeddings


def test_llama3_rope_freqs_tensor_becomes_hf_rope_scaling(tmp_path):
    """llama.cpp stores Llama 3.1 scaling as a per-frequency tensor; the HF parameters are recovered."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    head_dim, theta = 128, 500000.0
    params = {"rope_type": "llama3", "rope_theta": theta, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    config = LlamaConfig(hidden_size=head_dim * 2, num_attention_heads=2, rope_parameters=params,
                         max_position_embeddings=131072)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    plain = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    factors = (plain / scaled).numpy().astype(np.float32)

    path = tmp_path / "llama31.gguf"
    write_gguf(path, {"rope_freqs.weight": (factors, None)}, head_dim=head_dim, theta=theta, context=131072,
               extra=lambda w: w.add_key_length(head_dim))
    cfg = read_gguf_config(str(path))
    s = cfg.rope_scaling
    assert s["rope_type"] == "llama3" and s["factor"] == 8.0 and s["low_freq_factor"] == 1.0
    assert s["high_freq_factor"] == pytest.approx(4.0, rel=1e-4) and type(s["high_freq_factor"]) is float
    assert s["original_max_position_embeddings"] == 8192
    assert list(iter_gguf_weights(str(path))) == []  # rope_freqs is config, not a parameter
    assert math.isclose(cfg.rope_theta, theta)


def _yarn(w: gguf.GGUFWriter) -> None:
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(8.0)
    w.add_rope_scaling_orig_ctx_len(256)
    w.add_rope_scaling_yarn_beta_fast(32.0)
    w.add_rope_scaling_yarn_beta_slow(1.0)
    w.add_rope_scaling_yarn_attn_factor(1.5)  # llama.cpp computes its own


def test_olmo3_is_olmo2_with_a_window(tmp_path, llama_sd):
    """llama.cpp writes OLMo 3 as "olmo2" with its window and layer pattern; its graph rotates the
    sliding layers with the global base, unscaled, whatever rope.freq_base_swa says."""
    def extra(w: gguf.GGUFWriter) -> None:
        _yarn(w)
        w.add_sliding_window(8)
        w.add_sliding_window_pattern([True, False])
        w.add_rope_freq_base_swa(1000.0)

    tensors = {"token_embd.weight": (llama_sd["model.embed_tokens.weight"], None)}
    write_gguf(tmp_path / "olmo2.gguf", tensors, arch="olmo2")
    assert read_gguf_config(str(tmp_path / "olmo2.gguf")).architecture == "olmo2"
    write_gguf(tmp_path / "olmo3.gguf", tensors, arch="olmo2", theta=500000.0, extra=extra)
    cfg = read_gguf_config(str(tmp_path / "olmo3.gguf"))
    assert cfg.architecture == "olmo3"
    assert cfg.hf_config["layer_types"] == ["sliding_attention", "full_attention"]
    assert cfg.hf_config["sliding_window"] == 8
    assert cfg.hf_config["rope_parameters"] == {
        "full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 8.0,
                           "original_max_position_embeddings": 256, "beta_fast": 32.0, "beta_slow": 1.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0}}


def test_ministral3_yarn_and_query_scale(tmp_path, llama_sd):
    """Mistral 3 files: YaRN's mscale_all_dim as yarn_log_multiplier (mscale taken as 1, as llama.cpp
    does) and the query scale's beta as attention.temperature_scale."""
    def extra(w: gguf.GGUFWriter) -> None:
        _yarn(w)
        w.add_rope_scaling_yarn_log_mul(0.5)
        w.add_attn_temperature_scale(0.1)

    write_gguf(tmp_path / "m.gguf", {"token_embd.weight": (llama_sd["model.embed_tokens.weight"], None)},
               arch="mistral3", extra=extra)
    cfg = read_gguf_config(str(tmp_path / "m.gguf"))
    assert cfg.architecture == "ministral3"
    assert cfg.hf_config["rope_parameters"] == {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 256,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.5, "llama_4_scaling_beta": 0.1}


def test_lfm2_layer_kinds_from_per_layer_kv_heads(tmp_path, llama_sd):
    """LFM2 files: the convolution layers are those with no key/value heads, and the feed-forward
    length is already the MLP's width (transformers' adjustment is not applied again)."""
    tensors = {"token_embd.weight": (llama_sd["model.embed_tokens.weight"], None)}
    write_gguf(tmp_path / "lfm2.gguf", tensors, arch="lfm2", kv_heads=[0, 2],
               extra=lambda w: w.add_shortconv_l_cache(3))
    cfg = read_gguf_config(str(tmp_path / "lfm2.gguf"))
    assert cfg.architecture == "lfm2"
    hf = cfg.hf_config
    assert hf["layer_types"] == ["conv", "full_attention"]
    assert (hf["num_key_value_heads"], hf["conv_L_cache"], hf["norm_eps"]) == (2, 3, 1e-6)
    assert (hf["intermediate_size"], hf["block_auto_adjust_ff_dim"]) == (FFN, False)

    write_gguf(tmp_path / "mixed.gguf", tensors, arch="lfm2", kv_heads=[1, 2],
               extra=lambda w: w.add_shortconv_l_cache(3))
    with pytest.raises(ValueError, match=r"attention.head_count_kv holds \[1, 2\] in different layers"):
        read_gguf_config(str(tmp_path / "mixed.gguf"))


def test_per_layer_metadata_of_a_family_without_hybrid_layers_is_refused(tmp_path, llama_sd):
    tensors = {"token_embd.weight": (llama_sd["model.embed_tokens.weight"], None)}
    write_gguf(tmp_path / "l.gguf", tensors, kv_heads=[2, 0])
    with pytest.raises(ValueError, match=r"llama.attention.head_count_kv varies per layer \(\[2, 0\]"):
        read_gguf_config(str(tmp_path / "l.gguf"))


def test_granitehybrid_layer_kinds_and_mamba_sizes(tmp_path, llama_sd):
    """Granite 4 hybrid files: Mamba-2 layers are those with no key/value heads, sized by llama.cpp's
    state-space keys; attention without rotary embeddings unless rope.scaling.finetuned is set."""
    def extra(w: gguf.GGUFWriter) -> None:
        w.add_ssm_conv_kernel(4)
        w.add_ssm_state_size(8)
        w.add_ssm_group_count(2)
        w.add_ssm_inner_size(2 * HIDDEN)
        w.add_ssm_time_step_rank(8)
        w.add_expert_count(4)
        w.add_expert_used_count(2)
        w.add_expert_shared_feed_forward_length(96)
        w.add_rope_scaling_finetuned(False)

    tensors = {"token_embd.weight": (llama_sd["model.embed_tokens.weight"], None)}
    write_gguf(tmp_path / "g.gguf", tensors, arch="granitehybrid", kv_heads=[0, 2], extra=extra)
    cfg = read_gguf_config(str(tmp_path / "g.gguf"))
    assert cfg.architecture == "granite_moe_hybrid"
    hf = cfg.hf_config
    assert hf["layer_types"] == ["linear_attention", "full_attention"] and hf["num_key_value_heads"] == 2
    assert {k: hf[k] for k in ("mamba_d_conv", "mamba_d_state", "mamba_n_groups", "mamba_n_heads", "mamba_expand",
                               "mamba_d_head", "num_local_experts", "shared_intermediate_size",
                               "position_embedding_type")} == {
        "mamba_d_conv": 4, "mamba_d_state": 8, "mamba_n_groups": 2, "mamba_n_heads": 8, "mamba_expand": 2,
        "mamba_d_head": 2 * HIDDEN // 8, "num_local_experts": 4, "shared_intermediate_size": 96,
        "position_embedding_type": "nope"}


def test_gpt_oss_fixed_clamp_and_window_pattern(tmp_path, llama_sd):
    """gpt-oss files: llama.cpp fixes the clamp at 7.0 and the window on every other layer from the first."""
    def extra(w: gguf.GGUFWriter) -> None:
        w.add_expert_count(4)
        w.add_expert_used_count(2)
        w.add_sliding_window(8)

    write_gguf(tmp_path / "o.gguf", {"token_embd.weight": (llama_sd["model.embed_tokens.weight"], None)},
               arch="gpt-oss", extra=extra)
    cfg = read_gguf_config(str(tmp_path / "o.gguf"))
    assert cfg.architecture == "gpt_oss"
    hf = cfg.hf_config
    assert (hf["swiglu_limit"], hf["num_local_experts"], hf["sliding_window"]) == (7.0, 4, 8)
    assert hf["layer_types"] == ["sliding_attention", "full_attention"]


def test_llama4_sizes_and_what_llama_cpp_fixes(tmp_path, llama_sd):
    """Llama 4 files: feed_forward_length is the dense MLP's, the experts' length transformers'
    intermediate_size; chunks, rope-less layers, query scale and q/k norms are llama.cpp's fixed
    ones. A file whose window is 0 (MobileLLM's switch in llama.cpp) is refused."""
    def extra(window: int | None):
        def add(w: gguf.GGUFWriter) -> None:
            w.add_expert_count(16)
            w.add_expert_used_count(1)
            w.add_expert_feed_forward_length(64)
            w.add_interleave_moe_layer_step(2)
            if window is not None:
                w.add_sliding_window(window)
        return add

    tensors = {"token_embd.weight": (llama_sd["model.embed_tokens.weight"], None)}
    write_gguf(tmp_path / "l4.gguf", tensors, arch="llama4", extra=extra(None))
    cfg = read_gguf_config(str(tmp_path / "l4.gguf"))
    hf = cfg.hf_config
    assert cfg.architecture == "llama4"
    assert (hf["intermediate_size_mlp"], hf["intermediate_size"], hf["num_local_experts"], hf["moe_layers"]) == (
        FFN, 64, 16, [1])
    assert (hf["attention_chunk_size"], hf["floor_scale"], hf["attn_scale"]) == (8192, 8192, 0.1)
    assert hf["no_rope_layers"] == [1, 1] and hf["attn_temperature_tuning"] and hf["use_qk_norm"]

    write_gguf(tmp_path / "mobile.gguf", tensors, arch="llama4", extra=extra(0))
    with pytest.raises(ValueError, match=r"llama4.attention.sliding_window is 0 \(MobileLLM"):
        read_gguf_config(str(tmp_path / "mobile.gguf"))


def _deepseek2(gating: int | None = 2):
    def add(w: gguf.GGUFWriter) -> None:
        _yarn(w)
        w.add_rope_scaling_yarn_log_mul(0.1 * 0.707)  # the converter's 0.1 x mscale_all_dim
        w.add_key_length(32 + 16)  # the latent row and the rotary key
        w.add_value_length(32)
        w.add_key_length_mla(48 + 16)
        w.add_value_length_mla(40)
        w.add_q_lora_rank(24)
        w.add_kv_lora_rank(32)
        w.add_leading_dense_block_count(1)
        w.add_expert_count(4)
        w.add_expert_used_count(2)
        w.add_expert_feed_forward_length(64)
        w.add_expert_shared_count(1)
        w.add_expert_group_count(2)
        w.add_expert_group_used_count(1)
        w.add_expert_weights_scale(2.5)
        w.add_expert_weights_norm(True)
        if gating is not None:
            w.add_expert_gating_func(gguf.ExpertGatingFuncType(gating))
    return add


def test_deepseek2_latent_attention_and_router(tmp_path, llama_sd):
    """DeepSeek-V3 files ("deepseek2"): the heads' sizes from key_length_mla/value_length_mla, the
    router's groups, scale and norm, and YaRN's log multiplier (written as 0.1 x mscale_all_dim, mscale
    taken equal to it); a file whose router is softmax (DeepSeek-V2, or no gating key) is refused."""
    tensors = {"token_embd.weight": (llama_sd["model.embed_tokens.weight"], None)}
    write_gguf(tmp_path / "d.gguf", tensors, arch="deepseek2", head_dim=16, kv_heads=1, extra=_deepseek2())
    cfg = read_gguf_config(str(tmp_path / "d.gguf"))
    hf = cfg.hf_config
    assert cfg.architecture == "deepseek_v3"
    assert {k: hf[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                               "num_key_value_heads", "first_k_dense_replace", "n_routed_experts", "n_shared_experts",
                               "moe_intermediate_size", "n_group", "topk_group", "routed_scaling_factor",
                               "norm_topk_prob")} == {
        "q_lora_rank": 24, "kv_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 48, "v_head_dim": 40,
        "num_key_value_heads": HEADS, "first_k_dense_replace": 1, "n_routed_experts": 4, "n_shared_experts": 1,
        "moe_intermediate_size": 64, "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5,
        "norm_topk_prob": True}
    rope = hf["rope_parameters"]
    assert rope["mscale"] == rope["mscale_all_dim"] == pytest.approx(0.707, abs=1e-6)

    for gating, shown in ((1, r"1 \(softmax\)"), (None, r"missing \(llama.cpp then takes softmax\)")):
        write_gguf(tmp_path / "v2.gguf", tensors, arch="deepseek2", head_dim=16, kv_heads=1, extra=_deepseek2(gating))
        with pytest.raises(ValueError, match=rf"deepseek2.expert_gating_func is {shown}, DeepSeek-V2's router"):
            read_gguf_config(str(tmp_path / "v2.gguf"))


def test_deepseek2_k_b_and_v_b_join_into_kv_b_proj(tmp_path, llama_sd):
    """The converter splits kv_b_proj per head into k_b (each head's block transposed) and v_b;
    the loader gives back the checkpoint's kv_b_proj (which older files hold as it is)."""
    heads, nope, v, rank = HEADS, 48, 40, 32
    kv_b = np.random.default_rng(0).standard_normal((heads * (nope + v), rank)).astype(np.float32)
    k_b, v_b = np.split(kv_b.reshape(heads, nope + v, rank), [nope], axis=1)  # as convert_hf_to_gguf.py does
    tensors = {"token_embd.weight": (llama_sd["model.embed_tokens.weight"], None),
               "blk.0.attn_k_b.weight": (np.ascontiguousarray(k_b.transpose(0, 2, 1)), None),
               "blk.0.attn_v_b.weight": (np.ascontiguousarray(v_b), None)}
    write_gguf(tmp_path / "d.gguf", tensors, arch="deepseek2", head_dim=16, kv_heads=1, extra=_deepseek2())
    weights = dict(iter_gguf_weights(str(tmp_path / "d.gguf")))
    assert sorted(weights) == ["model.embed_tokens.weight", "model.layers.0.self_attn.kv_b_proj.weight"]
    assert torch.equal(weights["model.layers.0.self_attn.kv_b_proj.weight"], torch.from_numpy(kv_b))

    # Files from before the split carry attn_kv_b itself.
    tensors = {"blk.0.attn_kv_b.weight": (kv_b, None)}
    write_gguf(tmp_path / "old.gguf", tensors, arch="deepseek2", head_dim=16, kv_heads=1, extra=_deepseek2())
    (name, weight), = iter_gguf_weights(str(tmp_path / "old.gguf"))
    assert name == "model.layers.0.self_attn.kv_b_proj.weight" and torch.equal(weight, torch.from_numpy(kv_b))


def test_bundled_model_config():
    cfg = read_gguf_config(default_model_path())
    assert cfg.architecture == "llama"
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 9, 3)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.vocab_size) == (576, 1536, 64, 49152)
    assert cfg.tie_word_embeddings and not cfg.attention_bias
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == [2]
    assert cfg.rope_theta == 100000.0 and cfg.rms_norm_eps == 1e-5 and cfg.rope_scaling is None
    assert cfg.max_position_embeddings == 8192


def test_missing_file_raises_file_not_found(tmp_path):
    missing = str(tmp_path / "nope.gguf")
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        read_gguf_config(missing)
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        iter_gguf_weights(missing)


@pytest.fixture(scope="module")
def valid_gguf_bytes(tmp_path_factory, llama_sd) -> bytes:
    path = tmp_path_factory.mktemp("valid") / "valid.gguf"
    write_gguf(path, {k: (v, None) for k, v in stored_layout(llama_sd).items()})
    return path.read_bytes()


@pytest.mark.parametrize("damage", ["empty", "garbage", "header_cut", "data_cut", "bad_magic"])
def test_corrupt_files_raise_value_error_naming_the_file(tmp_path, valid_gguf_bytes, damage):
    data = {
        "empty": b"",
        "garbage": os.urandom(4096),
        "header_cut": valid_gguf_bytes[:200],
        "data_cut": valid_gguf_bytes[: len(valid_gguf_bytes) - 1000],
        "bad_magic": b"GGML" + valid_gguf_bytes[4:],
    }[damage]
    path = tmp_path / f"{damage}.gguf"
    path.write_bytes(data)
    with pytest.raises(ValueError, match=re.escape(str(path))):
        read_gguf_config(str(path))
    with pytest.raises(ValueError, match=re.escape(str(path))):
        list(iter_gguf_weights(str(path)))


def test_unsupported_tensor_type_is_named(tmp_path, llama_sd):
    tensors = {k: (v, None) for k, v in stored_layout(llama_sd).items()}
    tensors["token_embd.weight"] = (np.zeros((VOCAB, HIDDEN), dtype=np.int8), None)  # written as I8
    path = tmp_path / "i8.gguf"
    write_gguf(path, tensors)
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}.*I8"):
        list(iter_gguf_weights(str(path)))


def test_unsupported_architecture_and_unknown_tensor(tmp_path, llama_sd):
    path = tmp_path / "gemma.gguf"
    write_gguf(path, {}, arch="gemma")
    with pytest.raises(ValueError, match="gemma"):
        read_gguf_config(str(path))
    path = tmp_path / "extra.gguf"
    write_gguf(path, {"blk.0.ffn_gate_exps.weight": (np.zeros((2, 32), np.float32), None)})
    with pytest.raises(ValueError, match="ffn_gate_exps"):
        list(iter_gguf_weights(str(path)))


def test_load_model_source_defaults_to_the_bundled_gguf():
    source = load_model_source(None)
    assert source.format == "gguf" and source.path == default_model_path()
    assert source.arch.num_hidden_layers == 30 and source.tokenizer.eos_token_id == 2
    name, tensor = next(source.weights())
    assert name == "model.embed_tokens.weight" and tuple(tensor.shape) == (49152, 576)
    assert load_model_source(default_model_path(), "dummy").weights is None
    assert load_model_source(default_model_path(), "gguf").format == "gguf"


def test_load_model_source_refusals(tmp_path):
    with pytest.raises(ValueError, match="'pt'.*auto, gguf, safetensors, dummy"):
        load_model_source(None, "pt")
    with pytest.raises(ValueError, match="safetensors"):
        load_model_source(default_model_path(), "safetensors")
    with pytest.raises(FileNotFoundError, match="never downloads"):
        load_model_source("SomeOrg/some-model-that-is-not-here")
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        load_model_source(str(tmp_path / "missing.gguf"))
    with pytest.raises(ValueError, match="config.json"):
        load_model_source(str(tmp_path))


def test_k_quant_super_blocks_computed_by_hand():
    """One Q4_K and one Q6_K super-block whose values are worked out by hand from ggml's layout,
    checked against the reference in ggml_k_quants.py (which the next test holds the loader to)."""
    from ggml_k_quants import Q4_K_BYTES, Q6_K_BYTES, dequantize_q4_k_block, dequantize_q6_k_block

    # Q4_K: d = 0.5, dmin = 0.25. Sub-block 0: scale 3, min 2; sub-block 1: scale 5, min 1 (bytes 0-3
    # and 4-7 hold sub-blocks 0-3's scales and mins; 8-11 the low bits of 4-7's, their top bits
    # in the top 2 bits of bytes 0-7). Sub-block 4: scale 1 + (2 << 4) = 33, min 0 + (1 << 4) = 16.
    b = np.zeros(Q4_K_BYTES, dtype=np.uint8)
    b[0:2] = np.array([0.5], dtype=np.float16).view(np.uint8)
    b[2:4] = np.array([0.25], dtype=np.float16).view(np.uint8)
    scales = b[4:16]
    scales[0], scales[4] = 3, 2          # sub-block 0
    scales[1], scales[5] = 5, 1          # sub-block 1
    scales[8] = 1 | (0 << 4)             # sub-block 4: low 4 bits of scale, low 4 bits of min
    scales[0] |= 2 << 6                  # sub-block 4's scale, high 2 bits
    scales[4] |= 1 << 6                  # sub-block 4's min, high 2 bits
    qs = b[16:]
    qs[0] = 7 | (9 << 4)                 # value 0 (sub-block 0, low nibble) and value 32 (sub-block 1)
    qs[64] = 15                          # value 128: sub-block 4, low nibble of the third 32 bytes
    y = dequantize_q4_k_block(b)
    assert y[0] == 0.5 * 3 * 7 - 0.25 * 2      # 10.0
    assert y[32] == 0.5 * 5 * 9 - 0.25 * 1     # 22.25
    assert y[1] == -0.5 and y[33] == -0.25     # quant 0: minus the min
    assert y[128] == 0.5 * 33 * 15 - 0.25 * 16  # 243.5
    # Q6_K: d = 0.25 at the end. Value 0: low 4 bits 5 (ql[0] & 0xF), high 2 bits 2 (qh[0] & 3),
    # so q = 5 + 32 - 32 = 5, scale sc[0] = -3. Value 96: ql[32] >> 4 = 1, (qh[0] >> 6) & 3 = 3,
    # q = 1 + 48 - 32 = 17, scale sc[6] = 4.
    b = np.zeros(Q6_K_BYTES, dtype=np.uint8)
    b[0] = 5
    b[32] = 1 << 4
    b[128] = 2 | (3 << 6)
    sc = b[192:208].view(np.int8)
    sc[0], sc[6] = -3, 4
    b[208:210] = np.array([0.25], dtype=np.float16).view(np.uint8)
    y = dequantize_q6_k_block(b)
    assert y[0] == 0.25 * -3 * 5 and y[96] == 0.25 * 4 * 17
    assert y[1] == 0.25 * -3 * -32            # every quant 0 is -32 after the offset


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_k_quants_load_as_ggml_dequantizes_them(tmp_path, llama_sd, qtype):
    """The loader's K-quant weights equal ggml's own dequantization, written independently of the
    `gguf` package the loader calls (up to float32 rounding of the same products)."""
    from ggml_k_quants import (Q4_K_BYTES, Q6_K_BYTES, dequantize_q4_k_block, dequantize_q6_k_block,
                               dequantize_rows)

    block_bytes, fn = (Q4_K_BYTES, dequantize_q4_k_block) if qtype == Q.Q4_K else (Q6_K_BYTES, dequantize_q6_k_block)
    rng = np.random.default_rng(2)
    stored = {k: encode_as(v, qtype, rng) for k, v in stored_layout(llama_sd).items()}
    path = tmp_path / f"{qtype.name}-ref.gguf"
    write_gguf(path, stored)
    loaded = dict(iter_gguf_weights(str(path)))
    for name in ("model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.k_proj.weight"):
        data, raw = stored[gguf_name(name)]
        assert raw == qtype
        expected = dequantize_rows(data, block_bytes, fn)
        got = loaded[name].numpy()
        if ".k_proj." in name:
            got = rope_permute(got, KV_HEADS)
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=0, err_msg=name)

"""Small random models of every family, saved as Hugging Face directories.

Each exercises what makes its family different, at sizes where a bug would show: windows
shorter than the prompts, soft-caps low enough to bite, norms and biases that are not the
identity, partial rotary, layers without rotary, several experts per token, attention sinks
and expert activations clamped often enough to matter. Weights are drawn
with std 0.3 and norms and biases perturbed, so outputs depend on positions and context
(`assert_sees_context` checks it when a fixture is built)."""
from __future__ import annotations

from pathlib import Path

import torch
import transformers

from tests.conftest import CHAT_TEMPLATE, INIT_STD, _save, write_byte_tokenizer

COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, bos_token_id=0, eos_token_id=1,
              tie_word_embeddings=False, initializer_range=INIT_STD)

# family -> (config class, model class, config overrides)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    # Llama-family checkpoints with biases on q/k/v/o and on the MLP (attention_bias, mlp_bias).
    "llama_biases": ("LlamaConfig", "LlamaForCausalLM", dict(attention_bias=True, mlp_bias=True)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=16)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              dict(head_dim=16, use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(no_rope_layer_interval=2, pad_token_id=0)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    # A window layer, then a full one whose rope is YaRN-scaled; the sliding layer's rope is its
    # own (unscaled, another base).
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM",
              dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                   rope_parameters={"full_attention": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                                                       "original_max_position_embeddings": 64},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}})),
    "granite": ("GraniteConfig", "GraniteForCausalLM",
                dict(embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.3,
                     logits_scaling=2.0)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             dict(partial_rotary_factor=0.5, original_max_position_embeddings=64,
                  rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6],
                                "long_factor": [1.2, 1.9, 2.7, 3.5], "original_max_position_embeddings": 64},
                  pad_token_id=0)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=16, attn_logit_softcapping=5.0,
                    final_logit_softcapping=3.0, tie_word_embeddings=True, pad_token_id=0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(head_dim=16, sliding_window=8, sliding_window_pattern=2, query_pre_attn_scalar=16,
                    rope_scaling={"rope_type": "linear", "factor": 2.0}, tie_word_embeddings=False,
                    pad_token_id=0)),
    # Gemma 4: sliding layers (window 8) of 16-wide heads and full layers of 64-wide ones with one KV
    # head (v from k_proj: attention_k_eq_v) and proportional rope; the last two layers share the K/V
    # of the last earlier layer of their type (and have double-wide MLPs); per-layer embeddings; 4
    # experts (top-2) beside each MLP; a final soft-cap.
    "gemma4": ("Gemma4TextConfig", "Gemma4ForCausalLM",
               dict(head_dim=16, global_head_dim=64, num_global_key_value_heads=1, attention_k_eq_v=True,
                    num_hidden_layers=5, sliding_window=8, num_kv_shared_layers=2, use_double_wide_mlp=True,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
                                 "full_attention"],
                    hidden_size_per_layer_input=8, vocab_size_per_layer_input=320, enable_moe_block=True,
                    num_experts=4, top_k_experts=2, moe_intermediate_size=32, final_logit_softcapping=5.0,
                    tie_word_embeddings=True, pad_token_id=0)),
    # YaRN (a non-trivial attention factor from mscale / mscale_all_dim) and queries scaled up at
    # every 16 positions (original_max_position_embeddings), so each prompt crosses a step; a window.
    "ministral3": ("Ministral3Config", "Ministral3ForCausalLM",
                   dict(head_dim=16, sliding_window=16,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 32.0,
                                         "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
                                         "mscale": 1.0, "mscale_all_dim": 0.5, "llama_4_scaling_beta": 0.3})),
    # A gated attention layer, then Gated DeltaNet layers (4 value heads over 2 key heads).
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM",
                dict(head_dim=16, num_hidden_layers=3, layer_types=["full_attention", "linear_attention",
                                                                    "linear_attention"],
                     linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                     linear_value_head_dim=16, linear_conv_kernel_dim=4, pad_token_id=0)),
    # Qwen3.5's layers with 8 experts (top-2) and a gated shared expert in every layer.
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
                    dict(head_dim=16, num_hidden_layers=3, layer_types=["full_attention", "linear_attention",
                                                                        "linear_attention"],
                         linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                         linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
                         moe_intermediate_size=32, shared_expert_intermediate_size=48, pad_token_id=0)),
    # Granite 4 hybrid: Mamba-2 layers (2 groups) around an attention layer without rotary
    # embeddings, 4 experts (top-2) beside the shared MLP, Granite's multipliers.
    "granite_moe_hybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM",
                           dict(num_hidden_layers=3, layer_types=["attention", "linear_attention", "linear_attention"],
                                mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=8, mamba_d_head=32, mamba_d_conv=4,
                                mamba_expand=2, mamba_chunk_size=16, num_local_experts=4, num_experts_per_tok=2,
                                shared_intermediate_size=96, embedding_multiplier=2.0, residual_multiplier=0.5,
                                attention_multiplier=0.3, logits_scaling=2.0, pad_token_id=0)),
    # An attention layer, then convolution layers; a kernel of 4 (3 inputs of state).
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM",
             dict(num_hidden_layers=3, layer_types=["full_attention", "conv", "conv"], conv_L_cache=4,
                  conv_bias=True, block_auto_adjust_ff_dim=True, block_multiple_of=16, norm_eps=1e-5,
                  pad_token_id=0)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                       norm_topk_prob=True, mlp_only_layers=[1])),
    # A sliding layer then a full one (layer_types' default), YaRN beyond an original context of
    # 64, clamps at 1.5 (the experts' products reach past it often at std 0.3), sinks (see build).
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(head_dim=16, sliding_window=8, num_local_experts=8, num_experts_per_tok=2, intermediate_size=32,
                     swiglu_limit=1.5, pad_token_id=0,
                     rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "beta_fast": 32.0,
                                      "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64})),
    # A chunked RoPE layer (chunks of 8, shorter than the prompts) with q/k L2 norms and a dense
    # MLP, then a global NoPE layer whose queries scale up every 4 positions, with 4 experts
    # (top-1, sigmoid router) beside a shared expert.
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM",
               dict(head_dim=16, attention_chunk_size=8, no_rope_layer_interval=2, interleave_moe_layer_step=2,
                    num_local_experts=4, num_experts_per_tok=1, intermediate_size=32, intermediate_size_mlp=128,
                    attn_temperature_tuning=True, floor_scale=4, attn_scale=0.5, pad_token_id=0,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # Multi-head latent attention (q_lora_rank 48; layers/test_mla.py covers None), YaRN with
    # mscale != mscale_all_dim; a dense layer, then a MoE layer of 4 experts in 2 groups (top-2 from
    # the best group), a shared expert, correction biases drawn in build.
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8,
                         qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_group=2,
                         topk_group=1, moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
                         routed_scaling_factor=2.5, pad_token_id=0,
                         rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                                          "original_max_position_embeddings": 64, "beta_fast": 32.0,
                                          "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.707})),
}


# Image-text checkpoints: name -> (config class, model class, text family, vision config, outer
# config fields). The text model is the family's test model; the vision tower is as small as its
# class allows. Whose tie_word_embeddings counts differs: the outer ones here but Gemma 3's
# disagree with their text config's (False), so a loader that reads the wrong one fails. (Gemma 3's
# test model, tied, echoes itself: see _perturb.)
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=16,
               patch_size=4)
MULTIMODAL = {
    "qwen3_5_vl": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", "qwen3_5",
                   dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, out_hidden_size=64,
                        num_position_embeddings=16), dict(tie_word_embeddings=True)),
    "gemma3_vl": ("Gemma3Config", "Gemma3ForConditionalGeneration", "gemma3", _VISION,
                  dict(tie_word_embeddings=False, mm_tokens_per_image=4)),
    "mistral3_vl": ("Mistral3Config", "Mistral3ForConditionalGeneration", "ministral3", {**_VISION, "head_dim": 16},
                    dict(tie_word_embeddings=True)),
    # Gemma 4's published checkpoints are all of this class (with an audio tower in some, not read either).
    "gemma4_vl": ("Gemma4Config", "Gemma4ForConditionalGeneration", "gemma4",
                  dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=2, head_dim=16, patch_size=4, position_embedding_size=64),
                  dict(tie_word_embeddings=True)),
    # Mistral Small 3.1's text model is a plain Mistral one.
    "mistral3_mistral_vl": ("Mistral3Config", "Mistral3ForConditionalGeneration", "mistral",
                            {**_VISION, "head_dim": 16}, dict(tie_word_embeddings=True)),
    "llama4_vl": ("Llama4Config", "Llama4ForConditionalGeneration", "llama4",
                  {**_VISION, "vision_output_dim": 64, "projector_input_dim": 64, "projector_output_dim": 64},
                  dict(tie_word_embeddings=True)),
}

# The reference in float64 where transformers' own float32 rounding is not far enough below the
# tolerance: on the Qwen3.5 test model its float32 logprobs differ from float64's by up to 7.5e-5
# (the delta rule's chunked solve), while the engine's, in float32, stay within 4e-5 of float64's.
REFERENCE_DTYPE = {"qwen3_5": torch.float64, "qwen3_5_moe": torch.float64}


def build(family: str, path: Path, seed: int = 0, **changes) -> Path:
    """Family `family`'s test model saved in `path`; `changes`: config fields to set besides."""
    config_cls, model_cls, overrides = FAMILIES[family]
    torch.manual_seed(seed)
    cfg = getattr(transformers, config_cls)(**{**COMMON, **overrides, **changes})
    model = getattr(transformers, model_cls)(cfg).eval()
    _perturb(model, family)
    return _save(model, path)


def build_multimodal(name: str, path: Path, seed: int = 0, **changes) -> Path:
    """Image-text checkpoint `name` of MULTIMODAL, its text model the family's test model, saved in
    `path`; `changes`: text config fields to set besides."""
    config_cls, model_cls, family, vision, outer = MULTIMODAL[name]
    text_cls, _, overrides = FAMILIES[family]
    torch.manual_seed(seed)
    text = getattr(transformers, text_cls)(**{**COMMON, **overrides, **changes})
    cfg = getattr(transformers, config_cls)(text_config=text.to_dict(), vision_config=vision,
                                            **{"initializer_range": INIT_STD, **outer})
    model = getattr(transformers, model_cls)(cfg).eval()
    _perturb(model, family)
    return _save(model, path)


def _perturb(model: torch.nn.Module, family: str) -> None:
    hidden_size = model.config.get_text_config().hidden_size
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # transformers starts norms at the identity (1, or 0 for Gemma's 1 + w)
                p.add_(torch.randn_like(p) * 0.3)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.5)
            elif name.endswith(".sinks"):
                # gpt-oss's sink logits: transformers draws them at initializer_range; at std 2 a
                # head's sink takes a visible share of its softmax, more so over few keys.
                p.normal_(0.0, 2.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's router: zeros at init
                b.normal_(0.0, 0.3)
            elif name.endswith("layer_scalar"):  # Gemma 4's: ones at init
                b.uniform_(0.5, 1.5)
        if family.startswith("gemma"):
            # Gemma multiplies embeddings by sqrt(hidden_size) (8 here) and ties its head: at std
            # 0.3 the token's own embedding would swamp the residual stream and the model would
            # echo its input. Scaled back, the blocks' outputs (normalized to ~1) carry the context.
            model.get_input_embeddings().weight.div_(hidden_size ** 0.5)


def build_sentence_transformer(family: str, path: Path, pooling_mode: str, normalize: bool, seed: int = 0):
    """Family `family`'s test model made a sentence-transformers embedding model (Transformer, then
    Pooling in `pooling_mode`, then Normalize if `normalize`) and saved in `path` by
    sentence-transformers itself: a bare decoder (`Qwen3Model`, no head) with modules.json and
    1_Pooling/config.json. Returns the SentenceTransformer, the reference."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    from transformers import PreTrainedTokenizerFast

    decoder = build(family, path / "decoder", seed)
    # Plain text in, as embedding models take it: no chat template (sentence-transformers would render
    # texts through it), and a padding token for its batches.
    (decoder / "chat_template.jinja").unlink(missing_ok=True)
    tok = PreTrainedTokenizerFast.from_pretrained(str(decoder))
    tok.chat_template, tok.pad_token = None, "<unk>"
    tok.save_pretrained(str(decoder))
    transformer = Transformer(str(decoder))
    modules = [transformer, Pooling(transformer.get_embedding_dimension(), pooling_mode=pooling_mode)]
    model = SentenceTransformer(modules=modules + ([Normalize()] if normalize else []), device="cpu")
    model.save(str(path / "st"))
    return SentenceTransformer(str(path / "st"), device="cpu")


def build_cross_encoder(family: str, path: Path, seed: int = 0, num_labels: int = 1, pair_template: bool = False,
                        **changes) -> Path:
    """Family `family`'s test decoder as a cross-encoder (`<Family>ForSequenceClassification`, a
    score head of `num_labels` on the last token that is not padding), saved in `path`, its
    padding token </s> (id 1). `pair_template`: the tokenizer joins a pair as `<s> A </s> B </s>`
    (BERT-like special tokens, the trailing </s> being padding the head must look past); else it
    concatenates the two texts' bytes."""
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    config_cls, model_cls, overrides = FAMILIES[family]
    torch.manual_seed(seed)
    cfg = getattr(transformers, config_cls)(**{**COMMON, **overrides, "num_labels": num_labels, "pad_token_id": 1,
                                               **changes})
    model = getattr(transformers, model_cls.replace("ForCausalLM", "ForSequenceClassification"))(cfg).eval()
    _perturb(model, family)
    model.save_pretrained(path, safe_serialization=True)
    write_byte_tokenizer(path, cfg.vocab_size, CHAT_TEMPLATE)
    # No chat template: sentence-transformers 6 would render the pair through it (query and document
    # roles) instead of joining the two texts as the tokenizer does (docs/embeddings.md).
    (path / "chat_template.jinja").unlink(missing_ok=True)
    tok = PreTrainedTokenizerFast.from_pretrained(str(path))
    tok.chat_template, tok.pad_token = None, "</s>"
    if pair_template:
        tok.backend_tokenizer.post_processor = TemplateProcessing(
            single="<s> $A", pair="<s> $A </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 1)])
    tok.save_pretrained(str(path))
    return path

"""Model directories made on the spot: a byte-level tokenizer and a config.json of any
Llama shape. With load_format="dummy" they give a model of real shape and random
weights, for tests and benchmarks on shapes that have no checkpoint here."""
from __future__ import annotations

import json
from pathlib import Path

DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def write_byte_tokenizer(path: str | Path, vocab_size: int, chat_template: str = DEFAULT_CHAT_TEMPLATE,
                         special_tokens: tuple[str, ...] = ()) -> None:
    """A byte-level BPE with no merges: <s>, </s>, <unk> (ids 0, 1, 2) and the 256 bytes, then
    `special_tokens` (ids 259 on, each one token, as a chat format's markers are: harmony's
    `<|channel|>`). Ids above those exist in the model but never come out of encode."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<s>", "</s>", "<unk>"] + sorted(ByteLevel.alphabet()))}
    if len(vocab) + len(special_tokens) > vocab_size:
        raise ValueError(f"vocab_size must be >= {len(vocab) + len(special_tokens)} for a byte-level tokenizer "
                         f"with {len(special_tokens)} special tokens, got {vocab_size}")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    if special_tokens:
        fast.add_special_tokens({"additional_special_tokens": list(special_tokens)})
    fast.chat_template = chat_template
    fast.save_pretrained(str(path))


LLAMA_SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=320),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=True),
    "llama-3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
}

# The text model of released checkpoints other than Llama: their config.json as it ships, less
# what a random-weight copy has no use for (multi-token-prediction layers, vision tower, the
# real tokenizer's special ids). benchmarks/make_gguf_shape.py writes random weights for them.
CHECKPOINT_SHAPES = {
    # Qwen/Qwen3.5-4B's text_config (transformers 5.25's Qwen3_5TextConfig defaults are the 9B:
    # hidden 4096, intermediate 12288); the 4B keeps its layout (32 layers, every 4th full
    # attention, 16 q / 4 kv heads of 256, Gated DeltaNet with 16 key / 32 value heads of 128)
    # at hidden 2560 and intermediate 9216, with tied embeddings.
    "qwen3.5-4b": dict(
        architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", vocab_size=248320, hidden_size=2560,
        intermediate_size=9216, num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4,
        head_dim=256, full_attention_interval=4, linear_conv_kernel_dim=4, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32, hidden_act="silu",
        rms_norm_eps=1e-6, max_position_embeddings=262144, tie_word_embeddings=True, attn_output_gate=True,
        rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25,
                             mrope_interleaved=True, mrope_section=[11, 11, 10])),
    # openai/gpt-oss-20b's config.json: GptOssConfig's defaults are the 120b (36 layers, 128
    # experts); the 20b has 24 layers and 32 experts, the rest equal. Its experts ship in MXFP4
    # (quantization_config), everything else in bfloat16.
    "gpt-oss-20b": dict(
        architectures=["GptOssForCausalLM"], model_type="gpt_oss", vocab_size=201088, hidden_size=2880,
        intermediate_size=2880, num_hidden_layers=24, num_local_experts=32, num_experts_per_tok=4,
        head_dim=64, num_attention_heads=64, num_key_value_heads=8, sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 12, attention_bias=True, hidden_act="silu",
        swiglu_limit=7.0, rms_norm_eps=1e-5, max_position_embeddings=131072, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0,
                             truncate=False, original_max_position_embeddings=4096),
        quantization_config=dict(quant_method="mxfp4", modules_to_not_convert=[
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"])),
}


def write_dummy_model_dir(path: str | Path, shape: str | dict = "tiny", **overrides) -> str:
    """config.json of a Llama shape (a name from LLAMA_SHAPES or a dict) plus a byte
    tokenizer; load it with load_format="dummy"."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = dict(LLAMA_SHAPES[shape] if isinstance(shape, str) else shape)
    cfg.update(overrides)
    cfg.setdefault("max_position_embeddings", 4096)
    cfg.setdefault("rms_norm_eps", 1e-5)
    cfg.setdefault("rope_theta", 10000.0)
    cfg.setdefault("tie_word_embeddings", False)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
              "bos_token_id": 0, "eos_token_id": 1, **cfg}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    write_byte_tokenizer(path, cfg["vocab_size"])
    return str(path)


def write_random_model_dir(path: str | Path, shape: str | dict = "tiny", std: float = 0.3, seed: int = 0) -> str:
    """A Llama of this shape with random weights saved as safetensors, plus a byte tokenizer.
    std 0.3 (the tests' choice) makes attention sharp, so outputs depend on positions and context;
    transformers' default 0.02 gives almost uniform attention that hides K/V errors."""
    import torch
    import transformers

    path = Path(write_dummy_model_dir(path, shape))
    cfg = transformers.AutoConfig.from_pretrained(str(path), initializer_range=std)
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(str(path), safe_serialization=True)
    return str(path)

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


def write_byte_tokenizer(path: str | Path, vocab_size: int, chat_template: str = DEFAULT_CHAT_TEMPLATE) -> None:
    """A byte-level BPE with no merges: <s>, </s>, <unk> (ids 0, 1, 2) and the 256 bytes.
    Ids above 258 exist in the model but never come out of encode."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<s>", "</s>", "<unk>"] + sorted(ByteLevel.alphabet()))}
    if len(vocab) > vocab_size:
        raise ValueError(f"vocab_size must be >= {len(vocab)} for a byte-level tokenizer, got {vocab_size}")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
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

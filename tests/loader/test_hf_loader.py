"""Hugging Face directories: configs in both transformers spellings, safetensors weights, no pickles."""
from __future__ import annotations

import json
import pickle

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from pagellm.loader.hf_loader import iter_hf_weights, read_hf_config
from pagellm.loader.source import load_model_source

TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)


def save(model: torch.nn.Module, path, **kwargs) -> dict[str, torch.Tensor]:
    model.save_pretrained(path, **kwargs)
    return model.state_dict()


def test_llama_round_trip(tmp_path):
    torch.manual_seed(0)
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}
    config = LlamaConfig(**TINY, rope_parameters=rope, max_position_embeddings=4096, bos_token_id=1,
                         eos_token_id=[2, 3], rms_norm_eps=1e-5)
    sd = save(LlamaForCausalLM(config), tmp_path)
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    generation["eos_token_id"] = [3, 9]  # an end-of-turn token known only to generation_config
    (tmp_path / "generation_config.json").write_text(json.dumps(generation))

    cfg = read_hf_config(str(tmp_path))
    assert cfg.architecture == "llama"
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (300, 64, 128)
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (2, 4, 2, 16)
    assert cfg.rope_theta == 500000.0 and cfg.rms_norm_eps == 1e-5 and cfg.max_position_embeddings == 4096
    assert cfg.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}
    assert not cfg.tie_word_embeddings and not cfg.attention_bias
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == [2, 3, 9]

    loaded = dict(iter_hf_weights(str(tmp_path)))
    assert set(loaded) == set(sd)
    for name, value in sd.items():
        assert torch.equal(loaded[name], value), name


def test_qwen2_sharded_tied_round_trip(tmp_path):
    torch.manual_seed(1)
    config = Qwen2Config(**TINY, tie_word_embeddings=True, eos_token_id=5)
    sd = save(Qwen2ForCausalLM(config).to(torch.bfloat16), tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()

    cfg = read_hf_config(str(tmp_path))
    assert cfg.architecture == "qwen2" and cfg.attention_bias and cfg.tie_word_embeddings
    assert cfg.eos_token_ids == [5] and cfg.rope_scaling is None and cfg.rope_theta == 10000.0

    loaded = dict(iter_hf_weights(str(tmp_path)))
    assert "model.layers.0.self_attn.q_proj.bias" in loaded
    assert set(loaded) == set(sd) - {"lm_head.weight"}  # tied: stored once, as the embedding
    for name, value in loaded.items():
        assert value.dtype == torch.bfloat16  # as stored; converting is the caller's job
        assert torch.equal(value, sd[name]), name


def test_mtp_tensors_are_read_only_when_asked_for(tmp_path):
    """A checkpoint's MTP layer (`mtp.*`, Qwen3.5) is not the model's: plain loading neither yields
    it nor opens a shard holding only it (the index names one that is not there); method 'mtp'
    asks for it."""
    from safetensors.torch import save_file

    save_file({"model.norm.weight": torch.ones(4)}, str(tmp_path / "a.safetensors"))
    weight_map = {"model.norm.weight": "a.safetensors", "mtp.fc.weight": "mtp.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert set(dict(iter_hf_weights(str(tmp_path)))) == {"model.norm.weight"}
    with pytest.raises(FileNotFoundError, match="mtp.safetensors"):
        iter_hf_weights(str(tmp_path), mtp=True)
    save_file({"mtp.fc.weight": torch.ones(4, 8), "mtp.norm.weight": torch.ones(4)}, str(tmp_path / "mtp.safetensors"))
    assert set(dict(iter_hf_weights(str(tmp_path), mtp=True))) == {"model.norm.weight", "mtp.fc.weight",
                                                                   "mtp.norm.weight"}


def write_config(path, **fields) -> None:
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps({**TINY, **fields}))


def test_transformers_v4_rope_spelling(tmp_path):
    write_config(tmp_path, architectures=["LlamaForCausalLM"], rope_theta=1e6,
                 rope_scaling={"type": "linear", "factor": 2.0})
    cfg = read_hf_config(str(tmp_path))
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_mistral_sliding_window_is_read(tmp_path):
    sliding = MistralConfig(**TINY, sliding_window=512, max_position_embeddings=4096)
    MistralForCausalLM(sliding).config.save_pretrained(tmp_path / "swa")
    cfg = read_hf_config(str(tmp_path / "swa"))
    assert cfg.architecture == "mistral" and cfg.hf_config["sliding_window"] == 512
    MistralConfig(**TINY, sliding_window=None).save_pretrained(tmp_path / "full")
    assert read_hf_config(str(tmp_path / "full")).hf_config["sliding_window"] is None


def test_unsupported_architecture_is_named(tmp_path):
    write_config(tmp_path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        read_hf_config(str(tmp_path))


class _Tripwire:
    """Unpickling this creates a file: proof that a pickle was opened."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickled_weights_are_refused_unopened(tmp_path, monkeypatch):
    write_config(tmp_path / "model", architectures=["LlamaForCausalLM"])
    marker = tmp_path / "unpickled"
    (tmp_path / "model" / "pytorch_model.bin").write_bytes(pickle.dumps(_Tripwire(str(marker))))

    def no_torch_load(*args, **kwargs):
        raise AssertionError("torch.load must never be called")

    monkeypatch.setattr(torch, "load", no_torch_load)
    with pytest.raises(ValueError, match="safetensors"):
        iter_hf_weights(str(tmp_path / "model"))
    assert not marker.exists()


def test_shard_outside_the_directory_is_refused(tmp_path):
    write_config(tmp_path / "model", architectures=["LlamaForCausalLM"])
    index = {"weight_map": {"model.norm.weight": "../elsewhere.safetensors"}}
    (tmp_path / "model" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="outside"):
        iter_hf_weights(str(tmp_path / "model"))


def test_load_model_source_reads_an_hf_directory(tmp_path):
    torch.manual_seed(2)
    sd = save(LlamaForCausalLM(LlamaConfig(**TINY, eos_token_id=2)), tmp_path)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["hello world"] * 5, trainers.BpeTrainer(
        vocab_size=280, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))

    source = load_model_source(str(tmp_path))
    assert source.format == "hf" and source.arch.architecture == "llama"
    assert source.tokenizer.eos_token_id == 2
    assert set(dict(source.weights())) == set(sd)
    assert load_model_source(str(tmp_path), "safetensors").format == "hf"
    assert load_model_source(str(tmp_path), "dummy").weights is None
    with pytest.raises(ValueError, match="gguf"):
        load_model_source(str(tmp_path), "gguf")

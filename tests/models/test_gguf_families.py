"""GGUF files made by llama.cpp's own converter load as the Hugging Face model they came from:
for every family llama.cpp converts, the engine serving the GGUF gives transformers' greedy
tokens (on the HF directory) token for token, and logprobs within LOGPROB_ATOL, in fp32.

The converter needs a tokenizer it knows: a byte-level BPE one it recognises by its hash (the
test models carry the bundled SmolLM2 tokenizer and its 49152-token vocabulary), or, for the
families whose converter reads only SentencePiece (Phi-3, Gemma 2), a `tokenizer.model` trained
here with the sentencepiece package. Where llama.cpp represents less than the HF
config can say, the test models stay within what it represents (GGUF_CHANGES), since the GGUF
model is then the model llama.cpp serves."""
from __future__ import annotations

import io
import json
import logging
import os
import random
import shutil

import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as T
from safetensors.torch import load_file, save_file

from pagellm import LLM, SamplingParams
from pagellm.loader.bundled import default_model_path
from pagellm.models.registry import FAMILIES as REGISTRY
from tests.conftest import assert_matches, hf_greedy_logprobs, tokens_and_logprobs
from tests.models.families import REFERENCE_DTYPE, build, build_multimodal
from tests.models.llama_cpp import convert, convert_many, requantize

pytestmark = pytest.mark.slow

# Qwen2: transformers 5 reads a qwen2 directory's tokenizer with Qwen2's own pre-tokenizer, whose
# hash the converter does not know with SmolLM2's vocabulary; its GGUF layout is checked on files
# written in the converter's layout in tests/loader/test_gguf_loader.py.
# Mistral: the converter writes it as "llama", which must serve it exactly (without the window).
GGUF_FAMILIES = sorted([f.name for f in REGISTRY if f.gguf_architectures and f.name != "qwen2"] + ["mistral"])
VOCAB = 49152
GGUF_CHANGES = {
    # No sliding window in llama.cpp's Mistral or Qwen3 (real Mistral 7B v0.3 and Qwen3 have none).
    "mistral": dict(sliding_window=None),
    "qwen3": dict(use_sliding_window=False),
    # llama.cpp fixes SmolLM3's rope-less layers at every fourth and Gemma 3's pattern at five local
    # layers then a global one: enough layers that both kinds are present.
    "smollm3": dict(no_rope_layer_interval=4, num_hidden_layers=4),
    "gemma3": dict(sliding_window_pattern=6, num_hidden_layers=6),
    # llama.cpp's Qwen3-MoE has experts in every layer and always renormalizes.
    "qwen3_moe": dict(mlp_only_layers=[], norm_topk_prob=True),
    # llama.cpp writes OLMo 3 as "olmo2" with its window and layer pattern, and rotates the sliding
    # layers with the full layers' base (unscaled): one base here (real OLMo 3 has one).
    "olmo3": dict(rope_parameters={"full_attention": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                                                      "original_max_position_embeddings": 64},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    # No sliding window in llama.cpp's Mistral 3 (real Ministral 3 has none); it takes YaRN's mscale
    # as 1 (as here) and steps the query scale at the YaRN original context (as transformers).
    "ministral3": dict(sliding_window=None),
    # llama.cpp's LFM2 has no convolution bias (the converter fails on one; real LFM2 has none).
    "lfm2": dict(conv_bias=False),
    # llama.cpp fixes gpt-oss's clamp at 7.0 (real gpt-oss's) and truncates YaRN's correction range
    # (real gpt-oss has truncate false: llama.cpp serves it truncated all the same).
    "gpt_oss": dict(swiglu_limit=7.0,
                    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "truncate": True, "original_max_position_embeddings": 64}),
    # llama.cpp fixes Llama 4's rope-less layer at every fourth, its chunks at 8192 and its query
    # scale's floor and scale at 8192 and 0.1 (real Llama 4's): four layers, so both kinds are present.
    "llama4": dict(no_rope_layer_interval=4, num_hidden_layers=4, attention_chunk_size=8192, floor_scale=8192,
                   attn_scale=0.1),
    # llama.cpp takes DeepSeek's YaRN mscale equal to mscale_all_dim (as in DeepSeek-V2-Lite's 0.707;
    # V3's are both 1); the sigmoid router is written from scoring_func (see hf_model).
    "deepseek_v3": dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                                         "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
                                         "mscale": 0.707, "mscale_all_dim": 0.707}),
}
N_NEW = 12
# A file's quantized matrices served in their blocks against the same file dequantized: float32
# products in another summation order (as in test_gguf_quantized.py).
QUANTIZED_LOGPROB_ATOL = 2e-3
# Families whose converter needs a multi-token-prediction layer (see add_mtp_layer).
MTP = ("qwen3_5", "qwen3_5_moe")
SENTENCEPIECE = ("gemma2", "phi3")
# Families whose converter reads a Llama-style BPE tokenizer.json with byte fallback alone (Gemma 4):
# the SentencePiece model converted by transformers, its 300 pieces the whole vocabulary (the
# converter writes as many embedding rows as the tokenizer has tokens).
LLAMA_BPE = ("gemma4",)
# Phi-3's LongRoPE: short factors within the original context (64), as the HF reference has
# them for these sequences (see test_families.ENGINE_ARGS).
ENGINE_ARGS = {"phi3": {"max_model_len": 64}}


@pytest.fixture(scope="module")
def smollm2_tokenizer(tmp_path_factory):
    """The bundled model's tokenizer as tokenizer.json (transformers reads it out of the GGUF)."""
    path = default_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    out = tmp_path_factory.mktemp("smollm2-tokenizer")
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def sentencepiece_model() -> bytes:
    """A small SentencePiece BPE model (300 pieces, byte fallback), trained on made-up text."""
    import sentencepiece

    rng = random.Random(0)
    words = "the cat sat on a mat and then ran far away to eat one big red apple at home".split()
    lines = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(2000)]
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model, vocab_size=300,
                                             model_type="bpe", byte_fallback=True, unk_id=0, bos_id=1, eos_id=2,
                                             pad_id=-1, minloglevel=2)
    return model.getvalue()


def hf_model(family: str, tmp_path, smollm2_tokenizer, sentencepiece_model) -> tuple:
    """(the HF directory, the vocabulary size) of family's test model."""
    if family in LLAMA_BPE:
        vocab = 300
        model_dir = build(family, tmp_path / family, vocab_size=vocab, vocab_size_per_layer_input=vocab,
                          **GGUF_CHANGES.get(family, {}))
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (model_dir / name).unlink()
        (model_dir / "tokenizer.model").write_bytes(sentencepiece_model)
        (model_dir / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
        transformers.AutoTokenizer.from_pretrained(model_dir).save_pretrained(model_dir)
        (model_dir / "tokenizer.model").unlink()
    elif family in SENTENCEPIECE:
        model_dir, vocab = build(family, tmp_path / family, **GGUF_CHANGES.get(family, {})), 320
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (model_dir / name).unlink()
        (model_dir / "tokenizer.model").write_bytes(sentencepiece_model)
    else:
        model_dir, vocab = build(family, tmp_path / family, vocab_size=VOCAB, **GGUF_CHANGES.get(family, {})), VOCAB
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(smollm2_tokenizer / name, model_dir / name)
    if family in MTP:
        add_mtp_layer(model_dir)
    if family == "granite_moe_hybrid":
        granite_layer_types_as_published(model_dir)
    if family == "deepseek_v3":
        deepseek_scoring_func_as_published(model_dir)
    return model_dir, vocab


def granite_layer_types_as_published(model_dir) -> None:
    """Granite 4's config.json as IBM publishes it: layer_types "attention" and "mamba" (what the
    converter looks for), where transformers 5 saves "full_attention" and "linear_attention" (with
    which the converter would take every layer for a Mamba-2 one)."""
    config = json.loads((model_dir / "config.json").read_text())
    config["layer_types"] = ["attention" if t == "full_attention" else "mamba" for t in config["layer_types"]]
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))


def deepseek_scoring_func_as_published(model_dir) -> None:
    """DeepSeek-V3's config.json as DeepSeek publishes it, with scoring_func "sigmoid" (transformers 5
    fixes the sigmoid in code and does not save it): the converter writes the router's gate from it,
    and without it llama.cpp takes DeepSeek-V2's softmax."""
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "scoring_func": "sigmoid"}, indent=2))


def add_mtp_layer(model_dir) -> None:
    """A multi-token-prediction layer (`mtp.*`, as Qwen3.5's checkpoints have; transformers ignores
    it): the converter refuses a Qwen3.5 directory without one, and writes it after the model's
    layers (`nextn_predict_layers`), where the loader must leave it out."""
    path = model_dir / "model.safetensors"
    weights = load_file(path)
    hidden = weights["model.norm.weight"].shape[0]
    mtp = {"mtp." + k.removeprefix("model."): v.clone() for k, v in weights.items() if k.startswith("model.layers.0.")}
    mtp["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden) * 0.3
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{norm}.weight"] = torch.randn(hidden) * 0.3
    save_file({**weights, **mtp}, path, metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}, indent=2))


@pytest.fixture(scope="module")
def conversions(tmp_path_factory, smollm2_tokenizer, sentencepiece_model) -> dict:
    """family -> (HF directory, its GGUF conversion or the converter's error, vocabulary size); all
    families converted by one converter process."""
    tmp = tmp_path_factory.mktemp("gguf-families")
    models = {f: hf_model(f, tmp, smollm2_tokenizer, sentencepiece_model) for f in GGUF_FAMILIES}
    jobs = [(model_dir, tmp / f"{f}.gguf") for f, (model_dir, _) in models.items()]
    errors = convert_many(jobs)
    return {f: (model_dir, errors[out] or out, vocab) for (f, (model_dir, vocab)), (_, out) in zip(models.items(), jobs)}


@pytest.mark.parametrize("family", GGUF_FAMILIES)
def test_converted_gguf_matches_transformers(family, conversions):
    model_dir, gguf_path, vocab = conversions[family]
    if isinstance(gguf_path, str):
        raise AssertionError(f"convert_hf_to_gguf.py failed on {family}:\n{gguf_path}")

    # Experts multiplied one by one ("eager"): transformers' grouped products take no float64.
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=REFERENCE_DTYPE.get(family, torch.float32),
                                                           attn_implementation="eager",
                                                           experts_implementation="eager").eval()
    rng = random.Random(1)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (5, 17, 30)]
    expected = [hf_greedy_logprobs(hf, p, N_NEW) for p in prompts]

    llm = LLM(str(gguf_path), num_kv_blocks=64, block_size=8, **ENGINE_ARGS.get(family, {}))
    # The converter writes Mistral as Llama. (Read from the engine: parsing a GGUF's metadata again
    # takes seconds with a 49k-token vocabulary.)
    assert llm.engine.arch.architecture == ("llama" if family == "mistral" else family)
    params = SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_matches(tokens_and_logprobs(outs), expected)


def test_gpt_oss_mxfp4_experts_are_served_in_blocks(conversions, tmp_path, caplog):
    """OpenAI's gpt-oss GGUF files keep the experts in MXFP4. Such a file (the test model's experts
    quantized by gguf-py's own MXFP4 quantizer) keeps them in their blocks, with no warning of
    dequantized types, and serves what the same file dequantized serves: with float32 products the
    same tokens and logprobs (summation order aside), with the default int8x2 activations the same
    tokens."""
    _, gguf_path, vocab = conversions["gpt_oss"]
    if isinstance(gguf_path, str):
        raise AssertionError(f"convert_hf_to_gguf.py failed on gpt_oss:\n{gguf_path}")
    mxfp4 = requantize(gguf_path, tmp_path / "mxfp4.gguf", lambda name: T.MXFP4 if "_exps.weight" in name else None)
    with caplog.at_level(logging.WARNING):
        llm = LLM(str(mxfp4), num_kv_blocks=64, block_size=8, activation_quantization="none")
    assert not [r for r in caplog.records if "no quantized kernel" in r.getMessage()]
    experts = llm.engine.runner.model.layers[0].mlp.experts
    assert experts.block_types == {"w13": int(T.MXFP4), "w2": int(T.MXFP4)} and experts.w13.dtype == torch.uint8
    rng = random.Random(2)
    prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(n)]} for n in (6, 19)]
    params = SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True, logprobs=0)
    expected = tokens_and_logprobs(LLM(str(mxfp4), num_kv_blocks=64, block_size=8, quantization="none")
                                   .generate(prompts, params, use_tqdm=False))
    assert_matches(tokens_and_logprobs(llm.generate(prompts, params, use_tqdm=False)), expected)
    int8x2 = LLM(str(mxfp4), num_kv_blocks=64, block_size=8)  # activation_quantization auto
    assert int8x2.engine.runner.model.layers[0].mlp.experts.activations in ("int8x2", "none")
    got = tokens_and_logprobs(int8x2.generate(prompts, params, use_tqdm=False))
    assert [t for t, _ in got] == [t for t, _ in expected]


def test_qwen35_quantized_delta_rule_layers(conversions, tmp_path):
    """A Qwen3.5 file whose delta-rule matrices are Q8_0: the value-head rows go back to the
    checkpoint's order block row by block row, out_proj (whose columns take the value heads in the
    converter's tiled order) stays in its blocks with its columns as they are, and the engine serves
    what it serves from the same file dequantized (summation order aside)."""
    _, gguf_path, vocab = conversions["qwen3_5"]
    if isinstance(gguf_path, str):
        raise AssertionError(f"convert_hf_to_gguf.py failed on qwen3_5:\n{gguf_path}")
    delta_rule = ("attn_qkv", "attn_gate", "ssm_out")
    q8 = requantize(gguf_path, tmp_path / "q8.gguf", lambda name: T.Q8_0 if name.split(".")[-2] in delta_rule else None)
    llm = LLM(str(q8), num_kv_blocks=64, block_size=8)
    delta_rule = llm.engine.runner.model.layers[1].linear_attn
    assert delta_rule.tiled  # 4 value heads over 2 key heads
    assert int(T.Q8_0) in delta_rule.in_proj.segment_types  # served in their blocks
    assert delta_rule.out_proj.segment_types == [int(T.Q8_0)]
    _assert_serves_as_dequantized(llm, q8, vocab, seed=3)


def test_qwen35_mtp_layer_in_a_gguf_file_is_refused_for_speculation(conversions):
    """The converter keeps Qwen3.5's MTP layer as the block after the stack (nextn_predict_layers);
    the loader serves the file without it, and method 'mtp' is refused with what the converter did
    and what to serve instead."""
    _, gguf_path, _ = conversions["qwen3_5"]
    if isinstance(gguf_path, str):
        raise AssertionError(f"convert_hf_to_gguf.py failed on qwen3_5:\n{gguf_path}")
    from gguf import GGUFReader

    assert GGUFReader(gguf_path).fields["qwen35.nextn_predict_layers"].contents() == 1
    with pytest.raises(ValueError, match="llama.cpp's converter keeps Qwen3.5's MTP layer .*serve the Hugging Face"):
        LLM(str(gguf_path), num_kv_blocks=16, speculative_config={"method": "mtp", "num_speculative_tokens": 2})


def test_llama4_image_text_checkpoint_converts_to_its_text_model(smollm2_tokenizer, tmp_path):
    """Llama 4's published checkpoints are Llama4ForConditionalGeneration: the converter writes their
    text model as a `llama4` file (the vision tower goes to a separate mmproj file only with --mmproj),
    which serves what the image-text model gives on text."""
    model_dir = build_multimodal("llama4_vl", tmp_path / "llama4_vl", vocab_size=VOCAB, **GGUF_CHANGES["llama4"])
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_tokenizer / name, model_dir / name)
    gguf_path = convert(model_dir, tmp_path / "llama4_vl.gguf")
    hf = transformers.Llama4ForConditionalGeneration.from_pretrained(model_dir, attn_implementation="eager").eval()
    rng = random.Random(4)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (6, 19)]
    expected = [hf_greedy_logprobs(hf, p, N_NEW) for p in prompts]
    llm = LLM(str(gguf_path), num_kv_blocks=64, block_size=8)
    assert llm.engine.arch.architecture == "llama4"
    params = SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_matches(tokens_and_logprobs(outs), expected)


@pytest.mark.parametrize("family", ["llama4", "deepseek_v3"])
def test_q8_0_matrices_match_the_dequantized_file(family, conversions, tmp_path):
    """The file with its matrices Q8_0 (those whose rows are whole blocks; the experts, 3-D, are
    dequantized at load), as real files ship them: matrices served in their blocks (Llama 4's q/k
    rows reordered as runs of blocks, latent attention's projections) give what the same file
    dequantized gives, summation order aside. Activations stay float32, so the blocks are all that
    differs."""
    _, gguf_path, vocab = conversions[family]
    if isinstance(gguf_path, str):
        raise AssertionError(f"convert_hf_to_gguf.py failed on {family}:\n{gguf_path}")
    q8 = requantize(gguf_path, tmp_path / "q8.gguf", lambda name: None if name == "token_embd.weight" else T.Q8_0)
    llm = LLM(str(q8), num_kv_blocks=64, block_size=8, activation_quantization="none")
    assert any(int(T.Q8_0) in getattr(m, "segment_types", ()) for m in llm.engine.runner.model.modules())
    _assert_serves_as_dequantized(llm, q8, vocab, seed=5)


def _assert_serves_as_dequantized(llm: LLM, path, vocab: int, seed: int) -> None:
    """`llm` (serving `path` in its blocks) gives the greedy tokens of the same file dequantized on
    two prompts, and logprobs within QUANTIZED_LOGPROB_ATOL (summation order aside)."""
    rng = random.Random(seed)
    prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(n)]} for n in (6, 19)]
    params = SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True, logprobs=0)
    expected = tokens_and_logprobs(LLM(str(path), num_kv_blocks=64, block_size=8, quantization="none")
                                   .generate(prompts, params, use_tqdm=False))
    got = tokens_and_logprobs(llm.generate(prompts, params, use_tqdm=False))
    assert [t for t, _ in got] == [t for t, _ in expected]
    for (_, lps), (_, want) in zip(got, expected):
        assert lps == pytest.approx(want, abs=QUANTIZED_LOGPROB_ATOL)

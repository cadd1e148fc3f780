"""Tokenizers must give transformers' exact ids, and chat templates must stay inside the sandbox."""
from __future__ import annotations

import json
import os

import gguf
import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer

from pagellm.loader.bundled import default_model_path
from pagellm.loader.tokenizer import Tokenizer

TEXTS = [
    "Hello world",
    " leading space and  double  spaces",
    "Héllo wörld, ça va? Привет, 世界",
    "emoji 😀👍🏽 and numbers 1234567",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "<s>hello</s> world",
    "line\n\n\ttabbed\r\nend",
    "",
]
MESSAGES = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "Danke schön 😀"},
]


def assert_same_as_transformers(ours: Tokenizer, theirs) -> None:
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == theirs.encode(text, add_special_tokens=special), (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    assert ours.bos_token_id == theirs.bos_token_id
    assert ours.eos_token_id == theirs.eos_token_id
    assert ours.vocab_size == len(theirs)
    assert set(theirs.all_special_ids) <= ours.all_special_ids


@pytest.fixture(scope="module")
def bundled() -> tuple[Tokenizer, object]:
    path = default_model_path()
    theirs = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    return Tokenizer.from_gguf(path), theirs


def test_bundled_gguf_matches_transformers(bundled):
    ours, theirs = bundled
    assert_same_as_transformers(ours, theirs)
    # SmolLM2's metadata says add_bos_token=false, so no BOS even with special tokens on.
    assert ours.encode("Hello world")[0] != ours.bos_token_id
    assert ours.eos_token_id == 2 and ours.id_to_token(2) == "<|im_end|>"


def test_bundled_chat_template(bundled):
    ours, theirs = bundled
    prompt = ours.apply_chat_template(MESSAGES)
    assert prompt.startswith("<|im_start|>system\n")
    assert "<|im_start|>user\nDanke schön 😀<|im_end|>\n" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    assert prompt == theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert not ours.apply_chat_template(MESSAGES, add_generation_prompt=False).endswith("assistant\n")


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__ }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{% set x = [] %}{{ x.append(1) }}",
    "{{ messages[0].update({'role': 'system'}) }}",
    "{% set ns = namespace() %}{% set ns._secret = 1 %}{{ ns._secret }}",
    "{{ raise_exception('bad conversation') }}",
    "{% for m in messages %}",  # syntax error
])
def test_hostile_or_broken_templates_raise_value_error(bundled, template):
    backend = bundled[0]._backend
    tok = Tokenizer(backend, special_tokens={"eos_token": "<|im_end|>"}, chat_template=template)
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="chat template"):
        tok.apply_chat_template(messages)
    assert messages == [{"role": "user", "content": "hi"}]


def test_template_helpers_and_missing_template(bundled):
    backend = bundled[0]._backend
    template = "{{ bos_token }}{{ messages | tojson }}{% if add_generation_prompt %}>{% endif %}{{ extra }}"
    tok = Tokenizer(backend, special_tokens={"bos_token": "<|im_start|>"}, chat_template=template)
    assert tok.apply_chat_template([{"role": "user", "content": "é", "name": None}], extra="!") == (
        '<|im_start|>[{"role": "user", "content": "é"}]>!'
    )
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(backend).apply_chat_template(MESSAGES)


# Tiny tokenizers shaped like the real families, trained on the spot.

CORPUS = [
    "the quick brown fox jumps over the lazy dog", "Héllo wörld ünïcode Привет 世界", "emoji 😀 test 1234567",
    "def f(x): return x * 2", "hello world, hello there", "line\n\n\ttabbed",
] * 20
CHAT = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
SPECIAL = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]


def train_sentencepiece_style() -> BackendTokenizer:
    """Llama 2 layout: byte-fallback BPE on '▁'-joined text, BOS added by the post-processor."""
    tok = BackendTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    bytes_ = [f"<0x{i:02X}>" for i in range(256)]
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=420, special_tokens=SPECIAL + bytes_))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    return tok


def train_byte_level(bos: bool) -> BackendTokenizer:
    """Llama 3 (bos=True) / Qwen2 (bos=False) layout: byte-level BPE."""
    tok = BackendTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=420, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", 1)])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


HF_STYLES = {
    "llama2": (train_sentencepiece_style, {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>",
                                          "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True,
                                          "legacy": False}, "llama"),
    "llama3": (lambda: train_byte_level(True), {"tokenizer_class": "PreTrainedTokenizerFast",
                                               "bos_token": "<s>", "eos_token": "</s>"}, "llama"),
    "qwen2": (lambda: train_byte_level(False), {"tokenizer_class": "Qwen2Tokenizer", "bos_token": None,
                                               "eos_token": "<|im_end|>", "pad_token": "<unk>"}, "qwen2"),
}


@pytest.mark.parametrize("style", list(HF_STYLES))
def test_hf_dir_matches_auto_tokenizer(tmp_path, style):
    train, tokenizer_config, model_type = HF_STYLES[style]
    train().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (tmp_path / "chat_template.jinja").write_text(CHAT)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    ours, theirs = Tokenizer.from_hf_dir(str(tmp_path)), AutoTokenizer.from_pretrained(str(tmp_path))
    assert_same_as_transformers(ours, theirs)
    assert ours.apply_chat_template(MESSAGES) == theirs.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True)
    if style == "qwen2":
        assert ours.bos_token_id is None
    else:
        assert ours.encode("hello")[0] == ours.bos_token_id == 1


def test_sentencepiece_gguf_adds_bos_like_transformers(tmp_path):
    """A 'llama' (sentencepiece) GGUF without add_bos_token metadata gets BOS, as in transformers."""
    backend = train_sentencepiece_style()
    vocab = backend.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    types = [2 if t == "<unk>" else 3 if t in SPECIAL else 6 if t.startswith("<0x") else 1 for t in tokens]
    merges = [" ".join(pair) for pair in json.loads(backend.to_str())["model"]["merges"]]
    w = gguf.GGUFWriter(str(tmp_path / "spm.gguf"), "llama")
    for add, value in ((w.add_block_count, 1), (w.add_context_length, 128), (w.add_embedding_length, 64),
                       (w.add_feed_forward_length, 128), (w.add_head_count, 4), (w.add_head_count_kv, 4)):
        add(value)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([-float(i) for i in range(len(tokens))])
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours = Tokenizer.from_gguf(str(tmp_path / "spm.gguf"))
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    assert_same_as_transformers(ours, theirs)
    assert ours.encode("hello")[0] == 1


def test_missing_and_corrupt_sources(tmp_path):
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_gguf(str(tmp_path / "missing.gguf"))
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_hf_dir(str(tmp_path))
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="junk.gguf"):
        Tokenizer.from_gguf(str(tmp_path / "junk.gguf"))


@pytest.mark.parametrize("final", ["The answer is", "The answer is ", "  spaced out  "])
def test_continue_final_message_matches_transformers(bundled, final):
    ours, theirs = bundled
    messages = [*MESSAGES, {"role": "assistant", "content": final}]
    got = ours.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    assert got == theirs.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert got.endswith(final)  # the template keeps the spacing, so the text is kept as it is
    with pytest.raises(ValueError, match="cannot both be set"):
        ours.apply_chat_template(messages, add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(ValueError, match="text content"):
        ours.apply_chat_template([*MESSAGES, {"role": "assistant", "content": ""}], add_generation_prompt=False,
                                 continue_final_message=True)


def test_hf_dir_with_only_a_sentencepiece_model(tmp_path):
    """Many Llama 2 and Mistral folders ship tokenizer.model and no tokenizer.json: transformers'
    converter builds the fast pipeline, with the same ids as AutoTokenizer."""
    import io
    import random

    import sentencepiece

    rng = random.Random(0)
    words = "the cat sat on a mat and then ran far away to eat one big red apple at home".split()
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(" ".join(rng.choice(words) for _ in range(12)) for _ in range(2000)),
        model_writer=model, vocab_size=300, model_type="bpe", byte_fallback=True, unk_id=0, bos_id=1, eos_id=2,
        pad_id=-1, minloglevel=2)
    (tmp_path / "tokenizer.model").write_bytes(model.getvalue())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    ours, theirs = Tokenizer.from_hf_dir(str(tmp_path)), AutoTokenizer.from_pretrained(str(tmp_path))
    assert_same_as_transformers(ours, theirs)
    ids = ours.encode("the big cat ran home, naïvely")  # byte fallback for what it never saw
    assert ours.decode(ids) == "the big cat ran home, naïvely" and ids == theirs.encode("the big cat ran home, naïvely")

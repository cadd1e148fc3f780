"""Image-text checkpoints served as their text model: greedy tokens equal the
ForConditionalGeneration model's own (on text-only input) and each logprob within
LOGPROB_ATOL, in fp32; their vision weights are never read."""
from __future__ import annotations

import json
import logging

import pytest
import torch
import transformers
from safetensors import safe_open

from pagellm import LLM, SamplingParams
from pagellm.loader.hf_loader import iter_hf_weights, read_hf_config
from pagellm.models.registry import FAMILIES
from tests.conftest import assert_matches, hf_greedy_logprobs, tokens_and_logprobs
from tests.models.families import MULTIMODAL, build_multimodal
from tests.models.families import REFERENCE_DTYPE
from tests.models.test_families import _gen, _prompts

# The text families' own tests cover their exactness at length; these check loading and naming.
N_NEW = 8


@pytest.mark.parametrize("name", sorted(MULTIMODAL))
def test_text_model_matches_transformers(name, tmp_path):
    _, model_cls, family, _, _ = MULTIMODAL[name]
    path = str(build_multimodal(name, tmp_path / name))
    hf = getattr(transformers, model_cls).from_pretrained(path, dtype=REFERENCE_DTYPE.get(family, torch.float32),
                                                          attn_implementation="eager").eval()
    prompts = _prompts(3, [6, 19])
    expected = [hf_greedy_logprobs(hf, p, N_NEW) for p in prompts]
    assert read_hf_config(path).architecture == family
    greedy = SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True, logprobs=0)
    assert_matches(tokens_and_logprobs(_gen(LLM(path, num_kv_blocks=256), prompts, greedy)), expected)


def test_vision_weights_are_never_read(tmp_path, caplog):
    """Only the text model's tensors come out, named as the family names them; a shard holding
    only vision weights is never opened (here it is not even a safetensors file any more)."""
    path = build_multimodal("gemma3_vl", tmp_path / "gemma3")
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(path)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    sharded = tmp_path / "sharded"
    weight_map = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    text = {k for k in weight_map if k.startswith("language_model.")}
    vision_only = set(weight_map.values()) - {weight_map[k] for k in text}
    assert vision_only, "the test needs a shard that holds only vision weights"
    for shard in vision_only:
        (sharded / shard).write_bytes(b"not read")
    for other in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (path / other).exists() and not (sharded / other).exists():
            (sharded / other).write_bytes((path / other).read_bytes())

    with caplog.at_level(logging.INFO, logger="pagellm.loader.hf_loader"):
        arch = read_hf_config(str(sharded))
    assert arch.architecture == "gemma3" and not arch.tie_word_embeddings
    assert "image inputs are not served" in caplog.text
    loaded = dict(iter_hf_weights(str(sharded)))
    renamed = {k.replace("language_model.model.", "model.").replace("language_model.lm_head.", "lm_head."): k
               for k in text}
    assert "lm_head.weight" in renamed and sorted(loaded) == sorted(renamed)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for name, stored in renamed.items():
            assert torch.equal(loaded[name], f.get_tensor(stored)), name


def test_unserved_text_model_is_named(tmp_path):
    config = {"architectures": ["Mistral3ForConditionalGeneration"], "model_type": "mistral3",
              "text_config": {"model_type": "starcoder2"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"Mistral3ForConditionalGeneration is served as its text model, but its "
                                         r"text_config's model_type 'starcoder2' is not a supported family "
                                         rf"\(supported: llama, .*{FAMILIES[-1].model_types[-1]}\)"):
        read_hf_config(str(tmp_path))

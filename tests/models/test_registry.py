"""The registry is the one list of supported architectures: README's table, both loaders and
the errors for an unknown architecture all follow it."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pagellm.loader.hf_loader import read_hf_config
from pagellm.models.registry import FAMILIES, family_for_gguf, family_for_hf, model_class

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_rows() -> dict[str, list[str]]:
    text = README.read_text()
    table = text[text.index("<!-- families-table"):text.index("<!-- end families-table -->")]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in table.splitlines()[1:]
            if line.startswith("|")]
    return {row[0]: row for row in rows[2:]}  # past the header and its rule


def test_readme_table_lists_exactly_the_registry():
    rows = readme_rows()
    assert list(rows) == [f.name for f in FAMILIES]
    for family in FAMILIES:
        row = rows[family.name]
        assert row[1] == ", ".join(family.hf_architectures)
        # "yes (`arch`, ...)" for the GGUF architectures that load as this family.
        assert row[3].startswith("yes") == bool(family.gguf_architectures), family.name
        if family.gguf_architectures:
            assert re.findall(r"`([\w-]+)`", row[3]) == list(family.gguf_architectures), family.name


def test_every_family_has_its_class():
    for family in FAMILIES:
        assert model_class(family.name).__name__ == family.cls


def test_cross_encoders_with_a_score_head_are_refused_naming_why(tmp_path):
    """A Mistral sequence-classification checkpoint (a cross-encoder reranker, one label; its head is
    loaded for Qwen3 and Llama only) as transformers saves its config: refused at load, naming the
    architecture, the head and what to serve for rerank instead, not served as a causal LM (its bare
    decoder would load and score wrongly)."""
    import transformers

    transformers.MistralConfig(num_labels=1, architectures=["MistralForSequenceClassification"]).save_pretrained(
        tmp_path)
    with pytest.raises(ValueError, match=r"MistralForSequenceClassification is a sequence-classification model "
                                         r"\(a cross-encoder, 1 label from a score head.*loads classification "
                                         r"heads only for Qwen3ForSequenceClassification, "
                                         r"LlamaForSequenceClassification.*classifier_from_token"):
        read_hf_config(str(tmp_path))


def test_unknown_architectures_name_what_is_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FalconForCausalLM"]}))
    with pytest.raises(ValueError, match=r"'FalconForCausalLM' is not supported \(supported: LlamaForCausalLM, .*"
                                         r"GptOssForCausalLM, Llama4ForCausalLM, DeepseekV3ForCausalLM, "
                                         r"Qwen3_5ForConditionalGeneration, .*"
                                         r"Llama4ForConditionalGeneration\)"):
        read_hf_config(str(tmp_path))
    with pytest.raises(ValueError, match=r"'falcon' is not supported \(supported: .*qwen3moe"):
        family_for_gguf("falcon", "x.gguf")
    with pytest.raises(ValueError, match="'qwen3' with experts is not supported"):
        family_for_gguf("qwen3", "x.gguf", experts=True)
    assert family_for_gguf("llama", "x.gguf", experts=True).name == "mixtral"
    # llama.cpp writes OLMo 3 as "olmo2": its sliding layers tell it apart; Gemma's come as they are.
    assert family_for_gguf("olmo2", "x.gguf").name == "olmo2"
    assert family_for_gguf("olmo2", "x.gguf", sliding=True).name == "olmo3"
    assert family_for_gguf("gemma3", "x.gguf", sliding=True).name == "gemma3"
    # Granite 4 hybrids come with experts or without (a dense one): one family either way.
    assert family_for_gguf("granitehybrid", "x.gguf", experts=True).name == "granite_moe_hybrid"
    assert family_for_gguf("granitehybrid", "x.gguf").name == "granite_moe_hybrid"
    # Gemma 4's files all have sliding layers, its 26B-A4B experts besides.
    assert family_for_gguf("gemma4", "x.gguf", sliding=True).name == "gemma4"
    assert family_for_gguf("gemma4", "x.gguf", experts=True, sliding=True).name == "gemma4"
    assert family_for_gguf("gpt-oss", "x.gguf", experts=True, sliding=True).name == "gpt_oss"
    assert family_for_hf({"model_type": "gemma3_text"}, "config.json").name == "gemma3"

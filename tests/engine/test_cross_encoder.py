"""Cross-encoders with a score head (Qwen3/LlamaForSequenceClassification) through LLM.score,
against sentence-transformers' CrossEncoder on the same small random models: the pair joined as
the tokenizer joins two texts (plain bytes on Qwen3; `<s> A </s> B </s>` on Llama, whose trailing
</s> is padding the head looks past), one label, CrossEncoder's sigmoid."""
from __future__ import annotations

import json

import pytest

from pagellm import LLM
from tests.models.families import build_cross_encoder

# fp32 scores agree with CrossEncoder's this closely (measured: at most 4e-7 on these models); a
# wrong token, position or pair format moves them by 1e-2 and more.
ATOL = 1e-5
QUERY = "what is on the mat"
DOCS = ["a cat on a mat", "x", "dogs </s>", "the mat holds a sleeping cat and more words than that one"]


@pytest.mark.parametrize("family,template", [("qwen3", False), ("llama", True)])
def test_scores_match_sentence_transformers_cross_encoder(tmp_path, family, template):
    from sentence_transformers import CrossEncoder

    path = build_cross_encoder(family, tmp_path, pair_template=template)
    want = CrossEncoder(str(path), device="cpu").predict([(QUERY, d) for d in DOCS], batch_size=2)
    llm = LLM(str(path), num_kv_blocks=32, max_model_len=128, max_num_batched_tokens=16)
    got = [o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)]
    assert got == pytest.approx([float(w) for w in want], abs=ATOL)
    assert len({round(s, 4) for s in got}) == len(DOCS)  # the documents score apart
    if template:  # the tokenizer's pair markup, the padding after the document dropped
        assert llm.score_head.pair_ids(llm.get_tokenizer(), "ab", "c") == [0, 67, 68, 1, 69]


def test_raw_logits_when_the_config_says_identity_and_two_labels_refused(tmp_path):
    import transformers

    path = build_cross_encoder("qwen3", tmp_path / "identity")
    config = json.loads((path / "config.json").read_text())
    config["sentence_transformers"] = {"activation_fn": "torch.nn.modules.linear.Identity"}
    (path / "config.json").write_text(json.dumps(config))
    llm = LLM(str(path), num_kv_blocks=16, max_model_len=64)
    got = llm.score(QUERY, DOCS[0], use_tqdm=False)[0].outputs.score
    model = transformers.AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    ids = llm.get_tokenizer().encode_pair(QUERY, DOCS[0])
    import torch
    with torch.no_grad():
        assert got == pytest.approx(model(torch.tensor([ids])).logits[0, 0].item(), abs=ATOL)
    two = LLM(str(build_cross_encoder("llama", tmp_path / "two", num_labels=2)), num_kv_blocks=16, max_model_len=64)
    with pytest.raises(ValueError, match="has 2 labels; rerank and score need a cross-encoder with num_labels 1"):
        two.score(QUERY, DOCS, use_tqdm=False)

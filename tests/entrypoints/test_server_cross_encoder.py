"""/v1/rerank (Cohere's shape, through httpx) and /score through `pagellm serve` of a small random
Llama cross-encoder (LlamaForSequenceClassification, one label, a pair template): scores as
sentence-transformers' CrossEncoder gives them, ranked; a two-label cross-encoder refused with a
400 naming the count; generation refused naming what the model serves."""
from __future__ import annotations

import httpx
import pytest

from server_utils import RemoteServer, check_rerank
from tests.engine.test_cross_encoder import ATOL, DOCS, QUERY
from tests.models.families import build_cross_encoder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_cross_encoder("llama", tmp_path_factory.mktemp("xenc-llama"), pair_template=True)


@pytest.fixture(scope="module")
def server(model_dir):
    server = RemoteServer([str(model_dir), "--served-model-name", "xenc", "--max-model-len", "96",
                           "--num-kv-blocks", "32", "--max-num-batched-tokens", "16"])
    yield server
    server.close()


def test_rerank_and_score_match_cross_encoder(model_dir, server):
    from sentence_transformers import CrossEncoder

    want = [float(s) for s in CrossEncoder(str(model_dir), device="cpu").predict([(QUERY, d) for d in DOCS])]
    check_rerank(server.url, "xenc", QUERY, DOCS, want, 3, ATOL)
    s = httpx.post(server.url + "/score", json={"model": "xenc", "text_1": QUERY, "text_2": DOCS}, timeout=60)
    assert [d["score"] for d in s.json()["data"]] == pytest.approx(want, abs=ATOL)
    pairwise = httpx.post(server.url + "/v1/score", json={"text_1": [QUERY, QUERY], "text_2": DOCS[:2]}, timeout=60)
    assert [d["score"] for d in pairwise.json()["data"]] == pytest.approx(want[:2], abs=ATOL)

    for path, body, param, words in [
            ("/v1/rerank", {"query": QUERY, "documents": ["word " * 20]}, "documents", "maximum context length is 96"),
            ("/v1/rerank", {"query": QUERY, "documents": []}, "documents", "documents must not be empty"),
            ("/v1/completions", {"prompt": "hi", "max_tokens": 2}, None, "serves scores (rerank, score) and embeddings"),
    ]:
        r = httpx.post(server.url + path, json={"model": "xenc", **body}, timeout=60)
        assert r.status_code == 400, r.text
        assert words in r.json()["error"]["message"] and (param is None or r.json()["error"]["param"] == param), r.text
    server.wait_all_blocks_free()


@pytest.mark.slow  # a server of its own; LLM.score's refusal is in the fast suite (tests/engine)
def test_two_labels_are_refused_for_rerank(tmp_path):
    path = build_cross_encoder("qwen3", tmp_path, num_labels=2)
    server = RemoteServer([str(path), "--max-model-len", "64", "--num-kv-blocks", "16"])
    try:
        r = httpx.post(server.url + "/v1/rerank", json={"query": QUERY, "documents": DOCS}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
        assert "has 2 labels; rerank and score need a cross-encoder with num_labels 1" in r.json()["error"]["message"]
    finally:
        server.close()

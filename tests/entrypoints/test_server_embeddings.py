"""POST /v1/embeddings through the official openai client against `pagellm serve` of a small
random Qwen3 embedding model that sentence-transformers saved (last-token pooling, normalized):
vectors as sentence-transformers gives them, base64 and float, every input shape, and every
refusal a 400 naming the field."""
from __future__ import annotations

import asyncio
import re

import httpx
import openai
import pytest
import torch

from server_utils import RemoteServer, check_rerank
from tests.engine.test_embeddings import ATOL, texts
from tests.models.families import build_sentence_transformer

MAX_MODEL_LEN = 128
INPUTS = texts(3, [3, 20, 45, 100])


@pytest.fixture(scope="module")
def st_and_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("st-qwen3-server")
    st = build_sentence_transformer("qwen3", path, "lasttoken", normalize=True)
    # Prefill chunks of 32 tokens: the longer inputs take several steps, batched with the others.
    server = RemoteServer([str(path / "st"), "--served-model-name", "emb", "--max-model-len", str(MAX_MODEL_LEN),
                           "--num-kv-blocks", "64", "--max-num-batched-tokens", "32"])
    yield st, server
    server.close()


def reference(st, inputs: list[str]) -> torch.Tensor:
    return st.encode(inputs, convert_to_tensor=True, batch_size=len(inputs))


def assert_close(got: list[list[float]], want: torch.Tensor) -> None:
    got_t = torch.tensor(got)
    assert got_t.shape == want.shape
    assert (got_t - want).abs().max().item() <= ATOL


def test_openai_client_matches_sentence_transformers(st_and_server):
    """The client's default (base64) and float agree with sentence-transformers; usage counts the
    inputs' tokens; token-id inputs embed as their text does."""
    st, server = st_and_server
    client = server.client()
    want = reference(st, INPUTS)
    res = client.embeddings.create(model="emb", input=INPUTS, user="someone")
    assert [d.index for d in res.data] == [0, 1, 2, 3] and res.model == "emb"
    assert_close([d.embedding for d in res.data], want)
    ids = [st.tokenizer(t)["input_ids"] for t in INPUTS]
    assert res.usage.prompt_tokens == res.usage.total_tokens == sum(map(len, ids))
    floats = client.embeddings.create(model="emb", input=INPUTS[1], encoding_format="float")
    assert_close([floats.data[0].embedding], want[1:2])
    by_ids = client.embeddings.create(model="emb", input=ids)
    assert_close([d.embedding for d in by_ids.data], want)
    one_list = client.embeddings.create(model="emb", input=ids[2])
    assert_close([one_list.data[0].embedding], want[2:3])
    server.wait_all_blocks_free()


def test_concurrent_requests_batch_together(st_and_server):
    st, server = st_and_server
    client = server.async_client()

    async def all_at_once():
        return await asyncio.gather(*(client.embeddings.create(model="emb", input=t) for t in INPUTS))

    results = asyncio.run(all_at_once())
    assert_close([r.data[0].embedding for r in results], reference(st, INPUTS))
    server.wait_all_blocks_free()


@pytest.mark.parametrize("body, param, message", [
    ({"dimensions": 8}, "dimensions", "dimensions is not supported .* not a Matryoshka model"),
    ({"dimensions": 0}, "dimensions", "dimensions must be an integer >= 1, got 0"),
    ({"encoding_format": "int8"}, "encoding_format", "encoding_format must be one of float, base64, got 'int8'"),
    ({"input": []}, "input", "input must not be empty"),
    ({"input": [5] * (MAX_MODEL_LEN + 1)}, "input", f"maximum context length is {MAX_MODEL_LEN} tokens. However, "
                                                     f"input 0 has {MAX_MODEL_LEN + 1} tokens"),
    ({"input": [[5], [400]]}, "input", r"contains 400, outside the vocabulary \[0, 320\)"),
    ({"normalize": False}, "normalize", "normalize is not supported: it is not a parameter this server knows"),
    ({"model": "other"}, "model", "The model `other` does not exist"),
])
def test_refusals_name_the_field(st_and_server, body, param, message):
    _, server = st_and_server
    r = httpx.post(server.url + "/v1/embeddings", json={"model": "emb", "input": "hi", **body}, timeout=30)
    assert r.status_code == (404 if param == "model" else 400), r.text
    error = r.json()["error"]
    assert error["param"] == param
    assert re.search(message, error["message"]), error["message"]


def test_truncation_and_generation_refused(st_and_server):
    """truncate_prompt_tokens keeps an over-long input's last tokens; this model has no head, so a
    completion is a 400 that says so; nothing stays in the pool."""
    st, server = st_and_server
    client = server.client()
    ids = st.tokenizer(texts(4, [MAX_MODEL_LEN + 20])[0])["input_ids"]
    res = client.embeddings.create(model="emb", input=ids, extra_body={"truncate_prompt_tokens": MAX_MODEL_LEN})
    assert res.usage.prompt_tokens == MAX_MODEL_LEN
    with torch.no_grad():
        hidden = st[0].auto_model(torch.tensor([ids[-MAX_MODEL_LEN:]])).last_hidden_state[0, -1]
    assert_close([res.data[0].embedding], torch.nn.functional.normalize(hidden, dim=-1)[None])
    with pytest.raises(openai.BadRequestError, match="no language-model head .* embeddings only"):
        client.completions.create(model="emb", prompt="hello", max_tokens=2)
    server.wait_all_blocks_free()


def test_rerank_and_score_are_cosines_of_the_embeddings(st_and_server):
    """/rerank (vLLM's, Jina's and Cohere's shape) and /score (vLLM's): the cosine of the texts'
    sentence-transformers embeddings, ranked and cut to top_n; bounds and shapes a 400 naming the field."""
    st, server = st_and_server
    query, docs = INPUTS[0], INPUTS[1:]
    want = reference(st, [query] + docs)
    cos = [float(torch.nn.functional.cosine_similarity(want[0], want[1 + i], dim=0)) for i in range(len(docs))]
    order = sorted(range(len(docs)), key=lambda i: -cos[i])
    results = check_rerank(server.url, "emb", query, docs, cos, 2, ATOL)
    assert [x["document"]["text"] for x in results] == [docs[i] for i in order[:2]]
    bare = httpx.post(server.url + "/rerank", json={"query": query, "documents": [{"text": d} for d in docs],
                                                    "return_documents": False}, timeout=60).json()["results"]
    assert [x["index"] for x in bare] == order and all("document" not in x for x in bare)

    s = httpx.post(server.url + "/score", json={"model": "emb", "text_1": query, "text_2": docs}, timeout=60).json()
    assert [d["index"] for d in s["data"]] == [0, 1, 2]
    assert all(abs(d["score"] - cos[d["index"]]) <= ATOL for d in s["data"])
    pairwise = httpx.post(server.url + "/v1/score", json={"text_1": docs[:2], "text_2": docs[1:]}, timeout=60).json()
    assert abs(pairwise["data"][1]["score"] - float(torch.nn.functional.cosine_similarity(want[2], want[3], dim=0))) \
        <= ATOL

    for path, body, param, words in [
            ("/v1/rerank", {"query": "q", "documents": []}, "documents", "documents must not be empty"),
            ("/v1/rerank", {"query": "q", "documents": ["d"] * 1001}, "documents", "at most 1000"),
            ("/v1/rerank", {"query": "q", "documents": ["d"], "top_n": -1}, "top_n", "top_n must be an integer >= 0"),
            ("/v1/rerank", {"query": "q", "documents": [{"txt": "d"}]}, "documents[0]", "documents[0] must be"),
            ("/v1/rerank", {"query": "q", "documents": ["d"], "rank_fields": ["a"]}, "rank_fields", "not supported"),
            ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2", "1:1, 1:N or N:N"),
    ]:
        r = httpx.post(server.url + path, json={"model": "emb", **body}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert words in r.json()["error"]["message"], r.text
    server.wait_all_blocks_free()

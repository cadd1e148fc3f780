"""Embeddings (pooling requests) against sentence-transformers on the same small random models:
last-token pooling on Qwen3 (sliding-window layers, normalized) and mean pooling on Llama (not
normalized), inputs of several lengths batched, chunked, preempted and taken from the prefix
cache; and beside generation in the same steps."""
from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.pooling_params import PoolingParams
from tests.models.families import build_sentence_transformer

# fp32 embeddings agree with sentence-transformers' this closely (the order of sums differs;
# measured: at most 4e-7 on these models); a position or pooling bug moves them by 1e-2 and more.
ATOL = 1e-5


def texts(seed: int, lengths: list[int]) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice("abcdefghij klmnop") for _ in range(n)) for n in lengths]


# Short ones batched together, and two longer than a prefill chunk (32 tokens below).
TEXTS = texts(0, [1, 5, 17, 40, 90])


@pytest.fixture(scope="module")
def qwen3_last(tmp_path_factory):
    path = tmp_path_factory.mktemp("st-qwen3")
    return build_sentence_transformer("qwen3", path, "lasttoken", normalize=True), path


@pytest.fixture(scope="module")
def llama_mean(tmp_path_factory):
    path = tmp_path_factory.mktemp("st-llama")
    return build_sentence_transformer("llama", path, "mean", normalize=False), path


def assert_close(got: list[list[float]], want: torch.Tensor) -> None:
    got_t = torch.tensor(got)
    assert got_t.shape == want.shape
    assert (got_t - want).abs().max().item() <= ATOL
    assert torch.nn.functional.cosine_similarity(got_t, want).min().item() >= 1 - 1e-6


def vectors(outs) -> list[list[float]]:
    return [o.outputs.embedding for o in outs]


def test_last_token_matches_sentence_transformers(qwen3_last):
    """Normalized last-token embeddings, batched and in chunks of 32 tokens; the same again from
    the prefix cache; the blocks all free afterwards. Per request: MEAN pooling of the same model."""
    st, path = qwen3_last
    llm = LLM(str(path / "st"), max_num_batched_tokens=32, num_kv_blocks=64)
    assert llm.engine.pooler_config.pooling_type == "LAST" and llm.engine.pooler_config.normalize
    want = st.encode(TEXTS, convert_to_tensor=True, batch_size=len(TEXTS))
    outs = llm.embed(TEXTS, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [st.tokenizer(t)["input_ids"] for t in TEXTS]
    assert_close(vectors(outs), want)
    hits = llm.stats()["prefix_cache_hits"]
    assert_close(vectors(llm.embed(TEXTS, use_tqdm=False)), want)
    assert llm.stats()["prefix_cache_hits"] > hits  # the second round's prompts came from the cache
    assert llm.stats()["used_blocks"] == 0

    with torch.no_grad():
        features = st[0].auto_model(torch.tensor([st.tokenizer(TEXTS[-1])["input_ids"]])).last_hidden_state[0]
    mean = llm.embed(TEXTS[-1], PoolingParams(pooling_type="MEAN", normalize=False), use_tqdm=False)
    assert_close(vectors(mean), features.mean(0, keepdim=True))
    first = llm.embed(TEXTS[-1], PoolingParams(pooling_type="CLS", normalize=False), use_tqdm=False)
    assert_close(vectors(first), features[:1])


def test_mean_matches_sentence_transformers(llama_mean):
    """Mean pooling without normalization (no Normalize module), batched and chunked; twice (the
    mean takes nothing from the prefix cache, whose blocks would skip rows it needs)."""
    st, path = llama_mean
    llm = LLM(str(path / "st"), max_num_batched_tokens=32, num_kv_blocks=64)
    config = llm.engine.pooler_config
    assert (config.pooling_type, config.normalize) == ("MEAN", False)
    want = st.encode(TEXTS, convert_to_tensor=True, batch_size=len(TEXTS))
    assert want.norm(dim=-1).min() > 1.5  # not unit vectors: normalization really is off
    for _ in range(2):
        assert_close(vectors(llm.embed(TEXTS, use_tqdm=False)), want)
    assert llm.stats()["used_blocks"] == 0


def test_embeddings_beside_generation(llama_mean):
    """Embedding and generation requests in the same steps, in a pool the generation grows to fill:
    the embeddings' prefills are preempted and computed again. Each request gets what it gets alone.
    (The decoder sentence-transformers was made from: the same weights with their head.)"""
    st, path = llama_mean
    llm = LLM(str(path / "decoder"), max_num_batched_tokens=32, block_size=1, num_kv_blocks=150,
              pooler_config={"pooling_type": "MEAN", "normalize": False})
    engine = llm.engine
    # A long prompt first: the embeddings' prefills do not fit beside it as it grows to 145 tokens.
    prompt, params = texts(2, [100])[0], SamplingParams(temperature=0, max_tokens=45, ignore_eos=True)
    alone = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    inputs = texts(1, [90, 70, 80, 60])
    engine.add_request("gen", prompt, params)
    for i, text in enumerate(inputs):
        engine.add_pooling_request(f"emb{i}", text)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.error is None
            if out.finished:
                done[out.request_id] = out
    assert llm.stats()["num_preemptions"] > 0
    assert done["gen"].outputs[0].token_ids == alone and done["gen"].embedding is None
    assert_close([done[f"emb{i}"].embedding for i in range(len(inputs))],
                 st.encode(inputs, convert_to_tensor=True, batch_size=len(inputs)))
    assert not done["emb0"].outputs and llm.stats()["used_blocks"] == 0


def test_matryoshka_and_refusals(qwen3_last, tmp_path):
    """dimensions only where config.json says the model is Matryoshka (then cut, then normalized);
    an input longer than max_model_len, and generation on a bare decoder, refused by name."""
    st, path = qwen3_last
    llm = LLM(str(path / "st"), num_kv_blocks=16, max_model_len=64)
    with pytest.raises(ValueError, match="dimensions is not supported .* not a Matryoshka model"):
        llm.embed("hello", PoolingParams(dimensions=8), use_tqdm=False)
    with pytest.raises(ValueError, match="the input has 65 tokens; max_model_len is 64"):
        llm.embed([5] * 65, use_tqdm=False)
    # The whole context: an embedding generates no token.
    assert len(llm.embed([5] * 64, use_tqdm=False)[0].outputs.embedding) == 64
    with pytest.raises(ValueError, match="no language-model head .*Qwen3Model.* embeddings only"):
        llm.generate("hello", use_tqdm=False)
    assert llm.stats()["used_blocks"] == 0

    matryoshka = tmp_path / "matryoshka"
    shutil.copytree(path / "st", matryoshka)
    config = json.loads((matryoshka / "config.json").read_text())
    (matryoshka / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [16, 32]}))
    llm = LLM(str(matryoshka), num_kv_blocks=16, pooler_config={"pooling_type": "MEAN"})
    assert llm.engine.pooler_config.pooling_type == "MEAN"  # --pooler-config over 1_Pooling's lasttoken
    got = llm.embed(TEXTS[:3], PoolingParams(dimensions=16, pooling_type="LAST"), use_tqdm=False)
    want = st.encode(TEXTS[:3], convert_to_tensor=True, truncate_dim=16)
    assert_close(vectors(got), torch.nn.functional.normalize(want, dim=-1))
    with pytest.raises(ValueError, match=r"dimensions must be one of \[16, 32\]"):
        llm.embed("hello", PoolingParams(dimensions=8), use_tqdm=False)


def test_llm_score_is_the_cosine_of_llm_embed(qwen3_last):
    """LLM.score pairs as vLLM's (1:N, N:N) and scores the cosine of LLM.embed's vectors."""
    from pagellm.entrypoints.scoring import cosine

    _, path = qwen3_last
    llm = LLM(str(path / "st"), num_kv_blocks=16, max_model_len=64)
    a, b, c = texts(5, [4, 9, 13])
    vectors = [o.outputs.embedding for o in llm.embed([a, b, c], use_tqdm=False)]
    one_to_n = [o.outputs.score for o in llm.score(a, [b, c], use_tqdm=False)]
    # (Embedded again, the texts' prefixes come from the cache: equal within float32 rounding.)
    assert one_to_n == pytest.approx([cosine(vectors[0], vectors[1]), cosine(vectors[0], vectors[2])], abs=1e-6)
    assert [o.outputs.score for o in llm.score([a, b], [c, c], use_tqdm=False)] == \
        pytest.approx([cosine(vectors[0], vectors[2]), cosine(vectors[1], vectors[2])], abs=1e-6)
    with pytest.raises(ValueError, match="1:1, 1:N or N:N"):
        llm.score([a, b], [a, b, c])


def test_llm_score_as_a_yes_no_reranker_matches_transformers(tiny_llama_dir):
    """classifier_from_token ["n", "y"]: a pair's score is softmax over the two words' logits after
    the query's tokens then the document's, as transformers computes them on the same weights."""
    import transformers

    llm = LLM(tiny_llama_dir, num_kv_blocks=32, max_model_len=128, classifier_from_token=["n", "y"])
    tok = llm.get_tokenizer()
    query, docs = "is it so? ", ["yes it is", "no idea at all"]
    got = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32).eval()
    no, yes = (tok.encode(w, add_special_tokens=False)[0] for w in ("n", "y"))
    want = []
    for doc in docs:
        ids = tok.encode(query) + tok.encode(doc, add_special_tokens=False)
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        want.append(float(torch.softmax(logits[[no, yes]], dim=0)[1]))
    assert got == pytest.approx(want, abs=1e-5)
    assert len(set(round(s, 6) for s in got)) == 2  # the documents score apart
    from pagellm.entrypoints.scoring import classifier_token_ids

    with pytest.raises(ValueError, match="classifier_from_token must be words of one token each; 'no' is 2 tokens"):
        classifier_token_ids(["no", "yes"], lambda w: tok.encode(w, add_special_tokens=False))

"""Speculative decoding with the target's own MTP layer (method "mtp", DeepSeek-V3's
num_nextn_predict_layers): the layer's forward equals a plain-torch reference written here from its
weights (transformers' DeepseekV3DecoderLayer for the decoder block it wraps); its first proposal
is the reference's prediction from transformers' own hidden states of the target (so the runner
hands it the right states, paired with the right tokens); greedy output with it is plain decoding's
token for token, batched, in prefill chunks and under preemption; and what it cannot serve is
refused, naming what is missing or why.

transformers saves DeepSeek-V3 without its MTP layer, so the test checkpoint gets one written into
its safetensors file under the released names (`model.layers.2.*` after its 2 layers): the decoder
block is layer 2 of a 3-layer transformers model of the same family (attention, experts, router
bias), beside `enorm`, `hnorm` and `shared_head.norm` [hidden] and `eh_proj` [hidden, 2 * hidden],
and the copies of the embedding and head that DeepSeek's checkpoints store there too (not read:
pagellm uses the target's).
"""
from __future__ import annotations

import json
import logging
import random
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RotaryEmbedding

from pagellm import LLM, SamplingParams
from tests.engine.mtp_checks import (check_sampled_requests_keep_the_targets_logprobs, check_two_ranks_propose_as_one,
                                     forward_in_two_chunks)
from tests.models.families import COMMON, FAMILIES, _perturb, build

N_NEW = 16
K = 3
MTP = {"method": "mtp", "num_speculative_tokens": K, "disable_by_batch_size": 16}
LAYER = COMMON["num_hidden_layers"]  # the MTP layer's index in the checkpoint


def _three_layer_config() -> transformers.DeepseekV3Config:
    _, _, overrides = FAMILIES["deepseek_v3"]
    cfg = transformers.DeepseekV3Config(**{**COMMON, **overrides, "num_hidden_layers": LAYER + 1})
    cfg._attn_implementation = "eager"
    return cfg


def add_mtp_layer(model_dir) -> dict[str, torch.Tensor]:
    """Write an MTP layer into the checkpoint (see the module); returns its tensors."""
    torch.manual_seed(7)
    donor = transformers.DeepseekV3ForCausalLM(_three_layer_config()).eval()
    _perturb(donor, "deepseek_v3")
    block = f"model.layers.{LAYER}."
    state = {k: v.detach().clone() for k, v in donor.state_dict().items() if k.startswith(block)}
    path = model_dir / "model.safetensors"
    weights = load_file(str(path))
    hidden = COMMON["hidden_size"]
    g = torch.Generator().manual_seed(8)
    for name in ("enorm", "hnorm", "shared_head.norm"):
        state[f"{block}{name}.weight"] = 1 + 0.3 * torch.randn(hidden, generator=g)
    state[f"{block}eh_proj.weight"] = 0.1 * torch.randn(hidden, 2 * hidden, generator=g)
    state[f"{block}embed_tokens.weight"] = weights["model.embed_tokens.weight"].clone()
    state[f"{block}shared_head.head.weight"] = weights["lm_head.weight"].clone()
    save_file({**weights, **state}, str(path), metadata={"format": "pt"})
    return {**weights, **state}


def _requests() -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(5)
    return [([rng.randrange(3, 320) for _ in range(n)],
             SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True)) for n in [1, 6, 19, 33, 9]]


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    """(checkpoint dir with an MTP layer, its tensors, requests, plain greedy outputs). Its random MTP
    layer's proposals are all rejected (every proposal rolled back)."""
    path = build("deepseek_v3", tmp_path_factory.mktemp("ds_mtp"), num_nextn_predict_layers=1)
    weights = add_mtp_layer(path)
    requests = _requests()
    plain = _run(LLM(str(path), num_kv_blocks=256, block_size=4), requests)
    return path, weights, requests, plain


@pytest.fixture(scope="module")
def coin(ds, tmp_path_factory):
    """(the same checkpoint with a head of two tokens, requests, plain greedy outputs): every row of
    lm_head zero but token 5's, so the target and its MTP layer (which shares the head) both pick 5
    or 0 by the sign of one product, and agree about half the time: proposals accepted whole, in
    part and not at all."""
    path, weights, requests, _ = ds
    coin = tmp_path_factory.mktemp("ds_mtp_coin")
    shutil.copytree(path, coin, dirs_exist_ok=True)
    head = torch.zeros_like(weights["lm_head.weight"])
    head[5] = weights["lm_head.weight"][5]
    save_file({**weights, "lm_head.weight": head}, str(coin / "model.safetensors"), metadata={"format": "pt"})
    return coin, requests, _run(LLM(str(coin), num_kv_blocks=256, block_size=4), requests)


def _run(llm: LLM, requests) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in requests], [s for _, s in requests], use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def reference_mtp(weights: dict[str, torch.Tensor], next_tokens: list[int], hidden: torch.Tensor, start: int = 0):
    """The MTP layer over positions start .. (each reading `hidden` of that position and the token
    after it) as released: embedding zeroed at position 0, enorm / hnorm, [embedding, hidden] through
    eh_proj, the decoder block, shared_head.norm and the head. Returns (block outputs, logits)."""
    cfg = _three_layer_config()
    eps = cfg.rms_norm_eps
    w = {k.removeprefix(f"model.layers.{LAYER}."): v for k, v in weights.items()}
    positions = torch.arange(start, start + len(next_tokens))
    emb = weights["model.embed_tokens.weight"][torch.tensor(next_tokens)]
    emb = torch.where((positions == 0)[:, None], torch.zeros_like(emb), emb)
    x = torch.cat([_rms(emb, w["enorm.weight"], eps), _rms(hidden, w["hnorm.weight"], eps)], -1) @ w["eh_proj.weight"].T
    layer = DeepseekV3DecoderLayer(cfg, LAYER).eval()
    layer.load_state_dict({k: v for k, v in w.items() if k.split(".")[0] in ("self_attn", "mlp", "input_layernorm",
                                                                            "post_attention_layernorm")})
    cos, sin = DeepseekV3RotaryEmbedding(cfg)(x[None], positions[None])
    n = len(next_tokens)
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        out = layer(x[None], attention_mask=mask, position_ids=positions[None], position_embeddings=(cos, sin))
        out = out[0] if isinstance(out, torch.Tensor) else out[0][0]
        logits = _rms(out, w["shared_head.norm.weight"], eps) @ weights["lm_head.weight"].T
    return out, logits


def _proposer(llm: LLM):
    return llm.engine.executor.driver.proposer


def test_mtp_layer_forward_equals_the_reference_in_chunks(ds):
    path, weights, _, _ = ds
    llm = LLM(str(path), num_kv_blocks=16, block_size=4, speculative_config=MTP)
    runner, tokens, hidden, got = forward_in_two_chunks(llm, COMMON["hidden_size"])
    want, want_logits = reference_mtp(weights, tokens, hidden)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(runner.model.compute_logits(got), want_logits, rtol=1e-4, atol=1e-4)


def test_first_proposal_is_the_reference_prediction_from_the_targets_hidden_states(ds):
    path, weights, requests, plain = ds
    prompt = requests[3][0]
    llm = LLM(str(path), num_kv_blocks=64, block_size=4, speculative_config=dict(MTP, num_speculative_tokens=1))
    proposals = []
    proposer = _proposer(llm)
    propose_for = proposer.propose_for
    proposer.propose_for = lambda queries: proposals.append(propose_for(queries)) or proposals[-1]
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                 use_tqdm=False)
    target = transformers.AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32).eval()
    first = plain[3][0]
    with torch.no_grad():
        hidden = target.model(torch.tensor([prompt])).last_hidden_state[0]  # after the final norm
    _, logits = reference_mtp(weights, prompt[1:] + [first], hidden)
    assert proposals[0][0].token_ids == [int(logits[-1].argmax())]


SETUPS = {
    "batched": dict(num_kv_blocks=256, block_size=4),
    "chunked": dict(num_kv_blocks=256, block_size=4, max_num_batched_tokens=8),  # prompts prefilled in chunks
    "preempted": dict(num_kv_blocks=24, block_size=4),  # too few blocks for all at once: preemption by recompute
}
FAST = {("coin", "batched"), ("coin", "chunked"), ("coin", "preempted"), ("random", "batched")}


@pytest.mark.parametrize("which, name", [
    pytest.param(which, name, id=f"{which}-{name}", marks=() if (which, name) in FAST else pytest.mark.slow)
    for which in ("coin", "random") for name in SETUPS])
def test_greedy_with_mtp_equals_plain_decoding(ds, coin, which, name):
    path, requests, plain = coin if which == "coin" else (ds[0], ds[2], ds[3])
    llm = LLM(str(path), speculative_config=MTP, **SETUPS[name])
    assert _run(llm, requests) == plain
    stats = llm.stats()["spec_decode"]
    assert stats["num_drafts"] > 0 and stats["num_draft_tokens"] > stats["num_accepted_tokens"]
    if which == "coin":  # runs accepted in part, some past a chained proposal
        accepted = stats["accepted_per_position"]
        assert accepted[0] > accepted[1] > 0
    proposer = _proposer(llm)
    assert proposer.seqs == {}
    proposer.kv.check_integrity()
    assert proposer.kv.num_used_blocks == 0 and llm.stats()["used_blocks"] == 0


def test_under_tensor_parallelism_the_layer_proposes_as_on_one_rank(coin):
    path, requests, plain = coin
    check_two_ranks_propose_as_one(path, requests, MTP, plain)


def test_sampled_requests_keep_the_targets_logprobs(coin):
    """Seeded samples over three tokens, their proposals drawn from the layer's distribution and
    verified by rejection sampling against it: some accepted, every token reported with the
    target's logprob given the tokens before it (scored again by the plain engine as a prompt), and
    the same text again from the same seeds (no prefix cache: a hit would silence the layer and
    draw other proposals)."""
    path, requests, _ = coin
    check_sampled_requests_keep_the_targets_logprobs(path, requests, MTP, N_NEW)


def test_the_kv_split_names_the_mtp_layer(ds, caplog):
    """The MTP layer's cache takes its share of a byte budget as a draft model's does; the start-up
    line says whose share it is."""
    with caplog.at_level(logging.INFO, logger="pagellm.engine"):
        LLM(str(ds[0]), kv_cache_memory=1 << 20, block_size=4, speculative_config=MTP)
    lines = [r.message for r in caplog.records if "split between them" in r.message]
    assert len(lines) == 1 and "MTP layer" in lines[0] and "draft model" not in lines[0]


def test_checkpoints_without_mtp_layers_are_refused(ds, tmp_path, tiny_llama_dir):
    path, weights, _, _ = ds
    bare = tmp_path / "bare"
    shutil.copytree(path, bare)
    save_file({k: v for k, v in weights.items() if not k.startswith(f"model.layers.{LAYER}.")},
              str(bare / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"weights lack model\.layers\.2\.enorm\.weight.*transformers saves"):
        LLM(str(bare), num_kv_blocks=16, speculative_config=MTP)
    config = json.loads((bare / "config.json").read_text())
    (bare / "config.json").write_text(json.dumps(dict(config, num_nextn_predict_layers=0)))
    with pytest.raises(ValueError, match="num_nextn_predict_layers is 0: this checkpoint has no MTP layer"):
        LLM(str(bare), num_kv_blocks=16, speculative_config=MTP)
    with pytest.raises(ValueError, match="this family has no multi-token-prediction layers"):
        LLM(tiny_llama_dir, num_kv_blocks=16, speculative_config=MTP)
    with pytest.raises(ValueError, match="a GGUF file carries no MTP layer"):
        LLM(None, num_kv_blocks=16, speculative_config=MTP)  # the bundled GGUF

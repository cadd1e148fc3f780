"""Speculative decoding with Qwen3.5's own MTP layer (method "mtp", `mtp.*`): the layer's forward
equals a plain-torch reference written here from its weights (transformers' decoder layer for the
block it wraps, dense and with experts); its first proposals (a chain of three) are the
reference's chain from transformers' own hidden states of the target; greedy output with it is
plain decoding's token for token, batched, in prefill chunks, under preemption and from an
image-text checkpoint, with no block held after; sampled requests keep the target's logprobs and
their seeds' text; and what it cannot serve is refused, naming what is missing.

transformers neither creates nor saves Qwen3.5's MTP layer (it ignores `mtp.*` on load), so each
test checkpoint gets one written into its safetensors file under the released names and shapes
(hidden size H = 64 here):
- `mtp.pre_fc_norm_embedding.weight`, `mtp.pre_fc_norm_hidden.weight`, `mtp.norm.weight` [H]:
  RMSNorm weights applied as 1 + w, like every norm of the family;
- `mtp.fc.weight` [H, 2H]: projects [normed embedding, normed hidden state] back to H;
- `mtp.layers.0.*`: one full-attention decoder layer (gated attention with q/k norms; the MLP, or
  in the MoE model the experts, router and gated shared expert), taken from a one-layer
  transformers model of the same family;
and config.json gets `mtp_num_hidden_layers: 1`.
"""
from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5TextRotaryEmbedding
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer

from pagellm import LLM, SamplingParams
from tests.engine.mtp_checks import (check_sampled_requests_keep_the_targets_logprobs, check_two_ranks_propose_as_one,
                                     forward_in_two_chunks)
from tests.models.families import COMMON, FAMILIES, _perturb, build, build_multimodal

N_NEW = 16
K = 3
MTP = {"method": "mtp", "num_speculative_tokens": K, "disable_by_batch_size": 16}
DECODER_LAYER = {"qwen3_5": Qwen3_5DecoderLayer, "qwen3_5_moe": Qwen3_5MoeDecoderLayer}


def _one_layer_config(family: str):
    """The family's test config with one full-attention layer: the MTP layer's shapes."""
    config_cls, _, overrides = FAMILIES[family]
    cfg = getattr(transformers, config_cls)(**{**COMMON, **overrides, "num_hidden_layers": 1,
                                               "layer_types": ["full_attention"]})
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    return cfg


def add_mtp_layer(model_dir, family: str, text_prefix: str = "model.") -> dict[str, torch.Tensor]:
    """Write an MTP layer into the checkpoint (see the module); returns all its tensors."""
    torch.manual_seed(11)
    _, model_cls, _ = FAMILIES[family]
    donor = getattr(transformers, model_cls)(_one_layer_config(family)).eval()
    _perturb(donor, family)
    mtp = {"mtp.layers.0." + k.removeprefix("model.layers.0."): v.detach().clone()
           for k, v in donor.state_dict().items() if k.startswith("model.layers.0.")}
    hidden = COMMON["hidden_size"]
    g = torch.Generator().manual_seed(12)
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{name}.weight"] = 0.3 * torch.randn(hidden, generator=g)
    mtp["mtp.fc.weight"] = 0.1 * torch.randn(hidden, 2 * hidden, generator=g)
    path = model_dir / "model.safetensors"
    weights = {**load_file(str(path)), **mtp}
    save_file(weights, str(path), metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    if "text_config" in config:
        config["text_config"]["mtp_num_hidden_layers"] = 1
    else:
        config["mtp_num_hidden_layers"] = 1
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))
    return weights


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's RMSNorm: its weight applied as 1 + w."""
    return (1 + w) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def reference_mtp(weights: dict[str, torch.Tensor], family: str, next_tokens: list[int], hidden: torch.Tensor):
    """The MTP layer over positions 0 .. (each reading `hidden` of that position and the token
    after it), as vLLM's Qwen3_5MultiTokenPredictor runs it: the embedding (not zeroed at position
    0) and the hidden state normed, [embedding, hidden] through fc, the decoder layer, the final
    norm (its output is what a chain reads next) and the head. Returns (outputs, logits)."""
    cfg = _one_layer_config(family)
    eps = cfg.rms_norm_eps
    w = {k.removeprefix("mtp."): v for k, v in weights.items() if k.startswith("mtp.")}
    positions = torch.arange(len(next_tokens))
    emb = weights["model.embed_tokens.weight"][torch.tensor(next_tokens)]
    x = torch.cat([_norm(emb, w["pre_fc_norm_embedding.weight"], eps),
                   _norm(hidden, w["pre_fc_norm_hidden.weight"], eps)], -1) @ w["fc.weight"].T
    layer = DECODER_LAYER[family](cfg, 0).eval()
    layer.load_state_dict({k.removeprefix("layers.0."): v for k, v in w.items() if k.startswith("layers.0.")})
    cos, sin = Qwen3_5TextRotaryEmbedding(cfg)(x[None], positions[None])
    n = len(next_tokens)
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        out = layer(x[None], position_embeddings=(cos, sin), attention_mask=mask, position_ids=positions[None])
        out = _norm(out[0] if isinstance(out, torch.Tensor) else out[0][0], w["norm.weight"], eps)
        logits = out @ weights["lm_head.weight"].T
    return out, logits


def _requests() -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(5)
    return [([rng.randrange(3, 320) for _ in range(n)],
             SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True)) for n in [1, 6, 19, 33, 9]]


def _run(llm: LLM, requests) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in requests], [s for _, s in requests], use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _proposer(llm: LLM):
    return llm.engine.executor.driver.proposer


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """(checkpoint dir with an MTP layer, its tensors, requests, plain greedy outputs). Plain
    serving reads the checkpoint with its mtp.* tensors left out. Its random MTP layer's proposals
    are nearly all rejected."""
    path = build("qwen3_5", tmp_path_factory.mktemp("qwen_mtp"))
    weights = add_mtp_layer(path, "qwen3_5")
    requests = _requests()
    return path, weights, requests, _run(LLM(str(path), num_kv_blocks=256, block_size=4), requests)


def _coin(path, weights, directory):
    """The checkpoint with a head of two tokens: every row of lm_head zero but token 5's, so the
    target and its MTP layer (which shares the head) both pick 5 or 0 by the sign of one product,
    and agree about half the time: proposals accepted whole, in part and not at all."""
    shutil.copytree(path, directory, dirs_exist_ok=True)
    head = torch.zeros_like(weights["lm_head.weight"])
    head[5] = weights["lm_head.weight"][5]
    save_file({**weights, "lm_head.weight": head}, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


@pytest.fixture(scope="module")
def coin(qwen, tmp_path_factory):
    """(the coin checkpoint (see _coin), requests, plain greedy outputs)."""
    path, weights, requests, _ = qwen
    coin = _coin(path, weights, tmp_path_factory.mktemp("qwen_mtp_coin"))
    return coin, requests, _run(LLM(str(coin), num_kv_blocks=256, block_size=4), requests)


@pytest.mark.parametrize("family", ["qwen3_5", pytest.param("qwen3_5_moe", marks=pytest.mark.slow)])
def test_mtp_layer_forward_equals_the_reference_in_chunks(qwen, family, tmp_path):
    if family == "qwen3_5":
        path, weights = qwen[0], qwen[1]
    else:
        path = build(family, tmp_path / family)
        weights = add_mtp_layer(path, family)
    llm = LLM(str(path), num_kv_blocks=16, block_size=4, speculative_config=MTP)
    runner, tokens, hidden, got = forward_in_two_chunks(llm, COMMON["hidden_size"])
    want, want_logits = reference_mtp(weights, family, tokens, hidden)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(runner.model.compute_logits(got), want_logits, rtol=1e-4, atol=1e-4)


def test_first_proposals_are_the_reference_chain_from_the_targets_hidden_states(qwen):
    """For each prompt, the first proposal reads the target's last hidden state and the sampled
    token; the next two chain the layer on its own (normed) output and the token it proposed."""
    path, weights, requests, plain = qwen
    llm = LLM(str(path), num_kv_blocks=64, block_size=4, speculative_config=MTP)
    first = {}  # the context (prompt and sampled token) -> the tokens proposed after it, first time
    proposer = _proposer(llm)
    propose_for = proposer.propose_for

    def recording(queries):
        proposals = propose_for(queries)
        for q, p in zip(queries, proposals):
            first.setdefault(tuple(q.context), p.token_ids)
        return proposals

    proposer.propose_for = recording
    prompts = [p for p, _ in requests if len(p) > 1]
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 SamplingParams(temperature=0.0, max_tokens=K + 2, ignore_eos=True), use_tqdm=False)
    target = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    for prompt, out in zip(prompts, [o for (p, _), o in zip(requests, plain) if len(p) > 1]):
        with torch.no_grad():
            hidden = target.model(torch.tensor([prompt])).last_hidden_state[0]  # after the final norm
        tokens = prompt[1:] + [out[0]]
        want = []
        for _ in range(K):
            rows, logits = reference_mtp(weights, "qwen3_5", tokens, hidden)
            want.append(int(logits[-1].argmax()))
            tokens, hidden = tokens + want[-1:], torch.cat([hidden, rows[-1:]])
        assert first[tuple(prompt + out[:1])] == want


SETUPS = {
    "batched": dict(num_kv_blocks=256, block_size=4),
    "chunked": dict(num_kv_blocks=256, block_size=4, max_num_batched_tokens=8),  # prompts prefilled in chunks
    "preempted": dict(num_kv_blocks=24, block_size=4),  # too few blocks for all at once: preemption by recompute
}
FAST = {("coin", "batched"), ("coin", "preempted")}


def _assert_equal_and_released(llm: LLM, requests, plain) -> dict:
    assert _run(llm, requests) == plain
    stats = llm.stats()["spec_decode"]
    assert stats["num_drafts"] > 0 and stats["num_draft_tokens"] > stats["num_accepted_tokens"]
    proposer = _proposer(llm)
    assert proposer.seqs == {}
    proposer.kv.check_integrity()
    assert proposer.kv.num_used_blocks == 0 and llm.stats()["used_blocks"] == 0
    return stats


@pytest.mark.parametrize("which, name", [
    pytest.param(which, name, id=f"{which}-{name}", marks=() if (which, name) in FAST else pytest.mark.slow)
    for which in ("coin", "random") for name in SETUPS])
def test_greedy_with_mtp_equals_plain_decoding(qwen, coin, which, name):
    path, requests, plain = coin if which == "coin" else (qwen[0], qwen[2], qwen[3])
    stats = _assert_equal_and_released(LLM(str(path), speculative_config=MTP, **SETUPS[name]), requests, plain)
    if which == "coin":  # runs accepted in part, some past a chained proposal
        accepted = stats["accepted_per_position"]
        assert accepted[0] > accepted[1] > 0


def test_under_tensor_parallelism_proposes_and_rolls_back_as_on_one_rank(coin):
    """Each rank also rolls its shard of the delta-rule states back after a verification."""
    path, requests, plain = coin
    stats = check_two_ranks_propose_as_one(path, requests, MTP, plain)
    assert stats["num_accepted_tokens"] < stats["num_draft_tokens"]


@pytest.mark.slow
def test_sampled_requests_keep_the_targets_logprobs(coin):
    """Seeded samples over three tokens, their proposals drawn from the layer's distribution and
    verified by rejection sampling against it, the delta-rule states rolled back to the accepted
    tokens: some accepted, every token reported with the target's logprob given the tokens before
    it (scored again by the plain engine as a prompt), and the same text again from the same seeds
    (no prefix cache: a hit would silence the layer and draw other proposals)."""
    path, requests, _ = coin
    check_sampled_requests_keep_the_targets_logprobs(path, requests, MTP, N_NEW)


@pytest.mark.slow
def test_image_text_checkpoint_reads_its_mtp_layer(tmp_path):
    """Qwen3.5's published checkpoints are Qwen3_5ForConditionalGeneration (language model under
    model.language_model.*, head tied here) with the MTP layer at the top level (`mtp.*`): plain
    serving leaves it out, method 'mtp' reads it, and the outputs are plain decoding's."""
    path = build_multimodal("qwen3_5_vl", tmp_path / "vl")
    add_mtp_layer(path, "qwen3_5")
    requests = _requests()
    plain = _run(LLM(str(path), num_kv_blocks=256, block_size=4), requests)
    _assert_equal_and_released(LLM(str(path), speculative_config=MTP, **SETUPS["batched"]), requests, plain)


def test_checkpoints_without_the_mtp_layer_are_refused(qwen, tmp_path):
    path, weights, _, _ = qwen
    bare = tmp_path / "bare"
    shutil.copytree(path, bare)
    save_file({k: v for k, v in weights.items() if not k.startswith("mtp.")}, str(bare / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"weights lack mtp\.pre_fc_norm_embedding\.weight, mtp\.pre_fc_norm_hidden"
                                         r"\.weight, mtp\.fc\.weight, mtp\.norm\.weight .*transformers saves"):
        LLM(str(bare), num_kv_blocks=16, speculative_config=MTP)
    save_file({k: v for k, v in weights.items() if not k.startswith("mtp.layers.")}, str(bare / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"weights lack mtp\.layers\.0\.self_attn\.\*"):
        LLM(str(bare), num_kv_blocks=16, speculative_config=MTP)
    config = json.loads((bare / "config.json").read_text())
    (bare / "config.json").write_text(json.dumps(dict(config, mtp_num_hidden_layers=0)))
    with pytest.raises(ValueError, match="mtp_num_hidden_layers is 0: this checkpoint has no MTP layer"):
        LLM(str(bare), num_kv_blocks=16, speculative_config=MTP)

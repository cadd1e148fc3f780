"""Checks both MTP families' tests run (DeepSeek-V3's and Qwen3.5's layers)."""
from __future__ import annotations

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.core.step_plan import PlannedSeq
from tests.engine.spec_stats import without_times


def check_sampled_requests_keep_the_targets_logprobs(path, requests, speculative_config: dict, max_tokens: int) -> None:
    """Seeded samples over three tokens, their proposals drawn from the layer's distribution and
    verified by rejection sampling against it: some accepted, every token reported with the
    target's logprob given the tokens before it (scored again by the plain engine as a prompt), and
    the same text again from the same seeds (no prefix cache: a hit would silence the layer and
    draw other proposals)."""
    params = [SamplingParams(seed=10 + i, temperature=1.0, max_tokens=max_tokens, allowed_token_ids=[0, 5, 7],
                             ignore_eos=True, logprobs=0) for i in range(len(requests))]
    prompts = [{"prompt_token_ids": p} for p, _ in requests]
    llm = LLM(str(path), num_kv_blocks=256, block_size=4, enable_prefix_caching=False,
              speculative_config=speculative_config)
    got = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert again == [c.token_ids for c in got]
    assert llm.stats()["spec_decode"]["num_accepted_tokens"] > 0
    scored = LLM(str(path), num_kv_blocks=256, block_size=4).generate(
        [{"prompt_token_ids": p + c.token_ids} for (p, _), c in zip(requests, got)],
        SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    for (prompt, _), c, s in zip(requests, got, scored):
        want = [lp[t].logprob for t, lp in zip(c.token_ids, s.prompt_logprobs[len(prompt):])]
        assert [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)] == pytest.approx(want, abs=1e-4)


def forward_in_two_chunks(llm: LLM, hidden_size: int):
    """The MTP layer of `llm` run on 13 random tokens and target hidden states, in chunks of 8 and 5
    (the second reading the first's cache from blocks no sequence holds): (runner, tokens, hidden,
    its output)."""
    runner = llm.engine.executor.driver.proposer.runner
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(3, 320, (13,), generator=g).tolist()
    hidden = torch.randn(13, hidden_size, generator=g)
    table = ([10, 11, 12, 13],)  # blocks of the layer's own pool no sequence holds now
    first = runner.forward_hidden([PlannedSeq("a", tokens[:8], 0, table)], hidden[:8])
    rest = runner.forward_hidden([PlannedSeq("a", tokens[8:], 8, table)], hidden[8:])  # reads the cached 8
    return runner, tokens, hidden, torch.cat([first, rest])


def check_two_ranks_propose_as_one(path, requests, speculative_config: dict, plain: list[list[int]]) -> dict:
    """Two tensor-parallel ranks, the MTP layer whole on rank 0 from the target's hidden states
    there (the ranks' all-reduced ones), between the ranks' steps: greedy outputs are plain
    decoding's, and the proposals and what is kept are one rank's. Returns the two ranks' stats."""
    def run(llm: LLM) -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": p} for p, _ in requests], [s for _, s in requests], use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    one = LLM(str(path), num_kv_blocks=256, block_size=4, speculative_config=speculative_config)
    assert run(one) == plain
    with LLM(str(path), num_kv_blocks=256, block_size=4, speculative_config=speculative_config,
             tensor_parallel_size=2) as llm:
        assert run(llm) == plain
        stats = llm.stats()["spec_decode"]
    assert without_times(stats) == without_times(one.stats()["spec_decode"]) and stats["num_accepted_tokens"] > 0
    return stats

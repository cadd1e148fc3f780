"""The model runner needs nothing but the step plan: a plan written by hand (no scheduler, no
Request objects) drives it to transformers' greedy tokens; and the step's tensor work packs
and unpacks field by field for the tensor-parallel ranks."""
from __future__ import annotations

import torch
import transformers

from pagellm.config import EngineConfig
from pagellm.core.step_plan import PlannedSeq, SampleSpec, StepPlan
from pagellm.distributed.worker import pack, unpack
from pagellm.engine.llm_engine import LLMEngine
from pagellm.sampling_params import SamplingParams
from pagellm.worker.model_runner import StepInputs, decodes_first
from tests.conftest import hf_greedy


def test_a_hand_written_plan_gives_transformers_tokens(tiny_llama_dir):
    runner = LLMEngine(EngineConfig(model=tiny_llama_dir, block_size=4, num_kv_blocks=16)).runner
    prompt = [5, 17, 99, 3, 250, 41]
    greedy = SamplingParams(temperature=0)
    table = [9, 2, 14]  # any blocks, in any order
    out: list[int] = []

    def step(token_ids: list[int], start: int, sample: bool) -> None:
        samplers = [SampleSpec("a", greedy, prompt, list(out))] if sample else []
        result = runner.execute(StepPlan([PlannedSeq("a", token_ids, start, (table,), samplers)]), set())
        assert result.request_ids == (["a"] if sample else [])
        if sample:
            out.append(result.sampled.token_ids[0])

    step(prompt[:4], 0, sample=False)  # a prefill chunk: nothing samples yet
    step(prompt[4:], 4, sample=True)   # the rest of the prompt, and the first token
    while len(out) < 5:                 # decodes
        step([out[-1]], len(prompt) + len(out) - 1, sample=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    assert out == hf_greedy(hf, prompt, 5)


def test_step_inputs_pack_and_unpack_field_by_field(tiny_llama_dir):
    from pagellm.attention.backend import AttentionMetadata

    meta = AttentionMetadata(slot_mapping=torch.tensor([3, 4]), block_tables=torch.tensor([[0, 1]]),
                             query_lens=[2], seq_lens=[2], seq_lens_tensor=torch.tensor([2]), num_decodes=0,
                             block_size=4)
    inputs = StepInputs([(1, 2)], torch.tensor([7, 8]), torch.tensor([0, 1]), meta, [1])
    values, tensors = pack(inputs)
    assert set(tensors) == {"input_ids", "positions", "meta.slot_mapping", "meta.block_tables",
                            "meta.seq_lens_tensor"}
    back = unpack(StepInputs, values, tensors)
    assert back.block_copies == [(1, 2)] and back.rows == [1] and torch.equal(back.input_ids, inputs.input_ids)
    assert back.meta.query_lens == [2] and back.meta.block_size == 4
    assert torch.equal(back.meta.block_tables, meta.block_tables)


def test_a_forward_pass_takes_decodes_first_and_the_rest_in_their_order():
    """The attention metadata counts its leading one-token sequences as decodes: every pass (the
    scheduler's steps and a proposer model's) orders them so, keeping the plan's order otherwise."""
    seqs = [PlannedSeq(rid, tokens, 0, ([0],)) for rid, tokens in
            [("p1", [1, 2]), ("d1", [3]), ("p2", [4, 5, 6]), ("d2", [7]), ("d3", [8])]]
    assert [seqs[i].request_id for i in decodes_first(seqs)] == ["d1", "d2", "d3", "p1", "p2"]

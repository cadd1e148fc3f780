"""The timing hook benchmarks read (pagellm.timing): every phase of every step is reported while
a timer is attached, and nothing once it is detached."""
from __future__ import annotations

from pagellm import LLM, SamplingParams
from pagellm.timing import PhaseTimer

PHASES = {"step", "schedule", "execute", "prepare_inputs", "model_forward", "attention", "logits", "sampler"}


def test_attached_timer_sees_every_phase_of_every_step(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, num_kv_blocks=64)
    engine = llm.engine
    timer = PhaseTimer()
    engine.attach_timer(timer)
    engine.add_request("a", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4, ignore_eos=True))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    assert set(timer.calls) == PHASES
    for name in ("step", "schedule", "execute", "prepare_inputs", "model_forward", "logits", "sampler"):
        assert timer.calls[name] == steps == 4, name
    assert timer.calls["attention"] == steps * engine.arch.num_hidden_layers
    assert timer.seconds["model_forward"] >= timer.seconds["attention"] > 0
    assert timer.seconds["step"] >= timer.seconds["execute"] >= timer.seconds["model_forward"]
    engine.attach_timer(None)
    llm.generate({"prompt_token_ids": [5]}, SamplingParams(max_tokens=2), use_tqdm=False)
    assert timer.calls["step"] == 4

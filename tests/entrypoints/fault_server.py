"""`pagellm` with two test hooks in the engine, run as a script by the server error tests.

- A batch that holds a request whose prompt contains INJECT_FAULT makes the model runner
  raise, every time, as a bug deep in the engine that one request triggers would.
- PAGELLM_TEST_STEP_DELAY (seconds) slows every step, so that a queue can be filled on purpose.
"""
from __future__ import annotations

import os
import sys
import time

from pagellm.engine.llm_engine import LLMEngine
from pagellm.cli import main
from pagellm.worker.model_runner import ModelRunner

POISON = "INJECT_FAULT"
_add, _execute = LLMEngine.add_request, ModelRunner.execute
_poisoned: set[str] = set()
_delay = float(os.environ.get("PAGELLM_TEST_STEP_DELAY", "0"))


def add_request(self, request_id, prompt, params=None, arrival_time=None):
    req = _add(self, request_id, prompt, params, arrival_time=arrival_time)
    text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
    if text is None and isinstance(prompt, dict):
        text = self.tokenizer.decode(prompt.get("prompt_token_ids", []))
    if isinstance(text, str) and POISON in text:
        _poisoned.add(request_id)
    return req


def execute(self, plan, eos_token_ids):
    if _delay:
        time.sleep(_delay)
    if any(s.user_request_id in _poisoned for s in plan.seqs):
        raise RuntimeError("injected fault")
    return _execute(self, plan, eos_token_ids)


LLMEngine.add_request = add_request
ModelRunner.execute = execute

if __name__ == "__main__":
    sys.exit(main())

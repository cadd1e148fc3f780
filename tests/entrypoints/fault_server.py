"""`pagellm` with two test hooks in the engine, run as a script by the server error tests.

- A step that holds a request whose prompt contains INJECT_FAULT raises (once), as a bug
  deep in the engine would.
- PAGELLM_TEST_STEP_DELAY (seconds) slows every step, so that a queue can be filled on purpose.
"""
from __future__ import annotations

import os
import sys
import time

from pagellm.engine.llm_engine import LLMEngine
from pagellm.entrypoints.cli import main

POISON = "INJECT_FAULT"
_add, _step = LLMEngine.add_request, LLMEngine.step
_poisoned: set[str] = set()
_delay = float(os.environ.get("PAGELLM_TEST_STEP_DELAY", "0"))


def add_request(self, request_id, prompt, params=None, arrival_time=None):
    req = _add(self, request_id, prompt, params, arrival_time=arrival_time)
    text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
    if isinstance(text, str) and POISON in text:
        _poisoned.add(request_id)
    return req


def step(self):
    if _delay:
        time.sleep(_delay)
    if _poisoned:
        _poisoned.clear()
        raise RuntimeError("injected fault")
    return _step(self)


LLMEngine.add_request = add_request
LLMEngine.step = step

if __name__ == "__main__":
    sys.exit(main())

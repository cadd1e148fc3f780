"""One guard for every stream body, in each API's dialect: an engine failure mid-stream becomes
the API's error event (OpenAI: a data line then [DONE]; Anthropic and the Responses API: an
`error` event and no [DONE]; Ollama: an {"error"} line), anything else propagates, and the streams are aborted however the body ends."""
from __future__ import annotations

import asyncio
import json

import pytest

from pagellm.engine.async_engine import EngineStepError
from pagellm.entrypoints.openai.errors import OpenAIError
from pagellm.entrypoints.openai.serving_engine import SSE_DONE, guarded_sse


class _Stream:
    aborted = False

    def abort(self) -> None:
        self.aborted = True


async def _events(failure: BaseException):
    yield "first\n\n"
    raise failure


def _body(failure: BaseException, stream: _Stream | None = None, **dialect) -> tuple[list[str], _Stream]:
    stream = stream or _Stream()

    async def collect() -> list[str]:
        return [e async for e in guarded_sse(_events(failure), [stream], **dialect)]

    return asyncio.run(collect()), stream


def test_openai_dialect_ends_with_an_error_line_then_done():
    body, stream = _body(EngineStepError("the step failed"))
    assert body[0] == "first\n\n" and body[-1] == SSE_DONE
    assert json.loads(body[1].removeprefix("data: "))["error"]["message"] == "the step failed"
    assert stream.aborted


def test_anthropic_dialect_ends_with_an_error_event_and_no_done():
    body, stream = _body(EngineStepError("the step failed"), error_event=OpenAIError.anthropic_sse, done=None)
    assert body[0] == "first\n\n" and len(body) == 2
    kind, data = body[1].split("\n", 1)
    assert kind == "event: error"
    assert json.loads(data.removeprefix("data: ")) == {"type": "error",
                                                       "error": {"type": "api_error", "message": "the step failed"}}
    assert stream.aborted


def test_responses_dialect_ends_with_a_numbered_error_event():
    from pagellm.entrypoints.responses.serving_responses import Events

    events = Events()
    events("response.created")  # the stream's first event took number 0
    body, stream = _body(EngineStepError("the step failed"), error_event=events.error, done=None)
    kind, data = body[1].split("\n", 1)
    assert kind == "event: error" and len(body) == 2 and stream.aborted
    assert json.loads(data.removeprefix("data: ")) == {"type": "error", "sequence_number": 1,
                                                       "code": "internal_error", "message": "the step failed",
                                                       "param": None}


def test_ollama_dialect_ends_with_an_error_line():
    body, stream = _body(EngineStepError("the step failed"), error_event=OpenAIError.ollama_line, done=None)
    assert body == ["first\n\n", '{"error": "the step failed"}\n'] and stream.aborted


def test_an_unexpected_failure_propagates_and_still_aborts():
    stream = _Stream()
    with pytest.raises(KeyError):
        _body(KeyError("bug"), stream, error_event=OpenAIError.anthropic_sse, done=None)
    assert stream.aborted

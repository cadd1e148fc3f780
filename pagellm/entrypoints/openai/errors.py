"""Errors in OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}}.

Every failure the server answers, from a bad field to a failed step, goes through here, so a
client never sees FastAPI's own {"detail": ...} shape.
"""
from __future__ import annotations

import json
import re
from http import HTTPStatus

from starlette.responses import JSONResponse

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class OpenAIError(Exception):
    """An error the server answers with `status` and OpenAI's error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        kind = _TYPES.get(self.status) or HTTPStatus(self.status).phrase.replace(" ", "")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def sse(self) -> str:
        """The error as one server-sent event, for a stream whose 200 has already gone out."""
        return f"data: {json.dumps(self.body(), ensure_ascii=False)}\n\n"


_FIELD = re.compile(r"^([a-z_]+)[ \[]")


def bad_request(error: ValueError | str, param: str | None = None, code: str | None = None) -> OpenAIError:
    """A 400 for invalid input; the field is read from messages shaped "<field> must be ..."."""
    message = str(error)
    if param is None:
        m = _FIELD.match(message)
        if m and m.group(1) in _KNOWN_FIELDS:
            param = m.group(1)
    return OpenAIError(400, message, param=param, code=code)


_KNOWN_FIELDS = {
    "n", "best_of", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "seed", "max_tokens", "min_tokens", "stop", "stop_token_ids", "logprobs",
    "top_logprobs", "prompt", "prompt_token_ids", "messages", "max_completion_tokens", "logit_bias",
    "allowed_token_ids",
}

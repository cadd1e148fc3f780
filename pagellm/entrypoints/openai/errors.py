"""Errors in OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}}.

Every failure the server answers, from a bad field to a failed step, goes through here, so a
client never sees FastAPI's own {"detail": ...} shape.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterable
from http import HTTPStatus
from typing import Any

from starlette.responses import Response

from pagellm.sampling_params import check_text

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

    def response(self) -> Response:
        # ASCII JSON: a message may quote the client's own text, lone surrogates and all.
        return Response(json.dumps(self.body()), status_code=self.status, headers=self.headers,
                        media_type="application/json")

    def sse(self) -> str:
        """The error as one server-sent event, for a stream whose 200 has already gone out."""
        return f"data: {json.dumps(self.body())}\n\n"

    def anthropic_body(self) -> dict:
        """The same error in the shape of Anthropic's API (the /v1/messages routes answer in it)."""
        kind = _ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def anthropic_sse(self) -> str:
        """The error as Anthropic's stream sends one: an `error` event."""
        return f"event: error\ndata: {json.dumps(self.anthropic_body())}\n\n"

    def ollama_body(self) -> dict:
        """The same error in the shape of Ollama's API: {"error": message}."""
        return {"error": self.message}

    def ollama_line(self) -> str:
        """The error as Ollama's NDJSON stream sends one: a line of its own."""
        return json.dumps(self.ollama_body()) + "\n"

    def response_for(self, path: str) -> Response:
        """The error in the shape of the API `path` belongs to."""
        if path.startswith(ANTHROPIC_PREFIX):
            body = self.anthropic_body()
        elif path.startswith(OLLAMA_PREFIX):
            body = self.ollama_body()
        else:
            return self.response()
        return Response(json.dumps(body), status_code=self.status, headers=self.headers,
                        media_type="application/json")


# Anthropic's Messages API routes, whose errors take Anthropic's shape.
ANTHROPIC_PREFIX = "/v1/messages"
# Ollama's API routes, whose errors take Ollama's shape.
OLLAMA_PREFIX = "/api/"
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


_FIELD = re.compile(r"^([a-z_]+)[ \[]")


def bad_request(error: ValueError | str, param: str | None = None, code: str | None = None) -> OpenAIError:
    """A 400 for invalid input; the field is read from messages shaped "<field> must be ..."."""
    message = str(error)
    if param is None:
        m = _FIELD.match(message)
        if m and m.group(1) in _KNOWN_FIELDS:
            param = m.group(1)
    return OpenAIError(400, message, param=param, code=code)


def refuse_unknown(api: str, where: str, keys: Iterable[str]) -> None:
    """A 400 for the first (in sorted order) of `keys` sent at `where` ("", "messages[0].") that
    is no field of `api` this server implements: never accepted and ignored."""
    for key in sorted(keys):
        raise bad_request(f"{where}{key} is not supported: it is not a field of {api} that this server "
                          f"implements", param=f"{where}{key}")


def check_request_text(name: str, text: str) -> None:
    """`text` must encode to UTF-8 (no lone surrogate, which JSON can carry): else a 400 naming `name`."""
    try:
        check_text(name, text)
    except ValueError as e:
        raise bad_request(e, param=name) from None


_KNOWN_FIELDS = {
    "n", "best_of", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "seed", "max_tokens", "min_tokens", "stop", "stop_token_ids", "logprobs",
    "top_logprobs", "prompt", "prompt_token_ids", "messages", "max_completion_tokens", "logit_bias",
    "allowed_token_ids", "dimensions", "thinking_token_budget",
}


# What a field that takes one of several shapes expects, in words (pydantic lists one error per shape).
_SHAPES = {
    "prompt": "a string, a list of strings, a list of token ids or a list of lists of token ids",
    "stop": "a string or a list of strings",
    "content": "a string, a list of content parts or null",
}
_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none", "bytes"}


def _is_union_tag(part: Any) -> bool:
    """pydantic names the member of a union an error is about ('str', 'list[int]', 'ContentPart')
    in the error's location; our field names are lower-case identifiers."""
    return isinstance(part, str) and ("[" in part or part in _TYPE_NAMES or part[:1].isupper())


def _json(value: Any, limit: int = 80) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _path(loc: list) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _lookup(body: Any, loc: list) -> Any:
    for part in loc:
        try:
            body = body[part]
        except (KeyError, IndexError, TypeError):
            return None
    return body


def validation_error(errors: list[dict], body: Any) -> OpenAIError:
    """A 400 for a body that failed pydantic's checks, naming the field, the value and what it must be.

    pydantic reports one error per member of a union; those are folded into one sentence.
    """
    if not errors:
        return bad_request("invalid request body")
    first = errors[0]
    loc = [x for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
        where = f" at character {loc[0]}" if loc and isinstance(loc[0], int) else ""
        reason = (first.get("ctx") or {}).get("error", "invalid JSON")
        return bad_request(f"The request body is not valid JSON: {reason}{where}.")
    if not loc:
        got = first.get("input")
        if first.get("type") == "missing":
            return bad_request("The request body is empty; send a JSON object (Content-Type: application/json).")
        if isinstance(got, (bytes, bytearray)):
            return bad_request("The request body must be JSON, sent with Content-Type: application/json.")
        return bad_request(f"The request body must be a JSON object, got {_json(got)}.")
    tag = next((i for i, part in enumerate(loc) if _is_union_tag(part)), None)
    if tag is not None:  # every error under this union is about the one value
        root = loc[:tag]
        covered = [e for e in errors if [x for x in e.get("loc", ()) if x != "body"][:tag] == root]
        shape = _SHAPES.get(str(root[-1])) if root else None
        tags = sorted({str([x for x in e["loc"] if x != "body"][tag]) for e in covered})
        message = f"{_path(root)} must be {shape or ' or '.join(tags)}, got {_json(_lookup(body, root))}"
    else:
        covered = [first]
        message = (f"{_path(loc)} is required" if first.get("type") == "missing"
                   else f"{_path(loc)}: {first.get('msg', 'invalid value')}, got {_json(first.get('input'))}")
    others = len(errors) - len(covered)
    if others > 0:
        message += f" (and {others} more error{'s' if others > 1 else ''})"
    return bad_request(message, param=str(loc[0]))

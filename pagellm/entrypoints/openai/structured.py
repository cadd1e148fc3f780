"""The HTTP spellings of structured outputs, mapped to one `StructuredOutputsParams`.

Clients ask for a constrained output in several ways, and each is taken here:
- OpenAI's `response_format`: `{"type": "json_object"}`, `{"type": "json_schema", "json_schema":
  {"name": ..., "schema": {...}}}`, or `{"type": "text"}` (no constraint);
- vLLM's `structured_outputs` extra: `{"json": ..., "regex": ..., "choice": [...], "grammar": ...,
  "json_object": true}`;
- vLLM's older `guided_json`, `guided_regex`, `guided_choice` and `guided_grammar`.
At most one of them may be sent; whatever is wrong is a 400 naming the field as the client spelled it.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from pagellm.entrypoints.openai.errors import bad_request
from pagellm.sampling_params import StructuredOutputsParams

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
# vLLM's per-request backend selector (engine/grammars/).
BACKENDS = (None, "auto", "xgrammar", "guidance")


def parse_structured_outputs(req: Any) -> tuple[StructuredOutputsParams | None, str | None]:
    """(the constraint, the field it came from) of a chat or completion request; (None, None) if none."""
    backend = getattr(req, "guided_decoding_backend", None)
    if backend not in BACKENDS:
        raise bad_request(f"guided_decoding_backend must be one of auto, xgrammar, guidance, got {backend!r}",
                          param="guided_decoding_backend")
    sent = [name for name in ("response_format", "structured_outputs", *GUIDED) if getattr(req, name, None) is not None]
    if len(sent) > 1:
        raise bad_request(f"send only one of {', '.join(sent)}: each asks for a structured output", param=sent[1])
    if not sent:
        return None, None
    field = sent[0]
    value = getattr(req, field)
    try:
        if field == "response_format":
            spec = _response_format(value)
        elif field == "structured_outputs":
            if not isinstance(value, dict):
                raise ValueError(f"structured_outputs must be an object, got {value!r}")
            spec = StructuredOutputsParams(**value)
        else:
            spec = StructuredOutputsParams(**{GUIDED[field]: value})
        if backend is not None and spec is not None and spec.backend is None:
            spec = replace(spec, backend=backend)
    except TypeError:  # a key StructuredOutputsParams does not take
        known = ", ".join(StructuredOutputsParams.__dataclass_fields__)
        raise bad_request(f"structured_outputs takes only {known}; got {sorted(value)}", param=field) from None
    except ValueError as e:
        message = str(e).replace(f"structured_outputs.{GUIDED[field]}", field) if field in GUIDED else str(e)
        raise bad_request(message, param=field) from None
    return spec, field


def _response_format(value: Any) -> StructuredOutputsParams | None:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        inner = value.get("json_schema")
        if not isinstance(inner, dict) or not isinstance(inner.get("schema"), dict):
            raise ValueError("response_format.json_schema.schema must be a JSON schema (an object), as in "
                             '{"type": "json_schema", "json_schema": {"name": "...", "schema": {...}}}')
        return StructuredOutputsParams(json=inner["schema"])
    raise ValueError(f"response_format.type must be one of text, json_object, json_schema, got {kind!r}")

"""Tool calling on the chat endpoint: checking `tools` and `tool_choice`, the grammar that makes
`required` and a named tool choice hold, and the parsers that find tool calls in what a model
wrote on its own (`auto`).

- `required`: the reply is a JSON array of `{"name": ..., "arguments": {...}}`, one item schema
  per tool (its `parameters`), enforced by a structured-output grammar;
- a named function: the reply is that function's arguments, under its `parameters` schema;
- `auto` (with `--enable-auto-tool-choice --tool-call-parser NAME`): the model writes text and
  tool calls in its own format, which the parser takes apart: `hermes` (`<tool_call>{...}</tool_call>`,
  as Qwen, Hermes and SmolLM3 write), `llama3_json` (a bare `{"name": ..., "parameters": ...}`,
  optionally after `<|python_tag|>`, several joined by `;`), `mistral` (`[TOOL_CALLS][{...}]`),
  `openai` (gpt-oss's harmony: `<|channel|>commentary to=functions.NAME ...<|message|>{...}<|call|>`),
  `gemma4` (`<|tool_call>call:NAME{city:<|"|>Paris<|"|>}<tool_call|>`, gemma4_syntax.py);
- `none`: no tool calls; the tools still reach the chat template.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from pagellm.entrypoints.openai import gemma4_syntax
from pagellm.entrypoints.openai.errors import bad_request
from pagellm.sampling_params import StructuredOutputsParams


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=_call_id)

    def to_json(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


# ---- the request -------------------------------------------------------------------------------

@dataclass(frozen=True)
class ToolPlan:
    """What a chat request asks of tools: `mode` is none, auto, required or named."""

    mode: str
    tools: tuple[dict, ...] = ()
    name: str | None = None  # the named function
    parallel: bool = True

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """The grammar that makes `required` or a named choice hold (None for none and auto).
        Compact JSON: free whitespace lets a small model pad a call until max_tokens, and the
        client parses the arguments anyway."""
        if self.mode == "named":
            return StructuredOutputsParams(json=_parameters(self._tool(self.name)), disable_any_whitespace=True)
        if self.mode == "required":
            items = [{"type": "object", "properties": {"name": {"const": t["name"]}, "arguments": _parameters(t)},
                      "required": ["name", "arguments"]} for t in self.tools]
            schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                      "items": items[0] if len(items) == 1 else {"anyOf": items}}
            if not self.parallel:
                schema["maxItems"] = 1
            return StructuredOutputsParams(json=schema, disable_any_whitespace=True)
        return None

    def parse_auto(self, parser: ToolParser, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of an `auto` reply; one call at most without parallel_tool_calls."""
        content, calls = parser.extract(text)
        return content, calls if self.parallel else calls[:1]

    def _tool(self, name: str) -> dict:
        return next(t for t in self.tools if t["name"] == name)


def _parameters(tool: dict) -> dict:
    return tool.get("parameters") or {"type": "object"}


def plan_tools(tools: list[dict] | None, tool_choice: Any, parallel: bool, auto_enabled: bool) -> ToolPlan:
    """Check `tools` and `tool_choice` (400s naming them) and say what the request asks for."""
    functions = tuple(_function(i, t) for i, t in enumerate(tools or []))
    if tool_choice is None:  # OpenAI's default with tools is auto; vLLM's, without a parser, none
        return ToolPlan("auto" if functions and auto_enabled else "none", functions, parallel=parallel)
    if not functions and tool_choice != "none":
        raise bad_request("tool_choice needs tools: name the functions the model may call in `tools`",
                          param="tool_choice")
    if tool_choice in ("none", "required"):
        return ToolPlan(tool_choice, functions, parallel=parallel)
    if tool_choice == "auto":
        if not auto_enabled:
            raise bad_request('tool_choice "auto" needs the server started with --enable-auto-tool-choice and '
                              "--tool-call-parser (which format the model writes tool calls in); send "
                              '"required" or a named function to have a grammar enforce the call',
                              param="tool_choice")
        return ToolPlan("auto", functions, parallel=parallel)
    name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise bad_request(f'tool_choice must be "none", "auto", "required" or {{"type": "function", "function": '
                          f'{{"name": ...}}}}, got {tool_choice!r}', param="tool_choice")
    if name not in {f["name"] for f in functions}:
        raise bad_request(f"tool_choice names the function {name!r}, which is not in tools "
                          f"({', '.join(f['name'] for f in functions)})", param="tool_choice")
    return ToolPlan("named", functions, name=name, parallel=parallel)


def _function(i: int, tool: Any) -> dict:
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
        raise bad_request(f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., "parameters": '
                          f'{{...}}}}}}, got {tool!r}', param="tools")
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise bad_request(f"tools[{i}].function.name must be a non-empty string, got {fn.get('name')!r}",
                          param="tools")
    if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
        raise bad_request(f"tools[{i}].function.parameters must be a JSON schema (an object), got "
                          f"{fn['parameters']!r}", param="tools")
    return fn


# ---- the reply ---------------------------------------------------------------------------------

def forced_calls(plan: ToolPlan, text: str) -> list[ToolCall] | None:
    """The calls in a reply that `required` or a named choice constrained; None if the reply
    is not complete JSON (it ran out of max_tokens)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if plan.mode == "named":
        return [ToolCall(plan.name, json.dumps(value, ensure_ascii=False))]
    return [ToolCall(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in value]


def calls_before_cut(plan: ToolPlan, text: str) -> list[ToolCall]:
    """The complete calls at the front of a `required` reply that max_tokens cut short: the
    array's items that are whole JSON, the one it stopped inside dropped (the grammar made the text
    a prefix of a valid array, so an item that parses is the model's call as it meant it); [] for
    none, or for another mode (a named call is one set of arguments: cut, there is no whole call)."""
    if plan.mode != "required":
        return []
    decoder = json.JSONDecoder()
    i = _skip_space(text, 0)
    if not text.startswith("[", i):
        return []
    calls: list[ToolCall] = []
    i += 1
    while True:
        try:
            item, i = decoder.raw_decode(text, _skip_space(text, i))
        except json.JSONDecodeError:
            return calls
        if not isinstance(item, dict) or "name" not in item or "arguments" not in item:
            return calls
        calls.append(ToolCall(item["name"], json.dumps(item["arguments"], ensure_ascii=False)))
        i = _skip_space(text, i)
        if not text.startswith(",", i):  # "]": the array was whole after all; the end: nothing follows
            return calls
        i += 1


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


class ToolParser:
    """Finds tool calls in free text. `start(text)`: where tool calls begin (None: nowhere yet);
    `held(text)`: how many trailing characters could still turn into the start (kept back when
    streaming); `calls(tail)`: the calls in the text from the start on (ValueError if malformed)."""

    marker = ""

    def start(self, text: str) -> int | None:
        i = text.find(self.marker)
        return None if i < 0 else i

    def held(self, text: str) -> int:
        for k in range(min(len(self.marker) - 1, len(text)), 0, -1):
            if self.marker.startswith(text[-k:]):
                return k
        return 0

    def calls(self, tail: str) -> list[ToolCall]:
        raise NotImplementedError

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole reply; a malformed tool-call part is left as content."""
        i = self.start(text)
        if i is None:
            return text, []
        try:
            calls = self.calls(text[i:])
        except (ValueError, KeyError, TypeError, AttributeError):
            return text, []
        content = text[:i].strip()
        return content or None, calls


def _call(obj: Any, arguments_key: str = "arguments") -> ToolCall:
    args = obj[arguments_key] if arguments_key in obj else obj["arguments"]
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


class HermesParser(ToolParser):
    marker = "<tool_call>"
    end = "</tool_call>"

    def calls(self, tail: str) -> list[ToolCall]:
        out = []
        for block in tail.split(self.marker)[1:]:
            body = block.split(self.end, 1)[0].strip()
            out.append(_call(json.loads(body)))
        return out


class Llama3JsonParser(ToolParser):
    tag = "<|python_tag|>"

    def start(self, text: str) -> int | None:
        stripped = text.lstrip()
        return len(text) - len(stripped) if stripped.startswith(("{", self.tag)) else None

    def held(self, text: str) -> int:
        stripped = text.lstrip()
        return len(text) if not stripped or self.tag.startswith(stripped) else 0

    def calls(self, tail: str) -> list[ToolCall]:
        text = tail.strip()
        if text.startswith(self.tag):
            text = text[len(self.tag):]
        decoder, out, i = json.JSONDecoder(), [], 0
        while True:
            while i < len(text) and text[i] in " \t\r\n;":
                i += 1
            if i == len(text):
                return out
            obj, i = decoder.raw_decode(text, i)
            out.append(_call(obj, "parameters"))


class MistralParser(ToolParser):
    marker = "[TOOL_CALLS]"

    def calls(self, tail: str) -> list[ToolCall]:
        value, _ = json.JSONDecoder().raw_decode(tail[len(self.marker):].strip())
        return [_call(obj) for obj in (value if isinstance(value, list) else [value])]


class OpenAIParser(ToolParser):
    """gpt-oss's harmony calls: each a commentary message addressed `to=functions.NAME`, its JSON
    arguments after `<|message|>`, ended by `<|call|>`; the header may put the recipient before
    the channel or after it. (Its analysis before the call is the reasoning parser's: gpt_oss.)"""

    marker = "to=functions."
    headers = ("<|channel|>", "<|start|>")

    def start(self, text: str) -> int | None:
        i = text.find(self.marker)
        if i < 0:
            return None
        # Back to where the call's header begins: its <|start|> or <|channel|>, whichever comes first
        # after the last message.
        begins = [j for j in (text.rfind(h, 0, i) for h in self.headers) if j >= 0 and "<|message|>" not in text[j:i]]
        return min(begins, default=i)

    def held(self, text: str) -> int:
        # A header may be forming: from its last <|channel|> or <|start|> on, while no message began after it.
        begins = [j for j in (text.rfind(h) for h in self.headers) if j >= 0 and "<|message|>" not in text[j:]]
        if begins:
            return len(text) - min(begins)
        for k in range(min(max(len(h) for h in self.headers) - 1, len(text)), 0, -1):
            if any(h.startswith(text[-k:]) for h in self.headers):
                return k
        return 0

    def calls(self, tail: str) -> list[ToolCall]:
        out = []
        for block in tail.split(self.marker)[1:]:
            name = re.match(r"[^\s<]+", block)
            header, sep, body = block.partition("<|message|>")
            if name is None or not sep:
                raise ValueError(f"a harmony tool call without its name or message: {block[:80]!r}")
            for end in ("<|call|>", "<|end|>", "<|start|>"):
                body = body.split(end, 1)[0]
            out.append(ToolCall(name.group(0), json.dumps(json.loads(body), ensure_ascii=False)))
        return out


class Gemma4Parser(ToolParser):
    """Gemma 4's calls, as its chat template writes an assistant's: `<|tool_call>call:NAME{ARGS}<tool_call|>`,
    one after another, ARGS in Gemma's own syntax (gemma4_syntax.py), which comes back as JSON.
    After the calls only whitespace and the turn's end markers may follow (they are text when
    special tokens are kept and the model's stop tokens did not end it first); anything else, or
    a call that does not parse, leaves the whole reply as content."""

    marker = "<|tool_call>"
    end = "<tool_call|>"
    call_name = re.compile(r"call:([^{}\s<>]+)")
    trailers = ("<|tool_response>", "<turn|>", "<eos>")

    def calls(self, tail: str) -> list[ToolCall]:
        out, i = [], 0
        while True:
            i = _skip_space(tail, i)
            if i == len(tail):
                return out
            if tail.startswith(self.marker, i):
                name = self.call_name.match(tail, i + len(self.marker))
                if name is None:
                    raise ValueError(f"a Gemma 4 tool call without `call:NAME`: {tail[i:i + 80]!r}")
                args, i = gemma4_syntax.parse_object(tail, name.end())
                if not tail.startswith(self.end, i):
                    raise ValueError(f"a Gemma 4 tool call not closed by {self.end}: {tail[i:i + 80]!r}")
                out.append(ToolCall(name.group(1), json.dumps(args, ensure_ascii=False)))
                i += len(self.end)
                continue
            trailer = next((t for t in self.trailers if tail.startswith(t, i)), None)
            if trailer is None:
                raise ValueError(f"text after Gemma 4's tool calls: {tail[i:i + 80]!r}")
            i += len(trailer)


PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser,
                                         "mistral": MistralParser, "openai": OpenAIParser, "gemma4": Gemma4Parser}
# Their markers are special tokens in the models that use them: they must stay in the text.
KEEPS_SPECIAL_TOKENS = {"mistral", "openai", "gemma4"}

"""Tool calling with the official `openai` client against the bundled SmolLM2 (served with
--enable-auto-tool-choice --tool-call-parser hermes): required and named choices enforced by a
grammar, an agent round trip, auto calls parsed from the model's own text, streamed in OpenAI's
shape; and the parsers on their own."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from pagellm.entrypoints.openai.cli_args import add_serve_parser
from pagellm.entrypoints.openai.errors import OpenAIError
from pagellm.entrypoints.openai.tool_calls import (PARSERS, HermesParser, Llama3JsonParser, MistralParser,
                                                   calls_before_cut, plan_tools)
from server_utils import MODEL_NAME

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 20}}, "required": ["timezone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Time in a timezone",
                                           "parameters": TIME}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# Asked this with get_weather alone, the bundled model (greedy, `required`, parallel calls allowed)
# repeats its call until max_tokens; CUT_TOKENS holds two whole calls and stops inside the third.
REPEATS = [{"role": "user", "content": "Weather and time in Tokyo?"}]
CUT_TOKENS = 100
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


@pytest.fixture(scope="module")
def client(smollm2_server):
    c = smollm2_server.client(timeout=300)
    yield c
    c.close()


def check_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_gives_valid_calls(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="required",
                                       max_tokens=120, temperature=0.8, seed=3, n=3)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        check_calls(choice.message.tool_calls)


def test_named_function_and_an_agent_round_trip(client):
    """The named call comes back with content null; sent back with the tool's answer, as the SDK's
    agent loop does, the conversation goes on."""
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice=choice,
                                       max_tokens=80, temperature=0)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "stop"  # OpenAI's for a call the model was told to make
    (call,) = message.tool_calls
    assert call.function.name == "get_weather"
    check_calls(message.tool_calls)
    history = ASK + [message.model_dump(exclude_none=False),
                     {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18})}]
    assert history[1]["content"] is None
    follow = client.chat.completions.create(model=MODEL_NAME, messages=history, tools=TOOLS, max_tokens=16,
                                            temperature=0)
    assert follow.choices[0].message.content and not follow.choices[0].message.tool_calls


def test_named_arguments_stream_as_deltas(client):
    kwargs = dict(model=MODEL_NAME, messages=ASK, tools=TOOLS, max_tokens=80, temperature=0,
                  tool_choice={"type": "function", "function": {"name": "get_time"}})
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls[0]
    chunks = [c for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_time" and deltas[0].id.startswith("call_")
    assert len(deltas) > 2  # arguments come as they are generated
    assert "".join(d.function.arguments or "" for d in deltas) == whole.function.arguments
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.slow  # ~200 generated tokens; the parsing itself is test_calls_before_cut's
def test_required_cut_by_max_tokens_returns_the_complete_calls(client):
    """Parallel calls allowed, the model repeats its call until max_tokens: the calls it completed
    come back, the one cut off dropped, finish_reason "length" kept; streamed alike. Cut before
    its first call is complete, the reply is the text, as before."""
    kwargs = dict(model=MODEL_NAME, messages=REPEATS, tools=TOOLS[:1], tool_choice="required",
                  max_tokens=CUT_TOKENS, temperature=0)
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None, choice
    check_calls(choice.message.tool_calls)
    assert len(choice.message.tool_calls) >= 2  # several whole calls before the cut
    chunks = [c for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == \
        [(i, c.function.name, c.function.arguments) for i, c in enumerate(choice.message.tool_calls)]
    assert chunks[-1].choices[0].finish_reason == "length"
    short = client.chat.completions.create(**{**kwargs, "max_tokens": 5}).choices[0]
    assert short.finish_reason == "length" and short.message.tool_calls is None and short.message.content


def test_calls_before_cut():
    plan = plan_tools(TOOLS, "required", True, False)
    whole = '{"name": "get_time", "arguments": {"timezone": "UTC"}}'
    got = calls_before_cut(plan, f'[{whole}, {whole},{{"name": "get_weather", "arguments": {{"city": "Pa')
    assert [(c.name, json.loads(c.arguments)) for c in got] == [("get_time", {"timezone": "UTC"})] * 2
    assert calls_before_cut(plan, '[{"name": "get_time", "argum') == []
    assert calls_before_cut(plan, "") == [] and calls_before_cut(plan, "[") == []
    assert len(calls_before_cut(plan, f"[{whole}]")) == 1
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "get_time"}}, True, False)
    assert calls_before_cut(named, f"[{whole},") == []  # a named call is its arguments: nothing whole


HERMES_CALL = (r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Paris", "unit": "celsius"\}\}'
               r'\n</tool_call>')


def test_auto_parses_the_models_own_calls(client):
    """auto: the hermes parser takes calls out of the text (the text is held to a hermes call by a
    regex here, since this small model does not write one by itself); streamed and not alike."""
    kwargs = dict(model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=200, temperature=0,
                  extra_body={"structured_outputs": {"regex": r"Let me check\. " + HERMES_CALL}})
    r = client.chat.completions.create(**kwargs)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}
    chunks = [c for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert content.strip() == "Let me check." and "<tool" not in content
    assert [(d.function.name, json.loads(d.function.arguments)) for d in calls] == \
        [("get_weather", {"city": "Paris", "unit": "celsius"})]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_without_a_call_is_plain_text(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS, max_tokens=12, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


@pytest.mark.parametrize("extra, param, words", [
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "'nope'"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "sometimes"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools", "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "tools[0]"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "tool_choice required"),
    ({"functions": [{"name": "f"}]}, "functions", "tools and tool_choice"),
])
def test_bad_tool_requests_are_400(client, extra, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=4, extra_body=extra)
    assert e.value.body["param"] == param and words in e.value.body["message"], e.value.body


def test_auto_needs_the_server_flags():
    with pytest.raises(OpenAIError, match="--enable-auto-tool-choice") as e:
        plan_tools(TOOLS, "auto", True, auto_enabled=False)
    assert e.value.param == "tool_choice"
    assert plan_tools(TOOLS, None, True, auto_enabled=False).mode == "none"  # vLLM's default without a parser
    assert plan_tools(TOOLS, None, True, auto_enabled=True).mode == "auto"   # OpenAI's


def test_parsers():
    hermes = HermesParser()
    text = 'Sure.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>{"name": "b", ' \
           '"arguments": {}}</tool_call>'
    content, calls = hermes.extract(text)
    assert content == "Sure." and [(c.name, json.loads(c.arguments)) for c in calls] == [("a", {"x": 1}), ("b", {})]
    assert hermes.extract("no calls here") == ("no calls here", [])
    assert hermes.extract('x <tool_call>{"name": "a", "argu')[1] == []  # cut short: left as text
    assert hermes.held("text <tool_") == len("<tool_") and hermes.held("text") == 0

    llama = Llama3JsonParser()
    content, calls = llama.extract('<|python_tag|>{"name": "a", "parameters": {"x": 2}}; {"name": "b", '
                                   '"parameters": {"y": "z"}}')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("a", {"x": 2}),
                                                                                      ("b", {"y": "z"})]
    assert llama.extract("Paris is sunny.") == ("Paris is sunny.", [])
    assert llama.held("  ") == 2 and llama.held("<|pyth") == len("<|pyth")

    openai = PARSERS["openai"]()  # gpt-oss's harmony calls, both header orders, after any text
    content, calls = openai.extract('Checking.<|start|>assistant<|channel|>commentary to=functions.a <|constrain|>json'
                                    '<|message|>{"x": 1}<|call|><|start|>assistant to=functions.b<|channel|>commentary'
                                    ' json<|message|>{}')
    assert content == "Checking." and [(c.name, json.loads(c.arguments)) for c in calls] == [("a", {"x": 1}), ("b", {})]
    assert openai.extract("<|channel|>commentary to=functions.a <|message|>{") == \
        ("<|channel|>commentary to=functions.a <|message|>{", [])  # cut short: left as text
    assert openai.held("Sure<|channel|>commentary to=fun") == len("<|channel|>commentary to=fun")
    assert openai.held("Sure<|chan") == len("<|chan") and openai.held("Sure") == 0

    mistral = MistralParser()
    content, calls = mistral.extract('[TOOL_CALLS][{"name": "a", "arguments": {"q": "w"}}]')
    assert content is None and calls[0].name == "a" and json.loads(calls[0].arguments) == {"q": "w"}


def test_the_cli_offers_every_parser():
    import argparse

    sub = argparse.ArgumentParser().add_subparsers()
    serve = add_serve_parser(sub)
    action = next(a for a in serve._actions if a.dest == "tool_call_parser")
    assert set(action.choices) == set(PARSERS)

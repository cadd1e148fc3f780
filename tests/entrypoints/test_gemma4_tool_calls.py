"""Gemma 4's tool calls (`--tool-call-parser gemma4`): its argument syntax read back as JSON, calls
taken out of whole replies and of replies streamed a character at a time (after its thought
channel too), malformed calls left as content; Gemma 4's own chat template (llama.cpp's vendored
copy, where its source was fetched) renders a conversation with tools, calls and their results,
and the calls it writes parse back to what was sent; and, in the slow sweep, a small random
Gemma 4 served with that template and the official `openai` client."""
from __future__ import annotations

import json

import pytest

from pagellm.entrypoints.openai.gemma4_syntax import parse_object
from pagellm.entrypoints.openai.reasoning import REASONING_PARSERS, ReasoningStream
from pagellm.entrypoints.openai.serving_chat import ChoiceDeltas, OpenAIServingChat, ToolDeltas
from pagellm.entrypoints.openai.tool_calls import KEEPS_SPECIAL_TOKENS, PARSERS, plan_tools

GEMMA4 = PARSERS["gemma4"]()
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "days": {"type": "integer"}},
                                               "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "description": "Time in a timezone",
                                           "parameters": {"type": "object", "properties": {}}}}]
# Two calls as Gemma 4's template writes an assistant's (keys sorted and bare, strings between
# <|"|>, the text inside them as is), quoted from its rendering in test_real_template_round_trip;
# then the token that ends a turn of calls, kept in the text with the special tokens.
CALLS = ('<|tool_call>call:get_weather{city:<|"|>Paris, {France}: "x"<|"|>,days:3,nested:{n:-2,unit:<|"|>celsius'
         '<|"|>},none:None,ok:true,scale:1.5e-05,tags:[<|"|>a<|"|>,2,{k:[false]}]}<tool_call|>'
         '<|tool_call>call:get_time{}<tool_call|><|tool_response>')
WANT = [("get_weather", {"city": 'Paris, {France}: "x"', "days": 3, "nested": {"n": -2, "unit": "celsius"},
                         "none": None, "ok": True, "scale": 1.5e-05, "tags": ["a", 2, {"k": [False]}]}),
        ("get_time", {})]


def _calls(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) if hasattr(c, "name") else
            (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_gemma4_syntax_reads_back_as_json():
    text = ' { a : 1 , b:[ ], c:{}, <|"|>quoted key<|"|>:null }'
    assert parse_object(text, 0) == ({"a": 1, "b": [], "c": {}, "quoted key": None}, len(text))
    value, end = parse_object('{x:<|"|><|"|>,y:-0.5,z:1E+3}tail', 0)
    assert value == {"x": "", "y": -0.5, "z": 1000.0} and end == len('{x:<|"|><|"|>,y:-0.5,z:1E+3}')
    assert isinstance(parse_object("{n:7}", 0)[0]["n"], int)  # an integer stays one in the JSON
    for bad in ("{city:Paris}", '{city:<|"|>Paris}', "{a:1,}", "{a 1}", "{a:1", "[1]", "{a:[1 2]}", "{a:nan}",
                "{:1}", '{a:<|"|>x<|"|>"}'):
        with pytest.raises(ValueError):
            parse_object(bad, 0)


def test_gemma4_parser_takes_out_its_calls():
    content, calls = GEMMA4.extract("Let me check.\n" + CALLS)
    assert content == "Let me check." and _calls(calls) == WANT
    assert GEMMA4.extract(CALLS)[0] is None
    # Whitespace between calls and the turn's end markers after them are no content.
    assert _calls(GEMMA4.extract('<|tool_call>call:get_time{}<tool_call|>\n <|tool_call>call:get_weather'
                                 '{city:<|"|>Oslo<|"|>}<tool_call|><turn|>')[1]) == \
        [("get_time", {}), ("get_weather", {"city": "Oslo"})]
    assert GEMMA4.extract("Paris is sunny.") == ("Paris is sunny.", [])
    # parallel_tool_calls false: the first call only.
    one = plan_tools(TOOLS, "auto", False, True)
    assert _calls(one.parse_auto(GEMMA4, CALLS)[1]) == WANT[:1]
    assert "gemma4" in KEEPS_SPECIAL_TOKENS  # its markers are special tokens: they must reach the parser


@pytest.mark.parametrize("text", [
    '<|tool_call>call:get_weather{city:<|"|>Par',                          # cut short by max_tokens
    '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}',                  # not closed
    '<|tool_call>get_weather{city:<|"|>Paris<|"|>}<tool_call|>',           # no call:
    "<|tool_call>call:get_weather{city:Paris}<tool_call|>",                # a string without its delimiters
    '<|tool_call>call:get_weather{"city": "Paris"}<tool_call|>',           # JSON is not Gemma's syntax
    '<|tool_call>call:get_time{}<tool_call|> and then I will answer.',     # text after the calls
    "<|tool_call>call:{}<tool_call|>",                                     # no name
])
def test_malformed_gemma4_calls_stay_content(text):
    assert GEMMA4.extract("Sure. " + text) == ("Sure. " + text, [])


def test_gemma4_holds_back_a_marker_cut_across_chunks():
    assert GEMMA4.held("Sure <|tool_") == len("<|tool_") and GEMMA4.held("Sure") == 0
    assert GEMMA4.start("Sure <|tool_call>call:") == len("Sure ")


def _stream(plan, text: str, thinking: ReasoningStream | None) -> tuple[dict, str | None]:
    """The deltas of `text` streamed a character at a time, joined."""
    deltas = ChoiceDeltas(ToolDeltas(plan, PARSERS["gemma4"]()), thinking)
    sent = {"reasoning_content": "", "content": "", "tool_calls": []}
    finish = None
    for i in range(1, len(text) + 1):
        delta, finish = deltas.advance(text[:i], i == len(text), "stop" if i == len(text) else None)
        for key in ("reasoning_content", "content"):
            sent[key] += delta.get(key) or ""
        sent["tool_calls"] += delta.get("tool_calls", [])
    return sent, finish


@pytest.mark.parametrize("think", [False, True])
def test_gemma4_calls_whole_and_streamed(think):
    """The chat endpoint's reply and its stream agree: content before the calls, the calls (after
    Gemma 4's thought channel, which the gemma4 reasoning parser takes out first); a malformed call
    is content, finish_reason stop."""
    chat = object.__new__(OpenAIServingChat)
    chat.tool_call_parser = "gemma4"
    plan = plan_tools(TOOLS, "auto", True, True)
    reasoning = REASONING_PARSERS["gemma4"]()
    thought = "<|channel>thought\nThe user wants weather.<channel|>" if think else ""
    bad = '<|tool_call>call:get_weather{city:Paris}<tool_call|>'
    for text, content, calls in [(thought + "Checking. " + CALLS, "Checking.", WANT),
                                 (thought + bad, bad, [])]:
        thinking = ReasoningStream(reasoning, False) if think else None
        message, finish = chat.reply(plan, text, "stop", thinking)
        assert message["content"] == content and _calls(message.get("tool_calls", [])) == calls, message
        assert finish == ("tool_calls" if calls else "stop")
        assert message.get("reasoning_content") == ("The user wants weather." if think else None)
        sent, streamed_finish = _stream(plan, text, ReasoningStream(reasoning, False) if think else None)
        assert sent["content"].strip() == content and _calls(sent["tool_calls"]) == calls
        assert [c["index"] for c in sent["tool_calls"]] == list(range(len(calls)))
        assert (sent["reasoning_content"] or None) == message.get("reasoning_content")
        assert streamed_finish == finish


# ---- Gemma 4's own chat template -----------------------------------------------------------------

# Gemma 4's control tokens, one token each as in its tokenizer.
GEMMA4_TOKENS = ("<|turn>", "<turn|>", "<|tool_call>", "<tool_call|>", '<|"|>', "<|tool>", "<tool|>",
                 "<|tool_response>", "<tool_response|>", "<|channel>", "<channel|>", "<|think|>")


def _real_template(name: str = "google-gemma-4-31B-it.jinja") -> str:
    from pathlib import Path

    from pagellm.envs import llama_cpp_bin
    path = Path(llama_cpp_bin()).parents[1] / "src" / "models" / "templates" / name
    if not path.is_file():
        pytest.skip(f"llama.cpp's source with its vendored templates is not here ({path})")
    return path.read_text()


def _agent_turn(arguments: dict) -> list[dict]:
    """A user's question, the assistant's two calls (content null, arguments as JSON text, as the
    OpenAI SDK sends them back) and the tools' results."""
    return [{"role": "user", "content": "Weather in Paris, and the time?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": json.dumps(arguments)}},
                {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"temperature": 18})},
            {"role": "tool", "tool_call_id": "call_2", "content": "noon"}]


@pytest.mark.parametrize("name", ["google-gemma-4-31B-it.jinja", "google-gemma-4-31B-it-interleaved.jinja"])
def test_real_template_round_trip(tmp_path, name):
    """Rendered through the chat endpoint's message handling and pagellm's sandbox: the tools are
    declared, the calls written in Gemma's syntax (CALLS quotes this) and the calls the template
    wrote parse back to the arguments sent. The current template writes each result after them
    as a `<|tool_response>response:NAME{value:...}` block and opens no new model turn (the model
    goes on in the turn of its calls); the earlier, interleaved revision reads results only from
    an assistant's `tool_responses` (Google's own field) and writes OpenAI's `tool` messages as
    turns of their own."""
    from pagellm.entrypoints.openai.protocol import ChatCompletionRequest
    from pagellm.loader.synthetic import write_byte_tokenizer
    from pagellm.loader.tokenizer import Tokenizer

    write_byte_tokenizer(tmp_path, 400, _real_template(name), GEMMA4_TOKENS)
    tok = Tokenizer.from_hf_dir(str(tmp_path))
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": _agent_turn(WANT[0][1]), "tools": TOOLS})
    convo = [OpenAIServingChat.message_dict(m, i) for i, m in enumerate(req.messages)]
    text = tok.apply_chat_template(convo, tools=TOOLS, add_generation_prompt=True)
    assert "<|tool>declaration:get_weather{description:<|\"|>Weather in a city<|\"|>" in text
    written = text[text.index("<|tool_call>"):]
    calls = CALLS.removesuffix("<|tool_response>")
    assert written.startswith(calls)
    content, parsed = GEMMA4.extract(written[:len(calls)])
    assert content is None and _calls(parsed) == WANT
    results = written[len(calls):]
    if "interleaved" in name:
        assert results.startswith('<turn|>\n<|turn>tool\n{"temperature": 18}<turn|>'), results
        return
    assert results == ('<|tool_response>response:get_weather{value:<|"|>{"temperature": 18}<|"|>}<tool_response|>'
                       '<|tool_response>response:get_time{value:<|"|>noon<|"|>}<tool_response|>')


# ---- served ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gemma4_server(tmp_path_factory):
    """A small random Gemma 4 with its real chat template and control tokens, tool calls parsed by gemma4."""
    from pagellm.loader.synthetic import write_byte_tokenizer
    from server_utils import RemoteServer
    from tests.models.families import build

    template = _real_template()
    path = build("gemma4", tmp_path_factory.mktemp("gemma4"))
    write_byte_tokenizer(path, 320, template, GEMMA4_TOKENS)
    server = RemoteServer([str(path), "--served-model-name", "gemma4", "--kv-cache-memory", "16M",
                           "--max-model-len", "512", "--enable-auto-tool-choice", "--tool-call-parser", "gemma4",
                           "--reasoning-parser", "auto"])
    yield server
    server.close()


@pytest.mark.slow  # builds and serves a Gemma 4 model: about 20 s
def test_served_gemma4_calls_with_the_openai_client(gemma4_server):
    """auto: the reply (held to Gemma 4's call syntax by a regex, since a random model writes no call
    by itself) comes back as OpenAI tool calls, whole and streamed; the agent's turn sent back
    renders and the conversation goes on; required and a named call are enforced by their grammar
    on this model too."""
    import re

    client = gemma4_server.client(timeout=120)
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    reply = 'Checking. <|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:2}<tool_call|>'
    kwargs = dict(model="gemma4", messages=ask, tools=TOOLS, tool_choice="auto", max_tokens=120, temperature=0,
                  extra_body={"structured_outputs": {"regex": re.escape(reply)}})
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking.", choice
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris", "days": 2})
    chunks = [c for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks).strip() == "Checking."
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert [(d.function.name, json.loads(d.function.arguments)) for d in deltas] == \
        [("get_weather", {"city": "Paris", "days": 2})]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    history = ask + [choice.message.model_dump(exclude_none=False),
                     {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18})}]
    follow = client.chat.completions.create(model="gemma4", messages=history, tools=TOOLS, max_tokens=4,
                                            temperature=0)
    assert follow.choices[0].finish_reason in ("stop", "length")

    # get_time takes no arguments, so the random model's forced call is short.
    for tool_choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        forced = client.chat.completions.create(model="gemma4", messages=ask, tools=TOOLS[1:], tool_choice=tool_choice,
                                                max_tokens=40, temperature=0).choices[0]
        assert [(c.function.name, json.loads(c.function.arguments)) for c in forced.message.tool_calls or []] == \
            [("get_time", {})], forced

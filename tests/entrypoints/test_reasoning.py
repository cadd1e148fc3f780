"""Reasoning parsers: each one on whole replies and on the same replies cut into chunks at every
place (tags split across chunks), a prompt that already ends inside the reasoning, no tags at
all; `auto` from chat templates; and end to end, `reasoning_content` from a served tiny random
model whose chat template opens `<think>` (Qwen3's shape), with the official `openai` client."""
from __future__ import annotations

import argparse
import json

import pytest

from pagellm.entrypoints.openai.cli_args import add_serve_parser
from pagellm.entrypoints.openai.reasoning import (REASONING_PARSERS, ReasoningStream, Split,
                                                  parser_for_template)

QWEN3 = REASONING_PARSERS["qwen3"]()
R1 = REASONING_PARSERS["deepseek_r1"]()
GRANITE = REASONING_PARSERS["granite"]()
GPT_OSS = REASONING_PARSERS["gpt_oss"]()
GEMMA4 = REASONING_PARSERS["gemma4"]()


@pytest.mark.parametrize("parser, text, opened, want", [
    (QWEN3, "<think>\nstep 1\n</think>\n\nThe answer.", False, Split("step 1", "The answer.")),
    (QWEN3, "step 1\n</think>\n\nThe answer.", True, Split("step 1", "The answer.")),  # the template opened it
    (QWEN3, "The answer.", False, Split(None, "The answer.")),  # no tags: thinking off
    (QWEN3, "<think>cut short", False, Split("cut short", None)),  # max_tokens inside the reasoning
    (QWEN3, "still thinking", True, Split("still thinking", None)),
    (QWEN3, "<think></think>Hi", False, Split("", "Hi")),
    (QWEN3, "Hi <think>not at the start</think>", False, Split(None, "Hi <think>not at the start</think>")),
    (R1, "no start tag</think>Answer", False, Split("no start tag", "Answer")),  # an R1 distill's shape
    (R1, "<think>a</think>b", False, Split("a", "b")),
    (R1, "only reasoning", False, Split("only reasoning", None)),
    (GRANITE, "Here is my thought process: sum it Here is my response: 4", False, Split("sum it", "4")),
    (GRANITE, "Here's my thought process: x\nHere's my response: y", False, Split("x", "y")),
    (GRANITE, "Just 4.", False, Split(None, "Just 4.")),
    # Granite 3.2's own layout: each phrase on its line, the answer after a blank line.
    (GRANITE, "Here is my thought process:\nadd them\n\nHere is my response:\n4", False, Split("add them", "4")),
    (GRANITE, "Here is my response:\n4", False, Split(None, "4")),  # the thought skipped: no marker leaks
    (GRANITE, " add them\nHere's my response: 4", True, Split("add them", "4")),  # the prompt opened the thought
    (GRANITE, "Here is my thought process: cut short", False, Split("cut short", None)),
    (GRANITE, "Here is the answer: 4", False, Split(None, "Here is the answer: 4")),  # shares the markers' lead
    # Granite 3.3's tags, asked for by the same template switch.
    (GRANITE, "<think>add them</think>\n<response>4</response>", False, Split("add them", "4")),
    (GRANITE, "<response>4</response>", False, Split(None, "4")),
    (GRANITE, "<think>add them</think>4", False, Split("add them", "4")),
    (GPT_OSS, "<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>final<|message|>Hi<|return|>",
     False, Split("think", "Hi")),
    (GPT_OSS, "<|channel|>final<|message|>Hi", False, Split(None, "Hi")),
    # A tool call after the analysis: its commentary header goes with the answer, to the tool parser.
    (GPT_OSS, "<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>commentary to=functions.add "
     "<|constrain|>json<|message|>{}<|call|>", False,
     Split("think", "<|channel|>commentary to=functions.add <|constrain|>json<|message|>{}<|call|>")),
    (GPT_OSS, "think<|end|><|start|>assistant to=functions.add<|channel|>commentary json<|message|>{}", True,
     Split("think", " to=functions.add<|channel|>commentary json<|message|>{}")),
    (GEMMA4, "<|channel>thought\nadd them<channel|>4", False, Split("add them", "4")),
    (GEMMA4, "4<|channel>thought\n<channel|>", False, Split(None, "4")),  # a trailing empty channel dropped
    (GEMMA4, "\nadd them<channel|>4<channel|>", True, Split("add them", "4")),
    (GEMMA4, "4", False, Split(None, "4")),
])
def test_split_whole_and_in_every_pair_of_chunks(parser, text, opened, want):
    assert parser.split(text, opened) == want
    # Streamed: each prefix is a chunk boundary; the deltas add up to the whole reply's split,
    # and no tag (nor part of one) leaks into what was sent before the end.
    for cut in range(len(text) + 1):
        stream = ReasoningStream(parser, opened)
        first, content_then = stream.advance(text[:cut], finished=False)
        rest, content = stream.advance(text, finished=True)
        assert first + rest == (want.reasoning or ""), cut
        assert content == want.content
        if content_then is not None:
            assert (want.content or "").startswith(content_then), (cut, content_then)
        assert "<th" not in first and "</" not in first and "<|" not in first, (cut, first)


def test_a_stream_sends_nothing_it_takes_back():
    """Character by character: the reasoning sent only grows, the answer never contains a tag."""
    text = "<think>\nabc </thin</think>\n\nHello <think> world"
    stream = ReasoningStream(QWEN3, False)
    sent, contents = "", []
    for i in range(1, len(text) + 1):
        new, content = stream.advance(text[:i], finished=False)
        sent += new
        if content is not None:
            contents.append(content)
    assert sent == "abc </thin" and contents[-1] == "Hello <think> world"
    assert all(b.startswith(a) for a, b in zip(contents, contents[1:]))


def test_the_prompt_says_whether_the_reasoning_is_open():
    assert QWEN3.opens_in("<|im_start|>assistant\n<think>\n")
    assert not QWEN3.opens_in("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # enable_thinking false
    assert not QWEN3.opens_in("<|im_start|>assistant\n")
    assert GRANITE.opens_in("... Here is my thought process:")
    earlier = "<|start|>assistant<|channel|>analysis<|message|>hm<|end|><|start|>assistant<|channel|>commentary"
    assert not GPT_OSS.opens_in(earlier + " to=functions.f<|message|>{}<|call|><|start|>assistant")
    assert GPT_OSS.opens_in("<|start|>assistant<|channel|>analysis<|message|>")


def test_auto_reads_the_chat_template():
    assert parser_for_template("{{ '<|start|>assistant<|channel|>final<|message|>' }}") == "gpt_oss"
    assert parser_for_template("{% if enable_thinking is false %}<think>\n\n</think>{% endif %}") == "qwen3"
    assert parser_for_template("{{ '<｜Assistant｜><think>\\n' }}") == "deepseek_r1"
    assert parser_for_template("Here is my thought process: ...") == "granite"
    assert parser_for_template("{{ messages }}") is None and parser_for_template(None) is None


# Granite 3.2's chat template, reduced to what the parser depends on (written here, not copied): the
# switch is the template variable `thinking` (off unless set), and it only asks, in the system
# prompt, for the two phrases, which the reply then writes itself; that prose says "thinking".
GRANITE_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}"
    "{%- set rest = messages[1:] %}{%- else %}{%- set system = \"You are Granite.\" %}"
    "{%- if thinking %}{%- set system = system + \" Use a thinking process: write your thoughts after "
    "'Here is my thought process:' and write your response after 'Here is my response:'.\" %}{%- endif %}"
    "{%- set rest = messages %}{%- endif %}"
    "{{- '<|start_of_role|>system<|end_of_role|>' + system + '<|end_of_text|>\\n' }}"
    "{%- for m in rest %}{{- '<|start_of_role|>' + m['role'] + '<|end_of_role|>' + m['content'] }}"
    "{%- if loop.last and add_generation_prompt %}{{- '<|end_of_text|>\\n<|start_of_role|>assistant<|end_of_role|>' }}"
    "{%- else %}{{- '<|end_of_text|>\\n' }}{%- endif %}{%- endfor %}"
)


def test_granites_template_and_switch():
    """Granite's switch is `thinking` (read in the template's code, not in its prose), reached by
    Ollama's think, reasoning efforts and Anthropic's thinking; its rendered prompt quotes both
    phrases, yet neither opens nor closes the reply's reasoning."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from pagellm.entrypoints.anthropic.protocol import MessagesRequest, to_chat
    from pagellm.entrypoints.openai.reasoning import effort_switch, switch_variable, thinking_switch

    assert parser_for_template(GRANITE_TEMPLATE) == "granite"
    assert switch_variable(GRANITE_TEMPLATE) == "thinking"
    assert switch_variable(THINKING_TEMPLATE) == "enable_thinking"
    assert switch_variable("{{ 'a thinking process' }}{{ message.thinking }}") is None
    assert thinking_switch(GRANITE_TEMPLATE, True, "think", True) == {"thinking": True}
    assert thinking_switch(GRANITE_TEMPLATE, False, "think", True) == {"thinking": False}
    assert effort_switch(GRANITE_TEMPLATE, "none", "reasoning_effort", True) == {"thinking": False}

    def anthropic(thinking: dict) -> dict | None:
        req = MessagesRequest.model_validate({"model": "m", "max_tokens": 8, "messages": ASK, "thinking": thinking})
        return to_chat(req, GRANITE_TEMPLATE, True).chat_template_kwargs
    assert anthropic({"type": "enabled", "budget_tokens": 4}) == {"thinking": True}
    assert anthropic({"type": "disabled"}) == {"thinking": False}

    template = ImmutableSandboxedEnvironment().from_string(GRANITE_TEMPLATE)
    on = template.render(messages=ASK, add_generation_prompt=True, thinking=True)
    off = template.render(messages=ASK, add_generation_prompt=True)
    assert "Here is my thought process:" in on and "thought process" not in off
    for prompt in (on, off):
        assert not GRANITE.opens_in(prompt) and not GRANITE.closes(prompt)


def test_the_cli_offers_every_parser():
    serve = add_serve_parser(argparse.ArgumentParser().add_subparsers())
    action = next(a for a in serve._actions if a.dest == "reasoning_parser")
    assert set(action.choices) == {"auto", *REASONING_PARSERS}


# ---- end to end ------------------------------------------------------------------------------------

# Qwen3's shape: the generation prompt opens <think>, unless enable_thinking is false; an
# assistant's reasoning sent back is shown in its turn.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m.get('reasoning_content') %}<think>{{ m['reasoning_content'] }}</think>{% endif %}"
    "{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and enable_thinking is false %}<think></think>{% else %}<think>{% endif %}"
    "{% endif %}"
)
ASK = [{"role": "user", "content": "2+2?"}]
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory):
    from pagellm.loader.synthetic import write_byte_tokenizer, write_dummy_model_dir
    from server_utils import RemoteServer

    path = write_dummy_model_dir(tmp_path_factory.mktemp("thinking"), "tiny")
    write_byte_tokenizer(path, 320, THINKING_TEMPLATE)
    server = RemoteServer([path, "--load-format", "dummy", "--served-model-name", "thinker",
                           "--kv-cache-memory", "16M", "--max-model-len", "512", "--reasoning-parser", "auto",
                           "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                           # The random model's reasoning is forced by a grammar over the whole reply.
                           "--structured-outputs-config", '{"enable_in_reasoning": true}'])
    yield server
    server.close()


def forced(regex: str) -> dict:
    """The random model's reply held to `regex` (it writes nothing sensible by itself)."""
    return {"structured_outputs": {"regex": regex}}


def test_reasoning_content_whole_and_streamed(thinking_server):
    client = thinking_server.client(timeout=120)
    kwargs = dict(model="thinker", messages=ASK, max_tokens=64, temperature=0,
                  extra_body=forced(r"two and two\n</think>\n\nfour"))
    message = client.chat.completions.create(**kwargs).choices[0].message
    assert message.reasoning_content == "two and two" and message.content == "four"
    chunks = [c.choices[0] for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    reasoning = "".join(getattr(c.delta, "reasoning_content", None) or "" for c in chunks)
    content = "".join(c.delta.content or "" for c in chunks)
    assert (reasoning, content) == ("two and two", "four")
    first_content = next(i for i, c in enumerate(chunks) if c.delta.content)
    assert all(not getattr(c.delta, "reasoning_content", None) for c in chunks[first_content:])

    # Cut short while thinking: all reasoning, no answer.
    cut = client.chat.completions.create(**{**kwargs, "max_tokens": 5}).choices[0]
    assert cut.finish_reason == "length" and cut.message.reasoning_content == "two a"
    assert cut.message.content is None


def test_thinking_switched_off_and_reasoning_sent_back(thinking_server):
    client = thinking_server.client(timeout=120)
    off = client.chat.completions.create(model="thinker", messages=ASK, max_tokens=16, temperature=0,
                                         extra_body={**forced("four"),
                                                     "chat_template_kwargs": {"enable_thinking": False}})
    assert off.choices[0].message.content == "four" and off.choices[0].message.reasoning_content is None
    history = ASK + [{"role": "assistant", "content": "four", "reasoning_content": "two and two"},
                     {"role": "user", "content": "and 3+3?"}]
    ids = json.loads(__import__("httpx").post(thinking_server.url + "/tokenize",
                                              json={"messages": history}).text)["tokens"]
    detok = __import__("httpx").post(thinking_server.url + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert "<think>two and two</think>four" in detok


def test_tool_calls_come_from_the_answer_only(thinking_server):
    """A call written in the reasoning is thought, not called; the one in the answer is."""
    client = thinking_server.client(timeout=120)
    call = r'<tool_call>\{"name": "add", "arguments": \{"a": 2\}\}</tool_call>'
    kwargs = dict(model="thinker", messages=ASK, tools=TOOLS, max_tokens=200, temperature=0,
                  extra_body=forced(r"maybe " + call + r"</think>ok " + call))
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning_content.startswith("maybe <tool_call>")
    assert choice.message.content == "ok"
    (tc,) = choice.message.tool_calls
    assert tc.function.name == "add" and json.loads(tc.function.arguments) == {"a": 2}
    chunks = [c.choices[0] for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    reasoning = "".join(getattr(c.delta, "reasoning_content", None) or "" for c in chunks)
    calls = [d for c in chunks for d in (c.delta.tool_calls or [])]
    assert reasoning == choice.message.reasoning_content and len(calls) == 1
    assert "".join(c.delta.content or "" for c in chunks).strip() == "ok"
    assert chunks[-1].finish_reason == "tool_calls"


def test_thinking_blocks_in_the_messages_api(thinking_server):
    """Anthropic's Messages API gives the reasoning as a thinking block before the text, and
    streams it as thinking_delta events; a thinking block sent back reaches the template."""
    import anthropic

    client = anthropic.Anthropic(base_url=thinking_server.url, api_key="none", max_retries=0, timeout=120)
    kwargs = dict(model="thinker", max_tokens=64, messages=ASK,
                  extra_body={"temperature": 0, **forced(r"two and two</think>four")})
    r = client.messages.create(**kwargs)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in r.content] == \
        [("thinking", "two and two"), ("text", "four")]
    with client.messages.stream(**kwargs) as stream:
        thought = "".join(e.delta.thinking for e in stream
                          if e.type == "content_block_delta" and e.delta.type == "thinking_delta")
        final = stream.get_final_message()
    assert thought == "two and two" and [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[1].text == "four" and final.stop_reason == "end_turn"
    off = client.messages.create(**{**kwargs, "extra_body": {"temperature": 0, **forced("four")}},
                                 thinking={"type": "disabled"})
    assert [b.type for b in off.content] == ["text"]
    back = ASK + [{"role": "assistant", "content": [{"type": "thinking", "thinking": "two and two", "signature": ""},
                                                    {"type": "text", "text": "four"}]},
                  {"role": "user", "content": "and 3+3?"}]
    with_thought = client.messages.count_tokens(model="thinker", messages=back).input_tokens
    without = client.messages.count_tokens(model="thinker", messages=[back[0], {"role": "assistant", "content": "four"},
                                                                      back[2]]).input_tokens
    assert with_thought == without + len("<think>two and two</think>")  # one token a byte


def test_reasoning_items_in_the_responses_api(thinking_server):
    """The Responses API gives the reasoning as a reasoning item (reasoning_text) before the
    message, streams it as reasoning_text deltas, counts its tokens; effort none switches it off."""
    client = thinking_server.client(timeout=120)
    kwargs = dict(model="thinker", input="2+2?", max_output_tokens=64, temperature=0,
                  extra_body=forced(r"two and two</think>four"))
    r = client.responses.create(**kwargs)
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "two and two" and r.output_text == "four"
    assert r.usage.output_tokens_details.reasoning_tokens == len("two and two")  # one token a byte
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thought == "two and two" and final.output_text == "four"
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    # The reasoning item sent back reaches the template, as reasoning_content does on the chat endpoint.
    follow = client.responses.create(model="thinker", previous_response_id=r.id, input="and 3+3?",
                                     max_output_tokens=4, temperature=0, extra_body=forced("six"))
    whole = client.chat.completions.create(model="thinker", max_tokens=4, temperature=0, extra_body=forced("six"),
                                           messages=ASK + [{"role": "assistant", "content": "four",
                                                            "reasoning_content": "two and two"},
                                                           {"role": "user", "content": "and 3+3?"}])
    assert follow.usage.input_tokens == whole.usage.prompt_tokens
    off = client.responses.create(**{**kwargs, "extra_body": forced("four")}, reasoning={"effort": "none"})
    assert [item.type for item in off.output] == ["message"] and off.output_text == "four"


def test_thinking_in_the_ollama_api(thinking_server):
    """Ollama's message.thinking (and generate's thinking), whole and streamed; think false
    switches it off. (The ollama client sends no extra fields: the forcing regex goes by httpx.)"""
    import httpx

    def post(path: str, **body) -> list[dict]:
        body = {"model": "thinker", "options": {"temperature": 0, "num_predict": 64}, **body}
        r = httpx.post(thinking_server.url + path, json=body, timeout=120)
        assert r.status_code == 200, r.text
        return [json.loads(line) for line in r.text.splitlines()]

    kwargs = dict(messages=ASK, structured_outputs={"regex": r"two and two</think>four"})
    (whole,) = post("/api/chat", stream=False, **kwargs)
    assert whole["message"]["thinking"] == "two and two" and whole["message"]["content"] == "four"
    lines = post("/api/chat", **kwargs)
    assert "".join(x["message"].get("thinking", "") for x in lines) == "two and two"
    assert "".join(x["message"]["content"] for x in lines) == "four" and lines[-1]["done"]
    (gen,) = post("/api/generate", prompt="2+2?", stream=False, structured_outputs={"regex": r"hm</think>four"})
    assert (gen["thinking"], gen["response"]) == ("hm", "four")
    (off,) = post("/api/chat", stream=False, think=False, messages=ASK, structured_outputs={"regex": "four"})
    assert off["message"] == {"role": "assistant", "content": "four"}


def test_the_thinking_switch_refuses_what_the_template_cannot_do():
    """Ollama's think and the Responses API's reasoning.effort reach the template only where it reads them."""
    from pagellm.entrypoints.openai.errors import OpenAIError
    from pagellm.entrypoints.openai.reasoning import thinking_switch

    assert thinking_switch(THINKING_TEMPLATE, False, "think", True) == {"enable_thinking": False}
    assert thinking_switch(THINKING_TEMPLATE, True, "think", True) == {"enable_thinking": True}
    assert thinking_switch("{{ reasoning_effort }}<|channel|>", "low", "think", True) == {"reasoning_effort": "low"}
    assert thinking_switch("<think>", True, "think", True) is None  # an R1 distill thinks by itself
    assert thinking_switch("", False, "think", False) is None  # a model that does not think, asked not to
    for template, think, splits, words in [(THINKING_TEMPLATE, "high", True, "takes no reasoning effort"),
                                           ("<think>", False, True, "no switch"),
                                           (THINKING_TEMPLATE, True, False, "--reasoning-parser")]:
        with pytest.raises(OpenAIError, match=words) as e:
            thinking_switch(template, think, "reasoning.effort", splits)
        assert e.value.param == "reasoning.effort"


def test_anthropic_output_config_effort_reaches_the_template_or_is_refused():
    """output_config.effort low..high goes where the chat template reads an effort (gpt-oss's
    reasoning_effort) beside the thinking switch; xhigh and max have no level there, and a template
    without one refuses every level: 400s that name output_config.effort and the value."""
    from pagellm.entrypoints.anthropic.protocol import MessagesRequest, to_chat
    from pagellm.entrypoints.openai.errors import OpenAIError

    def request(**extra):
        return MessagesRequest.model_validate({"model": "m", "max_tokens": 8, "messages": ASK, **extra})

    gpt_oss = "{{ reasoning_effort }}<|channel|>"
    for effort in ("low", "medium", "high"):
        chat = to_chat(request(output_config={"effort": effort}), gpt_oss, True)
        assert chat.chat_template_kwargs == {"reasoning_effort": effort}
    chat = to_chat(request(output_config={"effort": "low"}, thinking={"type": "disabled"}), gpt_oss, True)
    assert chat.chat_template_kwargs == {"enable_thinking": False, "reasoning_effort": "low"}
    assert to_chat(request(), gpt_oss, True).chat_template_kwargs is None
    for template, effort, words in [(gpt_oss, "max", "at most 'high'"), (gpt_oss, "xhigh", "at most 'high'"),
                                    (gpt_oss, "huge", "must be one of"),
                                    (THINKING_TEMPLATE, "high", "takes no reasoning effort")]:
        with pytest.raises(OpenAIError, match=words) as e:
            to_chat(request(output_config={"effort": effort}), template, True)
        assert e.value.param == "output_config.effort" and repr(effort) in str(e.value)


def test_the_reasoning_budget_closes_the_thinking(thinking_server):
    """thinking_token_budget N: N tokens of reasoning, then the close the template writes
    ("\n</think>\n\n") is forced, then the answer runs; the same in a stream. (allowed_token_ids
    keeps the random model to letters, one token each: the forced close is not among them.)"""
    import httpx

    client = thinking_server.client(timeout=120)
    letters = httpx.post(thinking_server.url + "/tokenize", json={"prompt": "abcdefghij"}).json()["tokens"]
    kwargs = dict(model="thinker", messages=ASK, max_tokens=6 + 11 + 5, temperature=0,
                  extra_body={"thinking_token_budget": 6, "allowed_token_ids": letters})
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert len(choice.message.reasoning_content) == 6 and set(choice.message.reasoning_content) <= set("abcdefghij")
    assert len(choice.message.content) == 5 and choice.finish_reason == "length"
    chunks = [c.choices[0] for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    reasoning = "".join(getattr(c.delta, "reasoning_content", None) or "" for c in chunks)
    assert (reasoning, "".join(c.delta.content or "" for c in chunks)) == \
        (choice.message.reasoning_content, choice.message.content)

    # Anthropic's thinking.budget_tokens is the same budget; its stream shows the same thinking.
    import anthropic

    claude = anthropic.Anthropic(base_url=thinking_server.url, api_key="none", max_retries=0, timeout=120)
    ask = dict(model="thinker", max_tokens=24, messages=ASK, thinking={"type": "enabled", "budget_tokens": 5},
               extra_body={"temperature": 0})
    r = claude.messages.create(**ask)
    assert [b.type for b in r.content] == ["thinking", "text"]
    assert 0 < len(r.content[0].thinking) <= 5  # 5 random bytes: at most 5 characters
    with claude.messages.stream(**ask) as stream:
        thought = "".join(e.delta.thinking for e in stream
                          if e.type == "content_block_delta" and e.delta.type == "thinking_delta")
        final = stream.get_final_message()
    assert thought == r.content[0].thinking and final.content[1].text == r.content[1].text

    # What it needs: room for the answer, no grammar over the reasoning; a number.
    for body, words in [({"thinking_token_budget": -1}, "thinking_token_budget must be an integer >= 0"),
                        ({"thinking_token_budget": 4, **forced("a+")}, "thinking_token_budget must be left out "
                                                                        "with structured outputs")]:
        r = httpx.post(thinking_server.url + "/v1/chat/completions", timeout=60,
                       json={"model": "thinker", "messages": ASK, "max_tokens": 8, **body})
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == "thinking_token_budget"


@pytest.fixture(scope="module")
def answer_server(tmp_path_factory):
    """The thinking model served as by default: a structured output's grammar starts after the reasoning."""
    from pagellm.loader.synthetic import write_byte_tokenizer, write_dummy_model_dir
    from server_utils import RemoteServer

    path = write_dummy_model_dir(tmp_path_factory.mktemp("answer"), "tiny")
    write_byte_tokenizer(path, 320, THINKING_TEMPLATE)
    server = RemoteServer([path, "--load-format", "dummy", "--served-model-name", "thinker",
                           "--kv-cache-memory", "16M", "--max-model-len", "512", "--reasoning-parser", "auto"])
    yield server
    server.close()


VERDICT = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
           "additionalProperties": False}
# The random model would fill any whitespace the grammar allows until max_tokens.
TIGHT_VERDICT = {"structured_outputs": {"json": VERDICT, "disable_any_whitespace": True}}


def test_the_grammar_starts_where_the_answer_starts(answer_server):
    """response_format and a forced tool call on a thinking model: the reasoning (random bytes from
    the random model, closed by thinking_token_budget) is free text, the answer follows the schema;
    the same streamed. With thinking switched off the grammar applies at once."""
    import jsonschema

    client = answer_server.client(timeout=120)
    kwargs = dict(model="thinker", messages=ASK, max_tokens=4 + 11 + 40, temperature=0,
                  extra_body={"thinking_token_budget": 4, **TIGHT_VERDICT})
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "stop" and choice.message.reasoning_content is not None
    jsonschema.validate(json.loads(choice.message.content), VERDICT)
    chunks = [c.choices[0] for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    assert "".join(getattr(c.delta, "reasoning_content", None) or "" for c in chunks) == \
        choice.message.reasoning_content
    assert "".join(c.delta.content or "" for c in chunks) == choice.message.content

    off = client.chat.completions.create(**{**kwargs, "extra_body": {
        "chat_template_kwargs": {"enable_thinking": False}, **TIGHT_VERDICT}}).choices[0]
    assert off.message.reasoning_content is None and off.finish_reason == "stop"
    jsonschema.validate(json.loads(off.message.content), VERDICT)

    tool = {"type": "function", "function": {"name": "judge", "parameters": VERDICT}}
    for tool_choice in ("required", {"type": "function", "function": {"name": "judge"}}):
        called = client.chat.completions.create(**{**kwargs, "max_tokens": 4 + 11 + 60,
                                                   "extra_body": {"thinking_token_budget": 4}},
                                                tools=[tool], tool_choice=tool_choice,
                                                parallel_tool_calls=False).choices[0]
        assert called.finish_reason == ("tool_calls" if tool_choice == "required" else "stop"), called
        assert called.message.reasoning_content == choice.message.reasoning_content
        (tc,) = called.message.tool_calls
        assert tc.function.name == "judge"
        jsonschema.validate(json.loads(tc.function.arguments), VERDICT)
    # Thinking off: the call is the whole reply.
    called = client.chat.completions.create(**{**kwargs, "max_tokens": 60, "extra_body": {
        "chat_template_kwargs": {"enable_thinking": False}}}, tools=[tool], tool_choice=tool_choice).choices[0]
    assert getattr(called.message, "reasoning_content", None) is None
    assert json.loads(called.message.tool_calls[0].function.arguments) in ({"ok": True}, {"ok": False})


def test_reasoning_effort_reaches_the_template_or_is_refused(answer_server):
    """reasoning_effort (chat) and reasoning.effort (Responses): none and minimal switch this
    template's thinking off; a level it cannot take, or no effort at all, is a 400 naming both."""
    import httpx

    client = answer_server.client(timeout=120)
    off = client.chat.completions.create(model="thinker", messages=ASK, max_tokens=40, temperature=0,
                                         reasoning_effort="minimal", extra_body=TIGHT_VERDICT).choices[0]
    assert off.message.reasoning_content is None and json.loads(off.message.content) in ({"ok": True}, {"ok": False})
    r = client.responses.create(model="thinker", input="2+2?", max_output_tokens=40, temperature=0,
                                reasoning={"effort": "none"}, extra_body=TIGHT_VERDICT)
    assert [i.type for i in r.output] == ["message"] and json.loads(r.output_text) == json.loads(off.message.content)
    for path, body, field, value in [
            ("/v1/chat/completions", {"messages": ASK, "reasoning_effort": "high"}, "reasoning_effort", "'high'"),
            ("/v1/chat/completions", {"messages": ASK, "reasoning_effort": "max"}, "reasoning_effort", "'max'"),
            ("/v1/chat/completions", {"messages": ASK, "reasoning_effort": "none",
                                      "chat_template_kwargs": {"enable_thinking": True}}, "reasoning_effort", "'none'"),
            ("/v1/responses", {"input": "hi", "reasoning": {"effort": "low"}}, "reasoning.effort", "'low'")]:
        got = httpx.post(answer_server.url + path, json={"model": "thinker", **body}, timeout=60)
        assert got.status_code == 400 and value in got.json()["error"]["message"], got.text
        assert got.json()["error"]["param"] == field


@pytest.fixture(scope="module")
def granite_server(tmp_path_factory):
    from pagellm.loader.synthetic import write_byte_tokenizer, write_dummy_model_dir
    from server_utils import RemoteServer

    path = write_dummy_model_dir(tmp_path_factory.mktemp("granite"), "tiny")
    write_byte_tokenizer(path, 320, GRANITE_TEMPLATE)
    server = RemoteServer([path, "--load-format", "dummy", "--served-model-name", "granite",
                           "--kv-cache-memory", "16M", "--max-model-len", "512", "--reasoning-parser", "auto",
                           "--structured-outputs-config", '{"enable_in_reasoning": true}'])
    yield server
    server.close()


@pytest.mark.slow  # its own server: about 10 s
def test_granite_end_to_end(granite_server):
    """A Granite-shaped model served with --reasoning-parser auto: the thinking switch through
    chat_template_kwargs and Ollama's think, the two phrases split out whole and streamed, no
    phrases at all, the response's phrase alone, and a prompt that already opened the thought."""
    import httpx

    client = granite_server.client(timeout=120)
    reply = "Here is my thought process:\nadd them\n\nHere is my response:\n4"

    def chat(regex: str, stream: bool = False, **extra) -> tuple[object, tuple]:
        kwargs = dict(model="granite", messages=extra.pop("messages", ASK), max_tokens=64, temperature=0,
                      extra_body={**forced(regex), **extra})
        whole = client.chat.completions.create(**kwargs)
        message = whole.choices[0].message
        if stream:  # the phrases cut across chunks (one byte a token) come out the same
            chunks = [c.choices[0] for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
            streamed = ("".join(getattr(c.delta, "reasoning_content", None) or "" for c in chunks) or None,
                        "".join(c.delta.content or "" for c in chunks) or None)
            assert streamed == (message.reasoning_content, message.content)
        return whole, (message.reasoning_content, message.content)

    on, split = chat(reply, stream=True, chat_template_kwargs={"thinking": True})
    assert split == ("add them", "4")
    off, split = chat("4")
    assert split == (None, "4") and off.usage.prompt_tokens < on.usage.prompt_tokens  # the switch reached it
    assert chat("Here is my response:\n4", stream=True)[1] == (None, "4")
    opened = ASK + [{"role": "assistant", "content": "Here is my thought process:"}]
    assert chat(" add them\nHere is my response: 4", messages=opened, add_generation_prompt=False,
                continue_final_message=True)[1] == ("add them", "4")

    r = httpx.post(granite_server.url + "/api/chat", timeout=120, json={
        "model": "granite", "messages": ASK, "think": True, "stream": False,
        "options": {"temperature": 0, "num_predict": 64}, "structured_outputs": {"regex": reply}})
    assert r.status_code == 200, r.text
    assert (r.json()["message"]["thinking"], r.json()["message"]["content"]) == ("add them", "4")
    assert r.json()["prompt_eval_count"] == on.usage.prompt_tokens


# ---- gpt-oss: harmony's channels -------------------------------------------------------------------

HARMONY_TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>", "<|constrain|>")
# The harmony format's shape, reduced (written here): a system turn that reads reasoning_effort, each
# turn `<|start|>ROLE ... <|message|>TEXT<|end|>`, an assistant's answer in its final channel, and a
# generation prompt that leaves the channel to the reply (it writes analysis first, then final).
HARMONY_TEMPLATE = (
    "<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"
    "{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "<|start|>assistant<|channel|>final<|message|>{{ m['content'] }}<|end|>"
    "{% else %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)


@pytest.fixture(scope="module")
def harmony_server(tmp_path_factory):
    """A small random gpt-oss model (sinks, clamped SwiGLU experts) with harmony's markers as single tokens."""
    from pagellm.loader.synthetic import write_byte_tokenizer
    from server_utils import RemoteServer
    from tests.models.families import build

    path = build("gpt_oss", tmp_path_factory.mktemp("gpt_oss"))
    write_byte_tokenizer(path, 320, HARMONY_TEMPLATE, HARMONY_TOKENS)
    server = RemoteServer([str(path), "--served-model-name", "oss", "--kv-cache-memory", "16M",
                           "--max-model-len", "512", "--reasoning-parser", "auto"])
    yield server
    server.close()


@pytest.mark.slow  # builds and serves a real gpt-oss model: about 25 s
def test_gpt_oss_grammar_starts_after_the_final_channel(harmony_server):
    """On gpt-oss a structured output and a forced tool call hold the final channel's message only:
    the analysis channel is free text, the header `<|end|><|start|>assistant<|channel|>final<|message|>`
    (forced here by the reasoning budget) is not the grammar's, the answer after it is. logit_bias
    makes the random model open the analysis channel and think in 'a's (neither is JSON)."""
    import httpx
    import jsonschema

    client = harmony_server.client(timeout=120)
    tokens = httpx.post(harmony_server.url + "/tokenize", json={"prompt": "<|channel|>a"}).json()["tokens"]
    assert len(tokens) == 2  # the marker is one token
    bias = {str(tokens[0]): 20, str(tokens[1]): 30}
    kwargs = dict(model="oss", messages=ASK, max_tokens=60, temperature=0, logit_bias=bias,
                  extra_body={"thinking_token_budget": 4, **TIGHT_VERDICT})
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert (choice.message.reasoning_content, choice.finish_reason) == ("aaaa", "stop"), choice
    jsonschema.validate(json.loads(choice.message.content), VERDICT)
    chunks = [c.choices[0] for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    assert "".join(getattr(c.delta, "reasoning_content", None) or "" for c in chunks) == "aaaa"
    assert "".join(c.delta.content or "" for c in chunks) == choice.message.content

    tool = {"type": "function", "function": {"name": "judge", "parameters": VERDICT}}
    for tool_choice in ("required", {"type": "function", "function": {"name": "judge"}}):
        called = client.chat.completions.create(**{**kwargs, "max_tokens": 100,
                                                   "extra_body": {"thinking_token_budget": 4}},
                                                tools=[tool], tool_choice=tool_choice,
                                                parallel_tool_calls=False).choices[0]
        assert called.message.reasoning_content == "aaaa", called
        assert called.message.tool_calls, called
        (tc,) = called.message.tool_calls
        assert tc.function.name == "judge"
        jsonschema.validate(json.loads(tc.function.arguments), VERDICT)


# ---- the real chat templates of 2025-26 families (llama.cpp's vendored copies, where built) ----------

def _vendored_templates():
    from pathlib import Path

    from pagellm.envs import llama_cpp_bin
    return Path(llama_cpp_bin()).parents[1] / "src" / "models" / "templates"


@pytest.mark.parametrize("name, parser, switch, tools_shown", [
    ("openai-gpt-oss-120b.jinja", "gpt_oss", None, "namespace functions"),
    ("Qwen3.5-4B.jinja", "qwen3", "enable_thinking", "<tools>"),
    ("google-gemma-4-31B-it.jinja", "gemma4", "enable_thinking", "add"),
    ("ibm-granite-granite-3.3-2B-Instruct.jinja", "granite", "thinking", "add"),
])
def test_real_templates_pick_their_parser_and_switch(tmp_path, name, parser, switch, tools_shown):
    """Each family's own template (as the model ships it; llama.cpp vendors them, read here where
    its source was fetched): `auto` picks the parser for its markers, the thinking switch is the
    variable the template reads, it renders in pagellm's sandbox with tools and a reasoning sent
    back, and the rendered prompt opens the reasoning or closes it as the switch asks."""
    from pagellm.entrypoints.openai.reasoning import switch_variable
    from pagellm.loader.synthetic import write_byte_tokenizer
    from pagellm.loader.tokenizer import Tokenizer

    path = _vendored_templates() / name
    if not path.is_file():
        pytest.skip(f"llama.cpp's source with its vendored templates is not here ({path})")
    template = path.read_text()
    assert parser_for_template(template) == parser
    assert switch_variable(template) == switch
    write_byte_tokenizer(tmp_path, 400, template, HARMONY_TOKENS)
    tok = Tokenizer.from_hf_dir(str(tmp_path))
    reasoning = REASONING_PARSERS[parser]()
    convo = ASK + [{"role": "assistant", "content": "4", "reasoning_content": "add them"},
                   {"role": "user", "content": "and 3+3?"}]
    tools = [{"type": "function", "function": {"name": "add", "description": "Adds two numbers.",
                                               "parameters": {"type": "object", "properties": {}}}}]
    shown = tok.apply_chat_template(convo, tools=tools, **({switch: True} if switch else {}))
    assert tools_shown in shown and "and 3+3?" in shown
    prompts = {}
    for on in (True, False):  # without tools: Granite's template asks for thoughts only then
        kwargs = {switch: on} if switch else {"reasoning_effort": "low" if on else "high"}
        prompts[on] = tok.apply_chat_template(convo, **kwargs)
        assert not reasoning.opens_in(prompts[on]) or parser == "qwen3"
    assert prompts[True] != prompts[False]
    if parser == "qwen3":  # Qwen3.5's template opens <think> itself when thinking is on
        assert reasoning.opens_in(prompts[True]) and reasoning.closes(prompts[False])
    if parser == "gemma4":  # Gemma 4's writes the thought channel empty when thinking is off
        assert reasoning.closes(prompts[False]) and not reasoning.closes(prompts[True])

    # An agent's turn sent back (reasoning, then a call, then its result) as the chat endpoint
    # hands it to the template: the reasoning shows in the family's own markers.
    from pagellm.entrypoints.openai.protocol import ChatCompletionRequest
    from pagellm.entrypoints.openai.serving_chat import OpenAIServingChat

    turn = ChatCompletionRequest.model_validate({"model": "m", "messages": ASK + [
        {"role": "assistant", "content": None, "reasoning_content": "add them",
         "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "4"}]})
    convo = [OpenAIServingChat.message_dict(m, i) for i, m in enumerate(turn.messages)]
    text = tok.apply_chat_template(convo, tools=tools, **({switch: True} if switch else {}))
    marked = {"gpt_oss": "<|channel|>analysis<|message|>add them<|end|>", "gemma4": "<|channel>thought\nadd them",
              "qwen3": "<think>\nadd them\n</think>", "granite": None}[parser]
    assert marked is None or marked in text, text[-400:]


def test_gpt_oss_tool_calls_after_the_analysis_whole_and_streamed():
    """--reasoning-parser gpt_oss with --tool-call-parser openai: the analysis is the reasoning, the
    commentary message addressed to=functions.add is the call (not reasoning, not content), whole
    and streamed a character at a time; a final answer without a call is plain content."""
    from pagellm.entrypoints.openai.serving_chat import ChoiceDeltas, OpenAIServingChat, ToolDeltas
    from pagellm.entrypoints.openai.tool_calls import PARSERS, plan_tools

    chat = object.__new__(OpenAIServingChat)
    chat.tool_call_parser = "openai"
    plan = plan_tools(TOOLS, "auto", True, True)
    call = ("<|channel|>analysis<|message|>Need add.<|end|><|start|>assistant<|channel|>commentary to=functions.add "
            "<|constrain|>json<|message|>{\"a\": 2}<|call|>")
    answer = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>4<|return|>"
    for text, reasoning, content, args in [(call, "Need add.", None, {"a": 2}), (answer, "Easy.", "4", None)]:
        message, finish = chat.reply(plan, text, "stop", ReasoningStream(GPT_OSS, False))
        assert (message["reasoning_content"], message["content"]) == (reasoning, content), message
        got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls", [])]
        assert got == ([("add", args)] if args else []) and finish == ("tool_calls" if args else "stop")
        deltas = ChoiceDeltas(ToolDeltas(plan, PARSERS["openai"]()), ReasoningStream(GPT_OSS, False))
        sent = {"reasoning_content": "", "content": "", "tool_calls": []}
        for i in range(1, len(text) + 1):
            delta, streamed_finish = deltas.advance(text[:i], i == len(text), "stop" if i == len(text) else None)
            for key in ("reasoning_content", "content"):
                sent[key] += delta.get(key) or ""
            sent["tool_calls"] += delta.get("tool_calls", [])
        assert (sent["reasoning_content"], sent["content"] or None) == (reasoning, content)
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in sent["tool_calls"]] == got
        assert streamed_finish == finish

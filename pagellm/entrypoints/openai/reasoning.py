"""Reasoning parsers (`--reasoning-parser`): a thinking model's reply split into its reasoning
and its answer, as vLLM's parsers of the same names split it.

- `qwen3`: `<think>...</think>` then the answer; no tags at all is all answer (the thinking
  switch off);
- `deepseek_r1`: the same tags, but an R1 distill may start without `<think>` (its template
  opens it), so text before `</think>` is reasoning even when no `<think>` was written;
- `granite`: "Here is my thought process:" ... "Here is my response:" (Granite 3.2's `thinking`:
  its template only asks for the two phrases in the system prompt, so the reply writes both;
  a reply that writes only the response's phrase has no reasoning, and the phrase is not answer),
  or Granite 3.3's `<think>...</think><response>...</response>`, asked for the same way;
- `gemma4`: Gemma 4's thought channel, `<|channel>thought` ... `<channel|>` (special tokens);
- `gpt_oss`: the harmony channels: `<|channel|>analysis<|message|>` ... `<|end|>`, then the
  `final` channel's message.

A parser splits the whole text seen so far (`split`), so a stream is split the same way as a
full reply, however its chunks cut a tag: while a tag may still be forming, its characters are
held back. A prompt that already ends inside the reasoning (the template opened `<think>`, as
Qwen3's thinking mode and R1 distills do) is passed as `opened`.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from pagellm.entrypoints.openai.errors import bad_request
from pagellm.sampling_params import ReasoningBudget


@dataclass(frozen=True)
class Split:
    """What a reply holds so far: reasoning (None: the reply has none), and the answer after it
    (None: not begun). Both only grow as more text comes, which is what lets a stream send deltas."""

    reasoning: str | None
    content: str | None


def _partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """How many trailing characters of `text` are a proper prefix of one of `markers`."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


def _find(text: str, markers: tuple[str, ...]) -> tuple[int, int]:
    """(start, end) of the first of `markers` in `text`, or (-1, -1)."""
    hits = [(i, i + len(m)) for m in markers if (i := text.find(m)) >= 0]
    return min(hits) if hits else (-1, -1)


class ReasoningParser:
    """Reasoning between one of `starts` and one of `ends`. `implicit_start`: text before an end
    is reasoning even without a start (R1). `keeps_special_tokens`: the markers are special tokens,
    which must stay in the text."""

    starts: tuple[str, ...] = ("<think>",)
    ends: tuple[str, ...] = ("</think>",)
    # The ends after which a structured output's grammar starts (None: all of `ends`).
    grammar_ends: tuple[str, ...] | None = None
    implicit_start = False
    keeps_special_tokens = False
    # What a reasoning budget forces once spent: the end marker as the chat template writes it.
    close = "\n</think>\n\n"

    def opens_in(self, prompt: str) -> bool:
        """Whether a rendered prompt ends inside the reasoning (the template opened it)."""
        start = max(prompt.rfind(m) for m in self.starts)
        end = max(prompt.rfind(m) for m in self.ends)
        return start > end

    def closes(self, prompt: str) -> bool:
        """Whether a rendered prompt ends just after a closed reasoning: the template wrote an empty
        one to switch thinking off (Qwen3's `enable_thinking: false`), so the answer starts at once."""
        tail = prompt.rstrip()
        return any(tail.endswith(m) for m in self.ends)

    def budget(self, tokens: int, opened: bool, encode: Callable[[str], list[int]],
               field: str = "thinking_token_budget") -> ReasoningBudget:
        """thinking_token_budget `tokens` as the sampler's rule, in this model's token ids. A reply
        whose prompt did not open the reasoning is bounded only if it opens it with `starts[0]`
        (an R1 distill's reasoning, open without a start, is opened by its template)."""
        try:
            return ReasoningBudget(tokens, tuple(encode(self.close)), tuple(encode(self.ends[0])),
                                   () if opened else tuple(encode(self.starts[0])))
        except ValueError as e:
            raise bad_request(str(e).replace("thinking_token_budget", field), param=field) from None

    def split(self, text: str, opened: bool = False, final: bool = True) -> Split:
        """Split `text`, all of a reply so far; `final`: no more will come (nothing is held back)."""
        body = text
        if not opened:
            lead = text.lstrip()
            begin, after = _find(lead[:max(len(m) for m in self.starts)], self.starts)
            if begin == 0:
                body = lead[after:]
            elif not final and any(m.startswith(lead) for m in self.starts):
                return Split(None, None)  # a start tag may be forming
            elif not self.implicit_start:
                return Split(None, self._content(text, final))
        stop, after = _find(body, self.ends)
        if stop < 0:  # still thinking (or cut short while thinking)
            held = 0 if final else _partial_suffix(body, self.ends)
            reasoning = body[:len(body) - held].lstrip()
            return Split(reasoning if final else reasoning.rstrip(), None)
        return Split(body[:stop].strip(), self._content(body[after:], final, answer=True))

    def _content(self, text: str, final: bool, answer: bool = False) -> str | None:
        """The answer's text; after the reasoning its leading blank lines go (held until the text begins)."""
        if answer:
            text = text.lstrip()
        return text if text or final else None


class Qwen3ReasoningParser(ReasoningParser):
    pass


class DeepSeekR1ReasoningParser(ReasoningParser):
    implicit_start = True


class GraniteReasoningParser(ReasoningParser):
    """Granite 3.2's phrases, and Granite 3.3's tags (`<think>...</think><response>...</response>`,
    which its template asks for in the same words): `auto` picks this parser for either template."""

    starts = ("Here is my thought process:", "Here's my thought process:", "<think>")
    ends = ("Here is my response:", "Here's my response:", "</think>")
    close = "\nHere is my response:\n"
    # What opens the answer without a thought before it: a marker, not part of the answer.
    answer_opens = ("Here is my response:", "Here's my response:", "<response>")

    def split(self, text: str, opened: bool = False, final: bool = True) -> Split:
        # Granite may skip the thought and open with the response's phrase (or tag) alone: that
        # phrase is a marker, not part of the answer (while it may still be forming, it is held back).
        lead = text.lstrip()
        if not opened:
            begin, after = _find(lead[:max(len(m) for m in self.answer_opens)], self.answer_opens)
            if begin == 0:
                answer = self._content(lead[after:], final, answer=True)
                return Split(None, self._untag(answer, final) if lead.startswith("<response>") else answer)
            if not final and lead and any(m.startswith(lead) for m in self.answer_opens):
                return Split(None, None)
        out = super().split(text, opened, final)
        if out.reasoning is None or out.content is None:
            return out
        content = out.content
        if content.startswith("<response>"):
            content = self._untag(content[len("<response>"):], final)
        elif not final and "<response>".startswith(content):
            content = None  # the tag may be forming
        return Split(out.reasoning, content)

    @staticmethod
    def _untag(answer: str | None, final: bool) -> str | None:
        """Granite 3.3's answer after its `<response>`: without the closing tag (held while it may be forming)."""
        if answer is None:
            return None
        answer = answer.removesuffix("</response>")
        return answer if final else answer[:len(answer) - _partial_suffix(answer, ("</response>",))]


class GptOssReasoningParser(ReasoningParser):
    starts = ("<|channel|>analysis<|message|>",)
    # The analysis ends where the final channel begins, or where a tool call's commentary message
    # does (`<|channel|>commentary to=functions.NAME ...` or `to=functions.NAME<|channel|>...`): that
    # header stays with the answer, for the tool-call parser (`--tool-call-parser openai`).
    ends = ("<|end|><|start|>assistant<|channel|>final<|message|>", "<|channel|>final<|message|>",
            "<|end|><|start|>assistant<|channel|>commentary", "<|end|><|start|>assistant to=")
    # A forced tool call or structured output is written in the final channel, under the grammar.
    grammar_ends = ends[:2]
    close = ends[0]
    keeps_special_tokens = True
    call_header = "<|end|><|start|>assistant"

    def opens_in(self, prompt: str) -> bool:
        # Earlier turns keep their analysis closed by a bare <|end|> (then a commentary call, say),
        # so only a prompt that ends on the analysis header is inside it.
        return prompt.rstrip().endswith(self.starts[0])

    def split(self, text: str, opened: bool = False, final: bool = True) -> Split:
        # No analysis channel at all: the final channel's header alone opens the answer.
        lead = text.lstrip()
        header = self.ends[1]
        if not opened and lead.startswith(header):
            return Split(None, self._content(lead[len(header):], final, answer=True))
        if not opened and not final and header.startswith(lead) and lead:
            return Split(None, None)
        out = super().split(text, opened, final)
        if out.content is not None:  # harmony ends a reply with <|return|> (or <|end|> mid-conversation)
            content = out.content
            at, _ = _find(text, self.ends)
            if at >= 0 and text.startswith(self.ends[2:], at):  # a tool call: its header is the tool parser's
                content = text[at + len(self.call_header):]
            for tail in ("<|return|>", "<|end|>"):
                content = content.removesuffix(tail)
            if not final:
                content = content[:len(content) - _partial_suffix(content, ("<|return|>", "<|end|>"))]
            out = Split(out.reasoning, content)
        return out


class Gemma4ReasoningParser(ReasoningParser):
    """Gemma 4 thinks in its thought channel when its template's enable_thinking is on; off (the
    default), the template writes the channel empty itself, so the answer starts at once."""

    starts = ("<|channel>thought",)
    ends = ("<channel|>",)
    close = "\n<channel|>"
    keeps_special_tokens = True
    # Gemma 4 may end its answer with an empty thought channel or a lone channel close (llama.cpp's
    # parser drops them too): markers, not answer.
    trailers = ("<|channel>thought\n<channel|>", "<channel|>")

    def split(self, text: str, opened: bool = False, final: bool = True) -> Split:
        out = super().split(text, opened, final)
        if out.content is None:
            return out
        content = out.content
        for tail in self.trailers:
            content = content.removesuffix(tail)
        if not final:
            content = content[:len(content) - _partial_suffix(content, self.trailers)]
        return Split(out.reasoning, content)


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "qwen3": Qwen3ReasoningParser,
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "gpt_oss": GptOssReasoningParser,
    "granite": GraniteReasoningParser,
    "gemma4": Gemma4ReasoningParser,
}


def parser_for_template(chat_template: str | None) -> str | None:
    """`--reasoning-parser auto`: the parser a chat template's own markers call for (None: the
    template writes no reasoning)."""
    template = chat_template or ""
    if "<|channel|>" in template:
        return "gpt_oss"
    if "<|channel>thought" in template:
        return "gemma4"
    if "thought process" in template:
        return "granite"
    if "<think>" in template:
        # Qwen3's template has the thinking switch; an R1 distill's opens <think> unconditionally.
        return "qwen3" if "enable_thinking" in template else "deepseek_r1"
    return None


# The chat-template variables that switch thinking, as templates read them: Qwen3's (and most since)
# `enable_thinking`, on unless set false; Granite 3.2's `thinking`, off unless set true.
SWITCHES = ("enable_thinking", "thinking")


def _template_code(template: str) -> str:
    """The Jinja code of a template ({% ... %} and {{ ... }}) without its string literals, so that a
    variable is found where the template reads it, not in the prose it writes (Granite's system
    prompt says "thinking process")."""
    blocks = re.findall(r"\{[%{](.*?)[%}]\}", template, re.S)
    return " ".join(re.sub(r"'[^']*'|\"[^\"]*\"", "", b) for b in blocks)


def switch_variable(chat_template: str | None) -> str | None:
    """The variable this template's thinking switch reads (one of SWITCHES), or None: it has none."""
    code = _template_code(chat_template or "")
    return next((name for name in SWITCHES if re.search(rf"(?<![\w.]){name}\b", code)), None)


def thinking_switch(chat_template: str | None, think: bool | str | None, field: str,
                    splits_reasoning: bool) -> dict | None:
    """The chat-template arguments that do what a client's thinking switch asks (Ollama's `think`,
    the Responses API's `reasoning.effort`): True or False through the template's
    switch (`enable_thinking`, or Granite's `thinking`), an effort ("low", "high"...) through its `reasoning_effort` (gpt-oss reads
    it). None: the template's own default. What this model's template cannot do is a 400 naming
    `field`, never a switch passed to a template that does not read it."""
    template = chat_template or ""
    if think is None:
        return None
    if think is not False and not splits_reasoning:
        raise bad_request(f"{field} {think!r} needs the server started with --reasoning-parser (how this model "
                          f"marks its reasoning), so that the reasoning comes back apart from the answer",
                          param=field)
    if isinstance(think, bool):
        if (switch := switch_variable(template)) is not None:
            return {switch: think}
        if think or not splits_reasoning:
            return None  # it thinks by itself; or it does not think, and is asked not to
        raise bad_request(f"{field} false is not supported by this model: its chat template has no switch "
                          f"(enable_thinking) that turns thinking off", param=field)
    if "reasoning_effort" not in template:
        raise bad_request(f"{field} {think!r} is not supported by this model: its chat template takes no "
                          f"reasoning effort (send true or false instead)", param=field)
    return {"reasoning_effort": think}


# OpenAI's reasoning efforts (chat `reasoning_effort`, Responses `reasoning.effort`); "none" and
# "minimal" ask for no reasoning.
EFFORTS = ("none", "minimal", "low", "medium", "high")


def effort_switch(chat_template: str | None, effort: str | None, field: str, splits_reasoning: bool) -> dict | None:
    """A reasoning effort as the chat-template arguments this model's template reads: "none" and
    "minimal" turn thinking off (`enable_thinking: false`), "low" to "high" go to a template that
    reads `reasoning_effort` (gpt-oss). What the template cannot do is a 400 naming `field` and the value."""
    if effort is None:
        return None
    if effort not in EFFORTS:
        raise bad_request(f"{field} must be one of {', '.join(EFFORTS)}, got {effort!r}", param=field)
    template = chat_template or ""
    switch = switch_variable(template)
    if effort in ("none", "minimal"):
        if switch is not None:
            return {switch: False}
        if not splits_reasoning:
            return None  # a model that does not think, asked not to
        raise bad_request(f"{field} {effort!r} is not supported by this model: its chat template has no switch "
                          f"(enable_thinking) that turns thinking off", param=field)
    if not splits_reasoning:
        raise bad_request(f"{field} {effort!r} needs the server started with --reasoning-parser (how this model "
                          f"marks its reasoning), so that the reasoning comes back apart from the answer",
                          param=field)
    if "reasoning_effort" not in template:
        levels = " (this model's template only switches thinking off: send 'none')" if switch else ""
        raise bad_request(f"{field} {effort!r} is not supported by this model: its chat template takes no reasoning "
                          f"effort{levels}", param=field)
    return {"reasoning_effort": effort}


class ReasoningStream:
    """One streamed choice: the reasoning delta and the answer's text so far, from the whole text."""

    def __init__(self, parser: ReasoningParser, opened: bool) -> None:
        self.parser = parser
        self.opened = opened
        self.sent = 0  # characters of reasoning already sent

    def advance(self, text: str, finished: bool) -> tuple[str, str | None]:
        """(new reasoning, the answer so far or None when it has not begun)."""
        split = self.parser.split(text, self.opened, final=finished)
        reasoning = split.reasoning or ""
        new, self.sent = reasoning[self.sent:], max(self.sent, len(reasoning))
        return new, split.content

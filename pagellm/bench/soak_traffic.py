"""The soak's traffic: one client's seeded stream of requests, each ended as a Record.

Well-formed requests go through the official `openai` client and their answers are checked
(choices, token counts with ignore_eos, JSON-schema and tool-call arguments against their
schemas); a wrong answer raises Invalid. Fuzzed bodies (pagellm.bench.fuzz's generator) and
dropped streams go through httpx, which can send what the client would refuse and hang up
mid-stream.
"""
from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass

from pagellm.bench.fuzz import fuzz_one, random_case
from pagellm.bench.serve import words

# The traffic mix: kind (the Traffic method that sends it) -> weight.
MIX = {"completion": 3, "chat": 3, "completion_stream": 3, "chat_stream": 3, "beam": 1, "json_schema": 1,
       "tools": 1, "shared_prefix": 3, "long_prompt": 2, "fuzzed": 2, "disconnect": 1, "client_timeout": 1}
# Outcomes a request may end with; only "failed" and "fuzz_harm" fail the verdict.
OUTCOMES = ("ok", "failed", "refused", "fuzz_served", "fuzz_harm", "disconnected", "timed_out")
ANSWER = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                           "sure": {"type": "boolean"}},
          "required": ["answer", "sure"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}}]


@dataclass
class SoakConfig:
    duration_s: float = 3600.0
    concurrency: int = 4
    interval_s: float = 60.0
    seed: int = 0
    timeout_s: float = 300.0          # a well-formed request's client timeout
    max_tokens: int = 16
    system_prompt_tokens: int = 400   # the prompt every shared_prefix request starts with
    long_prompt_tokens: int = 800     # most of the --launch pool: its long output beside others preempts


@dataclass
class Record:
    kind: str
    start: float
    end: float = 0.0
    outcome: str = "ok"
    cause: str | None = None
    detail: str | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None


class Invalid(Exception):
    """A well-formed request's answer was not what it asked for."""


class Traffic:
    """One client's seeded stream of requests; each ends as a Record."""

    def __init__(self, url: str, model: str, cfg: SoakConfig, rng: random.Random, system_prompt: str) -> None:
        import httpx
        import openai

        self.url, self.model, self.cfg, self.rng, self.system = url, model, cfg, rng, system_prompt
        self.openai = openai
        self.client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="soak", max_retries=0,
                                         timeout=cfg.timeout_s)
        self.http = httpx.AsyncClient(timeout=cfg.timeout_s)

    async def close(self) -> None:
        await self.client.close()
        await self.http.aclose()

    async def one(self) -> Record:
        kind = self.rng.choices(list(MIX), weights=list(MIX.values()))[0]
        rec = Record(kind, time.perf_counter())
        try:
            await getattr(self, kind)(rec)
        except self.openai.APITimeoutError as e:
            rec.outcome, rec.cause, rec.detail = "failed", "client timeout", str(e)[:300]
        except self.openai.APIStatusError as e:
            rec.outcome, rec.cause, rec.detail = "failed", f"HTTP {e.status_code}", str(e)[:300]
        except Invalid as e:
            rec.outcome, rec.cause, rec.detail = "failed", str(e).split(":")[0], str(e)[:300]
        except Exception as e:  # a reset or refused connection, an error event in a stream
            rec.outcome, rec.cause, rec.detail = "failed", type(e).__name__, str(e)[:300]
        rec.end = time.perf_counter()
        return rec

    def _sampling(self, max_tokens: int) -> dict:
        temperature = self.rng.choice([0.0, 0.8])
        return {"temperature": temperature, "seed": self.rng.randrange(1000), "max_tokens": max_tokens}

    def _question(self) -> str:
        return words(self.rng, self.rng.randint(4, 24))

    # Well-formed requests, ignore_eos so that every choice's length is known.
    async def completion(self, rec: Record, prompt: str | None = None, max_tokens: int | None = None) -> None:
        n, max_tokens = self.rng.choice([1, 1, 2, 3]), max_tokens or self.cfg.max_tokens
        r = await self.client.completions.create(model=self.model, prompt=prompt or self._question(), n=n,
                                                 extra_body={"ignore_eos": True}, **self._sampling(max_tokens))
        check_choices(r.choices, n, r.usage.completion_tokens, max_tokens)

    async def chat(self, rec: Record) -> None:
        n = self.rng.choice([1, 1, 2, 3])
        r = await self.client.chat.completions.create(model=self.model, messages=self._messages(), n=n,
                                                      extra_body={"ignore_eos": True},
                                                      **self._sampling(self.cfg.max_tokens))
        check_choices(r.choices, n, r.usage.completion_tokens, self.cfg.max_tokens)

    def _messages(self, system: str | None = None) -> list[dict]:
        return [*([{"role": "system", "content": system}] if system else []),
                {"role": "user", "content": self._question()}]

    async def completion_stream(self, rec: Record, prompt: str | None = None, max_tokens: int | None = None) -> None:
        n, max_tokens = self.rng.choice([1, 1, 2]), max_tokens or self.cfg.max_tokens
        stream = await self.client.completions.create(
            model=self.model, prompt=prompt or self._question(), n=n, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}, **self._sampling(max_tokens))
        await self._read_stream(rec, stream, n, max_tokens, lambda c: c.text)

    async def chat_stream(self, rec: Record, system: str | None = None) -> None:
        n = self.rng.choice([1, 1, 2])
        stream = await self.client.chat.completions.create(
            model=self.model, messages=self._messages(system), n=n, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            **self._sampling(self.cfg.max_tokens))
        await self._read_stream(rec, stream, n, self.cfg.max_tokens, lambda c: c.delta.content)

    async def _read_stream(self, rec: Record, stream, n: int, max_tokens: int, text_of) -> None:
        first = last = None
        finished: set[int] = set()
        usage = None
        async for chunk in stream:
            if chunk.usage:
                usage = chunk.usage
            for choice in chunk.choices:
                if text_of(choice):
                    last = time.perf_counter()
                    first = first or last
                if choice.finish_reason:
                    finished.add(choice.index)
        if finished != set(range(n)):
            raise Invalid(f"unfinished choices: {sorted(finished)} of {n} finished")
        if usage is None or usage.completion_tokens != n * max_tokens:
            raise Invalid(f"token count: usage {usage}, expected {n} x {max_tokens}")
        if first is not None:
            rec.ttft_s = first - rec.start
            if max_tokens > 1 and last > first:
                rec.tpot_s = (last - first) / (max_tokens - 1)

    async def beam(self, rec: Record) -> None:
        n = self.rng.choice([2, 3])
        r = await self.client.completions.create(model=self.model, prompt=self._question(), n=n,
                                                 max_tokens=self.cfg.max_tokens,
                                                 extra_body={"use_beam_search": True, "ignore_eos": True})
        if len(r.choices) != n or not all(c.text for c in r.choices):
            raise Invalid(f"beams: {len(r.choices)} choices of {n}, texts {[c.text for c in r.choices]}")

    async def json_schema(self, rec: Record) -> None:
        n = self.rng.choice([1, 2])
        r = await self.client.chat.completions.create(
            model=self.model, messages=[{"role": "user", "content": "Is the sky blue? Answer as JSON."}], n=n,
            max_tokens=48, temperature=self.rng.choice([0.0, 1.0]), seed=self.rng.randrange(1000),
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}})
        for c in r.choices:
            if c.finish_reason == "stop":  # a reply cut by max_tokens is incomplete, not invalid
                check_json(c.message.content, ANSWER)

    async def tools(self, rec: Record) -> None:
        choice = self.rng.choice(["required", {"type": "function", "function": {"name": "get_weather"}}])
        r = await self.client.chat.completions.create(
            model=self.model, messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=TOOLS,
            tool_choice=choice, max_tokens=60, temperature=self.rng.choice([0.0, 0.8]), seed=self.rng.randrange(99))
        c = r.choices[0]
        if c.finish_reason != "length":
            if not c.message.tool_calls:
                raise Invalid(f"no tool call: {c.message}")
            for call in c.message.tool_calls:
                check_json(call.function.arguments, WEATHER)

    async def shared_prefix(self, rec: Record) -> None:
        await self.chat_stream(rec, system=self.system)

    async def long_prompt(self, rec: Record) -> None:
        """Most of a small pool, and a long output: the requests beside it need blocks while it grows."""
        prompt, max_tokens = words(self.rng, self.cfg.long_prompt_tokens), 4 * self.cfg.max_tokens
        send = self.completion_stream if self.rng.random() < 0.5 else self.completion
        await send(rec, prompt, max_tokens)

    # Requests that may be refused or cut off; the server must carry on.
    async def fuzzed(self, rec: Record) -> None:
        endpoint, fields = random_case(self.rng)
        out = await fuzz_one(self.http, self.url, self.model, endpoint, fields, self.cfg.timeout_s)
        if out.harm:
            rec.outcome, rec.cause, rec.detail = "fuzz_harm", out.harm.split(":")[0], f"{out.fields}: {out.harm}"[:300]
        else:
            rec.outcome = "fuzz_served" if out.status == 200 else "refused"

    async def disconnect(self, rec: Record) -> None:
        """A stream the client drops after a few events: the server must abort it and free its blocks."""
        body = {"model": self.model, "messages": self._messages(), "stream": True, "ignore_eos": True,
                "max_tokens": 4 * self.cfg.max_tokens}
        keep = self.rng.randint(1, 3)
        async with self.http.stream("POST", self.url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                raise Invalid(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                keep -= line.startswith("data: ")
                if keep <= 0:
                    break
        rec.outcome = "disconnected"

    async def client_timeout(self, rec: Record) -> None:
        """A client that gives up after a fraction of a second; one that is answered in time is checked."""
        timeout = self.rng.uniform(0.1, 1.0)
        try:
            r = await self.client.with_options(timeout=timeout).completions.create(
                model=self.model, prompt=self._question(), max_tokens=4 * self.cfg.max_tokens,
                extra_body={"ignore_eos": True}, temperature=0.0)
        except self.openai.APITimeoutError:
            rec.outcome = "timed_out"
            return
        check_choices(r.choices, 1, r.usage.completion_tokens, 4 * self.cfg.max_tokens)


def check_choices(choices, n: int, tokens: int, max_tokens: int) -> None:
    if len(choices) != n or tokens != n * max_tokens or any(c.finish_reason != "length" for c in choices):
        raise Invalid(f"choices: {len(choices)} of {n}, {tokens} tokens of {n * max_tokens}, finish reasons "
                      f"{[c.finish_reason for c in choices]}")


def check_json(text: str | None, schema: dict) -> None:
    """The object `text` holds has exactly the schema's properties, each of its type and enum."""
    try:
        value = json.loads(text or "")
    except ValueError:
        raise Invalid(f"invalid JSON: {text!r}") from None
    props = schema["properties"]
    kinds = {"string": str, "boolean": bool}
    if not isinstance(value, dict) or set(value) != set(props) or not all(
            isinstance(value[k], kinds[p["type"]]) and value[k] in p.get("enum", [value[k]])
            for k, p in props.items()):
        raise Invalid(f"not of the schema: {text!r}")

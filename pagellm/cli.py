"""The `pagellm` command: generate and chat on the CPU (or a GPU when there is one)."""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from pagellm.config import EngineConfig, add_engine_args, engine_kwargs
from pagellm.sampling_params import SamplingParams


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens,
                   help=f"tokens to generate at most per reply (default: {max_tokens})")
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (the default, reproducible)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the smallest set of tokens whose "
                                                            "probabilities reach this (default: 1.0, off)")
    g.add_argument("--top-k", type=int, default=-1, help="sample among the k likeliest tokens (default: -1, off)")
    g.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens less likely than this fraction of the likeliest (default: 0.0, off)")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="> 1 discourages tokens already seen (default: 1.0, off)")
    g.add_argument("--sampling-seed", type=int, default=None,
                   help="seed of the sampling, for reproducible non-greedy output (default: none)")
    g.add_argument("--stop", action="append", default=None, help="a string that ends the reply; repeat for several")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          seed=args.sampling_seed, stop=args.stop,
                          ignore_eos=args.ignore_eos)


def cmd_generate(args: argparse.Namespace) -> int:
    from pagellm.entrypoints.llm import LLM

    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        print("pagellm generate: give --prompt or prompts on standard input, one a line", file=sys.stderr)
        return 2
    params = sampling_params(args)  # a bad sampling option fails now, not after the model loads
    llm = LLM(**engine_kwargs(args))
    outputs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
    for out in outputs:
        if len(outputs) > 1:
            print(f"--- {out.prompt!r}")
        print(out.outputs[0].text, flush=True)
    return 0


CHAT_HELP = """commands: /help this list, /reset forget the conversation, /exit quit (or Ctrl-D)
Ctrl-C while a reply streams stops that reply; at the prompt it quits"""


def cmd_chat(args: argparse.Namespace) -> int:
    from pagellm.engine.llm_engine import LLMEngine

    params = sampling_params(args)  # a bad sampling option fails now, not after the model loads
    engine = LLMEngine(EngineConfig(**engine_kwargs(args)))
    tok = engine.tokenizer
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict] = list(system)
    interactive = sys.stdin.isatty()
    if interactive:
        import readline  # noqa: F401  (line editing and history for input())

        print("pagellm chat: /help for commands", file=sys.stderr)
    turn = 0
    while True:
        try:
            line = input("> ") if interactive else sys.stdin.readline()
        except (EOFError, KeyboardInterrupt):
            line = ""
        if not line:  # end of input, or Ctrl-C / Ctrl-D at the prompt
            if interactive:
                print()
            return 0
        text = line.strip()
        if text in ("/exit", "/quit"):
            return 0
        if text == "/help":
            print(CHAT_HELP)
            continue
        if text == "/reset":
            history = list(system)
            print("(conversation forgotten)")
            continue
        if not text:
            continue
        history.append({"role": "user", "content": text})
        prompt = tok.encode(tok.apply_chat_template(history, add_generation_prompt=True), add_special_tokens=False)
        rid = f"chat-{turn}"
        turn += 1
        try:
            engine.add_request(rid, prompt, params)
        except ValueError as e:  # this message cannot be answered (too long, say): the chat goes on
            print(f"pagellm: {e}", file=sys.stderr)
            history.pop()
            continue
        reply = ""
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    so_far = out.outputs[0].text
                    print(so_far[len(reply):], end="", flush=True)
                    reply = so_far
        except KeyboardInterrupt:  # stop this reply, keep the conversation (with what was said)
            engine.abort_request(rid)
            print(" [stopped]", end="")
        print(flush=True)
        history.append({"role": "assistant", "content": reply})


def build_parser() -> argparse.ArgumentParser:
    from pagellm.version import __version__

    parser = argparse.ArgumentParser(prog="pagellm", description="LLM serving engine built on PagedAttention")
    parser.add_argument("--version", action="version", version=f"pagellm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete prompts (from --prompt or standard input) and print them")
    gen.add_argument("--prompt", action="append", help="a prompt; repeat for several")
    add_engine_args(gen)
    add_sampling_args(gen, max_tokens=64)
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="talk to the model; replies stream as they are generated")
    chat.add_argument("--system", default=None, help="a system message")
    add_engine_args(chat)
    add_sampling_args(chat, max_tokens=256)
    chat.set_defaults(func=cmd_chat)
    from pagellm.entrypoints.openai.cli_args import add_serve_parser

    add_serve_parser(sub)
    from pagellm.bench.cli import add_bench_parser

    add_bench_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in ("generate", "chat"):  # say what loads, and when it is ready (serve sets its own)
        import logging

        logging.basicConfig(level=logging.INFO, format="pagellm: %(message)s")
    try:
        if getattr(args, "tensor_parallel_size", 1) > 1:
            from pagellm.distributed.worker_main import is_torchrun_worker, run_worker

            if is_torchrun_worker():  # torchrun started this rank: rank 0 runs the command, the others serve it
                return run_worker(args.device, args.model)
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"pagellm: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130

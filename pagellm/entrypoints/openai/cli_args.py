"""`pagellm serve`: its flags. Importable without the server extra, so the CLI can list it."""
from __future__ import annotations

import argparse

from pagellm import envs
from pagellm.config import ROUTER_POLICIES
from pagellm.entrypoints.openai.reasoning import REASONING_PARSERS
from pagellm.entrypoints.openai.tool_calls import PARSERS as TOOL_CALL_PARSERS

DEFAULT_MAX_WAITING_REQUESTS = 1024
DEFAULT_MAX_REQUEST_BODY_BYTES = 4 << 20
DEFAULT_SHUTDOWN_TIMEOUT = 5.0
DEFAULT_MAX_STREAM_BUFFER = 512


def _seconds(text: str) -> float:
    value = float(text)
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text!r}")
    return value


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    from pagellm.config import add_engine_args

    p = subparsers.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API",
                              description="Serve the model over an OpenAI-compatible HTTP API "
                                          "(/v1/completions, /v1/chat/completions, /metrics, /dashboard).")
    p.add_argument("model_tag", nargs="?", metavar="MODEL", default=None,
                   help="the model, as `vllm serve MODEL` takes it (the same as --model)")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    g.add_argument("--port", type=int, default=8000, help="TCP port (default: 8000)")
    g.add_argument("--api-key", default=envs.api_key(),
                   help="require `Authorization: Bearer <key>` on /v1/*, /tokenize and /detokenize "
                        "(default: $PAGELLM_API_KEY, else no key)")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="the name(s) clients use for the model (default: derived from --model, "
                        "e.g. SmolLM2-135M-Instruct); other names get 404")
    g.add_argument("--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING_REQUESTS,
                   help="requests allowed to wait for their first token; more are refused with 503 "
                        f"and Retry-After (default: {DEFAULT_MAX_WAITING_REQUESTS})")
    g.add_argument("--max-stream-buffer", type=int, default=DEFAULT_MAX_STREAM_BUFFER, metavar="OUTPUTS",
                   help="outputs (one a step) a streamed request may have waiting behind its client, past what the "
                        "socket holds; a client that falls this far behind (it stopped reading) has its request "
                        "aborted, finish_reason 'abort', and its KV blocks freed: the engine never waits for a "
                        f"reader (default: {DEFAULT_MAX_STREAM_BUFFER}; one engine, not -dp)")
    g.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                   help=f"larger request bodies get 413 (default: {DEFAULT_MAX_REQUEST_BODY_BYTES})")
    g.add_argument("--max-seqs-per-request", type=int, default=None,
                   help="the largest n (or best_of) one request may ask for; larger get 400. Admission is "
                        "first come, first served, so a request that needs every sequence slot would hold "
                        "up everyone behind it until all running requests finish (default: half of "
                        "--max-num-seqs)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='allow tool_choice "auto": the model decides whether to call a tool, and its output is '
                        "parsed for calls by --tool-call-parser")
    g.add_argument("--tool-call-parser", default=None, choices=list(TOOL_CALL_PARSERS),
                   help="the format the model writes tool calls in: hermes (<tool_call>{...}</tool_call>: Qwen, "
                        "Hermes, SmolLM3), llama3_json (Llama 3.x), mistral ([TOOL_CALLS][...]), openai (gpt-oss's "
                        "harmony commentary calls, with --reasoning-parser gpt_oss), gemma4 (Gemma 4's "
                        "<|tool_call>call:NAME{...}<tool_call|>)")
    g.add_argument("--reasoning-parser", default=None, choices=["auto", *REASONING_PARSERS],
                   help="split a thinking model's replies into reasoning_content and content: qwen3 "
                        "(<think>...</think>), deepseek_r1 (the same, <think> possibly opened by the template), "
                        "gpt_oss (harmony's analysis "
                        "channel), granite (\"Here is my thought process:\", or Granite 3.3's <think>), gemma4 "
                        "(<|channel>thought...<channel|>), auto (from the chat template) "
                        "(default: not split)")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine replicas, each a whole engine in its own Ray actor, behind a router (default: 1, "
                        "no Ray)")
    g.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (e.g. 10.0.0.1:6379) so that replicas land on its machines "
                        "(default: a local Ray instance, started and stopped with the server)")
    g.add_argument("--router-policy", default="cache_aware", choices=ROUTER_POLICIES,
                   help="which replica serves a request: cache_aware (the one that has seen the longest run of "
                        "its leading KV blocks, unless overloaded), round_robin, least_loaded (default: "
                        "cache_aware)")
    g.add_argument("--shutdown-timeout", type=_seconds, default=DEFAULT_SHUTDOWN_TIMEOUT, metavar="SECONDS",
                   help="on SIGTERM or SIGINT, stop admitting (503 with Retry-After) and let the requests in "
                        "flight finish for up to this long, then end the rest with finish_reason 'abort'; a "
                        f"second signal exits at once (default: {DEFAULT_SHUTDOWN_TIMEOUT:g})")
    g.add_argument("--exit-on-engine-death", action=argparse.BooleanOptionalAction, default=True,
                   help="when the engine dies (a tensor-parallel rank died, say), answer 503 for a moment, then "
                        "exit with status 1 so that a supervisor restarts the server (default: on)")
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="the server's logging (default: info: each request, and throughput every 5 s)")
    g.add_argument("--disable-access-log", action="store_true", help="do not log each HTTP request")
    add_engine_args(p)
    p.set_defaults(func=cmd_serve)
    return p


def address_problem(host: str, port: int) -> str | None:
    """Why the server could not listen on host:port (in use, not this machine's, no permission), or None."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        return str(e)
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: TIME_WAIT is no conflict
        try:
            s.bind(address)
        except OSError as e:
            return e.strerror or str(e)
    return None


def cmd_serve(args: argparse.Namespace) -> int:
    import sys

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            print(f"pagellm serve: the model is given twice ({args.model_tag!r} and --model {args.model!r})",
                  file=sys.stderr)
            return 2
        args.model = args.model_tag
    if not 1 <= args.port <= 65535:
        print(f"pagellm serve: --port must be in [1, 65535], got {args.port}", file=sys.stderr)
        return 2
    if args.max_request_body_bytes < 1:
        print(f"pagellm serve: --max-request-body-bytes must be >= 1, got {args.max_request_body_bytes}",
              file=sys.stderr)
        return 2
    problem = address_problem(args.host, args.port)  # before the model loads, not after
    if problem:
        print(f"pagellm serve: cannot listen on {args.host}:{args.port}: {problem}", file=sys.stderr)
        return 2
    if args.max_seqs_per_request is not None and args.max_seqs_per_request < 1:
        print(f"pagellm serve: --max-seqs-per-request must be >= 1, got {args.max_seqs_per_request}",
              file=sys.stderr)
        return 2
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        print(f"pagellm serve: --enable-auto-tool-choice needs --tool-call-parser ({', '.join(TOOL_CALL_PARSERS)}): "
              "the format the model writes tool calls in", file=sys.stderr)
        return 2
    if args.data_parallel_size < 1:
        print(f"pagellm serve: --data-parallel-size must be >= 1, got {args.data_parallel_size}", file=sys.stderr)
        return 2
    if args.max_stream_buffer < 1:
        print(f"pagellm serve: --max-stream-buffer must be >= 1, got {args.max_stream_buffer}", file=sys.stderr)
        return 2
    if args.max_waiting_requests < 0:
        print(f"pagellm serve: --max-waiting-requests must be >= 0, got {args.max_waiting_requests}", file=sys.stderr)
        return 2
    try:
        from pagellm.entrypoints.openai.api_server import run_server
    except ImportError as e:
        print(f"pagellm serve: the server needs the `server` extra ({e}); "
              "install it with `pip install 'pagellm[server]'`", file=sys.stderr)
        return 2
    return run_server(args)

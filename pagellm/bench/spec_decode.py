"""`pagellm bench spec-decode`: single-stream decode speed with and without speculative decoding.

Two workloads, one request at a time, greedy: a code edit (a source file of about 300 lines in the
prompt, to be returned with a one-line change: the model copies, and prompt lookup proposes what
it copies) and an open chat (little to copy: speculation must not cost much there). Decode tokens
per second are measured from the first token to the last, so the prompt's prefill is not counted.
The systems run interleaved, each once per workload per round (on shared cores the machine's speed
drifts), and the load average is recorded at every run. Outputs with and without speculation must
be equal (it is lossless); the JSON says whether they were.

    pagellm bench spec-decode --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'
    pagellm bench spec-decode --method draft_model

The second is the draft-model pair at hand: the bundled SmolLM2-135M served dequantized (float32)
as the target, the bundled Q4_1 GGUF itself (the same weights, quantized) as its draft: nearly
every proposal accepted, each draft step cheaper than a target step.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pagellm.bench import report, spec_decode_peer

# The code-edit workload's file: this package's own scheduler, a real ~300-line Python module.
CODE_FILE = Path(__file__).resolve().parent.parent / "core" / "scheduler.py"
CHAT_PROMPT = "Tell me about the history of lighthouses and the people who kept them."
DEFAULT_SPEC = {"method": "ngram", "num_speculative_tokens": 4}
METHODS = ("ngram", "draft_model")


@dataclass
class SpecBenchConfig:
    model: str | None = None
    speculative_config: dict = field(default_factory=lambda: dict(DEFAULT_SPEC))
    quantization: str = "auto"  # the target's (both systems'): "none" serves a GGUF dequantized
    workloads: list[str] = field(default_factory=lambda: ["code-edit", "chat"])
    code_lines: int = 300
    max_tokens: int = 256
    repeat: int = 3
    threads: int = 2
    # llama-server's --spec-type values to run beside (bench/spec_decode_peer.py); none: no peer.
    peer_types: list[str] = field(default_factory=list)


def code_edit_prompt(lines: int) -> str:
    code = "\n".join(CODE_FILE.read_text().splitlines()[:lines])
    return (f"Here is a Python file:\n```python\n{code}\n```\nReturn the whole file with one change: rename the "
            f"method `schedule` to `plan_step`. Reply with the code only.")


def _messages(workload: str, cfg: SpecBenchConfig) -> list[dict]:
    content = code_edit_prompt(cfg.code_lines) if workload == "code-edit" else CHAT_PROMPT
    return [{"role": "user", "content": content}]


def _one_run(llm, workload: str, cfg: SpecBenchConfig) -> dict:
    from pagellm.sampling_params import SamplingParams

    before = (llm.stats()["spec_decode"] or {}).get("num_accepted_tokens", 0)
    drafts_before = (llm.stats()["spec_decode"] or {}).get("num_draft_tokens", 0)
    out = llm.chat(_messages(workload, cfg), SamplingParams(temperature=0.0, max_tokens=cfg.max_tokens),
                   use_tqdm=False)[0]
    m, tokens = out.metrics, out.outputs[0].token_ids
    decode_s = m.finished_time - m.first_token_time
    spec = llm.stats()["spec_decode"] or {}
    return {"tokens": len(tokens), "decode_s": decode_s,
            "decode_tokens_per_s": (len(tokens) - 1) / decode_s if decode_s > 0 else None,
            "prompt_tokens": len(out.prompt_token_ids), "loadavg": os.getloadavg(),
            "accepted_tokens": spec.get("num_accepted_tokens", 0) - before,
            "draft_tokens": spec.get("num_draft_tokens", 0) - drafts_before, "token_ids": tokens}


def run_spec_decode_bench(cfg: SpecBenchConfig) -> dict:
    import torch

    from pagellm.entrypoints.llm import LLM

    torch.set_num_threads(cfg.threads)
    load_start = os.getloadavg()
    systems = {"plain": {}, "speculative": {"speculative_config": cfg.speculative_config}}
    llms = {name: LLM(cfg.model, device="cpu", quantization=cfg.quantization, **options)
            for name, options in systems.items()}
    runs: dict[str, dict[str, list[dict]]] = {w: {s: [] for s in systems} for w in cfg.workloads}
    peer_runs: dict[str, dict[str, list[dict]]] = {w: {t: [] for t in cfg.peer_types} for w in cfg.workloads}
    peers: dict = {}
    try:
        model_path = llms["plain"].engine.model_path
        if cfg.peer_types:
            context = len(llms["plain"].get_tokenizer().encode(code_edit_prompt(cfg.code_lines))) + cfg.max_tokens + 256
            peers = spec_decode_peer.start(model_path, cfg.peer_types, cfg.threads, context)
        for name, llm in llms.items():  # warm-up: kernels built, allocators grown
            _one_run(llm, "chat", SpecBenchConfig(**{**asdict(cfg), "max_tokens": 8}))
        for _, url in peers.values():
            spec_decode_peer.one_run(url, _messages("chat", cfg), 8)
        for _ in range(cfg.repeat):
            for workload in cfg.workloads:
                for name, llm in llms.items():
                    runs[workload][name].append(_one_run(llm, workload, cfg))
                for kind, (_, url) in peers.items():
                    peer_runs[workload][kind].append(spec_decode_peer.one_run(url, _messages(workload, cfg),
                                                                              cfg.max_tokens))
    finally:
        for llm in llms.values():
            llm.shutdown()
        spec_decode_peer.stop(peers)
    results = {}
    for workload, by_system in runs.items():
        entry = {}
        for name, rs in by_system.items():
            entry[name] = {"decode_tokens_per_s": statistics.median(r["decode_tokens_per_s"] for r in rs),
                           "runs": [{k: v for k, v in r.items() if k != "token_ids"} for r in rs]}
            drafts = sum(r["draft_tokens"] for r in rs)
            if drafts:
                entry[name]["acceptance_rate"] = sum(r["accepted_tokens"] for r in rs) / drafts
                entry[name]["accepted_tokens_per_output_token"] = (sum(r["accepted_tokens"] for r in rs)
                                                                   / sum(r["tokens"] for r in rs))
        entry["speedup"] = entry["speculative"]["decode_tokens_per_s"] / entry["plain"]["decode_tokens_per_s"]
        entry["outputs_equal"] = all(a["token_ids"] == b["token_ids"]
                                     for a, b in zip(by_system["plain"], by_system["speculative"]))
        entry["output_tokens"] = by_system["plain"][0]["tokens"]
        if cfg.peer_types:
            entry["llama-server"] = _summarize_peer(peer_runs[workload])
        results[workload] = entry
    return {"config": asdict(cfg), "model": model_path, "code_file": str(CODE_FILE.relative_to(CODE_FILE.parents[2])),
            "load": {"loadavg_start": load_start, "loadavg_end": os.getloadavg()}, "workloads": results}


def _summarize_peer(by_type: dict[str, list[dict]]) -> dict:
    """llama-server's medians per --spec-type, and each one's speedup over its own plain decoding."""
    out = {}
    for kind, rs in by_type.items():
        rates = [r["decode_tokens_per_s"] for r in rs if r["decode_tokens_per_s"]]
        drafts = sum(r["draft_tokens"] for r in rs)
        out[kind] = {"decode_tokens_per_s": statistics.median(rates) if rates else None,
                     "acceptance_rate": sum(r["accepted_tokens"] for r in rs) / drafts if drafts else None,
                     "output_tokens": rs[0]["tokens"] if rs else None, "runs": rs}
    plain = (out.get("none") or {}).get("decode_tokens_per_s")
    for kind, e in out.items():
        e["speedup"] = e["decode_tokens_per_s"] / plain if plain and e["decode_tokens_per_s"] else None
    return out


def print_tables(results: dict) -> None:
    rows = []
    for workload, e in results["workloads"].items():
        rows.append([workload, e["plain"]["decode_tokens_per_s"], e["speculative"]["decode_tokens_per_s"],
                     e["speedup"], e["speculative"].get("acceptance_rate"), e["output_tokens"], e["outputs_equal"]])
    print(f"\n{results['model']} (quantization {results['config'].get('quantization', 'auto')}): one stream, "
          f"greedy, {results['config']['speculative_config']}")
    print(report.format_table(["workload", "plain tok/s", "speculative tok/s", "speedup", "acceptance", "tokens",
                               "same output"], rows))
    peer_rows = [[workload, kind, p["decode_tokens_per_s"], p["speedup"], p["acceptance_rate"], p["output_tokens"]]
                 for workload, e in results["workloads"].items() for kind, p in e.get("llama-server", {}).items()]
    if peer_rows:
        print("\nllama-server on the same file, by --spec-type")
        print(report.format_table(["workload", "spec type", "decode tok/s", "speedup", "acceptance", "tokens"], peer_rows))
    print(f"load average: {results['load']['loadavg_start']} at start, {results['load']['loadavg_end']} at end")


def add_parser(sub) -> None:
    p = sub.add_parser("spec-decode", help="single-stream decode tok/s with and without speculative decoding, on "
                                           "a code edit and an open chat")
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: the bundled SmolLM2)")
    p.add_argument("--method", default="ngram", choices=METHODS,
                   help="the proposer, when --speculative-config is not given: ngram (prompt lookup, k = 4) or "
                        "draft_model (--draft-model, k = 4)")
    p.add_argument("--draft-model", default=None,
                   help="the draft model of --method draft_model (default: the bundled SmolLM2 Q4_1 GGUF)")
    p.add_argument("--quantization", default=None,
                   help="the target's quantization (default: none, i.e. dequantized float32, for --method "
                        "draft_model on the bundled model, so that its Q4_1 file is the cheaper draft; else auto)")
    p.add_argument("--speculative-config", default=None,
                   help="the speculative system's speculative_config (vLLM's JSON; overrides --method)")
    p.add_argument("--workloads", default="code-edit,chat", help="comma-separated: code-edit, chat")
    p.add_argument("--code-lines", type=int, default=300, help="lines of the code file in the code-edit prompt")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens decoded per request")
    p.add_argument("--repeat", type=int, default=3, help="rounds (medians reported)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--peer", nargs="?", const=",".join(spec_decode_peer.DEFAULT_TYPES), default="",
                   metavar="TYPES", help="also run llama-server on the same GGUF file once per --spec-type "
                   f"(comma-separated; default {','.join(spec_decode_peer.DEFAULT_TYPES)}; none is plain decoding)")
    p.add_argument("--out", default=None, help="output path stem (default benchmarks/results/spec-decode-<date>)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = sorted(set(workloads) - {"code-edit", "chat"})
    if unknown:
        raise ValueError(f"--workloads: unknown {', '.join(unknown)}; choose code-edit, chat")
    for name in ("code_lines", "max_tokens", "repeat", "threads"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    peer_types = [t.strip() for t in args.peer.split(",") if t.strip()]
    spec_decode_peer.check_types(peer_types)
    if peer_types and args.model and not args.model.endswith(".gguf"):
        raise ValueError(f"--peer: llama-server serves GGUF files; --model {args.model} is not one")
    if args.speculative_config is not None:
        spec = json.loads(args.speculative_config)
    elif args.method == "draft_model":
        from pagellm.loader.bundled import default_model_path

        spec = {"method": "draft_model", "model": args.draft_model or default_model_path(), "num_speculative_tokens": 4}
    else:
        spec = dict(DEFAULT_SPEC)
    quantization = args.quantization or (
        "none" if spec.get("method") == "draft_model" and args.model is None else "auto")
    cfg = SpecBenchConfig(model=args.model, speculative_config=spec, quantization=quantization,
                          workloads=workloads, code_lines=args.code_lines, max_tokens=args.max_tokens,
                          repeat=args.repeat, threads=args.threads,
                          peer_types=peer_types)
    started = time.time()
    results = {**report.metadata("spec-decode"), **run_spec_decode_bench(cfg), "wall_s": time.time() - started}
    json_path, _ = report.output_paths("spec-decode", args.out)
    report.write_json(json_path, results)
    print_tables(results)
    print(f"\nwrote {json_path}")
    return 0


def doc_table(doc: dict) -> str:
    """docs/speculative-decoding.md's table: per workload, plain and speculative decode speed (medians)."""
    from pagellm.bench import doc_sections

    rows = []
    method = doc["config"]["speculative_config"].get("method", "ngram")
    for name, e in doc["workloads"].items():
        prompt = e["plain"]["runs"][0]["prompt_tokens"]
        rows.append([f"{name} ({prompt:,} prompt tokens)", f"{e['plain']['decode_tokens_per_s']:.1f}",
                     f"{e['speculative']['decode_tokens_per_s']:.1f}", f"{e['speedup']:.2f}x",
                     f"{e['speculative'].get('acceptance_rate', 0):.2f}", "yes" if e["outputs_equal"] else "no"])
    column = "with prompt lookup" if method == "ngram" else "with a draft model"
    table = doc_sections.markdown_table(["workload", "plain tok/s", column, "speedup (medians)",
                                       "acceptance", "same output"], rows, "lrrrrl")
    peers = [(name, e["llama-server"]) for name, e in doc["workloads"].items() if e.get("llama-server")]
    if not peers:
        return table
    rows = []
    for name, by_type in peers:
        plain = by_type.get("none", {}).get("decode_tokens_per_s")
        spec = {k: v for k, v in by_type.items() if k != "none" and v.get("decode_tokens_per_s")}
        best = max(spec, key=lambda k: spec[k]["decode_tokens_per_s"]) if spec else None
        ours = doc["workloads"][name]["speculative"]["decode_tokens_per_s"]
        rows.append([name, f"{plain:.1f}" if plain else "-",
                     f"{spec[best]['decode_tokens_per_s']:.1f} ({best})" if best else "-",
                     f"{spec[best]['speedup']:.2f}x" if best and spec[best].get("speedup") else "-",
                     f"{ours / spec[best]['decode_tokens_per_s']:.2f}x" if best else "-"])
    return table + "\n\n" + doc_sections.markdown_table(
        ["workload", "llama-server plain tok/s", "its best n-gram mode, tok/s", "its speedup",
         "pagellm speculative / its best"], rows, "lrrrr")

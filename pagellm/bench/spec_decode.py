"""`pagellm bench spec-decode`: single-stream decode speed with and without speculative decoding.

Four workloads, one request at a time, greedy: a code edit (a source file of about 300 lines in
the prompt, to be returned with a one-line change: the model copies, and prompt lookup proposes
what it copies), a summary of a document that quotes its key sentences verbatim (copied spans
between words of the model's own), an open chat (little to copy: speculation must not cost much
there) and a JSON echo (a record in the prompt returned under its JSON schema, a structured output:
each verified position masked by the grammar's state after the proposals before it). Decode tokens per second are measured from the first token to the last, so the prompt's
prefill is not counted. The systems run interleaved, each once per workload per round (on shared
cores the machine's speed drifts), and the load average is recorded at every run.

Every round has prompts of its own: another of this package's modules for the code edit
(CODE_FILES), another page of the repository's docs for the summary (SUMMARY_DOCS), another
question for the chat (CHAT_PROMPTS), a record of another module for the JSON echo (JSON_MODULES),
the same for every system within the round. A proposer that
keeps what it saw across requests (llama-server's ngram-mod pools the n-grams of earlier outputs)
would otherwise find from the second round on the very text it is asked to write again, and accept
nearly every draft. Outputs with and without speculation must be equal (it is lossless); the JSON
says whether they were, and keeps the start of every output.

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
import re
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pagellm.bench import report, spec_decode_peer
from pagellm.config import KV_CACHE_DTYPES, SpeculativeConfig
from pagellm.core.spec_decode import next_lookahead
from pagellm.worker.proposers.ngram import lookup

if TYPE_CHECKING:
    from pagellm.loader.tokenizer import Tokenizer

PACKAGE = Path(__file__).resolve().parent.parent
REPOSITORY = PACKAGE.parent
# The code edit's file of each round (round i takes the i-th): real modules of this package of
# 300 lines or more, none seen by any system in an earlier round.
CODE_FILES = ("core/scheduler.py", "sampling_params.py", "engine/llm_engine.py", "worker/sampler.py", "config.py")
# The summary's document of each round, likewise: pages of this repository's docs (relative to the
# repository) with 160 lines of prose or more once their code blocks, tables and comments are cut
# (document_prose), whose first 160 with the instruction come to 3,000 to 5,500 tokens with the
# bundled tokenizer, as the code edit's prompts do: a long context to quote from, which leaves the
# bundled model's context room for the output.
SUMMARY_DOCS = ("docs/serving.md", "docs/kv-cache.md", "docs/benchmarks.md", "docs/quantization.md",
                "docs/speculative-decoding.md")
# The chat's question of each round, likewise.
CHAT_PROMPTS = (
    "Tell me about the history of lighthouses and the people who kept them.",
    "How do bees find their way back to the hive, and how do they tell the others where food is?",
    "Explain how a bicycle stays upright while it moves, for someone who has never studied physics.",
    "What were the main causes of the fall of the Western Roman Empire?",
    "Describe how bread rises, from the yeast to the oven.",
)
# The JSON echo's module of each round, likewise: its record (json_record) is the prompt's JSON.
JSON_MODULES = ("core/block_pool.py", "engine/detokenizer.py", "worker/logits_processors.py", "loader/tokenizer.py",
                "kv_format.py")
# Names of imports, classes and functions a record lists at most: a record and its echo come to
# about 100 to 250 tokens with the bundled tokenizer, within --max-tokens' default 256.
JSON_NAMES = 12
# The warm-up's question: in no round, so that no system has seen a round's prompt before it.
WARMUP_PROMPT = "Name three rivers of Europe."
WARMUP_TOKENS = 8
DEFAULT_SPEC = {"method": "ngram", "num_speculative_tokens": 4}
METHODS = ("ngram", "draft_model")
WORKLOADS = ("code-edit", "summary", "chat", "json-echo")


@dataclass
class SpecBenchConfig:
    model: str | None = None
    speculative_config: dict = field(default_factory=lambda: dict(DEFAULT_SPEC))
    quantization: str = "auto"  # the target's (both systems'): "none" serves a GGUF dequantized
    kv_cache_dtype: str = "auto"  # both pagellm systems' (llama-server keeps its own f16 cache)
    workloads: list[str] = field(default_factory=lambda: list(WORKLOADS))
    code_lines: int = 300
    summary_lines: int = 160  # of the document's prose (document_prose)
    max_tokens: int = 256
    repeat: int = 3
    threads: int = 2
    # llama-server's --spec-type values to run beside (bench/spec_decode_peer.py); none: no peer.
    peer_types: list[str] = field(default_factory=list)


def max_rounds() -> int:
    """The most rounds with a prompt of their own in every workload."""
    return min(len(CODE_FILES), len(SUMMARY_DOCS), len(CHAT_PROMPTS), len(JSON_MODULES))


def check_repeat(repeat: int) -> None:
    if not 1 <= repeat <= max_rounds():
        raise ValueError(f"--repeat must be between 1 and {max_rounds()} (each round needs a code file, a document, "
                         f"a chat question and a module's record no earlier round used), got {repeat}")


def code_edit_prompt(path: Path, lines: int) -> str:
    """The first `lines` lines of `path`, to be returned with its first public function renamed."""
    code = "\n".join(path.read_text().splitlines()[:lines])
    names = [m.group(1) for m in re.finditer(r"^\s*(?:async\s+)?def ([A-Za-z]\w*)", code, re.MULTILINE)]
    change = (f"rename the function `{names[0]}` to `{names[0]}_v2`" if names
              else "add the comment `# reviewed` as its first line")
    return (f"Here is a Python file:\n```python\n{code}\n```\nReturn the whole file with one change: {change}. "
            f"Reply with the code only.")


def document_prose(path: Path) -> list[str]:
    """The lines of a Markdown page that are prose: fenced code blocks, tables and HTML comments
    (the generated tables' markers) cut, as they are not sentences to quote, and the blank lines
    left where they were merged into one."""
    if not path.is_file():
        raise ValueError(f"the summary workload's document {path} is missing (docs/ is in a pagellm checkout, "
                         f"not in the installed package): run from a checkout, or leave summary out of --workloads")
    lines: list[str] = []
    fenced = in_comment = False
    for line in path.read_text().splitlines():
        s = line.strip()
        if in_comment or s.startswith("<!--"):
            in_comment = "-->" not in s
            continue
        if s.startswith("```"):
            fenced = not fenced
            continue
        if fenced or s.startswith("|"):
            continue
        if s or (lines and lines[-1]):
            lines.append(line.rstrip())
    return lines


def summary_prompt(path: Path, lines: int) -> str:
    """The first `lines` lines of `path`'s prose, to be summarized quoting its key sentences verbatim:
    a model that follows copies spans of the document, which prompt lookup can propose."""
    document = "\n".join(document_prose(path)[:lines]).strip()
    return (f"Here is a document:\n\n<document>\n{document}\n</document>\n\nSummarize this document in a few "
            f"paragraphs. Quote its key sentences word for word, in double quotes, and say in your own words how "
            f"they connect. Reply with the summary only.")


def json_record(path: Path) -> dict:
    """A record of a Python module of this package: its path, its length and the first JSON_NAMES
    modules it imports from, top-level classes and functions."""
    code = path.read_text()
    imports = re.findall(r"^(?:from|import) ([\w.]+)", code, re.MULTILINE)
    return {"module": str(path.relative_to(REPOSITORY)),
            "lines": len(code.splitlines()),
            "imports": list(dict.fromkeys(imports))[:JSON_NAMES],
            "classes": re.findall(r"^class (\w+)", code, re.MULTILINE)[:JSON_NAMES],
            "functions": re.findall(r"^(?:async )?def (\w+)", code, re.MULTILINE)[:JSON_NAMES]}


def json_schema(record: dict) -> dict:
    """The JSON schema a record's echo is held to: its keys, each with its value's type."""
    def kind(value) -> dict:
        if isinstance(value, int):
            return {"type": "integer"}
        if isinstance(value, list):
            return {"type": "array", "items": {"type": "string"}}
        return {"type": "string"}
    return {"type": "object", "properties": {k: kind(v) for k, v in record.items()}, "required": list(record),
            "additionalProperties": False}


def json_echo_prompt(path: Path) -> str:
    """The record of `path` (json_record), to be returned as it is: a model that follows copies it
    whole, under json_schema's grammar."""
    return (f"Here is a JSON record of a Python module:\n{json.dumps(json_record(path))}\n"
            f"Return the record exactly as it is, as JSON.")


def round_sources(workload: str, repeat: int) -> list[str]:
    """What each round's prompt is made of: a file (relative to the repository) or a question."""
    check_repeat(repeat)
    if workload == "code-edit":
        return [str((PACKAGE / f).relative_to(REPOSITORY)) for f in CODE_FILES[:repeat]]
    if workload == "summary":
        return list(SUMMARY_DOCS[:repeat])
    if workload == "json-echo":
        return [str((PACKAGE / f).relative_to(REPOSITORY)) for f in JSON_MODULES[:repeat]]
    return list(CHAT_PROMPTS[:repeat])


def user_message(workload: str, source: str, cfg: SpecBenchConfig) -> str:
    """The user's message of a round whose prompt is made of `source` (round_sources)."""
    if workload == "code-edit":
        return code_edit_prompt(REPOSITORY / source, cfg.code_lines)
    if workload == "summary":
        return summary_prompt(REPOSITORY / source, cfg.summary_lines)
    if workload == "json-echo":
        return json_echo_prompt(REPOSITORY / source)
    return source


def response_schema(workload: str, source: str) -> dict | None:
    """The JSON schema a round's output is held to (the JSON echo's), or None."""
    return json_schema(json_record(REPOSITORY / source)) if workload == "json-echo" else None


@dataclass
class Prompt:
    """One round's prompt, rendered once with pagellm's tokenizer and its chat template: pagellm
    reads `token_ids`, llama-server is sent `peer_text` (the same text, tokenized by itself). `schema`:
    the JSON schema its output is held to (both systems' structured outputs), or None."""
    source: str
    text: str
    token_ids: list[int]
    peer_text: str
    schema: dict | None = None


def render_prompt(tokenizer: Tokenizer, content: str, source: str, schema: dict | None = None) -> Prompt:
    """`content` as the user's message, rendered as LLM.chat renders it (no special tokens added
    beyond what the template writes)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    bos = tokenizer.bos_token_id
    adds_bos = bos is not None and tokenizer.encode("", add_special_tokens=True)[:1] == [bos]
    special_prefix = tokenizer.id_to_token(bos) if adds_bos else ""
    return Prompt(source, text, tokenizer.encode(text, add_special_tokens=False),
                  spec_decode_peer.completion_prompt(text, special_prefix), schema)


def check_fits(prompts: dict[str, list[Prompt]], max_tokens: int, max_model_len: int) -> None:
    """Every round's prompt and its max_tokens within the model's context: an output the context
    cut short would be timed over fewer tokens than the others, and not be the same text."""
    for workload, ps in prompts.items():
        for p in ps:
            if len(p.token_ids) + max_tokens > max_model_len:
                raise ValueError(f"{workload} prompt of {p.source}: {len(p.token_ids)} tokens + --max-tokens "
                                 f"{max_tokens} exceed the model's context of {max_model_len} tokens: lower "
                                 f"--max-tokens, --code-lines or --summary-lines")


def _one_run(llm, prompt: Prompt, max_tokens: int) -> dict:
    from pagellm.sampling_params import SamplingParams, StructuredOutputsParams

    before = (llm.stats()["spec_decode"] or {}).get("num_accepted_tokens", 0)
    drafts_before = (llm.stats()["spec_decode"] or {}).get("num_draft_tokens", 0)
    steps_before = (llm.stats()["spec_decode"] or {}).get("decode_steps_by_rows", {})
    so = None if prompt.schema is None else StructuredOutputsParams(json=json.dumps(prompt.schema))
    out = llm.generate({"prompt_token_ids": prompt.token_ids},
                       SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=so), use_tqdm=False)[0]
    m, tokens = out.metrics, out.outputs[0].token_ids
    decode_s = m.finished_time - m.first_token_time
    spec = llm.stats()["spec_decode"] or {}
    return {"source": prompt.source, "tokens": len(tokens), "decode_s": decode_s,
            "decode_tokens_per_s": (len(tokens) - 1) / decode_s if decode_s > 0 else None,
            "prompt_tokens": len(out.prompt_token_ids), "loadavg": os.getloadavg(),
            "accepted_tokens": spec.get("num_accepted_tokens", 0) - before,
            "draft_tokens": spec.get("num_draft_tokens", 0) - drafts_before,
            "decode_steps_by_rows": _steps_since(steps_before, spec.get("decode_steps_by_rows", {})),
            "text_head": out.outputs[0].text[:spec_decode_peer.TEXT_HEAD_CHARS], "token_ids": tokens}


def _steps_since(before: dict, after: dict) -> dict[int, dict]:
    """The run's decode steps by rows (stats()' decode_steps_by_rows after it less before it): their
    count and seconds in all."""
    out = {}
    for rows, e in after.items():
        b = before.get(rows, {"steps": 0, "mean_ms": 0.0})
        steps = e["steps"] - b["steps"]
        if steps:
            out[rows] = {"steps": steps, "seconds": (e["steps"] * e["mean_ms"] - b["steps"] * b["mean_ms"]) / 1e3}
    return out


def step_ms_by_rows(runs: list[dict]) -> dict[int, float]:
    """Mean ms of a decode step by its rows (a sequence's token and the proposals it verifies) over
    `runs`: what a verified row costs against a plain step (1 row) on this machine and context."""
    steps: dict[int, int] = {}
    seconds: dict[int, float] = {}
    for r in runs:
        for rows, e in r.get("decode_steps_by_rows", {}).items():
            rows = int(rows)
            steps[rows] = steps.get(rows, 0) + e["steps"]
            seconds[rows] = seconds.get(rows, 0.0) + e["seconds"]
    return {rows: 1e3 * seconds[rows] / steps[rows] for rows in sorted(steps)}


def _peer_run(url: str, prompt: Prompt, max_tokens: int) -> dict:
    return {"source": prompt.source, **spec_decode_peer.one_run(url, prompt.peer_text, max_tokens, prompt.schema)}


def run_spec_decode_bench(cfg: SpecBenchConfig) -> dict:
    import torch

    from pagellm.entrypoints.llm import LLM

    check_repeat(cfg.repeat)
    torch.set_num_threads(cfg.threads)
    load_start = os.getloadavg()
    systems = {"plain": {}, "speculative": {"speculative_config": cfg.speculative_config}}
    llms = {name: LLM(cfg.model, device="cpu", quantization=cfg.quantization, kv_cache_dtype=cfg.kv_cache_dtype,
                      **options) for name, options in systems.items()}
    runs: dict[str, dict[str, list[dict]]] = {w: {s: [] for s in systems} for w in cfg.workloads}
    peer_runs: dict[str, dict[str, list[dict]]] = {w: {t: [] for t in cfg.peer_types} for w in cfg.workloads}
    peers: dict = {}
    peer_tokens: dict[tuple[str, int], list[int]] = {}
    try:
        model_path = llms["plain"].engine.model_path
        tok = llms["plain"].get_tokenizer()
        prompts = {w: [render_prompt(tok, user_message(w, src, cfg), src, response_schema(w, src))
                       for src in round_sources(w, cfg.repeat)] for w in cfg.workloads}
        check_fits(prompts, cfg.max_tokens, llms["plain"].engine.max_model_len)
        warmup = render_prompt(tok, WARMUP_PROMPT, WARMUP_PROMPT)
        if cfg.peer_types:
            longest = max(len(p.token_ids) for ps in prompts.values() for p in ps)
            peers = spec_decode_peer.start(model_path, cfg.peer_types, cfg.threads, longest + cfg.max_tokens + 256)
            url = next(iter(peers.values()))[1]
            peer_tokens = {(w, i): spec_decode_peer.tokenize(url, p.peer_text)
                           for w, ps in prompts.items() for i, p in enumerate(ps)}
        for llm in llms.values():  # warm-up: kernels built, allocators grown
            _one_run(llm, warmup, WARMUP_TOKENS)
        for _, url in peers.values():
            _peer_run(url, warmup, WARMUP_TOKENS)
        for i in range(cfg.repeat):
            for workload in cfg.workloads:
                prompt = prompts[workload][i]
                for name, llm in llms.items():
                    runs[workload][name].append(_one_run(llm, prompt, cfg.max_tokens))
                for kind, (_, url) in peers.items():
                    peer_runs[workload][kind].append(_peer_run(url, prompt, cfg.max_tokens))
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
        entry["speculative"]["step_ms_by_rows"] = step_ms_by_rows(by_system["speculative"])
        entry["speedup"] = entry["speculative"]["decode_tokens_per_s"] / entry["plain"]["decode_tokens_per_s"]
        entry["outputs_equal"] = all(a["token_ids"] == b["token_ids"]
                                     for a, b in zip(by_system["plain"], by_system["speculative"]))
        entry["output_tokens"] = [r["tokens"] for r in by_system["plain"]]
        spec = SpeculativeConfig.from_dict(cfg.speculative_config)
        if spec.method == "ngram":
            replays = [lookup_replay(p.token_ids, r["token_ids"], spec, cfg.max_tokens)
                       for p, r in zip(prompts[workload], by_system["plain"])]
            entry["lookup_replay"] = {"ceiling": statistics.median(r["ceiling"] for r in replays), "rounds": replays}
        entry["rounds"] = [{"source": p.source, "prompt_tokens": {"pagellm": len(p.token_ids)}}
                           for p in prompts[workload]]
        if cfg.peer_types:
            entry["llama-server"] = _summarize_peer(peer_runs[workload])
            for i, (r, p) in enumerate(zip(entry["rounds"], prompts[workload])):
                ids = peer_tokens[workload, i]
                r["prompt_tokens"]["llama-server"] = len(ids)
                r["same_prompt_tokens"] = ids == p.token_ids
            entry["same_prompt_tokens"] = all(r["same_prompt_tokens"] for r in entry["rounds"])
        results[workload] = entry
    return {"config": asdict(cfg), "model": model_path,
            "code_files": round_sources("code-edit", cfg.repeat) if "code-edit" in cfg.workloads else [],
            "summary_docs": round_sources("summary", cfg.repeat) if "summary" in cfg.workloads else [],
            "json_modules": round_sources("json-echo", cfg.repeat) if "json-echo" in cfg.workloads else [],
            "load": {"loadavg_start": load_start, "loadavg_end": os.getloadavg()}, "workloads": results}


def lookup_replay(prompt_ids: list[int], output_ids: list[int], spec: SpeculativeConfig,
                  max_tokens: int | None = None) -> dict:
    """Prompt lookup replayed over a plain run's greedy output with the engine's own rules (the
    proposer's `lookup`, the scheduler's `next_lookahead`): the verification steps it takes and what
    it proposes and gets accepted. `ceiling` = output tokens / steps is the speedup speculation would
    give if verifying k tokens cost what decoding one does: what the proposer can get out of this
    output whatever the kernels, so a low measured speedup reads as the model's output (it does
    not copy) or as the cost of verification. As in the engine, the first token comes from the
    prompt's own step (not counted, as decode speed does not count it), whose end proposes the next;
    and no more tokens are verified than max_tokens leaves room for."""
    pos, steps, drafted, accepted = 1, 0, 0, 0
    lookahead = most = spec.num_speculative_tokens

    def propose(num_tokens: int) -> list[int]:
        return lookup(prompt_ids + output_ids[:pos], num_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)

    proposal = propose(lookahead)
    while pos < len(output_ids):
        # Verified: the proposal made during the previous step, which asked for the lookahead of
        # that step's start (the one before its own verification adapted it).
        verified = proposal if max_tokens is None else proposal[:max(0, max_tokens - pos - 1)]
        kept = 0
        while kept < len(verified) and pos + kept < len(output_ids) and verified[kept] == output_ids[pos + kept]:
            kept += 1
        steps, drafted, accepted = steps + 1, drafted + len(verified), accepted + kept
        asked = lookahead
        if verified:
            lookahead = next_lookahead(lookahead, len(verified), kept, most)
        pos += kept + 1
        proposal = propose(asked)
    return {"steps": steps, "draft_tokens": drafted, "accepted_tokens": accepted,
            "ceiling": (len(output_ids) - 1) / steps if steps else None}


def _summarize_peer(by_type: dict[str, list[dict]]) -> dict:
    """llama-server's medians per --spec-type, and each one's speedup over its own plain decoding."""
    out = {}
    for kind, rs in by_type.items():
        rates = [r["decode_tokens_per_s"] for r in rs if r["decode_tokens_per_s"]]
        drafts = sum(r["draft_tokens"] for r in rs)
        out[kind] = {"decode_tokens_per_s": statistics.median(rates) if rates else None,
                     "acceptance_rate": sum(r["accepted_tokens"] for r in rs) / drafts if drafts else None,
                     "output_tokens": [r["tokens"] for r in rs], "runs": rs}
    plain = (out.get("none") or {}).get("decode_tokens_per_s")
    for kind, e in out.items():
        e["speedup"] = e["decode_tokens_per_s"] / plain if plain and e["decode_tokens_per_s"] else None
    return out


def _tokens(counts: list[int] | int) -> str:
    """Output tokens per round (one number in results written before prompts rotated)."""
    return "/".join(map(str, counts)) if isinstance(counts, list) else str(counts)


def print_tables(results: dict) -> None:
    rows = []
    for workload, e in results["workloads"].items():
        rows.append([workload, e["plain"]["decode_tokens_per_s"], e["speculative"]["decode_tokens_per_s"],
                     e["speedup"], e.get("lookup_replay", {}).get("ceiling"), e["speculative"].get("acceptance_rate"),
                     _tokens(e["output_tokens"]), e["outputs_equal"]])
    print(f"\n{results['model']} (quantization {results['config'].get('quantization', 'auto')}, KV cache "
          f"{results['config'].get('kv_cache_dtype', 'auto')}): one stream, greedy, {results['config']['speculative_config']}")
    print(report.format_table(["workload", "plain tok/s", "speculative tok/s", "speedup", "lookup ceiling", "acceptance",
                               "tokens per round", "same output"], rows))
    costs = [(workload, e["speculative"].get("step_ms_by_rows")) for workload, e in results["workloads"].items()]
    if any(c for _, c in costs):
        print("\nms per decode step by its rows (a token and the proposals it verifies), speculative runs")
        for workload, c in costs:
            if c:
                print(f"{workload}: " + ", ".join(f"{rows}: {ms:.1f}" for rows, ms in c.items()))
    peer_rows = [[workload, kind, p["decode_tokens_per_s"], p["speedup"], p["acceptance_rate"],
                  _tokens(p["output_tokens"]), e.get("same_prompt_tokens")]
                 for workload, e in results["workloads"].items() for kind, p in e.get("llama-server", {}).items()]
    if peer_rows:
        print("\nllama-server on the same prompt text, by --spec-type")
        print(report.format_table(["workload", "spec type", "decode tok/s", "speedup", "acceptance",
                                   "tokens per round", "same prompt tokens"], peer_rows))
    if results.get("code_files"):
        print(f"code files by round: {', '.join(results['code_files'])}")
    if results.get("summary_docs"):
        print(f"documents summarized by round: {', '.join(results['summary_docs'])}")
    if results.get("json_modules"):
        print(f"modules whose JSON records are echoed, by round: {', '.join(results['json_modules'])}")
    print(f"load average: {results['load']['loadavg_start']} at start, {results['load']['loadavg_end']} at end")


def add_parser(sub) -> None:
    p = sub.add_parser("spec-decode", help="single-stream decode tok/s with and without speculative decoding, on "
                                           "a code edit, a summary that quotes its document, an open chat and a "
                                           "JSON record echoed under its schema")
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: the bundled SmolLM2)")
    p.add_argument("--method", default="ngram", choices=METHODS,
                   help="the proposer, when --speculative-config is not given: ngram (prompt lookup, k = 4) or "
                        "draft_model (--draft-model, k = 4)")
    p.add_argument("--draft-model", default=None,
                   help="the draft model of --method draft_model (default: the bundled SmolLM2 Q4_1 GGUF)")
    p.add_argument("--quantization", default=None,
                   help="the target's quantization (default: none, i.e. dequantized float32, for --method "
                        "draft_model on the bundled model, so that its Q4_1 file is the cheaper draft; else auto)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="how both pagellm systems store K/V (8-bit and bfloat16 caches take other attention kernels)")
    p.add_argument("--speculative-config", default=None,
                   help="the speculative system's speculative_config (vLLM's JSON; overrides --method)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated: {', '.join(WORKLOADS)}")
    p.add_argument("--code-lines", type=int, default=300, help="lines of the code file in the code-edit prompt")
    p.add_argument("--summary-lines", type=int, default=SpecBenchConfig.summary_lines,
                   help="lines of the document's prose in the summary prompt")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens decoded per request")
    p.add_argument("--repeat", type=int, default=3,
                   help=f"rounds (medians reported), each with prompts of its own: 1 to {max_rounds()}")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--peer", nargs="?", const=",".join(spec_decode_peer.DEFAULT_TYPES), default="",
                   metavar="TYPES", help="also run llama-server on the same GGUF file once per --spec-type "
                   f"(comma-separated; default {','.join(spec_decode_peer.DEFAULT_TYPES)}; none is plain decoding)")
    p.add_argument("--out", default=None, help="output path stem (default benchmarks/results/spec-decode-<date>)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = sorted(set(workloads) - set(WORKLOADS))
    if unknown:
        raise ValueError(f"--workloads: unknown {', '.join(unknown)}; choose from {', '.join(WORKLOADS)}")
    if not workloads:
        raise ValueError(f"--workloads is empty; choose from {', '.join(WORKLOADS)}")
    for name in ("code_lines", "summary_lines", "max_tokens", "threads"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    check_repeat(args.repeat)
    if "summary" in workloads:  # a missing page named before any model loads
        for source in round_sources("summary", args.repeat):
            document_prose(REPOSITORY / source)
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
                          kv_cache_dtype=args.kv_cache_dtype,
                          workloads=workloads, code_lines=args.code_lines, summary_lines=args.summary_lines,
                          max_tokens=args.max_tokens,
                          repeat=args.repeat, threads=args.threads,
                          peer_types=peer_types)
    started = time.time()
    results = {**report.metadata("spec-decode"), **run_spec_decode_bench(cfg), "wall_s": time.time() - started}
    json_path, _ = report.output_paths("spec-decode", args.out)
    report.write_json(json_path, results)
    print_tables(results)
    print(f"\nwrote {json_path}")
    return 0


def verify_phases_doc_table(doc: dict, rows: tuple[int, ...] | None = (1, 2, 5, 9)) -> str:
    """docs/speculative-decoding.md's table of a verification's phases by its rows
    (benchmarks/verify_phases.py's results; `rows` None: every row count measured): ms per step."""
    from pagellm.bench import doc_sections

    by_rows = {int(n): r for n, r in doc["by_rows"].items()}  # str keys once written to JSON
    table = []
    for n in sorted(by_rows) if rows is None else rows:
        r = by_rows.get(n)
        if r is None:
            continue
        other = r.get("model_forward_ms", 0.0) - r.get("attention_ms", 0.0)
        table.append([n, f"{r['step_ms']:.1f} ms", f"{r.get('attention_ms', 0.0):.1f}", f"{other:.1f}",
                      f"{r.get('logits_ms', 0.0):.1f}", r["steps"]])
    return doc_sections.markdown_table(["rows in the step", "step", "attention", "other layer work (products, norms)",
                                        "logits", "steps measured"], table, "rrrrrr")


def vouched_doc_table(runs: list[dict]) -> str:
    """docs/speculative-decoding.md's table of prompt lookup with the length cap against without it
    (benchmarks/lookup_vouched_ab.py's results): decode speed ratios in total time, per run."""
    from pagellm.bench import doc_sections

    table = []
    for doc in runs:
        spec = SpeculativeConfig.from_dict(doc["speculative_config"])
        w = doc["workloads"]
        cpu = ", ".join(filter(None, (doc["machine"]["cpu"], doc["machine"].get("isa"))))
        config = f"k = {spec.num_speculative_tokens}, lookup {spec.prompt_lookup_min}..{spec.prompt_lookup_max}"
        table.append([config, cpu,
                      *(f"{w[name]['speedup_total_time']:.3f}x" if name in w else "-"
                        for name in ("code-edit", "summary", "chat")),
                      "yes" if all(e["outputs_equal"] for e in w.values()) else "no"])
    return doc_sections.markdown_table(["config", "CPU", "code edit", "summary", "chat", "same output"], table,
                                       "llrrrl")


def doc_table(doc: dict) -> str:
    """docs/speculative-decoding.md's table: per workload, plain and speculative decode speed (medians)."""
    from pagellm.bench import doc_sections

    rows = []
    method = doc["config"]["speculative_config"].get("method", "ngram")
    for name, e in doc["workloads"].items():
        prompts = sorted(r["prompt_tokens"] for r in e["plain"]["runs"])
        span = f"{prompts[0]:,}" if prompts[0] == prompts[-1] else f"{prompts[0]:,} to {prompts[-1]:,}"
        rows.append([f"{name} ({span} prompt tokens)", f"{e['plain']['decode_tokens_per_s']:.1f}",
                     f"{e['speculative']['decode_tokens_per_s']:.1f}", f"{e['speedup']:.2f}x",
                     f"{e['speculative'].get('acceptance_rate', 0):.2f}", "yes" if e["outputs_equal"] else "no"])
        if "lookup_replay" in e:
            rows[-1].insert(4, f"{e['lookup_replay']['ceiling']:.2f}x")
    column = "with prompt lookup" if method == "ngram" else "with a draft model"
    ceiling = any("lookup_replay" in e for e in doc["workloads"].values())
    table = doc_sections.markdown_table(
        ["workload", "plain tok/s", column, "speedup (medians)"] + (["lookup ceiling"] if ceiling else [])
        + ["acceptance", "same output"], rows, "lrrrr" + ("r" if ceiling else "") + "l")
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

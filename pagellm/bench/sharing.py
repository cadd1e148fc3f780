"""`pagellm bench sharing`: how much KV memory sharing saves, measured on the real
engine, as in the PagedAttention paper's figures.

Parallel sampling (n = 2, 4, 6) and beam search (width 2, 4, 6) run on Alpaca-like
and ShareGPT-like lengths through the real scheduler, block pool and copy-on-write,
with a tiny random-weight model (memory bookkeeping does not depend on the model's
size). After every step we count the distinct blocks in use, and the blocks the same
sequences would hold if each kept its own copy of everything it references; the
saving is 1 - sum(used) / sum(unshared) over the run.

A shared-prefix workload (a 1,000-token common prefix, 64 requests) measures the
prefix-cache hit rate and the time to first token with caching on and off, on the
bundled model unless --model says otherwise.
"""
from __future__ import annotations

import argparse
import random
import tempfile
import time

from pagellm.bench import doc_sections, report
from pagellm.bench.memory import WORKLOADS, sample_lengths

PAPER = {
    ("parallel", "alpaca"): (6.1, 9.8), ("parallel", "sharegpt"): (16.2, 30.5),
    ("beam", "alpaca"): (37.6, 55.2), ("beam", "sharegpt"): (44.3, 66.3),
}


def _tiny_llm(block_size: int, num_blocks: int, max_model_len: int):
    from pagellm import LLM
    from pagellm.loader.synthetic import write_dummy_model_dir

    path = write_dummy_model_dir(tempfile.mkdtemp(prefix="pagellm-sharing-"), "tiny",
                                 max_position_embeddings=max_model_len)
    return LLM(path, load_format="dummy", block_size=block_size, num_kv_blocks=num_blocks,
               max_num_seqs=1024, max_num_batched_tokens=8192, max_model_len=max_model_len)


def measure_saving(llm, mode: str, width: int, lengths: list[tuple[int, int]], seed: int) -> dict:
    """Run one batch of requests to the end; return block counts with and without sharing."""
    from pagellm import BeamSearchParams, SamplingParams

    eng = llm.engine
    rng = random.Random(seed)
    for i, (n_in, n_out) in enumerate(lengths):
        prompt = {"prompt_token_ids": [rng.randrange(3, 300) for _ in range(n_in)]}
        if mode == "parallel":
            eng.add_request(f"s{i}", prompt, SamplingParams(n=width, temperature=1.0, seed=seed + i,
                                                            max_tokens=n_out, ignore_eos=True))
        else:
            eng.add_beam_request(f"s{i}", prompt, BeamSearchParams(width, n_out, ignore_eos=True))
    used = unshared = steps = peak_used = 0
    while eng.has_unfinished_requests():
        eng.step()
        tables = eng.kv.block_tables.values()
        u = eng.kv.num_used_blocks
        used += u
        unshared += sum(len(t) for t in tables)
        peak_used = max(peak_used, u)
        steps += 1
    assert eng.kv.num_used_blocks == 0, "blocks leaked"
    return {"steps": steps, "mean_used_blocks": used / steps, "mean_unshared_blocks": unshared / steps,
            "peak_used_blocks": peak_used, "saving_pct": 100.0 * (1 - used / unshared)}


def prefix_cache_run(model: str | None, prefix_len: int, num_requests: int, suffix_len: int, max_tokens: int,
                     kv_cache_memory: int, seed: int) -> dict:
    from pagellm import LLM, SamplingParams

    out = {}
    rng = random.Random(seed)
    for caching in (True, False):
        llm = LLM(model, enable_prefix_caching=caching, kv_cache_memory=kv_cache_memory)
        vocab = llm.engine.arch.vocab_size
        rng.seed(seed)
        prefix = [rng.randrange(100, vocab - 100) for _ in range(prefix_len)]
        prompts = [{"prompt_token_ids": prefix + [rng.randrange(100, vocab - 100) for _ in range(suffix_len)]}
                   for _ in range(num_requests)]
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        # Warm the cache as a long-running server would have: two requests first, one after the
        # other (a recurrent model's second one leaves the state checkpoint where the prefix ends).
        for warm in prompts[:2]:
            llm.generate(warm, params, use_tqdm=False)
        before = llm.stats()
        t0 = time.perf_counter()
        outs = llm.generate(prompts[2:], params, use_tqdm=False)
        wall = time.perf_counter() - t0
        after = llm.stats()
        ttft = sorted(o.metrics.time_to_first_token for o in outs)
        queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
        hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
        out["on" if caching else "off"] = {
            "hit_rate": hits / queries if queries else 0.0,
            "mean_ttft_s": sum(ttft) / len(ttft),
            "p50_ttft_s": ttft[len(ttft) // 2],
            "wall_s": wall,
            "prompt_tokens_computed": after["prompt_tokens_computed"] - before["prompt_tokens_computed"],
            "tokens": [o.outputs[0].token_ids for o in outs],
        }
    out["same_outputs"] = out["on"].pop("tokens") == out["off"].pop("tokens")
    out["ttft_speedup"] = out["off"]["mean_ttft_s"] / out["on"]["mean_ttft_s"]
    return out


def run(args: argparse.Namespace) -> dict:
    from tqdm.auto import tqdm

    widths = args.widths
    cases = [(m, w, wl) for wl in args.workload for m in ("parallel", "beam") for w in widths]
    llm = _tiny_llm(args.block_size, args.num_blocks, args.max_model_len)
    rows = []
    for mode, width, wl in tqdm(cases, desc="sharing", disable=args.no_progress):
        n = args.num_requests or (64 if wl == "alpaca" else 24)
        lengths = sample_lengths(WORKLOADS[wl], n, args.seed, args.max_model_len // 2)
        r = measure_saving(llm, mode, width, lengths, args.seed)
        rows.append({"mode": mode, "width": width, "workload": wl, "num_requests": n,
                     "paper_range_pct": PAPER[(mode, wl)], **r})
    result = {"block_size": args.block_size, "sharing": rows}
    if not args.skip_prefix:
        result["prefix_cache"] = {"prefix_len": args.prefix_len, "num_requests": args.prefix_requests,
                                  **prefix_cache_run(args.model, args.prefix_len, args.prefix_requests,
                                                     args.suffix_len, args.prefix_max_tokens,
                                                     args.kv_cache_memory, args.seed)}
    return result


def print_tables(result: dict) -> None:
    rows = [(r["workload"], r["mode"], r["width"], r["saving_pct"], f"{r['paper_range_pct'][0]}-{r['paper_range_pct'][1]}",
             r["mean_used_blocks"], r["mean_unshared_blocks"]) for r in result["sharing"]]
    print(report.format_table(["workload", "sharing", "n/width", "saved %", "paper %", "mean blocks used",
                               "mean blocks unshared"], rows))
    pc = result.get("prefix_cache")
    if pc:
        print()
        print(report.format_table(
            ["prefix caching", "hit rate", "mean TTFT s", "p50 TTFT s", "prompt tokens computed", "wall s"],
            [(k, pc[k]["hit_rate"], pc[k]["mean_ttft_s"], pc[k]["p50_ttft_s"], pc[k]["prompt_tokens_computed"],
              pc[k]["wall_s"]) for k in ("on", "off")]))
        print(f"TTFT speed-up with caching: {pc['ttft_speedup']:.1f}x; same greedy outputs: {pc['same_outputs']}")


def doc_table(result: dict) -> str:
    """docs/benchmarks.md's table: per sharing mode, the saving at each width by workload, beside
    the paper's range."""
    rows = []
    for mode, label in (("parallel", "parallel sampling n ="), ("beam", "beam search width")):
        by_workload = {wl: [r for r in result["sharing"] if r["mode"] == mode and r["workload"] == wl]
                       for wl in ("alpaca", "sharegpt")}
        widths = [r["width"] for r in by_workload["alpaca"]]
        rows.append([f"{label} {' / '.join(map(str, widths))}",
                     *(" / ".join(f"{r['saving_pct']:.1f}" for r in by_workload[wl]) + " %" for wl in by_workload),
                     " / ".join(f"{PAPER[(mode, wl)][0]}-{PAPER[(mode, wl)][1]} %" for wl in by_workload)])
    return doc_sections.markdown_table(["sharing", "Alpaca saved", "ShareGPT saved", "paper (Alpaca / ShareGPT)"], rows)


def plot(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, mode in zip(axes, ("parallel", "beam")):
        for k, wl in enumerate(sorted({r["workload"] for r in result["sharing"]})):
            rows = [r for r in result["sharing"] if r["mode"] == mode and r["workload"] == wl]
            xs = [i + 0.38 * k for i in range(len(rows))]
            ax.bar(xs, [r["saving_pct"] for r in rows], width=0.36, label=f"{wl} (pagellm)")
            lo, hi = PAPER[(mode, wl)]
            ax.axhspan(lo, hi, alpha=0.12, color=f"C{k}", label=f"{wl} (paper range)")
        ax.set_xticks([i + 0.19 for i in range(len(rows))], [str(r["width"]) for r in rows])
        ax.set_xlabel("n" if mode == "parallel" else "beam width")
        ax.set_title("parallel sampling" if mode == "parallel" else "beam search")
        ax.legend(fontsize=7)
    axes[0].set_ylabel("KV blocks saved by sharing (%)")
    report.save_figure(fig, path, dpi=120)


def add_parser(sub) -> None:
    p = sub.add_parser("sharing", help="KV memory saved by sharing (parallel sampling, beam search) and "
                                       "prefix-cache hit rate and TTFT")
    p.add_argument("--workload", action="append", choices=sorted(WORKLOADS), default=None)
    p.add_argument("--widths", type=int, nargs="+", default=[2, 4, 6])
    p.add_argument("--num-requests", type=int, default=None, help="default: 64 Alpaca-like, 24 ShareGPT-like")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=20000)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--model", default=None, help="model for the prefix-cache run (default: bundled SmolLM2)")
    p.add_argument("--prefix-len", type=int, default=1000)
    p.add_argument("--prefix-requests", type=int, default=64)
    p.add_argument("--suffix-len", type=int, default=24)
    p.add_argument("--prefix-max-tokens", type=int, default=4)
    p.add_argument("--kv-cache-memory", type=int, default=512 << 20, help="KV budget in bytes for the prefix-cache run")
    p.add_argument("--skip-prefix", action="store_true", help="only the sharing figures")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="output path stem (default benchmarks/results/sharing-<date>)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    args.workload = args.workload or ["alpaca", "sharegpt"]
    result = run(args)
    data = {**report.metadata("sharing"), "results": result}
    json_path, png_path = report.output_paths("sharing", args.out)
    report.write_json(json_path, data)
    plot(result, png_path)
    print_tables(result)
    print(f"\nwrote {json_path} and {png_path}")
    return 0

"""`pagellm bench kv-offload`: multi-turn chat whose contexts outgrow the KV pool, with the prefix
cache's second tier on disk (--kv-offload-dir) against without it, and after a restart.

Conversations of 4-8 turns (seeded; user turns of ordinary words, assistant replies of
--max-tokens tokens, greedy) are served turn by turn, round-robin over the conversations, one
request at a time, so that by the time a conversation returns the others have pushed its blocks
out of the pool. The first pass (no tier) fixes every conversation's history; the tier pass
replays exactly the same prompts, and its outputs are compared with the first pass's token for
token. Reported per pass: prompt tokens recomputed (went through a forward pass) against prompt
tokens asked, and mean time to first token (TTFT: arrival to first token; with one request at a
time, the prefill and whatever the tier reads). Then the engine is restarted on the persisted
tier and the conversations' last turns are asked again, against a cold engine without a tier.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time

from pagellm.bench import doc_sections, report


def conversations(n: int, min_turns: int, max_turns: int, words: int, seed: int) -> list[list[str]]:
    """Per conversation, its user turns."""
    rng = random.Random(seed)
    return [[" ".join(rng.choice(report.COMMON_WORDS) for _ in range(words)) + "?"
             for _ in range(rng.randint(min_turns, max_turns))] for _ in range(n)]


def _engine(args: argparse.Namespace, **extra):
    from pagellm import LLM

    return LLM(args.model, dtype=args.dtype, block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
               max_model_len=args.max_model_len, seed=0, **extra)


def run_pass(llm, convs: list[list[str]], max_tokens: int, replies: list[list[str]] | None = None,
             last_turn_only: bool = False) -> dict:
    """Serve every conversation turn by turn (round-robin). `replies`: the assistant turns to put
    in the histories (None: this pass's own, which it returns)."""
    from pagellm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    own: list[list[str]] = [[] for _ in convs]
    outputs: dict[tuple[int, int], list[int]] = {}
    ttft, asked = [], 0
    before = llm.stats()["prompt_tokens_computed"]
    for t in range(max(map(len, convs))):
        for c, turns in enumerate(convs):
            if t >= len(turns) or (last_turn_only and t != len(turns) - 1):
                continue
            history = []
            for i in range(t):
                history += [{"role": "user", "content": turns[i]},
                            {"role": "assistant", "content": (replies or own)[c][i]}]
            out = llm.chat(history + [{"role": "user", "content": turns[t]}], params, use_tqdm=False)[0]
            own[c].append(out.outputs[0].text)
            outputs[(c, t)] = list(out.outputs[0].token_ids)
            ttft.append(out.metrics.time_to_first_token)
            asked += len(out.prompt_token_ids)
    stats = llm.stats()
    computed = stats["prompt_tokens_computed"] - before
    return {"requests": len(ttft), "prompt_tokens": asked, "prompt_tokens_computed": computed,
            "share_recomputed": computed / asked, "mean_ttft_s": statistics.mean(ttft),
            "median_ttft_s": statistics.median(ttft), "kv_offload": stats.get("kv_offload"),
            "_outputs": outputs, "_replies": own}


def run(args: argparse.Namespace) -> dict:
    convs = conversations(args.conversations, args.min_turns, args.max_turns, args.user_words, args.seed)
    tier_dir = args.kv_offload_dir or tempfile.mkdtemp(prefix="pagellm-kv-offload-")
    load = {"loadavg_start": os.getloadavg()}
    passes: dict = {}
    llm = _engine(args)
    pool_tokens = llm.engine.kv.num_blocks * args.block_size
    passes["no_tier"] = run_pass(llm, convs, args.max_tokens)
    llm.shutdown()
    replies = passes["no_tier"]["_replies"]
    llm = _engine(args, kv_offload_dir=tier_dir, kv_offload_size=args.kv_offload_size, kv_offload_persist=True)
    passes["tier"] = run_pass(llm, convs, args.max_tokens, replies)
    llm.shutdown()
    # A restart: the last turns again, on the persisted tier, and on a cold engine without one.
    llm = _engine(args, kv_offload_dir=tier_dir, kv_offload_size=args.kv_offload_size, kv_offload_persist=True)
    started = time.perf_counter()
    passes["restart_tier_last_turns"] = run_pass(llm, convs, args.max_tokens, replies, last_turn_only=True)
    passes["restart_tier_last_turns"]["wall_s"] = time.perf_counter() - started
    llm.shutdown()
    llm = _engine(args)
    passes["restart_cold_last_turns"] = run_pass(llm, convs, args.max_tokens, replies, last_turn_only=True)
    llm.shutdown()
    if args.kv_offload_dir is None:
        for f in os.listdir(tier_dir):
            os.remove(os.path.join(tier_dir, f))
        os.rmdir(tier_dir)
    load["loadavg_end"] = os.getloadavg()
    ref = passes["no_tier"]["_outputs"]
    equal = {name: all(p["_outputs"][k] == ref[k] for k in p["_outputs"]) for name, p in passes.items()}
    context_tokens = passes["no_tier"]["prompt_tokens"]  # every turn's prompt, summed
    last = passes["restart_cold_last_turns"]["prompt_tokens"]  # the conversations' final contexts
    out = {"config": {k: v for k, v in vars(args).items() if k not in ("func",)}, "pool_tokens": pool_tokens,
           "final_context_tokens": last, "final_contexts_over_pool": last / pool_tokens,
           "prompt_tokens_asked": context_tokens, "outputs_equal_no_tier": equal, "load": load,
           "passes": {n: {k: v for k, v in p.items() if not k.startswith("_")} for n, p in passes.items()}}
    out["targets"] = [
        {"target": "the conversations' cached contexts total >= 3x the pool", "value": out["final_contexts_over_pool"],
         "met": out["final_contexts_over_pool"] >= 3},
        {"target": "greedy outputs with the tier equal those without", "value": float(all(equal.values())),
         "met": all(equal.values())},
    ]
    return out


def swap_vs_recompute(args: argparse.Namespace, block_sizes: list[int], context: int, rounds: int = 3) -> dict:
    """The PagedAttention paper's comparison (its Figure 19) on this machine: for one request of
    `context` tokens, the time to bring its KV back by swapping (every block written to the disk
    tier and read back into the pool: DiskKVTier and the runner's block copies, as swap_out and a
    resume use them) against recomputing it (one prefill of the context), per block size.
    Medians of `rounds`."""
    from pagellm import SamplingParams

    rows = {}
    for bs in block_sizes:
        tier_dir = tempfile.mkdtemp(prefix="pagellm-swap-")
        llm = _engine(argparse.Namespace(**{**vars(args), "block_size": bs,
                                            "num_kv_blocks": -(-context // bs) * 2 + 4,
                                            "max_model_len": context + 8}),
                      kv_offload_dir=tier_dir, kv_offload_size=args.kv_offload_size)
        engine = llm.engine
        rng = random.Random(args.seed)
        prompt = {"prompt_token_ids": [rng.randrange(3, engine.arch.vocab_size) for _ in range(context)]}
        recompute, out_s, in_s = [], [], []
        for r in range(rounds):
            engine.kv.pool.reset_cache()  # a cold pool: the prefill computes every token
            started = time.perf_counter()
            llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
            recompute.append(time.perf_counter() - started)
            blocks = engine.kv.cached_blocks()
            tier = engine.kv_tier
            salted = [(b, bytes([r]) + key[1:]) for b, key in blocks]  # fresh keys: every round writes
            started = time.perf_counter()
            for b, key in salted:
                tier.store(key, engine.runner.read_block(b), wait=True)
            tier.flush()
            out_s.append(time.perf_counter() - started)
            started = time.perf_counter()
            for b, key in salted:
                engine.runner.write_block(b, tier.load(key))
            in_s.append(time.perf_counter() - started)
        num_blocks = len(blocks)
        llm.shutdown()
        os.rmdir(tier_dir)
        rows[str(bs)] = {"blocks": num_blocks, "block_bytes": engine.runner.bytes_per_block(bs),
                         "recompute_s": statistics.median(recompute), "swap_out_s": statistics.median(out_s),
                         "swap_in_s": statistics.median(in_s),
                         "swap_s": statistics.median(o + i for o, i in zip(out_s, in_s))}
    return {"context": context, "rounds": rounds, "block_sizes": rows}


def print_tables(out: dict) -> None:
    print(f"pool: {out['pool_tokens']} tokens; the conversations' final contexts: {out['final_context_tokens']} "
          f"tokens ({out['final_contexts_over_pool']:.1f}x the pool)")
    rows = [(name, p["requests"], p["prompt_tokens"], p["prompt_tokens_computed"], f"{p['share_recomputed']:.1%}",
             f"{1e3 * p['mean_ttft_s']:.0f}", f"{1e3 * p['median_ttft_s']:.0f}",
             (p["kv_offload"] or {}).get("promoted_blocks", "-"), out["outputs_equal_no_tier"][name])
            for name, p in out["passes"].items()]
    print(report.format_table(["pass", "requests", "prompt tokens", "recomputed", "share", "mean TTFT ms",
                               "median TTFT ms", "blocks from tier", "outputs equal"], rows))
    if "swap_vs_recompute" in out:
        s = out["swap_vs_recompute"]
        print(f"\nbringing back a {s['context']}-token request's KV: swap (disk tier, out and in) against "
              f"recompute (one prefill), medians of {s['rounds']}")
        rows = [(bs, r["blocks"], r["block_bytes"], f"{1e3 * r['swap_out_s']:.0f}", f"{1e3 * r['swap_in_s']:.0f}",
                 f"{1e3 * r['swap_s']:.0f}", f"{1e3 * r['recompute_s']:.0f}")
                for bs, r in s["block_sizes"].items()]
        print(report.format_table(["block size", "blocks", "block bytes", "swap out ms", "swap in ms", "swap ms",
                                   "recompute ms"], rows))
    report.print_targets(out["targets"])


PASS_LABELS = {"no_tier": "no tier", "tier": "tier",
               "restart_tier_last_turns": "last turns after a restart, persisted tier",
               "restart_cold_last_turns": "last turns after a restart, cold"}


def doc_table(out: dict) -> str:
    """docs/kv-cache.md's table of the passes: prompt tokens, those recomputed, mean time to first
    token, and whether the greedy outputs equal the pass without a tier."""
    rows = [[PASS_LABELS.get(name, name), f"{p['prompt_tokens']:,}",
             f"{p['prompt_tokens_computed']:,} ({p['share_recomputed']:.1%})", f"{1e3 * p['mean_ttft_s']:.0f} ms",
             "(the reference)" if name == "no_tier" else "equal" if out["outputs_equal_no_tier"][name] else "differ"]
            for name, p in out["passes"].items()]
    return doc_sections.markdown_table(["pass", "prompt tokens", "recomputed", "mean TTFT", "outputs against no tier"],
                                       rows, "lrrrl")


def swap_doc_table(out: dict) -> str:
    """docs/kv-cache.md's table of swapping against recomputing one request, per block size."""
    rows = [[bs, r["blocks"], f"{r['block_bytes']:,}", *(f"{1e3 * r[k]:,.0f} ms" for k in
                                                        ("swap_out_s", "swap_in_s", "swap_s", "recompute_s"))]
            for bs, r in out["swap_vs_recompute"]["block_sizes"].items()]
    return doc_sections.markdown_table(["block size", "blocks", "bytes / block", "swap out", "swap in", "swap total",
                                      "recompute"], rows, "rrrrrrr")


def add_parser(sub) -> None:
    p = sub.add_parser("kv-offload", help="multi-turn chat outgrowing the KV pool: the disk tier against none, "
                                          "and after a restart")
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: the bundled SmolLM2)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--conversations", type=int, default=12)
    p.add_argument("--min-turns", type=int, default=4)
    p.add_argument("--max-turns", type=int, default=8)
    p.add_argument("--user-words", type=int, default=40, help="words per user turn")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per assistant turn")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=96, help="the KV pool (blocks)")
    p.add_argument("--max-model-len", type=int, default=1536)
    p.add_argument("--kv-offload-dir", default=None, help="default: a temporary directory, removed afterwards")
    p.add_argument("--kv-offload-size", type=int, default=1 << 30)
    p.add_argument("--swap-block-sizes", type=int, nargs="*", default=[8, 16, 32, 64, 128],
                   help="block sizes of the swap-versus-recompute comparison (none: skip it)")
    p.add_argument("--swap-context", type=int, default=1024, help="tokens of the request swapped or recomputed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="output path stem (default benchmarks/results/kv-offload-<date>)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    out = {**report.metadata("kv-offload"), **run(args)}
    if args.swap_block_sizes:
        out["swap_vs_recompute"] = swap_vs_recompute(args, args.swap_block_sizes, args.swap_context)
        out["load"]["loadavg_after_swap"] = os.getloadavg()
    json_path, _ = report.output_paths("kv-offload", args.out)
    report.write_json(json_path, out)
    print_tables(out)
    print(f"\nwrote {json_path}")
    return 0

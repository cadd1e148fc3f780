"""`pagellm bench latency`: prompt and decode speed of a few streams, llama-bench's two figures.

llama-bench reports `pp N` (one prompt of N tokens, tokens per second) and `tg N` (N tokens
decoded one at a time, single stream). This runs the same two measurements on pagellm's engine
and, with `llama-bench` among the systems, llama.cpp's own tool on the same GGUF file with the
same threads, so the two sit in one JSON. Prompts are random token ids (as llama-bench's are);
prefix caching is off so repeats recompute. Systems are measured round by round (each once per
round, `--repeat` rounds, medians reported), so a drift in the machine's speed reaches them all.

Each system's figures come with the roofline (pagellm/bench/roofline.py): the machine's memory
bandwidth and GEMM rate measured in the same run, and the GB/s of weights streamed and GFLOP/s
achieved, so "how far from the limit" is a number. With `--profile` pagellm's decode steps are
timed by phase (where a step's time goes).

    pagellm bench latency --systems pagellm-paged,pagellm-paged-bf16,llama-bench
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field

from pagellm.bench import report, roofline
from pagellm.bench.throughput import _phase_breakdown, pagellm_system, system_unavailable

DEFAULT_SYSTEMS = ["pagellm-paged", "pagellm-paged-bf16", "llama-bench"]
LLAMA_BENCH = "llama-bench"


@dataclass
class LatencyConfig:
    model: str | None = None
    systems: list[str] = field(default_factory=lambda: list(DEFAULT_SYSTEMS))
    input_len: int = 256
    output_len: int = 128
    batch_size: int = 1
    repeat: int = 3
    threads: int = 2
    seed: int = 0
    profile: bool = False


def _prompt(vocab_size: int, n: int, rng: random.Random) -> list[int]:
    # Ids from the ordinary part of the vocabulary (past the first 256: special and byte tokens).
    return [rng.randrange(min(256, vocab_size // 2), vocab_size) for _ in range(n)]


class PagellmRun:
    """One pagellm system: its engine, built and warmed up once, measured one round at a time."""

    def __init__(self, cfg: LatencyConfig, options: dict) -> None:
        from pagellm.entrypoints.llm import LLM
        from pagellm.timing import PhaseTimer

        self.cfg, self.options = cfg, options
        self.llm = LLM(cfg.model, device="cpu", max_model_len=cfg.input_len + cfg.output_len + 8,
                       max_num_seqs=max(1, cfg.batch_size),
                       max_num_batched_tokens=max(2048, cfg.input_len * cfg.batch_size),
                       enable_prefix_caching=False, seed=cfg.seed, **options)
        self.engine = self.llm.engine
        self.vocab = self.engine.runner.model.cfg.vocab_size
        self.rng = random.Random(cfg.seed)
        self.prefill: list[float] = []
        self.decode: list[float] = []
        self.timer = PhaseTimer() if cfg.profile else None
        # Warm-up: kernels compiled and allocators grown outside the measurement.
        self._timed_steps([_prompt(self.vocab, 16, self.rng)], 4)

    def _timed_steps(self, prompts: list[list[int]], max_tokens: int) -> list[float]:
        from pagellm.sampling_params import SamplingParams

        for i, p in enumerate(prompts):
            self.engine.add_request(f"lat-{time.monotonic_ns()}-{i}", {"prompt_token_ids": p},
                                    SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        times = []
        while self.engine.has_unfinished_requests():
            start = time.perf_counter()
            self.engine.step()
            times.append(time.perf_counter() - start)
        return times

    def round(self) -> None:
        cfg, B = self.cfg, self.cfg.batch_size
        # pp: every prompt in one step (max_num_batched_tokens covers them), one token sampled.
        steps = self._timed_steps([_prompt(self.vocab, cfg.input_len, self.rng) for _ in range(B)], 1)
        self.prefill.append(sum(steps))
        # tg: a one-token prompt, then output_len single-token steps (the first step is its prefill).
        self.engine.attach_timer(self.timer)
        steps = self._timed_steps([_prompt(self.vocab, 1, self.rng) for _ in range(B)], cfg.output_len + 1)
        self.engine.attach_timer(None)
        self.decode.append(sum(steps[1:]))

    def result(self, limits: dict) -> dict:
        cfg, B = self.cfg, self.cfg.batch_size
        cost = self.engine.model_cost()
        pp_s, tg_s = statistics.median(self.prefill), statistics.median(self.decode)
        dtype = self.options.get("dtype", "float32")
        result = {
            "options": self.options,
            "activation_quantization": self.engine.activation_quantization,  # as resolved ("auto" -> a mode)
            "pp_tokens_per_s": B * cfg.input_len / pp_s,
            "tg_tokens_per_s": B * cfg.output_len / tg_s,
            "tg_ms_per_step": 1e3 * tg_s / cfg.output_len,
            "pp_runs_s": self.prefill, "tg_runs_s": self.decode,
            "weight_bytes": self.engine.memory_report()[0]["weight_bytes"],
            "model_cost": cost,
            "roofline_pp": roofline.achieved(cost, B * cfg.input_len, 1, pp_s, limits, dtype),
            "roofline_tg": roofline.achieved(cost, B * cfg.output_len, cfg.output_len, tg_s, limits, dtype),
        }
        if self.timer is not None:
            # Only decode steps were timed, plus each run's one-token prefill step.
            result["decode_phases"] = _phase_breakdown(self.timer)
        return result

    def shutdown(self) -> None:
        self.llm.shutdown()


def llama_bench_binary() -> str:
    from pagellm import envs

    return os.path.join(envs.llama_cpp_bin(), LLAMA_BENCH)


def llama_bench_round(cfg: LatencyConfig, model_path: str) -> dict:
    """One run of llama.cpp's llama-bench on the same file and threads: pp input_len and tg output_len."""
    cmd = [llama_bench_binary(), "-m", model_path, "-p", str(cfg.input_len), "-n", str(cfg.output_len),
           "-t", str(cfg.threads), "-r", "1", "-o", "json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-bench exited with {proc.returncode}: {proc.stderr.strip()[-500:]}")
    rows = json.loads(proc.stdout)
    pp = next(r for r in rows if r["n_prompt"] and not r["n_gen"])
    tg = next(r for r in rows if r["n_gen"] and not r["n_prompt"])
    return {"command": cmd, "pp": pp["avg_ts"], "tg": tg["avg_ts"],
            "build": {k: pp.get(k) for k in ("build_commit", "build_number", "cpu_info", "type_k", "n_threads")}}


def llama_bench_result(cfg: LatencyConfig, rounds: list[dict], cost: dict | None, limits: dict) -> dict:
    """llama-bench's rounds as one system: the median of each figure, like pagellm's."""
    pp, tg = statistics.median(r["pp"] for r in rounds), statistics.median(r["tg"] for r in rounds)
    result = {"command": rounds[0]["command"], "pp_tokens_per_s": pp, "tg_tokens_per_s": tg,
              "tg_ms_per_step": 1e3 / tg, "pp_runs_tokens_per_s": [r["pp"] for r in rounds],
              "tg_runs_tokens_per_s": [r["tg"] for r in rounds], "build": rounds[0]["build"]}
    if cost:
        # The same blocks as pagellm's GGUF-native engine streams: its cost stands for llama.cpp's.
        result["roofline_pp"] = roofline.achieved(cost, cfg.input_len, 1, cfg.input_len / pp, limits)
        result["roofline_tg"] = roofline.achieved(cost, cfg.output_len, cfg.output_len, cfg.output_len / tg, limits)
    return result


def run_latency_bench(cfg: LatencyConfig) -> dict:
    import torch

    from pagellm.loader.source import load_model_source

    torch.set_num_threads(cfg.threads)
    model_path = load_model_source(cfg.model).path
    load = {"loadavg_start": os.getloadavg()}
    limits = roofline.machine_limits(cfg.threads)
    systems, skipped = {}, {}
    bench_llama = LLAMA_BENCH in cfg.systems
    if bench_llama and not model_path.lower().endswith(".gguf"):
        skipped[LLAMA_BENCH], bench_llama = "llama-bench needs a GGUF model", False
    elif bench_llama and not os.access(llama_bench_binary(), os.X_OK):
        skipped[LLAMA_BENCH] = (f"{llama_bench_binary()} not found: build it with "
                                "benchmarks/build_llama_cpp.sh or set PAGELLM_LLAMA_CPP_BIN")
        bench_llama = False
    if bench_llama and cfg.batch_size != 1:  # before any engine is built and measured
        raise ValueError("llama-bench measures one stream; use --batch-size 1 with it")
    runs: dict[str, PagellmRun] = {}
    llama_rounds = []
    try:
        for name in cfg.systems:
            if name == LLAMA_BENCH:
                continue
            if not name.startswith("pagellm-"):
                raise ValueError(f"unknown system {name!r}; choose pagellm-<policy>[-bf16][-dense][-noneact|-int8act"
                                 f"|-int8x2act] or {LLAMA_BENCH}")
            policy, options = pagellm_system(name)
            if policy != "paged":
                raise ValueError(f"{name}: the latency bench runs the paged engine only")
            if why := system_unavailable(options):
                skipped[name] = why
                continue
            runs[name] = PagellmRun(cfg, options)
        # Round by round, every system once per round: on shared cores the machine's speed drifts
        # over minutes, and systems measured one after the other would carry that drift into their ratios.
        for _ in range(cfg.repeat):
            for run in runs.values():
                run.round()
            if bench_llama:
                llama_rounds.append(llama_bench_round(cfg, model_path))
        gguf_cost = None
        for name, run in runs.items():
            systems[name] = run.result(limits)
            if run.options.get("quantization") is None and gguf_cost is None:
                gguf_cost = systems[name]["model_cost"]
    finally:
        for run in runs.values():
            run.shutdown()
    if bench_llama:
        systems[LLAMA_BENCH] = llama_bench_result(cfg, llama_rounds, gguf_cost, limits)
    load["loadavg_end"] = os.getloadavg()
    limits_after = roofline.machine_limits(cfg.threads)
    return {"config": asdict(cfg), "model": model_path, "load": load, "machine_limits": limits,
            "machine_limits_after": limits_after, "systems": systems, "skipped": skipped,
            "ratios_to_llama_bench": _ratios(systems)}


def _ratios(systems: dict) -> dict:
    ref = systems.get(LLAMA_BENCH)
    if not ref:
        return {}
    return {name: {"pp": s["pp_tokens_per_s"] / ref["pp_tokens_per_s"],
                   "tg": s["tg_tokens_per_s"] / ref["tg_tokens_per_s"]}
            for name, s in systems.items() if name != LLAMA_BENCH}


def print_tables(results: dict) -> None:
    cfg = results["config"]
    lim = results["machine_limits"]
    rows = []
    for name, s in results["systems"].items():
        tg = s.get("roofline_tg") or {}
        rows.append([name, s["pp_tokens_per_s"], s["tg_tokens_per_s"], s["tg_ms_per_step"], tg.get("weight_gbps"),
                     tg.get("share_of_memory_bandwidth"), (s.get("roofline_pp") or {}).get("gflops")])
    print(f"\n{results['model']}: pp{cfg['input_len']} / tg{cfg['output_len']}, batch {cfg['batch_size']}, "
          f"{cfg['threads']} threads")
    print(report.format_table(["system", "pp tok/s", "tg tok/s", "tg ms/step", "tg weight GB/s", "of bandwidth",
                               "pp GFLOP/s"], rows))
    print(f"machine: {lim['memory_gbps']} GB/s memory, {lim['gemm_gflops_float32']} GFLOP/s fp32 GEMM, "
          f"{lim['gemm_gflops_bfloat16'] or 'no'} bf16 (after: {results['machine_limits_after']['memory_gbps']} GB/s)")
    for name, r in results["ratios_to_llama_bench"].items():
        print(f"{name} / llama-bench: pp {r['pp']:.2f}x, tg {r['tg']:.2f}x")
    for name, why in results["skipped"].items():
        print(f"skipped {name}: {why}")
    for name, s in results["systems"].items():
        if "decode_phases" in s:
            ph = s["decode_phases"]
            print(f"\n{name}, where a decode step's time goes ({ph['steps']} steps):")
            print(report.format_table(["phase", "ms/step", "share"],
                                      [[k, v, f"{ph['share'][k]:.1%}"] for k, v in ph["ms_per_step"].items()]))


def add_parser(sub) -> None:
    p = sub.add_parser("latency", help="prompt (pp) and decode (tg) tokens/s of one stream, pagellm and llama-bench")
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: the bundled SmolLM2)")
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                   help="comma-separated: pagellm-paged[-bf16][-dense][-noneact|-int8act|-int8x2act] "
                        "(activations: auto without a suffix), llama-bench")
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens (llama-bench -p)")
    p.add_argument("--output-len", type=int, default=128, help="decoded tokens (llama-bench -n)")
    p.add_argument("--batch-size", type=int, default=1, help="streams decoded together (pagellm only)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--profile", action="store_true", help="time pagellm's decode steps by phase")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="output path stem (default benchmarks/results/latency-<date>)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    for name in ("input_len", "output_len", "batch_size", "repeat", "threads"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    cfg = LatencyConfig(model=args.model, systems=[s.strip() for s in args.systems.split(",") if s.strip()],
                        input_len=args.input_len, output_len=args.output_len, batch_size=args.batch_size,
                        repeat=args.repeat, threads=args.threads, seed=args.seed, profile=args.profile)
    results = {**report.metadata("latency"), **run_latency_bench(cfg)}
    json_path, _ = report.output_paths("latency", args.out)
    report.write_json(json_path, results)
    print_tables(results)
    print(f"\nwrote {json_path}")
    return 0

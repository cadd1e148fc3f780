"""`pagellm bench throughput`: offline throughput on a real model and real tokens,
pagellm against what a user would otherwise run, in one process on the same prompts.

Systems (any subset with --systems):
- `pagellm-paged`: the engine as shipped (paged KV, block size 16).
- `pagellm-paged-bf16`, `pagellm-paged-dense`, `pagellm-paged-invariant`: the same engine in
  bfloat16, with a GGUF file dequantized at load, or in batch-invariant mode (suffixes combine
  in that order: `pagellm-paged-bf16-invariant`).
- `pagellm-contiguous-max` / `-oracle` / `-pow2`: the same engine built with
  `kv_policy=contiguous-*` (a contiguous region reserved per request) over the same
  number of blocks, so the difference is what paging buys at one KV budget.
- `hf-static-<B>`: transformers `generate` on padded static batches of B requests in
  input order (left padding, greedy); a batch runs until its longest request is done.
  Only the tokens each request asked for are counted.
- `hf-generate-batch`: transformers' continuous batching (`generate_batch`'s manager,
  fed each request's own max_new_tokens).
- `llama-cpp`: llama-cpp-python on the same GGUF, requests one after another as its
  server does (only when `llama_cpp` imports).

The workload: `--num-requests` prompts of uniformly drawn length (32-512 tokens) made of
ordinary words from the model's own vocabulary, strung into sentences by a seeded
generator (no dataset download), each with a uniformly drawn output length (16-256) and
ignore_eos, greedy. The benchmark checks that pagellm's greedy tokens equal transformers'
(one request at a time, unpadded) on a sample and records it.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pagellm.bench import doc_sections, report, roofline
from pagellm.timing import PhaseTimer

DEFAULT_SYSTEMS = ["pagellm-paged", "pagellm-contiguous-max", "pagellm-contiguous-oracle", "pagellm-paged-bf16",
                   "hf-static-8", "hf-static-32", "hf-static-64", "hf-generate-batch", "llama-cpp"]


@dataclass
class ThroughputConfig:
    model: str | None = None
    num_requests: int = 128
    min_prompt: int = 32
    max_prompt: int = 512
    min_output: int = 16
    max_output: int = 256
    seed: int = 0
    systems: list[str] = field(default_factory=lambda: list(DEFAULT_SYSTEMS))
    block_size: int = 16
    # The KV budget every pagellm policy gets, in blocks of block_size tokens. None: the KV
    # memory transformers' largest static batch (64) needs at full length, i.e. 64
    # max-length requests: what a contiguous max-length reservation fits exactly.
    num_kv_blocks: int | None = None

    @property
    def kv_blocks(self) -> int:
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        return -(-64 * (self.max_prompt + self.max_output) // self.block_size)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    threads: int = 2
    check_samples: int = 4
    profile: bool = False
    show_progress: bool = True


@dataclass
class Work:
    prompt: list[int]
    max_tokens: int


# ---- the workload -----------------------------------------------------------------------------
def word_list(tok) -> list[str]:
    """Ordinary lower-case words that the vocabulary holds as one token with a leading space."""
    words = []
    for i in range(tok.vocab_size):
        piece = tok.decode([i])
        w = piece[1:]
        if piece.startswith(" ") and 3 <= len(w) <= 10 and w.isascii() and w.isalpha() and w.islower():
            words.append(w)
    return words


def make_workload(tok, cfg: ThroughputConfig) -> list[Work]:
    rng = random.Random(cfg.seed)
    words = word_list(tok)
    if len(words) < 100:  # a byte-level or tiny vocabulary: plain English words instead
        words = list(report.COMMON_WORDS)
    work = []
    for _ in range(cfg.num_requests):
        n = rng.randint(cfg.min_prompt, cfg.max_prompt)
        sentences = []
        ids: list[int] = []
        while len(ids) < n:
            s = [rng.choice(words) for _ in range(rng.randint(6, 16))]
            sentences.append(" ".join(s).capitalize() + rng.choice([".", ".", ".", "?", "!", ","]))
            ids = tok.encode(" ".join(sentences), add_special_tokens=False)
        work.append(Work(ids[:n], rng.randint(cfg.min_output, cfg.max_output)))
    return work


# ---- pagellm ------------------------------------------------------------------------------------
def _phase_breakdown(timer: PhaseTimer) -> dict:
    s = timer.seconds
    step = s.get("step", 0.0)
    forward = s.get("model_forward", 0.0)
    parts = {
        "schedule": s.get("schedule", 0.0),
        "prepare_inputs": s.get("prepare_inputs", 0.0),
        "attention (incl. KV write and gather; RoPE too on fused decode steps)": s.get("attention", 0.0),
        "rest of model forward (linear layers, norms, rope)": forward - s.get("attention", 0.0),
        "logits": s.get("logits", 0.0),
        "sampler": s.get("sampler", 0.0),
        "sampling metadata and other runner work": s.get("execute", 0.0) - s.get("prepare_inputs", 0.0)
        - forward - s.get("logits", 0.0) - s.get("sampler", 0.0),
        "update, detokenize, outputs": step - s.get("schedule", 0.0) - s.get("execute", 0.0),
    }
    return {
        "steps": timer.calls.get("step", 0),
        "step_s_total": step,
        "ms_per_step": {k: 1000 * v / max(1, timer.calls.get("step", 1)) for k, v in parts.items()},
        "share": {k: (v / step if step else 0.0) for k, v in parts.items()},
    }


# Suffixes of a `pagellm-<policy>` system, in this order: engine options they set.
SYSTEM_SUFFIXES = {"-bf16": {"dtype": "bfloat16"}, "-dense": {"quantization": "none"},
                   "-noneact": {"activation_quantization": "none"}, "-int8act": {"activation_quantization": "int8"},
                   "-int8x2act": {"activation_quantization": "int8x2"}, "-invariant": {"batch_invariant": True}}


def pagellm_system(name: str) -> tuple[str, dict]:
    """(policy, engine options). `pagellm-<policy>` runs in float32 like every other system here;
    `-bf16` is the same engine in bfloat16 (weights and KV cache), the CPU's fast opt-in mode;
    `-dense` dequantizes a GGUF file's blocks at load (quantization "none"); `-noneact` / `-int8act` /
    `-int8x2act` give a GGUF model's products float32 activations / round them to one / two int8 codes
    (activation_quantization; without one of them, the default "auto");
    `-invariant` runs in batch-invariant mode. E.g. `pagellm-paged-bf16-invariant`."""
    rest, options = name.removeprefix("pagellm-"), {}
    for suffix in reversed(SYSTEM_SUFFIXES):
        if rest.endswith(suffix):
            rest, options = rest.removesuffix(suffix), {**SYSTEM_SUFFIXES[suffix], **options}
    return rest, {"dtype": "float32", **options}


def system_unavailable(options: dict) -> str | None:
    """Why this machine cannot run a pagellm system with these engine options (None: it can):
    the engine's own refusal of the dtype (bfloat16 on a CPU without its instructions)."""
    import torch

    from pagellm.worker.model_runner import resolve_dtype

    try:
        resolve_dtype(options.get("dtype", "auto"), torch.device("cpu"))
    except ValueError as e:
        return str(e)
    return None


def make_llm(cfg: ThroughputConfig, policy: str, **options):
    """A fresh engine for one run: its own KV pool of the run's budget (so no run reuses
    another's cached prefixes). `options`: engine options of the system (dtype, ...)."""
    from pagellm.entrypoints.llm import LLM

    return LLM(cfg.model, device="cpu", block_size=cfg.block_size,
               num_kv_blocks=cfg.kv_blocks, max_num_seqs=cfg.max_num_seqs,
               max_num_batched_tokens=cfg.max_num_batched_tokens, max_model_len=cfg.max_prompt + cfg.max_output,
               seed=cfg.seed, kv_policy=policy, **{"dtype": "float32", **options})


def run_pagellm(work: list[Work], policy: str, cfg: ThroughputConfig, profile: bool = False,
                limits: dict | None = None, **options) -> dict:
    from pagellm.sampling_params import SamplingParams

    llm = make_llm(cfg, policy, **options)
    # Warm up kernels and allocators once, outside the measurement.
    llm.generate([{"prompt_token_ids": work[0].prompt[:16]}], SamplingParams(temperature=0, max_tokens=4),
                 use_tqdm=False)
    engine = llm.engine
    timer = PhaseTimer()
    engine.attach_timer(timer)
    batch_sizes: list[int] = []
    outputs: dict[int, list[int]] = {}
    prof = cProfile.Profile() if profile else None
    tprof = None
    if profile:
        import torch.profiler

        tprof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    ids = {}
    t0 = time.perf_counter()
    for i, w in enumerate(work):
        rid = f"bench-{policy}-{i}"
        ids[rid] = i
        engine.add_request(rid, {"prompt_token_ids": w.prompt},
                           SamplingParams(temperature=0, max_tokens=w.max_tokens, ignore_eos=True))
    bar = report.progress(total=len(work), desc=f"pagellm {policy}", enable=cfg.show_progress, unit="req")
    if prof:
        prof.enable()
        tprof.__enter__()
    try:
        while engine.has_unfinished_requests():
            outs = engine.step()
            batch_sizes.append(len(engine.scheduler.running))
            for o in outs:
                if o.finished:
                    outputs[ids[o.request_id]] = list(o.outputs[0].token_ids)
                    bar.update(1)
    finally:
        if prof:
            tprof.__exit__(None, None, None)
            prof.disable()
        bar.close()
        engine.attach_timer(None)
    wall = time.perf_counter() - t0
    gen = sum(len(v) for v in outputs.values())
    result = {
        "wall_s": wall, "generated_tokens": gen, "tokens_per_s": gen / wall, "requests_per_s": len(work) / wall,
        "mean_batch": sum(batch_sizes) / max(1, len(batch_sizes)), "peak_batch": max(batch_sizes, default=0),
        "num_preemptions": engine.scheduler.num_preemptions, "kv_blocks": engine.kv.num_blocks,
        "block_size": engine.kv.block_size, "phases": _phase_breakdown(timer),
        # Every prompt token and every generated token but the last went through the model once.
        "roofline": roofline.achieved(engine.model_cost(),
                                      sum(len(w.prompt) for w in work) + gen - len(work), len(batch_sizes), wall,
                                      limits, options.get("dtype", "float32")),
    }
    llm.shutdown()
    if prof:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
        result["cprofile_top"] = s.getvalue()
        result["torch_profile_top"] = tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)
    return result, outputs


# ---- transformers ---------------------------------------------------------------------------------
def load_hf(model_path: str):
    import torch
    import transformers

    path = Path(model_path)
    if path.is_file():
        return transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def hf_greedy_one(model, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy generate on one unpadded prompt, never stopping early: the reference."""
    import torch

    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def run_hf_static(model, work: list[Work], batch_size: int, pad_id: int, cfg: ThroughputConfig) -> tuple[dict, dict]:
    import torch

    outputs = {}
    bar = report.progress(total=len(work), desc=f"hf static {batch_size}", enable=cfg.show_progress, unit="req")
    t0 = time.perf_counter()
    for b in range(0, len(work), batch_size):
        chunk = work[b:b + batch_size]
        width = max(len(w.prompt) for w in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for r, w in enumerate(chunk):
            ids[r, width - len(w.prompt):] = torch.tensor(w.prompt)
            mask[r, width - len(w.prompt):] = 1
        new = max(w.max_tokens for w in chunk)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                                 eos_token_id=None, pad_token_id=pad_id)
        for r, w in enumerate(chunk):
            outputs[b + r] = out[r, width:width + w.max_tokens].tolist()
        bar.update(len(chunk))
    bar.close()
    wall = time.perf_counter() - t0
    gen = sum(w.max_tokens for w in work)
    computed = sum(max(w.max_tokens for w in work[b:b + batch_size]) * len(work[b:b + batch_size])
                   for b in range(0, len(work), batch_size))
    return {"wall_s": wall, "generated_tokens": gen, "tokens_per_s": gen / wall,
            "requests_per_s": len(work) / wall, "batch_size": batch_size,
            "decoded_tokens_incl_padding": computed}, outputs


def run_hf_generate_batch(model, work: list[Work], cfg: ThroughputConfig) -> tuple[dict, dict]:
    """transformers' continuous batching, each request with its own max_new_tokens.

    `generate_batch` takes one max_new_tokens for all; its manager (the same code path) takes
    one per request, so the workload is the same as every other system's."""
    import torch
    from transformers import GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    gc = GenerationConfig(do_sample=False, max_new_tokens=cfg.max_output, eos_token_id=-1, pad_token_id=0)
    hints = WorkloadHints(max_prompt_length=max(len(w.prompt) for w in work),
                          max_generated_length=max(w.max_tokens for w in work), num_requests=len(work))
    outputs = {}
    bar = report.progress(total=len(work), desc="hf generate_batch", enable=cfg.show_progress, unit="req")
    # Timed from when the manager is up: its one-off setup (cache allocation, warmup) is
    # left out, as pagellm's engine construction and warmup are.
    with torch.no_grad(), model.continuous_batching_context_manager(
            generation_config=gc, block=True, timeout=5, workload_hints=hints) as manager:
        t0 = time.perf_counter()
        for i, w in enumerate(work):
            manager.add_request(w.prompt, request_id=f"r{i}", max_new_tokens=w.max_tokens, eos_token_id=-1)
        while len(outputs) < len(work):
            res = manager.get_result(timeout=1)
            if res is not None and res.is_finished():
                outputs[int(res.request_id[1:])] = list(res.generated_tokens)
                bar.update(1)
            elif res is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped before finishing")
        wall = time.perf_counter() - t0
    bar.close()
    gen = sum(len(v) for v in outputs.values())
    return {"wall_s": wall, "generated_tokens": gen, "tokens_per_s": gen / wall,
            "requests_per_s": len(work) / wall}, outputs


# ---- llama.cpp ------------------------------------------------------------------------------------
def _llama_cpp_child(model_path: str, work: list[Work], threads: int, seed: int, show_progress: bool, conn) -> None:
    from llama_cpp import Llama

    n_ctx = max(len(w.prompt) + w.max_tokens for w in work) + 8
    llm = Llama(model_path=model_path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                n_batch=512, seed=seed, verbose=False)
    outputs = {}
    bar = report.progress(total=len(work), desc="llama.cpp", enable=show_progress, unit="req")
    t0 = time.perf_counter()
    for i, w in enumerate(work):
        toks = []
        # Greedy (top_k 1), never stopping at eos: the same token count as every other system.
        for t in llm.generate(w.prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            toks.append(t)
            if len(toks) == w.max_tokens:
                break
        outputs[i] = toks
        bar.update(1)
    wall = time.perf_counter() - t0
    bar.close()
    conn.send((wall, outputs))
    conn.close()


def run_llama_cpp(model_path: str, work: list[Work], cfg: ThroughputConfig) -> tuple[dict, dict]:
    """llama.cpp in a child process: a crash in its native code (some builds fault in their
    AMX kernels on some CPUs) is reported instead of taking the whole benchmark down."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_llama_cpp_child,
                       args=(model_path, work, cfg.threads, cfg.seed, cfg.show_progress, child))
    proc.start()
    child.close()
    try:
        wall, outputs = parent.recv()
    except EOFError:
        proc.join()
        raise RuntimeError(f"llama.cpp exited with status {proc.exitcode} before finishing") from None
    proc.join()
    gen = sum(len(v) for v in outputs.values())
    return {"wall_s": wall, "generated_tokens": gen, "tokens_per_s": gen / wall,
            "requests_per_s": len(work) / wall, "weights": Path(model_path).name}, outputs


def llama_cpp_available() -> bool:
    """Installed, checked without loading its native libraries into this process."""
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


# ---- the run --------------------------------------------------------------------------------------
def matmul_gflops(threads: int, seconds: float = 0.5) -> float:
    """fp32 GFLOP/s of a decode-sized linear layer ([32, 576] x [576, 1536]) right now: how
    much of the machine this process is getting. About 220 on 2 idle cores of this machine
    kind; far less when other processes compete (OpenMP threads then wait on each other)."""
    import torch

    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    x, w = torch.randn(32, 576), torch.randn(1536, 576)
    for _ in range(20):
        torch.nn.functional.linear(x, w)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(50):
            torch.nn.functional.linear(x, w)
        n += 50
    dt = (time.perf_counter() - t0) / n
    torch.set_num_threads(prev)
    return 2 * 32 * 576 * 1536 / dt / 1e9


def run_throughput_bench(cfg: ThroughputConfig, on_update=None) -> dict:
    """Run every system; `on_update(results so far)` is called after each one, so a long
    run that is cut short still leaves what it measured."""
    import torch

    from pagellm.loader.source import load_model_source

    torch.set_num_threads(cfg.threads)
    if not cfg.show_progress:
        import transformers

        transformers.utils.logging.disable_progress_bar()
    load = {"loadavg_start": os.getloadavg(), "matmul_gflops_start": matmul_gflops(cfg.threads),
            "machine_limits": roofline.machine_limits(cfg.threads)}
    # The model's path and tokenizer (config and tokenizer only; each run loads the weights).
    source = load_model_source(cfg.model)
    model_path, tok = source.path, source.tokenizer
    work = make_workload(tok, cfg)
    systems: dict = {}
    skipped: dict = {}
    hf = None
    sample = list(range(min(cfg.check_samples, len(work))))
    reference: dict = {}
    ins = [len(w.prompt) for w in work]
    outs_len = [w.max_tokens for w in work]

    def snapshot(profile: dict | None) -> dict:
        return {
            "config": asdict(cfg),
            "model": model_path,
            "workload": {"num_requests": len(work), "mean_prompt": sum(ins) / len(ins),
                         "mean_output": sum(outs_len) / len(outs_len), "total_prompt_tokens": sum(ins),
                         "total_output_tokens": sum(outs_len)},
            "load": load,
            "systems": systems,
            "skipped": skipped,
            "greedy_check": {"sample": sample,
                             "reference": "transformers generate, one unpadded request at a time, fp32",
                                          # bfloat16 rounds differently from the fp32 reference: not expected to match.
                             "pagellm_all_match": all(all(systems[s]["greedy_matches_transformers"].values())
                                                      for s in systems if s.startswith("pagellm-")
                                                      and pagellm_system(s)[1]["dtype"] == "float32")},
            "profile": profile,
            "targets": check_targets(systems),
        }

    need_hf = any(s.startswith("hf-") for s in cfg.systems) or sample
    if need_hf:
        hf = load_hf(model_path)
    for i in report.progress(sample, desc="reference (transformers, one at a time)", enable=cfg.show_progress):
        reference[i] = hf_greedy_one(hf, work[i].prompt, work[i].max_tokens)
    for name in cfg.systems:
        if name.startswith("pagellm-"):
            policy, options = pagellm_system(name)
            if why := system_unavailable(options):
                skipped[name] = why
                continue
            res, outs = run_pagellm(work, policy, cfg, limits=load["machine_limits"], **options)
            res.update(options)
        elif name.startswith("hf-static-"):
            pad = tok.eos_token_id if tok.eos_token_id is not None else 0
            res, outs = run_hf_static(hf, work, int(name.removeprefix("hf-static-")), pad, cfg)
        elif name == "hf-generate-batch":
            res, outs = run_hf_generate_batch(hf, work, cfg)
        elif name == "llama-cpp":
            if not llama_cpp_available():
                skipped[name] = "llama_cpp (llama-cpp-python) is not installed"
                continue
            if not model_path.lower().endswith(".gguf"):
                skipped[name] = "llama.cpp needs a GGUF model"
                continue
            try:
                res, outs = run_llama_cpp(model_path, work, cfg)
            except RuntimeError as e:
                skipped[name] = str(e)
                continue
        else:
            raise ValueError(f"unknown system {name!r}; choose from {DEFAULT_SYSTEMS} or hf-static-<B>")
        res["greedy_matches_transformers"] = {str(i): outs.get(i) == reference[i] for i in sample}
        # How far each checked request follows the reference before its first different token
        # (1.0 = all of it): the figure that says how much a lower precision changes the text.
        res["greedy_agreement"] = {str(i): _common_prefix(outs.get(i) or [], reference[i]) / max(1, len(reference[i]))
                                   for i in sample}
        # The machine's state after the run: other processes on it skew every timing.
        res["loadavg_after"] = os.getloadavg()[0]
        res["matmul_gflops_after"] = matmul_gflops(cfg.threads)
        systems[name] = res
        if on_update:
            on_update(snapshot(None))
    profile = None
    if cfg.profile and "pagellm-paged" in cfg.systems:
        sub = work[: max(8, len(work) // 4)]
        profile, _ = run_pagellm(sub, "paged", cfg, profile=True)
        profile["num_requests"] = len(sub)
    load["loadavg_end"] = os.getloadavg()
    load["matmul_gflops_end"] = matmul_gflops(cfg.threads)
    load["machine_limits_end"] = roofline.machine_limits(cfg.threads)
    flops = next((r["roofline"]["flops_per_token"] for r in systems.values() if "roofline" in r), None)
    for r in systems.values():
        if "roofline" not in r and flops:
            # Other systems compute the same model: the same FLOPs per token (padding not counted);
            # their steps are not known here, so no GB/s.
            r["roofline"] = roofline.achieved({"flops_per_token": flops}, r["generated_tokens"] + sum(ins) - len(work),
                                              None, r["wall_s"], load["machine_limits"])
    return snapshot(profile)


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check_targets(systems: dict) -> list[dict]:
    p = systems.get("pagellm-paged")
    if not p:
        return []
    out = []
    static = {k: v["tokens_per_s"] for k, v in systems.items() if k.startswith("hf-static-")}
    if static:
        best = max(static, key=static.get)
        r = p["tokens_per_s"] / static[best]
        out.append({"target": f"pagellm >= 3x transformers static batching (best: {best})", "value": r, "met": r >= 3})
    if "hf-generate-batch" in systems:
        r = p["tokens_per_s"] / systems["hf-generate-batch"]["tokens_per_s"]
        out.append({"target": "pagellm >= 5x transformers continuous batching (generate_batch)", "value": r,
                    "met": r >= 5})
    if "llama-cpp" in systems:
        r = p["tokens_per_s"] / systems["llama-cpp"]["tokens_per_s"]
        out.append({"target": "pagellm >= 2x llama.cpp serving one request at a time", "value": r, "met": r >= 2})
    return out


def print_tables(results: dict) -> None:
    w = results["workload"]
    print(f"\n{w['num_requests']} requests, mean prompt {w['mean_prompt']:.0f} / output {w['mean_output']:.0f} tokens, "
          f"{results['model']}")
    rows = []
    for name, r in results["systems"].items():
        match = r["greedy_matches_transformers"]
        agree = r.get("greedy_agreement") or {}
        rows.append([name, r["tokens_per_s"], r["requests_per_s"], r["wall_s"], r.get("mean_batch"),
                     r.get("peak_batch"), r.get("num_preemptions"),
                     f"{sum(match.values())}/{len(match)}" if match else "-",
                     f"{100 * sum(agree.values()) / len(agree):.0f}%" if agree else "-", r.get("matmul_gflops_after")])
    print(report.format_table(["system", "gen tok/s", "req/s", "wall s", "mean batch", "peak batch", "preempt",
                               "greedy = HF", "tokens before 1st diff", "GFLOP/s after"], rows))
    load = results["load"]
    print(f"machine: load average {load['loadavg_start'][0]:.1f} at start; a reference matmul ran at "
          f"{load['matmul_gflops_start']:.0f} GFLOP/s (about 220 on 2 idle cores)")
    for name, why in results["skipped"].items():
        print(f"skipped {name}: {why}")
    p = results["systems"].get("pagellm-paged")
    if p:
        ph = p["phases"]
        print(f"\npagellm-paged, where a step's time goes ({ph['steps']} steps):")
        print(report.format_table(["phase", "ms/step", "share"],
                                  [[k, v, f"{ph['share'][k]:.1%}"] for k, v in ph["ms_per_step"].items()]))
    report.print_targets(results["targets"], "{:.2f}x")


def doc_table(results: dict) -> str:
    """docs/benchmarks.md's table: one row per system."""
    rows = []
    for name, r in results["systems"].items():
        match, agree = r["greedy_matches_transformers"], r.get("greedy_agreement") or {}
        batch = f"{r['mean_batch']:.1f} / {r['peak_batch']}" if "mean_batch" in r else "-"
        rows.append([name, f"{r['tokens_per_s']:.1f}", f"{r['requests_per_s']:.3f}", f"{r['wall_s']:.0f}", batch,
                     f"{sum(match.values())}/{len(match)}" if match else "-",
                     f"{100 * sum(agree.values()) / len(agree):.0f}%" if agree else "-",
                     f"{r['matmul_gflops_after']:.0f}" if r.get("matmul_gflops_after") else "-"])
    return doc_sections.markdown_table(["system", "generated tok/s", "req/s", "wall s", "mean / peak batch",
                                      "greedy = transformers", "tokens before the first difference",
                                      "reference matmul GFLOP/s after"], rows, "lrrrrrrr")


def invariant_doc_table(results: dict) -> str:
    """docs/python.md's table: tok/s per mode and dtype, batch-invariant against the default."""
    tok = {(r["batch_invariant"], r["dtype"]): r["tokens_per_s"] for r in results["systems"].values()
           if "batch_invariant" in r}
    dtypes = list(dict.fromkeys(dtype for _, dtype in tok))
    rows = [["default", *(f"{tok[(False, d)]:.1f} tok/s" for d in dtypes)],
            ["batch-invariant", *(f"{tok[(True, d)]:.1f} tok/s ({tok[(True, d)] / tok[(False, d)] - 1:+.0%})"
                                  for d in dtypes)]]
    return doc_sections.markdown_table(["mode", *dtypes], rows, "l" + "r" * len(dtypes))


def plot(results: dict, path) -> None:
    plt = report.pyplot()
    names = list(results["systems"])
    vals = [results["systems"][n]["tokens_per_s"] for n in names]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    colors = ["tab:green" if n == "pagellm-paged" else "tab:olive" if n.startswith("pagellm") else "tab:gray"
              for n in names]
    axes[0].barh(names[::-1], vals[::-1], color=colors[::-1])
    for i, v in enumerate(vals[::-1]):
        axes[0].text(v, i, f" {v:.0f}", va="center", fontsize=8)
    w = results["workload"]
    axes[0].set_xlabel("generated tokens/s")
    axes[0].set_title(f"offline throughput: {w['num_requests']} requests, prompts ~{w['mean_prompt']:.0f}, "
                      f"outputs ~{w['mean_output']:.0f} tokens", fontsize=9)
    p = results["systems"].get("pagellm-paged")
    if p:
        ph = p["phases"]["ms_per_step"]
        axes[1].barh(list(ph)[::-1], list(ph.values())[::-1], color="tab:blue")
        axes[1].set_xlabel("ms per engine step")
        axes[1].set_title("pagellm-paged: where a step's time goes", fontsize=9)
        axes[1].tick_params(axis="y", labelsize=7)
    else:
        axes[1].axis("off")
    report.save_figure(fig, path)


def add_parser(sub) -> None:
    p = sub.add_parser("throughput", help="offline throughput: pagellm (paged, contiguous) vs transformers and "
                                          "llama.cpp on the same prompts")
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: the bundled SmolLM2)")
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--min-prompt", type=int, default=32)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                   help="comma-separated; pagellm-<policy>[-bf16][-dense][-invariant], hf-static-<batch>, "
                        "hf-generate-batch, llama-cpp")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV budget for every pagellm policy, in blocks (default: what 64 requests of the "
                        "longest possible length need, the KV memory of transformers' static batch of 64)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--check-samples", type=int, default=4, help="requests whose greedy tokens are checked")
    p.add_argument("--profile", action="store_true", help="also profile pagellm-paged (cProfile + torch.profiler)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="output path stem (default benchmarks/results/throughput-<date>)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    cfg = ThroughputConfig(model=args.model, num_requests=args.num_requests, min_prompt=args.min_prompt,
                           max_prompt=args.max_prompt, min_output=args.min_output, max_output=args.max_output,
                           seed=args.seed, systems=[s.strip() for s in args.systems.split(",") if s.strip()],
                           block_size=args.block_size, num_kv_blocks=args.num_kv_blocks, threads=args.threads,
                           check_samples=args.check_samples, profile=args.profile,
                           show_progress=not args.no_progress)
    for name, lo, hi in (("prompt", cfg.min_prompt, cfg.max_prompt), ("output", cfg.min_output, cfg.max_output)):
        if not 1 <= lo <= hi:
            raise ValueError(f"--min-{name} and --max-{name} must satisfy 1 <= min <= max, got {lo}, {hi}")
    meta = report.metadata("throughput", extra_versions=("accelerate", "llama_cpp_python"))
    json_path, png_path = report.output_paths("throughput", args.out)
    results = {**meta, **run_throughput_bench(cfg, on_update=lambda r: report.write_json(json_path, {**meta, **r}))}
    print_tables(results)
    report.write_json(json_path, results)
    plot(results, png_path)
    print(f"\nwrote {json_path} and {png_path}")
    return 0

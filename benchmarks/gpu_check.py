#!/usr/bin/env python3
"""The prepared GPU check: kernel tests, bandwidths, greedy agreement, end-to-end throughput.

    bash benchmarks/gpu_check.sh                   # on the GPU machine, from the repository root
    python benchmarks/gpu_check.py --cpu-smoke     # here: every part's code on tiny shapes, ~2 minutes

Writes benchmarks/results/gpu_check-<date>-<machine>.json after every part, so a part that fails
or runs out of time still leaves the others' figures; docs/gpu.md's tables are generated from
those files (`python -m pagellm.bench.gpu_tables`). Parts, in the order they run (figures first,
so a run cut short still brings back the kernels' numbers):

1. copy_bandwidth: a device-to-device copy, bytes read plus written per second.
2. decode_bandwidth: the paged decode kernel at B=64, context 4096, 32 query heads, 8 KV heads,
   head dim 128, bf16, block sizes 16 and 32, in K/V bytes read per second, against torch's
   scaled_dot_product_attention on contiguous K/V (enable_gqa), the two timed in alternating
   rounds after the GPU's clock is warmed; a sweep of tile configs and split counts; the 8-bit
   KV formats against bf16, also alternating.
3. kernel_tests: the Triton kernel and CUDA-graph tests compiled on the GPU (in parallel
   processes, logged as they run); gguf_kernel_tests: the Triton GGUF product, compiled.
4. graphs_vs_eager: greedy tokens and logprobs of CUDA-graph decode against the eager path, float32
   and bfloat16, and against transformers in float32, on a small model with sharp attention.
5. e2e_8b, e2e_1b: offline throughput with random weights in the Llama-3-8B and Llama-3.2-1B
   shapes (256 requests, prompts uniform in 64-512 tokens, 128 output tokens, ignore_eos):
   pagellm (Triton backend, CUDA-graph decode, as the model runner chooses them; again with an
   fp8 KV cache), transformers `generate` (static batch 256) and `generate_batch` (its continuous
   batching); a roofline of pagellm's decode steps (weights plus KV bytes per step over the
   measured copy bandwidth, against the measured step time); a second workload of the same shape;
   and a profile of one prefill and of decode steps (GPU busy time, top kernels).

The GPU machine reaches no registry. Its image has torch 2.11, triton 3.6, transformers 5.17,
tokenizers, safetensors, jinja2, numpy, tqdm, pytest, pytest-xdist and hypothesis, but not gguf,
which pagellm.loader.source imports at module level. Carry its pure-Python wheel (gpu_check.sh
installs .whl/*.whl when present):
    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: -d .whl gguf==0.19.0
Without it this script puts a stub `gguf` module in place (the dummy-weight path never reads a
GGUF file), skips the GGUF kernel tests and says so in the JSON.

In --cpu-smoke runs the model runner chooses the torch backend; the script swaps in the Triton
one (under the interpreter) so that its code runs; the JSON records which happened.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import functools
import gc
import json
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

# Model shapes: the published configs of Llama-3-8B and Llama-3.2-1B (weights random).
SHAPES = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192,
               tie_word_embeddings=False),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, vocab_size=128256, rope_theta=500000.0,
               max_position_embeddings=131072, tie_word_embeddings=True,
               rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, rope_theta=10000.0, max_position_embeddings=512,
                 tie_word_embeddings=False),
}


class PartTimeout(Exception):
    pass


@contextlib.contextmanager
def time_budget(seconds: float):
    """Raise PartTimeout in this thread after `seconds` (checked between Python bytecodes).

    Nests: an inner budget never outlives the outer one, and the outer timer resumes after it.
    """
    def fire(signum, frame):
        raise PartTimeout(f"over its budget of {seconds:.0f} s")

    outer_left, _ = signal.getitimer(signal.ITIMER_REAL)
    old = signal.signal(signal.SIGALRM, fire)
    t0 = time.monotonic()
    signal.setitimer(signal.ITIMER_REAL, min(max(1.0, seconds), outer_left) if outer_left > 0 else max(1.0, seconds))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        if outer_left > 0:
            signal.setitimer(signal.ITIMER_REAL, max(0.01, outer_left - (time.monotonic() - t0)))


class Report:
    """The JSON document, rewritten whole after every part."""

    def __init__(self, path: Path, meta: dict) -> None:
        self.path = path
        self.doc = {"meta": meta, "parts": {}}
        self.started = time.monotonic()

    def run(self, name: str, budget: float, fn, *args) -> None:
        left = self.doc["meta"]["deadline_s"] - (time.monotonic() - self.started)
        budget = min(budget, left - 5)
        print(f"== {name} (budget {budget:.0f} s)", flush=True)
        if budget < 10:
            self.doc["parts"][name] = {"status": "skipped", "error": "out of time before it started"}
            self.write()
            return
        t0 = time.monotonic()
        part: dict = {}
        try:
            with time_budget(budget):
                part.update(fn(*args) or {})
            part["status"] = "ok"
        except PartTimeout as e:
            part.update(getattr(e, "partial", {}), status="timeout", error=str(e))
        except Exception as e:  # one part's failure must not lose the others
            part.update(getattr(e, "partial", {}), status="error", error=f"{type(e).__name__}: {e}",
                        traceback=traceback.format_exc()[-3000:])
        part["seconds"] = round(time.monotonic() - t0, 1)
        self.doc["parts"][name] = part
        print(json.dumps({k: v for k, v in part.items() if k not in ("traceback", "tail")}, indent=1)[:3000],
              flush=True)
        cleanup()
        self.write()

    def write(self) -> None:
        self.doc["meta"]["duration_s"] = round(time.monotonic() - self.started, 1)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.doc, indent=1))
        tmp.replace(self.path)


def cleanup() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gbs(nbytes: int, ms: float) -> float:
    """GB/s to four significant figures (CPU smoke runs measure far below 1 GB/s)."""
    return float(f"{nbytes / ms / 1e6:.4g}")


def median_ms(fn, device: torch.device, warmup: int, iters: int) -> float:
    """Median time of one call: CUDA events on a GPU, the wall clock on a CPU."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


# ---- environment ---------------------------------------------------------------------------------
def stub_gguf_if_missing() -> bool:
    """Put a stub `gguf` in sys.modules when the package is absent; True if stubbed."""
    try:
        import gguf  # noqa: F401
        return False
    except ImportError:
        pass

    class _Missing:
        def __init__(self, *a, **k):
            raise RuntimeError("gguf is not installed on this machine (gpu_check stubbed it)")

    mod = types.ModuleType("gguf")
    mod.GGUFReader = _Missing
    mod.GGUFValueType = types.SimpleNamespace(FLOAT32=object(), STRING=object())
    quants = types.ModuleType("gguf.quants")
    quants.dequantize = _Missing
    mod.quants = quants
    sys.modules["gguf"], sys.modules["gguf.quants"] = mod, quants
    return True


def environment(device: torch.device) -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "device": str(device)}
    from importlib.metadata import PackageNotFoundError, version

    for name in ("triton", "transformers", "tokenizers", "numpy", "gguf", "jinja2", "pytest"):
        try:
            info[name] = version(name)
        except PackageNotFoundError:
            info[name] = "missing"
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(gpu=p.name, sms=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30, 1),
                    capability=f"{p.major}.{p.minor}")
    return info


def machine_name(device: torch.device, cpu_smoke: bool) -> str:
    if cpu_smoke:
        return "cpu-smoke"
    if device.type == "cuda":
        return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(device).lower()).strip("-")
    return "cpu"


# ---- 1. kernel tests ---------------------------------------------------------------------------------
def kernel_tests(budget: float, cpu_smoke: bool,
                 paths: tuple[str, ...] = ("tests/attention/test_triton_kernels.py", "tests/test_kv_format.py",
                                           "tests/attention/test_triton_latent.py",
                                           "tests/attention/test_triton_compile.py",
                                           "tests/worker/test_cuda_graphs.py"),
                 smoke_filter: str | None = "choose_num_splits or batch_size_ladder") -> dict:
    """pytest on `paths`, its output to a file as it runs: a run cut by the budget still says which
    tests passed and failed. (tests/attention/test_torch_backend.py is the CPU backend's.)"""
    cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "--durations=10", *paths]
    if cpu_smoke and smoke_filter:
        cmd += ["-k", smoke_filter]
    elif not cpu_smoke and _has_module("xdist"):  # compiling the kernels is most of the time: in parallel
        cmd += ["-n", str(min(8, os.cpu_count() or 1))]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            returncode = proc.wait(timeout=budget - 5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            returncode = None
        log.seek(0)
        out = log.read()
    results = re.findall(r"(PASSED|FAILED|ERROR|SKIPPED)\s+(\S+::\S+)|(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED)", out)
    outcome = [(a or d, b or c) for a, b, c, d in results]
    counts: dict = {}
    for status, _ in outcome:
        counts[status.lower()] = counts.get(status.lower(), 0) + 1
    result = {"returncode": returncode, "counts": counts,
              "failed": [name for status, name in outcome if status in ("FAILED", "ERROR")][:40],
              "tail": out[-6000:]}
    if returncode is None:
        raise _with_partial(PartTimeout(f"pytest still running after {budget - 5:.0f} s"), result)
    if returncode != 0:
        raise _with_partial(RuntimeError(f"pytest exited {returncode}"), result)
    return result


def _with_partial(error: Exception, partial: dict) -> Exception:
    """An error that carries what the part measured before it (Report.run keeps it)."""
    error.partial = partial
    return error


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


# ---- 2. copy bandwidth --------------------------------------------------------------------------------
def copy_bandwidth(device: torch.device, nbytes: int) -> dict:
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device, warmup=3, iters=20)
    return {"bytes_copied": nbytes, "median_ms": round(ms, 4), "gb_per_s_read_plus_write": gbs(2 * nbytes, ms)}


# ---- 3. decode bandwidth --------------------------------------------------------------------------------
def decode_bandwidth(device: torch.device, shape: dict, block_sizes: list[int], sweep: list[tuple[int, int, int]],
                     splits: list[int], iters: int) -> dict:
    import torch.nn.functional as F

    from pagellm.attention.triton_kernels import (
        KernelConfig,
        choose_num_splits,
        default_decode_config,
        paged_decode,
    )

    b, ctx, h, kvh, d = shape["batch"], shape["context"], shape["heads"], shape["kv_heads"], shape["head_dim"]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(b, h, 1, d, generator=gen, device=device, dtype=dtype)
    k = torch.randn(b, kvh, ctx, d, generator=gen, device=device, dtype=dtype)
    v = torch.randn(b, kvh, ctx, d, generator=gen, device=device, dtype=dtype)
    kv_bytes = 2 * k.numel() * k.element_size()
    scale = d ** -0.5
    result: dict = {"shape": shape, "dtype": str(dtype), "kv_bytes": kv_bytes}

    sdpa = lambda: F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)  # noqa: E731
    ref = sdpa()
    # The GPU idles at a low clock: the first timings of a run read slower (the same decode
    # config timed first and again later differed by 15%). Warm it, then time SDPA and each
    # default decode in alternating rounds, so each ratio compares like with like.
    median_ms(sdpa, device, warmup=100, iters=1)
    ms = median_ms(sdpa, device, warmup=3, iters=iters)
    result["sdpa_contiguous"] = {"median_ms": round(ms, 4), "gb_per_s": gbs(kv_bytes, ms)}

    qp = q.view(b, h, d)
    seq_lens = torch.full((b,), ctx, device=device, dtype=torch.long)
    for bs in block_sizes:
        per_seq = ctx // bs
        tables = torch.randperm(b * per_seq, generator=gen, device=device).view(b, per_seq)
        k_cache = torch.empty(b * per_seq, bs, kvh, d, device=device, dtype=dtype)
        v_cache = torch.empty_like(k_cache)
        # Sequence i's token t lives in block tables[i, t // bs] at offset t % bs.
        k_cache[tables.flatten()] = k.permute(0, 2, 1, 3).reshape(b * per_seq, bs, kvh, d)
        v_cache[tables.flatten()] = v.permute(0, 2, 1, 3).reshape(b * per_seq, bs, kvh, d)
        out = torch.empty_like(qp)
        auto = choose_num_splits(b, kvh, per_seq * bs, torch.cuda.get_device_properties(device).multi_processor_count
                                 if device.type == "cuda" else 1)
        default = default_decode_config(device, d)
        entry: dict = {"auto_num_splits": auto, "default_config": dataclasses.asdict(default), "runs": []}

        # partial binds the tensors, not names that the loop's end deletes.
        decode = functools.partial(paged_decode, qp, k_cache, v_cache, tables, seq_lens, scale, out=out)

        paged_decode(qp, k_cache, v_cache, tables, seq_lens, scale, out=out)
        entry["max_abs_err_vs_sdpa"] = float((out.float() - ref.view(b, h, d).float()).abs().max())
        rounds = alternating_ms({"sdpa": sdpa, "paged": decode}, device, rounds=3, iters=iters)
        ms = rounds["paged"]
        entry["default"] = {"median_ms": round(ms, 4), "gb_per_s": gbs(kv_bytes, ms),
                            "sdpa_median_ms": round(rounds["sdpa"], 4), "sdpa_gb_per_s": gbs(kv_bytes, rounds["sdpa"]),
                            "vs_sdpa": round(rounds["sdpa"] / ms, 3), "rounds": 3}
        variants = [(KernelConfig(block_n=bn, num_warps=w, num_stages=st), ns) for bn, w, st, ns in sweep]
        variants += [(None, ns) for ns in splits]
        for cfg, ns in variants:
            try:
                ms = median_ms(functools.partial(decode, num_splits=ns, config=cfg), device, warmup=2,
                               iters=max(5, iters // 2))
                entry["runs"].append({"config": None if cfg is None else [cfg.block_n, cfg.num_warps, cfg.num_stages],
                                      "num_splits": ns if ns is not None else auto, "median_ms": round(ms, 4),
                                      "gb_per_s": gbs(kv_bytes, ms)})
            except Exception as e:  # a config that does not compile (shared memory) is a data point too
                entry["runs"].append({"config": None if cfg is None else [cfg.block_n, cfg.num_warps, cfg.num_stages],
                                      "num_splits": ns, "error": f"{type(e).__name__}: {str(e)[:200]}"})
        best = max((r for r in entry["runs"] if "gb_per_s" in r), key=lambda r: r["gb_per_s"], default=None)
        entry["best"] = best
        result[f"paged_block_{bs}"] = entry
        if bs == block_sizes[-1]:
            result["kv_8bit"] = decode_8bit(qp, k_cache, v_cache, tables, seq_lens, scale, out, device, iters)
        del k_cache, v_cache, tables, decode
        cleanup()
    return result


def alternating_ms(fns: dict, device: torch.device, rounds: int, iters: int) -> dict[str, float]:
    """Each function's median time over `rounds` rounds that time them one after another."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(median_ms(fn, device, warmup=3, iters=iters))
    return {name: statistics.median(t) for name, t in times.items()}


def decode_8bit(q, k_cache, v_cache, tables, seq_lens, scale, out, device, iters) -> dict:
    """The same decode over 8-bit caches (kv_format.py), timed in alternating rounds
    with the plain one: half the bytes of bfloat16, so at least as fast is the target; error
    against the plain kernel over the values the format keeps."""
    from pagellm.kv_format import resolve_kv_format
    from pagellm.attention.triton_kernels import paged_decode

    res: dict = {}
    for name in ("int8", "fp8_e4m3", "fp8_e5m2"):
        fmt = resolve_kv_format(name, q.dtype)
        kc, vc = fmt.encode(k_cache), fmt.encode(v_cache)
        paged_decode(q, kc, vc, tables, seq_lens, scale, out=out, kv_format=fmt)
        got = out.float().clone()
        paged_decode(q, fmt.decode(kc, q.dtype), fmt.decode(vc, q.dtype), tables, seq_lens, scale, out=out)
        err = float((got - out.float()).abs().max())
        rounds = alternating_ms({
            "plain": functools.partial(paged_decode, q, k_cache, v_cache, tables, seq_lens, scale, out=out),
            "8bit": functools.partial(paged_decode, q, kc, vc, tables, seq_lens, scale, out=out, kv_format=fmt),
        }, device, rounds=3, iters=iters)
        res[name] = {"median_ms": round(rounds["8bit"], 4), "plain_median_ms": round(rounds["plain"], 4),
                     "speed_vs_plain": round(rounds["plain"] / rounds["8bit"], 3),
                     "kv_bytes": 2 * kc.numel(), "plain_kv_bytes": 2 * k_cache.numel() * k_cache.element_size(),
                     "max_abs_err_vs_decoded": err}
        del kc, vc
    return res


# ---- 4. CUDA graphs against eager, and against transformers -----------------------------------------------
GREEDY_SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                    num_key_value_heads=2, vocab_size=1024, max_position_embeddings=1024)


def graphs_vs_eager(device: torch.device, cpu_smoke: bool) -> dict:
    """Greedy tokens of the CUDA-graph decode against the eager path (same engine, enforce_eager),
    in float32 and bfloat16, and both against transformers on the same weights in float32.

    Weights of std 0.3 (write_random_model_dir) make attention sharp, so a graph that replays a
    wrong position, block table or sequence length changes the tokens. Logprobs of the chosen tokens
    are compared over each pair's common prefix."""
    from pagellm import LLM, SamplingParams
    from pagellm.loader.synthetic import write_random_model_dir

    n, new = (4, 8) if cpu_smoke else (24, 48)
    prompts = make_prompts(n, 4, 40 if cpu_smoke else 300, GREEDY_SHAPE["vocab_size"], seed=1)
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True, logprobs=0)
    result: dict = {"shape": GREEDY_SHAPE, "requests": n, "output_len": new}
    runs: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_random_model_dir(Path(tmp) / "m", GREEDY_SHAPE, std=0.3)
        for dtype in ("float32", "bfloat16"):
            for mode in ("eager", "graphs"):
                llm = LLM(model=model_dir, dtype=dtype, device=device.type, max_model_len=512, max_num_seqs=32,
                          kv_cache_memory=1 << 28, enforce_eager=(mode == "eager"))
                graphs = llm.engine.runner.cuda_graphs
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
                runs[dtype, mode] = [(o.outputs[0].token_ids,
                                      [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
                                     for o in outs]
                result[f"{dtype}_{mode}_graphs_captured"] = 0 if graphs is None else len(graphs.graphs)
                del llm
                cleanup()
        reference = _hf_greedy(device, model_dir, prompts[: max(4, n // 2)], new)
    for dtype in ("float32", "bfloat16"):
        result[f"{dtype}_graphs_vs_eager"] = _agreement(runs[dtype, "graphs"], runs[dtype, "eager"])
        result[f"{dtype}_graphs_vs_transformers_fp32"] = _agreement(runs[dtype, "graphs"][: len(reference)], reference)
    return result


def _agreement(a: list, b: list) -> dict:
    """Identical greedy sequences, tokens matched before the first difference, and the largest
    chosen-token logprob difference over each pair's common prefix."""
    same = matched = total = 0
    worst = 0.0
    for (ta, la), (tb, lb) in zip(a, b):
        k = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
        same += ta == tb
        matched += k
        total += len(tb)
        worst = max([worst] + [abs(x - y) for x, y in zip(la[:k], lb[:k])])
    return {"identical_sequences": f"{same}/{len(b)}", "tokens_before_first_difference": f"{matched}/{total}",
            "max_abs_logprob_diff": float(f"{worst:.3g}")}


@torch.inference_mode()
def _hf_greedy(device: torch.device, model_dir: str, prompts: list[list[int]], new: int) -> list:
    """transformers' greedy tokens and their logprobs in float32, one prompt at a time (no padding)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    out = []
    for p in prompts:
        ids = torch.tensor([p], device=device)
        gen = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None,
                             pad_token_id=0, output_scores=True, return_dict_in_generate=True)
        toks = gen.sequences[0, len(p):].tolist()
        lps = [torch.log_softmax(sc[0].float(), -1)[t].item() for sc, t in zip(gen.scores, toks)]
        out.append((toks, lps))
    del model
    return out


# ---- 5. end to end -------------------------------------------------------------------------------------
def write_model_dir(path: Path, shape: dict) -> Path:
    """config.json of the shape and a byte-level tokenizer; no EOS, so nothing stops early."""
    from pagellm.loader.synthetic import write_dummy_model_dir

    return Path(write_dummy_model_dir(path, shape, bos_token_id=None, eos_token_id=None, pad_token_id=0))


def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def device_dummy_init(runner, seed: int = 0) -> None:
    """The engine's dummy init (N(0, 0.02), norms 1), drawn on the device: minutes faster at 8B."""
    gen = torch.Generator(device=runner.device).manual_seed(seed)
    with torch.no_grad():
        for name, p in runner.model.named_parameters():
            if name.endswith("norm.weight"):  # as ModelRunner.init_dummy_weights
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)


class _GraphedModel:
    """Stands in for runner.model until the runner calls CUDAGraphRunner itself."""

    def __init__(self, model, graphs) -> None:
        self._model, self._graphs = model, graphs

    def __call__(self, *args):
        return self._graphs(*args)

    def __getattr__(self, name):
        return getattr(self._model, name)


def enable_gpu_path(llm, max_num_seqs: int) -> dict:
    from pagellm.attention.triton_backend import TritonAttentionBackend
    from pagellm.worker.cuda_graphs import CUDAGraphRunner

    runner = llm.engine.runner
    info = {}
    if isinstance(runner.backend, TritonAttentionBackend):
        info["backend"] = "triton (chosen by the model runner)"
    else:
        info["backend"] = f"triton (swapped in by gpu_check; the runner chose {type(runner.backend).__name__})"
        backend = TritonAttentionBackend()
        backend.kv_format = runner.kv_format
        runner.backend = backend
        for layer in runner.model.layers:
            layer.self_attn.backend = backend
    if hasattr(runner, "cuda_graphs"):
        info["cuda_graphs"] = "by the model runner" if runner.cuda_graphs is not None else "off in the model runner"
    else:
        t0 = time.monotonic()
        graphs = CUDAGraphRunner(runner.model, runner.kv_caches, backend=runner.backend,
                                 block_size=runner.block_size, max_model_len=llm.engine.max_model_len,
                                 max_num_seqs=max_num_seqs, device=runner.device)
        graphs.capture()
        runner.model = _GraphedModel(runner.model, graphs)
        info["cuda_graphs"] = (f"wrapped by gpu_check: {len(graphs.graphs)} graphs captured "
                               f"in {time.monotonic() - t0:.1f} s" if graphs.use_graphs else "eager padding (no CUDA)")
    return info


def instrument_steps(runner, kv_bytes_per_token: int) -> list[dict]:
    """Time every runner.execute; note batch composition and KV bytes read by the step's decodes."""
    steps: list[dict] = []
    execute = runner.execute

    def timed(plan, *args, **kwargs):
        decodes = [s for s in plan.seqs if len(s.token_ids) == 1]
        ctx = sum(s.start + 1 for s in decodes)
        prefill_tokens = sum(len(s.token_ids) for s in plan.seqs if len(s.token_ids) != 1)
        sync(runner.device)
        t0 = time.perf_counter()
        out = execute(plan, *args, **kwargs)
        sync(runner.device)
        steps.append({"ms": (time.perf_counter() - t0) * 1e3, "decodes": len(decodes),
                      "prefill_tokens": prefill_tokens, "kv_bytes": ctx * kv_bytes_per_token})
        return out

    runner.execute = timed
    return steps


def roofline(steps: list[dict], weight_bytes: int, bandwidth_gbs: float | None) -> dict:
    dec = [s for s in steps if s["prefill_tokens"] == 0 and s["decodes"]]
    out = {"steps": len(steps), "decode_only_steps": len(dec), "weight_bytes": weight_bytes,
           "bandwidth_gb_per_s": bandwidth_gbs,
           "decode_share_of_time": round(sum(s["ms"] for s in dec) / max(1e-9, sum(s["ms"] for s in steps)), 3)}
    if not dec or not bandwidth_gbs:
        return out
    limit = [(weight_bytes + s["kv_bytes"]) / (bandwidth_gbs * 1e6) for s in dec]  # ms
    measured = [s["ms"] for s in dec]
    out.update(
        median_step_ms=round(statistics.median(measured), 3),
        median_roofline_ms=round(statistics.median(limit), 3),
        fraction_of_roofline=float(f"{sum(limit) / sum(measured):.3g}"),
        by_batch={f"{bucket // 2 + 1}-{bucket}": {
            "steps": len(sel), "median_ms": round(statistics.median(m for _, m, _ in sel), 3),
            "median_roofline_ms": round(statistics.median(r for _, _, r in sel), 3)}
            for bucket in (256, 128, 64, 32, 16, 8, 4, 2, 1)
            for sel in [[(s["decodes"], m, r) for s, m, r in zip(dec, measured, limit)
                         if bucket // 2 < s["decodes"] <= bucket]] if sel},
    )
    return out


def e2e(device: torch.device, shape_name: str, n: int, lo: int, hi: int, new: int, budgets: dict,
        bandwidth: dict, cpu_smoke: bool) -> dict:
    shape = SHAPES[shape_name]
    result: dict = {"shape": shape_name, "requests": n, "prompt_len": [lo, hi], "output_len": new}
    prompts = make_prompts(n, lo, hi, shape["vocab_size"])
    result["prompt_tokens"] = sum(map(len, prompts))
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir(Path(tmp) / shape_name, shape)
        systems = (("pagellm", _pagellm), ("pagellm_kv_fp8", functools.partial(_pagellm, kv_cache_dtype="fp8_e4m3")),
                   ("hf_generate", _hf_generate), ("hf_generate_batch", _hf_batch))
        for system, fn in systems:
            if not budgets.get(system):
                result[system] = {"skipped": True}
                continue
            t0 = time.monotonic()
            try:
                with time_budget(budgets[system]):
                    result[system] = fn(device, model_dir, shape, prompts, new, bandwidth, cpu_smoke)
            except Exception as e:
                result[system] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
            result[system]["seconds"] = round(time.monotonic() - t0, 1)
            cleanup()
    p, s = result["pagellm"].get("tok_per_s"), result["hf_generate"].get("tok_per_s")
    if p and s:
        result["pagellm_over_hf_generate"] = round(p / s, 2)
    return result


def _pagellm(device, model_dir, shape, prompts, new, bandwidth, cpu_smoke, kv_cache_dtype: str = "auto") -> dict:
    """pagellm's offline throughput; with an 8-bit `kv_cache_dtype`, without the profile."""
    from pagellm import LLM, SamplingParams
    from pagellm.worker import model_runner as mr

    res: dict = {}
    head_dim = shape.get("head_dim", shape["hidden_size"] // shape["num_attention_heads"])
    row_bytes = (head_dim + 2) if kv_cache_dtype != "auto" else head_dim * (2 if device.type == "cuda" else 4)
    kv_per_token = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * row_bytes
    need = len(prompts) * (max(map(len, prompts)) + new) * kv_per_token
    original_init = mr.ModelRunner.init_dummy_weights
    if device.type == "cuda":
        mr.ModelRunner.init_dummy_weights = device_dummy_init
        res["dummy_init"] = "on the device (patched by gpu_check)"
    t0 = time.monotonic()
    try:
        llm = LLM(model=str(model_dir), load_format="dummy", dtype="bfloat16" if device.type == "cuda" else "float32",
                  device=device.type, max_model_len=min(1024, shape["max_position_embeddings"]), max_num_seqs=256,
                  max_num_batched_tokens=8192, kv_cache_memory=int(need * 1.25) + (1 << 28),
                  kv_cache_dtype=kv_cache_dtype)
    finally:
        mr.ModelRunner.init_dummy_weights = original_init
    res["init_s"] = round(time.monotonic() - t0, 1)
    res.update(enable_gpu_path(llm, 256) if (device.type == "cuda" or cpu_smoke) else {})
    params = SamplingParams(max_tokens=new, ignore_eos=True, temperature=0.0)
    t0 = time.monotonic()
    llm.generate([{"prompt_token_ids": p[:16]} for p in prompts[:4]], SamplingParams(max_tokens=4, ignore_eos=True),
                 use_tqdm=False)
    res["warmup_s"] = round(time.monotonic() - t0, 1)
    steps = instrument_steps(llm.engine.runner, kv_per_token)
    sync(device)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    sync(device)
    elapsed = time.perf_counter() - t0
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    model = llm.engine.runner.model
    model = getattr(model, "_model", model)
    weight_bytes = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                       if not (name.startswith("embed_tokens") and model.lm_head is not None))
    res.update(elapsed_s=round(elapsed, 2), generated_tokens=generated, tok_per_s=round(generated / elapsed, 1),
               total_tok_per_s=round((generated + sum(map(len, prompts))) / elapsed, 1),
               roofline=roofline(steps, weight_bytes, bandwidth.get("gb_per_s_read_plus_write")))
    res["kv_cache_dtype"] = kv_cache_dtype
    if device.type == "cuda":
        # A second workload of the same shape (other prompts: the same ones would hit the prefix
        # cache): a first run may still compile kernels for shapes the short warm-up did not meet
        # (Triton specializes on arguments' divisibility).
        others = make_prompts(len(prompts), min(map(len, prompts)), max(map(len, prompts)), shape["vocab_size"],
                              seed=1)
        steps.clear()
        sync(device)
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in others], params, use_tqdm=False)
        sync(device)
        again = time.perf_counter() - t0
        res["second_run"] = {"elapsed_s": round(again, 2), "tok_per_s": round(generated / again, 1),
                             "total_tok_per_s": round((generated + sum(map(len, others))) / again, 1),
                             "roofline": roofline(steps, weight_bytes, bandwidth.get("gb_per_s_read_plus_write"))}
    steps.clear()
    if device.type == "cuda" and kv_cache_dtype == "auto":
        res["profile"] = {
            # One prefill of 8192 tokens (16 prompts of 512), then decode at batch 256 (256 prompts
            # of 16 tokens: one prefill step of 4096 tokens, then 16 decode steps).
            "prefill_16x512": profile_generate(llm, [p[:16] * 32 for p in prompts[:16]], 1, device),
            "decode_256x16": profile_generate(llm, [p[:16] for p in prompts[:256]], 17, device),
        }
    del llm, model
    return res


def profile_generate(llm, prompts: list[list[int]], new: int, device: torch.device, top: int = 15) -> dict:
    """Wall time of one generate call against the GPU time of its kernels (a GPU busy far less than
    the wall is waiting on the host), and the kernels that took the most GPU time."""
    from pagellm import SamplingParams
    from torch.profiler import ProfilerActivity, profile

    params = SamplingParams(max_tokens=new, ignore_eos=True, temperature=0.0)
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            sync(device)
            t0 = time.perf_counter()
            llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            sync(device)
            wall_ms = (time.perf_counter() - t0) * 1e3
        # Kernels only: the operators that launch them report the same device time again.
        kernels = [e for e in prof.key_averages() if getattr(e, "self_device_time_total", 0) > 0
                   and getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
        gpu_ms = sum(e.self_device_time_total for e in kernels) / 1e3
        kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
        return {"wall_ms": round(wall_ms, 1), "kernel_ms": round(gpu_ms, 1),
                "gpu_busy_fraction": round(gpu_ms / wall_ms, 3),
                "top_kernels": [{"name": e.key[:120], "calls": e.count,
                                 "ms": round(e.self_device_time_total / 1e3, 2)} for e in kernels[:top]]}
    except Exception as e:  # the figures above must not be lost to a profiler problem
        return {"error": f"{type(e).__name__}: {e}"}


def _hf_model(device, model_dir):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model_dir)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()


def _hf_generate(device, model_dir, shape, prompts, new, bandwidth, cpu_smoke) -> dict:
    model = _hf_model(device, model_dir)
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as batched generation needs
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.inference_mode():
        model.generate(ids[:2, -16:], attention_mask=mask[:2, -16:], max_new_tokens=4, min_new_tokens=4, **kw)
        sync(device)
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, **kw)
        sync(device)
    elapsed = time.perf_counter() - t0
    generated = (out.shape[1] - width) * out.shape[0]
    del model
    return {"batch": len(prompts), "elapsed_s": round(elapsed, 2), "generated_tokens": generated,
            "tok_per_s": round(generated / elapsed, 1)}


def _hf_batch(device, model_dir, shape, prompts, new, bandwidth, cpu_smoke) -> dict:
    from transformers import GenerationConfig

    model = _hf_model(device, model_dir)
    gen_cfg = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    # no_grad, not inference_mode: generate_batch runs its loop in a thread of its own, where
    # tensors made here in inference mode cannot be updated in place.
    with torch.no_grad():
        if cpu_smoke:  # each call costs ~20 s of thread hand-offs on a CPU: one short call shows the path works
            prompts = prompts[:2]
        else:
            model.generate_batch(inputs=[p[:16] for p in prompts[:4]], generation_config=gen_cfg, progress_bar=False)
        sync(device)
        # Timed as a user calls it: a manager that is not persistent warms up (captures its graphs) per call.
        t0 = time.perf_counter()
        outs = model.generate_batch(inputs=prompts, generation_config=gen_cfg, progress_bar=False)
        sync(device)
    elapsed = time.perf_counter() - t0
    generated = sum(len(o.generated_tokens) for o in outs.values())
    del model
    return {"elapsed_s": round(elapsed, 2), "generated_tokens": generated, "tok_per_s": round(generated / elapsed, 1),
            "requests_returned": len(outs), "note": "includes generate_batch's own per-call warm-up"}


# ---- main -------------------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (Triton interpreter)")
    ap.add_argument("--deadline", type=float, default=450.0, help="seconds for the whole check")
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default benchmarks/results/...)")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip")
    ap.add_argument("--skip-hf", action="store_true", help="pagellm only in the end-to-end parts")
    args = ap.parse_args()

    if args.cpu_smoke:
        from pagellm.attention.interpreter import use_interpreter_without_gpu

        use_interpreter_without_gpu()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu_smoke else "cpu")
    stubbed = stub_gguf_if_missing()
    date = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")
    machine = machine_name(device, args.cpu_smoke)
    out = args.out or (Path(tempfile.gettempdir()) / f"gpu_check-{date}-{machine}.json" if args.cpu_smoke
                       else ROOT / "benchmarks" / "results" / f"gpu_check-{date}-{machine}.json")
    meta = {"date": date, "machine": machine, "mode": "cpu-smoke" if args.cpu_smoke else "gpu",
            "commit": os.environ.get("PAGELLM_COMMIT") or _git_commit(), "deadline_s": args.deadline,
            "gguf_stubbed": stubbed, "argv": sys.argv[1:]}
    report = Report(out, meta)
    report.doc["meta"]["environment"] = environment(device)
    report.write()
    skip = set(filter(None, args.skip.split(",")))
    smoke = args.cpu_smoke
    bandwidth: dict = {}

    def copy_part():
        bandwidth.update(copy_bandwidth(device, (64 << 20) if smoke else (2 << 30)))
        return dict(bandwidth)

    decode_shape = (dict(batch=2, context=64, heads=4, kv_heads=2, head_dim=16) if smoke
                    else dict(batch=64, context=4096, heads=32, kv_heads=8, head_dim=128))
    # (block_n, num_warps, num_stages, num_splits; None: the automatic choice)
    sweep = [(16, 4, 2, None)] if smoke else [(32, 4, 2, None), (64, 4, 3, None), (128, 4, 2, None), (128, 8, 3, None),
                                               (128, 4, 2, 1), (128, 4, 3, 1), (128, 8, 2, 1), (64, 8, 2, 1),
                                               (64, 4, 2, 2), (128, 4, 2, 2)]
    splits = [2] if smoke else [1, 2, 4, 8]
    # Figures first, then correctness, then end to end: a run cut short by the device's time still
    # brings back the kernels' numbers.
    parts = [
        ("copy_bandwidth", 20, copy_part),
        ("decode_bandwidth", 90, decode_bandwidth, device, decode_shape, [4, 16] if smoke else [16, 32], sweep,
         splits, 3 if smoke else 30),
        ("kernel_tests", 120, kernel_tests, 120, smoke),
        # The Triton GGUF product (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) compiled, against gguf-py's dequantization;
        # needs the real gguf package (its wheel carried in .whl/).
        ("gguf_kernel_tests", 60, kernel_tests, 60, smoke, ("tests/kernels/test_triton_gguf.py",), None),
        ("graphs_vs_eager", 60, graphs_vs_eager, device, smoke),
    ]
    if smoke:
        budgets = {"pagellm": 60, "pagellm_kv_fp8": 60, "hf_generate": 30, "hf_generate_batch": 45}
        parts.append(("e2e_tiny", 90, e2e, device, "tiny", 6, 8, 24, 6, budgets, bandwidth, True))
    else:
        hf = 0 if args.skip_hf else 1
        parts.append(("e2e_8b", 100 + hf * 110, e2e, device, "8b", 256, 64, 512, 128,
                      {"pagellm": 60, "pagellm_kv_fp8": 40, "hf_generate": 45 * hf, "hf_generate_batch": 60 * hf},
                      bandwidth, False))
        parts.append(("e2e_1b", 70 + hf * 70, e2e, device, "1b", 256, 64, 512, 128,
                      {"pagellm": 45, "pagellm_kv_fp8": 25, "hf_generate": 30 * hf, "hf_generate_batch": 40 * hf},
                      bandwidth, False))
    if stubbed:
        skip.add("gguf_kernel_tests")
    for name, budget, fn, *fargs in parts:
        if name in skip:
            report.doc["parts"][name] = {"status": "skipped", "error": "--skip" if name in args.skip.split(",")
                                         else "no gguf package (carry its wheel in .whl/)"}
            continue
        report.run(name, budget, fn, *fargs)
    report.write()
    print(f"wrote {out}")
    return 0 if all(p.get("status") in ("ok", "skipped") for p in report.doc["parts"].values()) else 1


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=5).stdout.strip() or "unknown"
    except Exception:
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())

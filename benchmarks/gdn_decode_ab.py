"""One decode step of a model's Gated DeltaNet layers (one layer of its shape, built from its HF
config with random weights, float32, run on `--layers` separate pools of states, as many as the
model has such layers: the states of a step do not stay in the CPU's caches between steps), the
states in blocks of float32 KV pools as the engine keeps them: where the time of
`GatedDeltaNet.cached_forward` goes without its two projections (in_proj's output given, out_proj
skipped), and the torch path against the fused decode kernel (cpu.gdn_decode_step) in one process,
turn about. Also the largest difference of the two paths' outputs and states. Times are per step
(all the layers).

Parts of the torch path: "state_io" (read_state + write_state, the states copied out of the pool
and back), "conv" (the convolution's one-token step), "recurrent_step" (the delta rule), and
"mixer_torch" the whole of it; "mixer_fused" the kernel's whole.

    python benchmarks/gdn_decode_ab.py --config /work/shapes/qwen3.5-4b-random --batch 1 4 \
        --threads 1 --rounds 11 --out RESULTS/gdn-decode-ab.json
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from pagellm.bench.report import metadata, write_json  # noqa: E402
from pagellm.layers import gated_delta_net  # noqa: E402
from pagellm.layers.causal_conv import causal_conv1d  # noqa: E402
from pagellm.layers.recurrent import STATE_DTYPE, blocks_for_state, read_state, write_state  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from delta_rule_ab import build, projections_out  # noqa: E402  (the layer of random weights, projections given)

# A block of the 4B shape's attention layers: 16 tokens x 4 KV heads x 256, float32, for K and for V.
BLOCK_SHAPE = (16, 4, 256)


@contextlib.contextmanager
def kernel(enabled: bool) -> Iterator[None]:
    """The fused decode kernel on or off (off: the torch path)."""
    serves = getattr(gated_delta_net, "decode_kernel_serves", None)
    if serves is None or enabled:
        yield
        return
    gated_delta_net.decode_kernel_serves = lambda *a, **k: False
    try:
        yield
    finally:
        gated_delta_net.decode_kernel_serves = serves


def pool_for(layer, batch: int, seed: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A float32 pool whose blocks hold `batch` random states (block 0 unused), and their block ids."""
    block_bytes = torch.Size(BLOCK_SHAPE).numel() * STATE_DTYPE.itemsize
    per_seq = blocks_for_state(layer.state_bytes, 2 * block_bytes)
    gen = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(1 + batch * per_seq, *BLOCK_SHAPE, generator=gen) * 0.1 for _ in range(2))
    ids = torch.randperm(batch * per_seq, generator=gen).add_(1).view(batch, per_seq)
    return (k, v), ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="an HF model folder (config.json) with Gated DeltaNet layers")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4], help="decode batch sizes")
    ap.add_argument("--layers", type=int, default=24, help="Gated DeltaNet layers of the model (24 in Qwen3.5-4B)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1])
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    hf = AutoConfig.from_pretrained(args.config)
    hf = getattr(hf, "text_config", hf)
    layer = build(gated_delta_net.GatedDeltaNet, hf)
    proj = layer.in_proj.weight.shape[0]
    has_kernel = hasattr(gated_delta_net, "decode_kernel_serves")

    def mixer(fused: bool, batch: int) -> Callable[[], tuple[torch.Tensor, tuple]]:
        gen = torch.Generator().manual_seed(batch)
        x = torch.randn(batch, proj, generator=gen) * 0.5
        pools = [pool_for(layer, batch, seed=batch + 100 * i) for i in range(args.layers)]
        metas = [SimpleNamespace(state_block_ids=ids[None], fresh_states=torch.tensor([], dtype=torch.long),
                                 query_lens=[1] * batch, verifying=None, state_rollbacks=[]) for _, ids in pools]

        def run() -> tuple[torch.Tensor, tuple]:
            with torch.no_grad(), projections_out(layer, x), kernel(fused):
                for (kv, _), meta in zip(pools, metas):
                    out = layer.cached_forward(x, kv, meta)
            return out, kv  # the last layer's
        return run

    def parts(batch: int) -> dict[str, Callable[[], object]]:
        pools = [pool_for(layer, batch, seed=batch + 100 * i) for i in range(args.layers)]
        gen = torch.Generator().manual_seed(batch)
        conv_states = [torch.randn(batch, *layer.state_shapes["conv"], generator=gen) for _ in pools]
        qkv = torch.randn(batch, conv_states[0].shape[1], generator=gen)
        w = layer.conv1d.weight[:, 0]
        h, dk, dv = layer.num_v_heads, layer.dk, layer.dv
        q, k = (torch.nn.functional.normalize(torch.randn(batch, h, dk, generator=gen), dim=-1) for _ in range(2))
        v = torch.randn(batch, h, dv, generator=gen)
        g, beta = -torch.rand(batch, h, generator=gen), torch.rand(batch, h, generator=gen)
        ssms = [torch.randn(batch, h, dk, dv, generator=gen) * 0.1 for _ in pools]

        def state_io() -> None:
            for kv, ids in pools:
                write_state(kv, ids, read_state(kv, ids))

        def conv() -> None:
            for state in conv_states:
                causal_conv1d(qkv, w, None, state, [1] * batch, "silu")

        def delta_rule() -> None:
            for ssm in ssms:
                gated_delta_net.recurrent_step(q, k, v, g, beta, ssm)
        return {"state_io": state_io, "conv": conv, "recurrent_step": delta_rule}

    # Agreement: the same inputs from the same pooled states through both paths.
    agreement = {}
    if has_kernel:
        for batch in args.batch:
            (out_t, kv_t), (out_f, kv_f) = mixer(False, batch)(), mixer(True, batch)()
            agreement[f"batch{batch}"] = {
                "out_max_abs_diff": (out_t - out_f).abs().max().item(), "out_max_abs": out_t.abs().max().item(),
                "pool_max_abs_diff": max((a - b).abs().max().item() for a, b in zip(kv_t, kv_f))}
            print(f"agreement batch {batch}", agreement[f"batch{batch}"], flush=True)

    load = os.getloadavg()
    timings = {}
    for threads in args.threads:
        torch.set_num_threads(threads)
        for batch in args.batch:
            runs = {f"part_{n}": f for n, f in parts(batch).items()}
            runs["mixer_torch"] = mixer(False, batch)
            if has_kernel:
                runs["mixer_fused"] = mixer(True, batch)
            times: dict[str, list[float]] = {n: [] for n in runs}
            for f in runs.values():
                f()  # warm-up
            for r in range(args.rounds):
                for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
                    t0 = time.perf_counter()
                    runs[name]()
                    times[name].append(time.perf_counter() - t0)
            med = {n: round(statistics.median(t) * 1e3, 3) for n, t in times.items()}
            entry = {"ms_median": med, "seconds": times}
            if has_kernel:
                entry["speedup_median"] = round(med["mixer_torch"] / med["mixer_fused"], 2)
            timings[f"threads{threads}_batch{batch}"] = entry
            print(f"threads {threads} batch {batch}:", med, entry.get("speedup_median", ""), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, {**metadata("gdn_decode_ab"), "config": args.config, "layers": args.layers,
                     "block_shape": BLOCK_SHAPE,
                     "rounds": args.rounds, "load_avg_before_after": [load, os.getloadavg()],
                     "agreement": agreement, "timings": timings})


if __name__ == "__main__":
    main()

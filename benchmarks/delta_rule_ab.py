"""One Gated DeltaNet layer of a model's shape (built from its HF config, random weights, float32)
in this checkout ("new") against the same layer as the source at another git revision has it
("old": its gated_delta_net.py and causal_conv.py, loaded from `git show`), in one process, turn
about: prefills of each length from a carried state and from a fresh (zero) one, and decode steps. Also the largest
difference of the two paths' outputs and states on the same inputs.

"mixer" times the layer with its two projections taken out (in_proj's output precomputed,
out_proj skipped): what the change touches; "layer" times the whole forward, with float32
dense projections (a GGUF model's quantized ones cost otherwise).

    python benchmarks/delta_rule_ab.py --config /work/shapes/qwen3.5-4b-random --base main \
        --tokens 128 512 --threads 1 2 --rounds 7 --out RESULTS/delta-rule-ab.json
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from pagellm.bench.report import metadata, write_json  # noqa: E402
from pagellm.layers import gated_delta_net, sharded_parts  # noqa: E402


def module_at(rev: str, path: str, name: str) -> types.ModuleType:
    """The module at `path` as revision `rev` of this repository has it."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{path}"], check=True, capture_output=True,
                            text=True).stdout
    module = types.ModuleType(name)
    module.__file__ = f"{rev}:{path}"
    sys.modules[name] = module  # dataclasses and annotations look their module up
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module


def build(cls: type, hf) -> torch.nn.Module:
    torch.manual_seed(0)
    layer = cls(hf)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.02)
        layer.conv1d.weight.normal_(0, 0.3)
        layer.A_log.copy_(torch.linspace(-4, 0, layer.num_v_heads))  # slow to fast heads
        layer.dt_bias.normal_(0, 1)
        layer.norm.weight.fill_(1)
    return layer


def state_like(layer, num_seqs: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(num_seqs, *shape, generator=gen) * 0.1 for name, shape in layer.state_shapes.items()}


class _Given(torch.nn.Module):
    """Stands in for a projection: returns `value` (None: its input)."""

    def __init__(self, value: torch.Tensor | None) -> None:
        super().__init__()
        self.value = value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.value is None else self.value


@contextlib.contextmanager
def projections_out(layer, x_proj: torch.Tensor) -> Iterator[None]:
    """The layer with in_proj returning `x_proj` and out_proj returning its input."""
    in_proj, out_proj = layer.in_proj, layer.out_proj
    layer.in_proj, layer.out_proj = _Given(x_proj), _Given(None)
    try:
        yield
    finally:
        layer.in_proj, layer.out_proj = in_proj, out_proj


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="an HF model folder (config.json) with Gated DeltaNet layers")
    ap.add_argument("--base", default="main", help="the git revision whose layer is 'old'")
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 512], help="prefill lengths")
    ap.add_argument("--decodes", type=int, nargs="+", default=[1, 16], help="decode batch sizes")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    hf = AutoConfig.from_pretrained(args.config)
    hf = getattr(hf, "text_config", hf)
    old_conv = module_at(args.base, "pagellm/layers/causal_conv.py", "old_causal_conv")
    old_gdn = module_at(args.base, "pagellm/layers/gated_delta_net.py", "old_gated_delta_net")
    layers = {"new": build(gated_delta_net.GatedDeltaNet, hf), "old": build(old_gdn.GatedDeltaNet, hf)}
    convs = {"new": sharded_parts.causal_conv1d, "old": old_conv.causal_conv1d}

    def run(path: str, x: torch.Tensor, state: dict[str, torch.Tensor], lens: list[int],
            mixer: bool) -> torch.Tensor:
        layer = layers[path]
        sharded_parts.causal_conv1d = convs[path]  # PartsConv1d calls the module's global
        try:
            with torch.no_grad(), (projections_out(layer, x) if mixer else contextlib.nullcontext()):
                return layer(x, state, lens)
        finally:
            sharded_parts.causal_conv1d = convs["new"]

    hidden, proj = hf.hidden_size, layers["new"].in_proj.weight.shape[0]

    def case(lens: list[int], mixer: bool, fresh: bool = False) -> Callable[[str], float]:
        gen = torch.Generator().manual_seed(len(lens) * 7 + sum(lens))
        x = torch.randn(sum(lens), proj if mixer else hidden, generator=gen)
        x = x * 0.5 if mixer else x
        start = state_like(layers["new"], len(lens), seed=1)
        if fresh:  # a sequence's first prefill
            start = {k: v.zero_() for k, v in start.items()}

        def seconds(path: str) -> float:
            state = {k: v.clone() for k, v in start.items()}
            t0 = time.perf_counter()
            run(path, x, state, lens, mixer)
            return time.perf_counter() - t0
        return seconds

    # Agreement: the same inputs from the same carried state through both paths.
    agreement = {}
    for tokens in args.tokens + [1, 37]:
        gen = torch.Generator().manual_seed(tokens)
        x = torch.randn(tokens, hidden, generator=gen)
        outs, states = {}, {}
        for path in ("new", "old"):
            states[path] = state_like(layers["new"], 1, seed=2)
            outs[path] = run(path, x, states[path], [tokens], mixer=False)
        agreement[f"L{tokens}"] = {
            "out_max_abs_diff": (outs["new"] - outs["old"]).abs().max().item(),
            "out_max_abs": outs["old"].abs().max().item(),
            **{f"{k}_state_max_abs_diff": (states["new"][k] - states["old"][k]).abs().max().item()
               for k in states["new"]},
        }
        print(f"agreement L{tokens}", agreement[f"L{tokens}"], flush=True)

    load = os.getloadavg()
    timings = {}
    for threads in args.threads:
        torch.set_num_threads(threads)
        cases = {**{f"prefill{t}_{what}": ([t], what == "mixer", False) for t in args.tokens
                    for what in ("mixer", "layer")},
                 **{f"prefill{t}_fresh_mixer": ([t], True, True) for t in args.tokens},
                 **{f"decode{b}_{what}": ([1] * b, what == "mixer", False) for b in args.decodes
                    for what in ("mixer", "layer")}}
        for name, (lens, mixer, fresh) in cases.items():
            seconds = case(lens, mixer, fresh)
            seconds("new"), seconds("old")  # warm-up
            times: dict[str, list[float]] = {"new": [], "old": []}
            for r in range(args.rounds):
                for path in (("new", "old") if r % 2 == 0 else ("old", "new")):
                    times[path].append(seconds(path))
            med = {p: statistics.median(t) for p, t in times.items()}
            best = {p: min(t) for p, t in times.items()}
            timings[f"threads{threads}_{name}"] = {
                "new_ms_median": round(med["new"] * 1e3, 3), "old_ms_median": round(med["old"] * 1e3, 3),
                "speedup_median": round(med["old"] / med["new"], 3), "speedup_min": round(best["old"] / best["new"], 3),
                "seconds": times}
            print(f"threads {threads} {name}:",
                  {k: v for k, v in timings[f'threads{threads}_{name}'].items() if k != "seconds"}, flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, {**metadata("delta_rule_ab"), "config": args.config, "base": args.base, "rounds": args.rounds,
                     "load_avg_before_after": [load, os.getloadavg()], "agreement": agreement, "timings": timings})


if __name__ == "__main__":
    main()

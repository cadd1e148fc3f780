"""What every bench command shares: where results go, the metadata that makes them
reproducible (machine, versions, git commit, command line), tables, plots, progress."""
from __future__ import annotations

import datetime as _dt
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterable, Sequence

from pagellm import envs
from pagellm.cpu_features import cpu_flags, cpu_model

RESULTS_DIR = Path("benchmarks") / "results"

# Ordinary English words for synthetic prompts, so a byte-pair tokenizer sees plausible text.
COMMON_WORDS = (
    "the of and to in is was for on that with as by at from his her they this which have had are not were "
    "been one all their there would more when who will about into time only some could them other than then "
    "first also after made many before over such most where through years work under while water world "
    "people house small great city long little found country place number part school river between state "
    "during music early life called family several three power known later being government found story "
    "garden morning evening winter summer market village mountain window letter travel simple question "
    "answer reason history science nature market light sound voice paper table street field forest island"
).split()


def output_paths(name: str, out: str | None) -> tuple[Path, Path]:
    """(json, png) paths: `--out` as given (with or without an extension), else
    benchmarks/results/<name>-<date>, or <name>-<date>-2, -3, ... when that is taken: a rerun
    never overwrites a result (only an explicit --out may)."""
    if out is None:
        base = RESULTS_DIR / f"{name}-{_dt.date.today().isoformat()}"
        stem, k = base, 1
        while _with(stem, ".json").exists() or _with(stem, ".png").exists():
            k += 1
            stem = base.with_name(f"{base.name}-{k}")
    else:
        stem = Path(out)
        if stem.suffix in (".json", ".png"):
            stem = stem.with_suffix("")
    stem.parent.mkdir(parents=True, exist_ok=True)
    return _with(stem, ".json"), _with(stem, ".png")


def _with(stem: Path, extension: str) -> Path:
    """`stem` with `extension` added: a dot in the stem ("qwen3.5-4b") is part of the name, not an
    extension for Path.with_suffix to replace."""
    return stem.with_name(stem.name + extension)


SIMD_FLAG_PREFIXES = ("avx", "amx", "fma", "f16c", "sse", "ssse", "vnni", "bmi")


# Environment variables that hold torch's CPU kernels (ATen's, MKL's) to an older instruction set.
ISA_LIMITS = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")


def machine_info() -> dict:
    cpu = cpu_model() or platform.processor() or platform.machine()
    mem = None
    try:
        with open("/proc/meminfo") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
            mem = round(kb / (1 << 20), 1)
    except (OSError, StopIteration):
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    # isa: what the CPU has; kernels_march: what pagellm's kernels were built for (PAGELLM_CPU_MARCH:
    # x86-64-v3 runs the AVX2 code on an AVX-512 CPU), which decides which of their paths ran.
    # cpu_flags: the vector and matrix extensions among /proc/cpuinfo's flags, which decide which
    # kernels run and how fast (an AVX2-only Zen 3 and an AVX-512 Zen 4 both say "AMD EPYC").
    simd = sorted(f for f in cpu_flags() if f.startswith(SIMD_FLAG_PREFIXES))
    info = {"cpu": cpu, "cores": cores, "memory_gib": mem, "platform": platform.platform(),
            "isa": envs.cpu_isa_tag(), "kernels_march": envs.cpu_march(), "cpu_flags": simd}
    # torch's own kernels held to fewer extensions (an AVX2 run on an AVX-512 CPU holds both sides to AVX2)
    held = {k: os.environ[k] for k in ISA_LIMITS if os.environ.get(k)}
    return {**info, "isa_limits": held} if held else info


def versions(extra: Sequence[str] = ()) -> dict:
    """Installed versions, read from package metadata so nothing heavy is imported."""
    out = {"python": platform.python_version()}
    for pkg in ("pagellm", "torch", "transformers", *extra):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def git_commit() -> dict:
    root = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                                  timeout=10, check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def metadata(name: str, argv: Sequence[str] | None = None, extra_versions: Sequence[str] = ()) -> dict:
    argv = list(sys.argv if argv is None else argv)
    return {
        "benchmark": name,
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in argv),
        "machine": machine_info(),
        "versions": versions(extra_versions),
        "git": git_commit(),
    }


def print_targets(targets: Iterable[dict], value_format: str = "{:.3g}") -> None:
    """One line per target of an issue: MET or MISSED, what it asks, the value measured."""
    for t in targets:
        print(f"{'MET ' if t['met'] else 'MISSED'}  {t['target']}: {value_format.format(t['value'])}")


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, default=_jsonable) + "\n")


def _jsonable(x: Any):
    if hasattr(x, "item"):
        return x.item()
    if isinstance(x, (set, tuple)):
        return list(x)
    raise TypeError(f"not JSON serializable: {type(x).__name__}")


def format_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A plain-text table with right-aligned numbers."""
    cells = [[_fmt(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(vals: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(vals, widths)))

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in cells)])


def _fmt(c: Any) -> str:
    if c is None:
        return "-"
    if isinstance(c, float):
        if c != c:
            return "nan"
        if abs(c) >= 100:
            return f"{c:,.0f}"
        if abs(c) >= 1:
            return f"{c:.2f}"
        return f"{c:.3f}"
    return str(c)


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def label_axes(panels, xlabel: str) -> None:
    """Each (axes, title, ylabel) of `panels` titled and labelled, with a legend where it plotted labelled lines."""
    for ax, title, ylabel in panels:
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)


def save_figure(fig, path, dpi: int = 110) -> None:
    """Lay the figure out, write it to `path` and free it (pyplot keeps every open figure)."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)


def progress(iterable=None, total: int | None = None, desc: str = "", enable: bool = True, unit: str = "it"):
    """A tqdm bar on stderr, or a silent pass-through."""
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, desc=desc, disable=not enable, unit=unit, leave=False)

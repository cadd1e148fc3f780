"""llama.cpp's own converter (`convert_hf_to_gguf.py`), the writer of the GGUF files people
bring, taken from the llama.cpp sources vendored in llama-cpp-python's source distribution.

The sources are fetched from PyPI once (`pip download`, about 75 MB) and only the converter,
its `conversion/` package and its `gguf-py` are kept, under PAGELLM_TEST_CACHE (default
~/.cache/pagellm-tests). The converter runs with its own vendored gguf-py, so writer and
reader versions are both pinned: llama-cpp-python==LLAMA_CPP_PYTHON here, gguf in pyproject.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

LLAMA_CPP_PYTHON = "0.3.36"
_KEEP = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


def converter_dir() -> Path:
    """A directory holding convert_hf_to_gguf.py, fetched and unpacked on first use."""
    cache = Path(os.environ.get("PAGELLM_TEST_CACHE", Path.home() / ".cache" / "pagellm-tests"))
    target = cache / f"llama.cpp-{LLAMA_CPP_PYTHON}"
    if (target / "convert_hf_to_gguf.py").is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", tmp], check=True)
        (sdist,) = Path(tmp).glob("llama_cpp_python-*.tar.gz")
        unpacked = Path(tmp) / "llama.cpp"
        prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
        with tarfile.open(sdist) as tar:
            members = []
            for m in tar.getmembers():
                rel = m.name.removeprefix(prefix)
                if m.name.startswith(prefix) and rel.startswith(_KEEP) and (m.isfile() or m.isdir()):
                    m.name = rel
                    members.append(m)
            tar.extractall(unpacked, members=members, filter="data")
        try:
            os.replace(unpacked, target)  # atomic: a concurrent or interrupted run never sees half a copy
        except OSError:
            if not (target / "convert_hf_to_gguf.py").is_file():  # else another worker got there first
                raise
    return target


def convert(model_dir: Path, out: Path, outtype: str = "f32") -> Path:
    """Convert a Hugging Face directory to GGUF exactly as a user would with llama.cpp."""
    error = convert_many([(model_dir, out)], outtype)[out]
    if error is not None:
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {model_dir}:\n{error}")
    return out


# Runs the converter once per (model, output, outtype) line of stdin in one interpreter, as its
# own command line would (`runpy` re-executes the script each time; torch, transformers and gguf
# are imported once). Prints one JSON line per conversion: its error, or null.
# transformers 5 reads a Qwen3.5-MoE directory's tokenizer as its Qwen3.5 class, whatever
# tokenizer_config.json names (a Qwen3.5 directory's is read as named): Qwen's pre-tokenizer over
# the test models' SmolLM2 vocabulary, whose hash the converter does not know. Read as named
# there too; the tokenizer is all this changes, and the converter writes SmolLM2's as for Qwen3.5.
_MANY = """
import contextlib, io, json, os, runpy, sys, traceback
import transformers.models.auto.tokenization_auto as auto
auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS.discard("qwen3_5_moe_text")
script = sys.argv[1]
sys.path.insert(0, os.path.dirname(script))  # as for `python script`: its conversion/ package
for line in sys.stdin:
    model, out, outtype = json.loads(line)
    sys.argv = [script, model, "--outfile", out, "--outtype", outtype]
    err = io.StringIO()
    try:
        with contextlib.redirect_stdout(err), contextlib.redirect_stderr(err):
            runpy.run_path(script, run_name="__main__")
        error = None
    except SystemExit as e:
        error = None if e.code in (0, None) else err.getvalue()[-3000:]
    except BaseException:
        error = err.getvalue()[-2000:] + traceback.format_exc()[-1000:]
    print(json.dumps(error), flush=True)
"""


def convert_many(jobs: list[tuple[Path, Path]], outtype: str = "f32") -> dict[Path, str | None]:
    """Convert several Hugging Face directories in one converter process (each conversion in its
    own process costs ~5 s of imports). Returns, per output path, None or the converter's error."""
    script = converter_dir() / "convert_hf_to_gguf.py"
    lines = "".join(json.dumps([str(m), str(o), outtype]) + "\n" for m, o in jobs)
    result = subprocess.run([sys.executable, "-c", _MANY, str(script)], input=lines, capture_output=True, text=True)
    answers = [json.loads(x) for x in result.stdout.splitlines() if x.strip()]
    if result.returncode != 0 or len(answers) != len(jobs):
        raise RuntimeError(f"the converter process failed:\n{result.stderr[-3000:]}")
    return {out: error for (_, out), error in zip(jobs, answers)}


def requantize(src: Path, out: Path, type_of) -> Path:
    """Rewrite a GGUF file with each matrix (or stack of them: experts) re-quantized by gguf-py's own quantizer
    (by tests/kernels/gguf_blocks.py's for the types gguf-py only decodes):
    `type_of(tensor name)` gives its GGMLQuantizationType (or None to keep it; a matrix whose rows are not
    whole blocks of the type is kept too); metadata is copied."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize, quantize

    from tests.kernels.gguf_blocks import quantize_iq4, quantize_k

    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(out, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub_type)
    for t in reader.tensors:
        qtype = type_of(t.name) if len(t.shape) >= 2 else None
        shape = [int(d) for d in reversed(t.shape.tolist())]  # rows, then values per row
        if qtype is None or shape[-1] % GGML_QUANT_SIZES[GGMLQuantizationType(qtype)][0]:
            writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
            continue
        dense = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        # gguf-py only decodes IQ4_NL, IQ4_XS and the K-quants Q4_K, Q5_K, Q6_K: the tests' own encoders write them
        if qtype in (GGMLQuantizationType.IQ4_NL, GGMLQuantizationType.IQ4_XS):
            blocks = quantize_iq4(dense, qtype)
        elif qtype in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K):
            blocks = quantize_k(dense, qtype)
        else:
            blocks = quantize(dense, qtype)
        writer.add_tensor(t.name, blocks, raw_dtype=GGMLQuantizationType(qtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out

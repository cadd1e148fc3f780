"""A GGUF file of a real model's shape with random weights, quantized by llama.cpp's own tools:
the files the quantized-weights benchmarks run on where no checkpoint can be downloaded.

    python benchmarks/make_gguf_shape.py --shape llama-3.2-1b --types Q4_K_M Q8_0 --out /data/shapes
    python benchmarks/make_gguf_shape.py --shape qwen3.5-4b --types Q4_K_M --out /data/shapes
    python benchmarks/make_gguf_shape.py --shape gpt-oss-20b --out /data/shapes    # -> ...-MXFP4.gguf

1. config.json of the shape (pagellm.loader.synthetic: LLAMA_SHAPES, or CHECKPOINT_SHAPES for the
   other families, each the released checkpoint's config) with the bundled SmolLM2's tokenizer (a
   byte-level BPE the converter recognises; its 49,152 tokens are padded to the shape's vocabulary);
2. random weights named and shaped as transformers' model of that config has them (read off the
   model built on the meta device), written tensor by tensor to safetensors shards so an 8B shape
   never sits in memory whole: matrices normal(0, 0.02) in bfloat16, norms their identity
   (1, or 0 where the family scales by 1 + weight), biases and sinks 0, and Gated DeltaNet's
   decay parameters as transformers initialises them. A checkpoint whose experts ship in MXFP4
   (gpt-oss: quantization_config's quant_method "mxfp4") gets them in that layout: `*_blocks`
   (uint8, two 4-bit E2M1 codes a byte, 32 a block) and `*_scales` (uint8 E8M0 exponents);
3. llama.cpp's convert_hf_to_gguf.py to an F16 GGUF, then llama-quantize to each --types entry
   (both from benchmarks/build_llama_cpp.sh's build and sources). For MXFP4 experts the converter
   repacks the blocks as they are (MXFP4 in the GGUF, the rest F16, as the release's GGUF), and that
   file is the result (-MXFP4.gguf); no --types then.

Prints the GGUF paths. Disk: the shape in bf16 twice (safetensors, F16 GGUF) plus the results.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from pagellm import envs
from pagellm.loader.synthetic import CHECKPOINT_SHAPES, LLAMA_SHAPES, write_dummy_model_dir

SHARD_BYTES = 2 << 30
# Families whose RMSNorm multiplies by (1 + weight): their identity norm is 0.
ZERO_CENTRED_NORMS = {"qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"}
# The converter expects Qwen3.5's multi-token-prediction layer unless told the file has none.
CONVERTER_FLAGS = {"qwen3_5_text": ["--no-mtp"]}
MXFP4_BLOCK = 32
# E8M0 exponents of the random MXFP4 scales: 2^-6 .. 2^-4 times E2M1 codes (|x| <= 6) keeps an
# expert's weights about the size of the trained ones, so activations stay finite.
MXFP4_SCALE_EXPONENTS = (127 - 6, 127 - 4)


def hf_tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every weight's name and shape in transformers' model of `cfg` (built on the meta device,
    so nothing is allocated); the tied output head is left out as the checkpoints leave it."""
    import transformers

    cfg = {k: v for k, v in cfg.items() if k != "quantization_config"}
    config = transformers.AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        shapes.pop("lm_head.weight", None)
    return shapes


def random_tensor(name: str, shape: tuple[int, ...], cfg: dict, gen: torch.Generator) -> torch.Tensor:
    if name.endswith("A_log"):  # Gated DeltaNet's decay rate, log of U(1, 16) as transformers draws it
        return torch.empty(shape).uniform_(1, 16, generator=gen).log().to(torch.bfloat16)
    if name.endswith("dt_bias"):
        return torch.ones(shape, dtype=torch.bfloat16)
    if "norm" in name and len(shape) == 1:
        zero = cfg["model_type"] in ZERO_CENTRED_NORMS and ".linear_attn.norm." not in name
        return (torch.zeros if zero else torch.ones)(shape, dtype=torch.bfloat16)
    if len(shape) == 1 or name.endswith("_bias"):  # biases, gpt-oss's sinks
        return torch.zeros(shape, dtype=torch.bfloat16)
    return (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)


def random_mxfp4(name: str, shape: tuple[int, ...], gen: torch.Generator) -> Iterator[tuple[str, torch.Tensor]]:
    """transformers' [experts, in, out] expert matrix as the MXFP4 checkpoint stores it:
    `name_blocks` [experts, out, in / 32, 16] and `name_scales` [experts, out, in / 32]."""
    experts, n_in, n_out = shape
    blocks = n_in // MXFP4_BLOCK
    yield name + "_blocks", torch.randint(0, 256, (experts, n_out, blocks, MXFP4_BLOCK // 2), generator=gen,
                                          dtype=torch.uint8)
    lo, hi = MXFP4_SCALE_EXPONENTS
    yield name + "_scales", torch.randint(lo, hi + 1, (experts, n_out, blocks), generator=gen, dtype=torch.uint8)


def random_weights(cfg: dict, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    mxfp4 = cfg.get("quantization_config", {}).get("quant_method") == "mxfp4"
    for name, shape in hf_tensor_shapes(cfg).items():
        if mxfp4 and name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            yield from random_mxfp4(name, shape, gen)
        else:
            yield name, random_tensor(name, shape, cfg, gen)


def write_random_weights(model_dir: Path, seed: int) -> None:
    """The random weights, shard by shard, with the shards' index. The converter wants an MXFP4
    matrix's blocks before its scales: they are written in that order, shards in name order."""
    cfg = json.loads((model_dir / "config.json").read_text())
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}

    def flush() -> None:
        name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shard, str(model_dir / name), metadata={"format": "pt"})
        weight_map.update({t: name for t in shard})
        shard.clear()

    for name, t in random_weights(cfg, seed):
        if shard and sum(x.nbytes for x in shard.values()) + t.nbytes > SHARD_BYTES:
            flush()
        shard[name] = t
    flush()
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def write_config(model_dir: Path, shape: str) -> None:
    if shape in CHECKPOINT_SHAPES:
        model_dir.mkdir(parents=True, exist_ok=True)
        (model_dir / "config.json").write_text(json.dumps(CHECKPOINT_SHAPES[shape], indent=2))
    else:
        write_dummy_model_dir(model_dir, shape, max_position_embeddings=8192)


def write_smollm2_tokenizer(model_dir: Path) -> None:
    import transformers

    from pagellm.loader.bundled import default_model_path

    path = default_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    tok.save_pretrained(model_dir)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=[s for s in LLAMA_SHAPES if s != "tiny"] + list(CHECKPOINT_SHAPES),
                    required=True)
    ap.add_argument("--types", nargs="*", default=None,
                    help="llama-quantize types (Q4_K_M, Q8_0, ...); default Q4_K_M, none for MXFP4 experts")
    ap.add_argument("--out", required=True, help="directory for the model folder and the GGUF files")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep-f16", action="store_true", help="keep the F16 GGUF and the safetensors folder")
    args = ap.parse_args()
    out = Path(args.out)
    bin_dir = Path(envs.llama_cpp_bin())
    src = bin_dir.parent.parent / "src"
    if not (bin_dir / "llama-quantize").exists() or not (src / "convert_hf_to_gguf.py").exists():
        sys.exit(f"no llama.cpp build at {bin_dir}: run benchmarks/build_llama_cpp.sh first")
    mxfp4 = CHECKPOINT_SHAPES.get(args.shape, {}).get("quantization_config", {}).get("quant_method") == "mxfp4"
    types = args.types if args.types is not None else [] if mxfp4 else ["Q4_K_M"]
    if mxfp4 and types:
        sys.exit(f"{args.shape}'s experts are MXFP4 as released; the converter's file is the result (no --types)")
    model_dir = out / f"{args.shape}-random"
    converted = out / f"{args.shape}-random-{'MXFP4' if mxfp4 else 'F16'}.gguf"
    if not converted.exists():
        write_config(model_dir, args.shape)
        write_smollm2_tokenizer(model_dir)
        write_random_weights(model_dir, args.seed)
        env = {**os.environ, "PYTHONPATH": str(src / "gguf-py")}
        flags = CONVERTER_FLAGS.get(json.loads((model_dir / "config.json").read_text())["model_type"], [])
        subprocess.run(["nice", "-n", "10", sys.executable, str(src / "convert_hf_to_gguf.py"), str(model_dir),
                        "--outtype", "f16", "--outfile", str(converted), *flags], check=True, env=env)
    for qtype in types:
        target = out / f"{args.shape}-random-{qtype}.gguf"
        if not target.exists():
            subprocess.run(["nice", "-n", "10", str(bin_dir / "llama-quantize"), str(converted), str(target), qtype],
                           check=True)
        print(target)
    if mxfp4:
        print(converted)
    elif not args.keep_f16:
        converted.unlink(missing_ok=True)
    if not args.keep_f16:
        for p in model_dir.glob("*.safetensors"):
            p.unlink()


if __name__ == "__main__":
    main()

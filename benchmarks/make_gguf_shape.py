"""A GGUF file of a real model's shape with random weights, quantized by llama.cpp's own tools:
the files the quantized-weights benchmarks run on where no checkpoint can be downloaded.

    python benchmarks/make_gguf_shape.py --shape llama-3.2-1b --types Q4_K_M Q8_0 --out /data/shapes

1. config.json of the shape (pagellm.loader.synthetic.LLAMA_SHAPES) with the bundled SmolLM2's
   tokenizer (a byte-level BPE the converter recognises; its 49,152 tokens are padded to the
   shape's vocabulary);
2. random bfloat16 weights (normal, std 0.02), written tensor by tensor to safetensors shards,
   so an 8B shape never sits in memory whole;
3. llama.cpp's convert_hf_to_gguf.py to an F16 GGUF, then llama-quantize to each --types entry
   (both from benchmarks/build_llama_cpp.sh's build and sources).

Prints the GGUF paths. Disk: the shape in bf16 twice (safetensors, F16 GGUF) plus the results.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from pagellm import envs
from pagellm.loader.synthetic import LLAMA_SHAPES, write_dummy_model_dir

SHARD_BYTES = 2 << 30


def tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (v, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                       p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                       p + "mlp.down_proj.weight": (h, inter),
                       p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
    shapes["model.norm.weight"] = (h,)
    if not cfg.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (v, h)
    return shapes


def write_random_weights(model_dir: Path, seed: int) -> None:
    """Normal(0, 0.02) bfloat16 weights (norms 1), shard by shard, with the shards' index."""
    cfg = json.loads((model_dir / "config.json").read_text())
    gen = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}

    def flush() -> None:
        name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shard, str(model_dir / name), metadata={"format": "pt"})
        weight_map.update({t: name for t in shard})
        shard.clear()

    for name, shape in tensor_shapes(cfg).items():
        if len(shape) == 1:
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        if shard and sum(x.numel() * 2 for x in shard.values()) + t.numel() * 2 > SHARD_BYTES:
            flush()
        shard[name] = t
    flush()
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def write_smollm2_tokenizer(model_dir: Path) -> None:
    import transformers

    from pagellm.loader.bundled import default_model_path

    path = default_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    tok.save_pretrained(model_dir)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=[s for s in LLAMA_SHAPES if s != "tiny"], required=True)
    ap.add_argument("--types", nargs="+", default=["Q4_K_M"], help="llama-quantize types (Q4_K_M, Q8_0, ...)")
    ap.add_argument("--out", required=True, help="directory for the model folder and the GGUF files")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep-f16", action="store_true", help="keep the F16 GGUF and the safetensors folder")
    args = ap.parse_args()
    out = Path(args.out)
    bin_dir = Path(envs.llama_cpp_bin())
    src = bin_dir.parent.parent / "src"
    if not (bin_dir / "llama-quantize").exists() or not (src / "convert_hf_to_gguf.py").exists():
        sys.exit(f"no llama.cpp build at {bin_dir}: run benchmarks/build_llama_cpp.sh first")
    model_dir = out / f"{args.shape}-random"
    f16 = out / f"{args.shape}-random-F16.gguf"
    if not f16.exists():
        write_dummy_model_dir(model_dir, args.shape, max_position_embeddings=8192)
        write_smollm2_tokenizer(model_dir)
        write_random_weights(model_dir, args.seed)
        env = {**os.environ, "PYTHONPATH": str(src / "gguf-py")}
        subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(model_dir), "--outtype", "f16",
                        "--outfile", str(f16)], check=True, env=env)
    for qtype in args.types:
        target = out / f"{args.shape}-random-{qtype}.gguf"
        if not target.exists():
            subprocess.run([str(bin_dir / "llama-quantize"), str(f16), str(target), qtype], check=True)
        print(target)
    if not args.keep_f16:
        f16.unlink(missing_ok=True)
        for p in model_dir.glob("*.safetensors"):
            p.unlink()


if __name__ == "__main__":
    main()

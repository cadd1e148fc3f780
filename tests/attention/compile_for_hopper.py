"""Compile the Triton kernels for an H100/H200 (sm_90) without a GPU, and print each one's shared memory.

The interpreter runs kernels in NumPy and never lowers them, so it cannot see what only the
GPU compiler rejects (dot shapes, layouts, types, shared memory); this script runs that compiler
ahead of time. Run in a process without TRITON_INTERPRET (test_triton_compile.py does).
`--all` also compiles the benchmark sweep's configs; `--each-kernel` only the first case of each
kernel in each precision (the suite's quick check; every case runs in the slow one).
"""
from __future__ import annotations

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from pagellm.attention import triton_kernels as K  # noqa: E402
from pagellm.attention import triton_latent as LK  # noqa: E402
from pagellm.layers.quant import triton_gguf  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)


def compile_kernel(fn, pointers: dict[str, str], scalars: dict[str, str], constexprs: dict, num_warps: int = 4,
                   num_stages: int = 2):
    """Every argument not in `pointers`/`constexprs` is an int32 unless `scalars` names its type."""
    signature = {name: "constexpr" if name in constexprs else pointers.get(name, scalars.get(name, "i32"))
                 for name in fn.arg_names}
    return triton.compile(ASTSource(fn, signature, constexprs=constexprs), target=HOPPER,
                          options={"num_warps": num_warps, "num_stages": num_stages})


# The per-layer attention options: none (the plain kernels), and all of them at once.
OPTIONS = [dict(HAS_WINDOW=False, HAS_CHUNK=False, HAS_SOFTCAP=False, HAS_SINKS=False),
           dict(HAS_WINDOW=True, HAS_CHUNK=True, HAS_SOFTCAP=True, HAS_SINKS=True)]
OPTION_SCALARS = {"qk_scale": "fp32", "softcap": "fp32"}
PLAIN = dict(QUANT=0, QMAX=0.0)  # caches that hold values (not 8-bit codes)


def _opts_name(opts: dict) -> str:
    return "" if not any(opts.values()) else " window chunk softcap sinks"


def cases(full: bool):
    for dt in ("bf16", "fp32"):
        prec = "ieee" if dt == "fp32" else "tf32"
        kv = {"k_cache_ptr": f"*{dt}", "v_cache_ptr": f"*{dt}"}
        yield ("store", dt), K._store_kv_kernel, {"k_ptr": f"*{dt}", "v_ptr": f"*{dt}", "slot_ptr": "*i64", **kv}, {}, \
            dict(NUM_KV_HEADS=8, HEAD_DIM=128, HEADS_PAD=8, DIM_PAD=128, **PLAIN), 4, 1
        # Llama shapes in bf16; the tests' small shapes in fp32.
        shapes = [(4, 128), (1, 64), (2, 8)] if dt == "bf16" else [(2, 16), (4, 32)]
        configs = [(64, 4, 2)] + ([(32, 4, 2), (64, 4, 3), (64, 8, 3), (128, 4, 2), (128, 8, 3)] if full else [])
        for group, d in shapes:
            for opts in OPTIONS:
                for direct in (True, False):
                    for bn, warps, stages in configs:
                        part = f"*{dt}" if direct else "*fp32"
                        yield (f"decode group={group} d={d} direct={direct} tile={bn} warps={warps} stages={stages}"
                               f"{_opts_name(opts)}", dt), \
                            K._decode_kernel, {"q_ptr": f"*{dt}", "block_tables_ptr": "*i64", "seq_lens_ptr": "*i64",
                                               "out_ptr": f"*{dt}", "part_out_ptr": part, "part_lse_ptr": part,
                                               "sinks_ptr": "*fp32", **kv}, \
                            OPTION_SCALARS, dict(GROUP=group, GROUP_PAD=K.group_pad(group), HEAD_DIM=d,
                                                 DIM_PAD=K.dot_pad(d), BLOCK_N=bn, DIRECT=direct, PRECISION=prec,
                                                 **opts, **PLAIN), warps, stages
                yield (f"prefill group={group} d={d}{_opts_name(opts)}", dt), K._prefill_kernel, \
                    {"q_ptr": f"*{dt}", "block_tables_ptr": "*i64", "tiles_ptr": "*i32", "out_ptr": f"*{dt}",
                     "sinks_ptr": "*fp32", **kv}, \
                    OPTION_SCALARS, dict(GROUP=group, HEAD_DIM=d, DIM_PAD=K.dot_pad(d), BLOCK_M=64, BLOCK_N=64,
                                         PRECISION=prec, **opts, **PLAIN), 4, 2
        for sinks in (False, True):
            yield ("combine" + (" sinks" if sinks else ""), dt), K._combine_kernel, \
                {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": f"*{dt}", "sinks_ptr": "*fp32"}, \
                {}, dict(HEAD_DIM=128, DIM_PAD=128, SPLITS_PAD=32, HAS_SINKS=sinks), 4, 1
        if dt == "bf16":  # 8-bit KV caches (uint8 rows of codes and a scale), Llama-3-8B's heads
            u8 = {"k_cache_ptr": "*u8", "v_cache_ptr": "*u8"}
            for quant, qmax in ((1, 127.0), (2, 448.0), (3, 57344.0)):
                flags = dict(QUANT=quant, QMAX=qmax)
                yield (f"store kv={quant}", dt), K._store_kv_kernel, \
                    {"k_ptr": f"*{dt}", "v_ptr": f"*{dt}", "slot_ptr": "*i64", **u8}, {}, \
                    dict(NUM_KV_HEADS=8, HEAD_DIM=128, HEADS_PAD=8, DIM_PAD=128, **flags), 4, 1
                yield (f"decode group=4 d=128 kv={quant}", dt), K._decode_kernel, \
                    {"q_ptr": f"*{dt}", "block_tables_ptr": "*i64", "seq_lens_ptr": "*i64", "out_ptr": f"*{dt}",
                     "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "sinks_ptr": "*fp32", **u8}, OPTION_SCALARS, \
                    dict(GROUP=4, GROUP_PAD=K.group_pad(4), HEAD_DIM=128, DIM_PAD=128, BLOCK_N=64, DIRECT=False,
                         PRECISION=prec, **OPTIONS[0], **flags), 4, 2
                yield (f"prefill group=4 d=128 kv={quant}", dt), K._prefill_kernel, \
                    {"q_ptr": f"*{dt}", "block_tables_ptr": "*i64", "tiles_ptr": "*i32", "out_ptr": f"*{dt}",
                     "sinks_ptr": "*fp32", **u8}, OPTION_SCALARS, \
                    dict(GROUP=4, HEAD_DIM=128, DIM_PAD=128, BLOCK_M=64, BLOCK_N=64, PRECISION=prec, **OPTIONS[0],
                         **flags), 4, 2
        # Latent attention with the GPU defaults: DeepSeek-V3's rows (512 latent + 64 rotary) in bf16,
        # the tests' small rows (24 latent pad to 32, 8 rotary to 16) in fp32.
        for lora, rope in [(512, 64)] if dt == "bf16" else [(24, 8)]:
            lcfg = LK.default_latent_config(torch.device("cuda"), lora)
            lat = dict(LORA=lora, LORA_PAD=K.dot_pad(lora), ROPE=rope, ROPE_PAD=K.dot_pad(rope),
                       BLOCK_N=lcfg.block_n, PRECISION=prec)
            for direct in (True, False):
                part = f"*{dt}" if direct else "*fp32"
                yield (f"latent decode lora={lora} rope={rope} direct={direct}", dt), LK._latent_decode_kernel, \
                    {"q_ptr": f"*{dt}", "cache_ptr": f"*{dt}", "block_tables_ptr": "*i64", "seq_lens_ptr": "*i64",
                     "out_ptr": f"*{dt}", "part_out_ptr": part, "part_lse_ptr": part}, {"qk_scale": "fp32"}, \
                    dict(BLOCK_H=lcfg.block_h, DIRECT=direct, **lat), lcfg.num_warps, lcfg.num_stages
            block_h = LK.latent_heads_block(128, lcfg)
            yield (f"latent prefill lora={lora} rope={rope}", dt), LK._latent_prefill_kernel, \
                {"q_ptr": f"*{dt}", "cache_ptr": f"*{dt}", "block_tables_ptr": "*i64", "tiles_ptr": "*i32",
                 "out_ptr": f"*{dt}"}, {"qk_scale": "fp32"}, \
                dict(BLOCK_M=LK.latent_prefill_block_m(128, lcfg), BLOCK_H=block_h, **lat), lcfg.num_warps, \
                lcfg.num_stages
        for qtype, (code, block_bytes, block_values) in triton_gguf.TYPES.items():
            yield (f"gguf matmul type={qtype}", dt), triton_gguf._gguf_matmul_kernel, \
                {"x_ptr": f"*{dt}", "w_ptr": "*u8", "y_ptr": f"*{dt}"}, {}, \
                dict(FORMAT=code, BLOCK_BYTES=block_bytes, BLOCK_VALUES=block_values, BLOCK_M=16, BLOCK_N=64,
                     PRECISION=prec), 4, 2


def main() -> int:
    seen = set()
    for (name, dt), fn, pointers, scalars, constexprs, warps, stages in cases("--all" in sys.argv):
        if "--each-kernel" in sys.argv:
            if (fn, dt) in seen:
                continue
            seen.add((fn, dt))
        compiled = compile_kernel(fn, pointers, scalars, constexprs, warps, stages)
        print(f"ok {dt:4s} {name}: shared memory {compiled.metadata.shared} bytes", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env bash
# Builds llama.cpp's llama-server, llama-bench and llama-quantize, the peer for the quantized-weights
# benchmarks, from the sources vendored in llama-cpp-python's source distribution (nothing else is
# reachable here). The build is cached outside git; CI never runs this.
#
#   bash benchmarks/build_llama_cpp.sh            # prints the bin directory when done
#   LLAMA_CPP_BUILD=/some/dir bash benchmarks/build_llama_cpp.sh
#   LLAMA_CPP_AVX2_ONLY=1 bash benchmarks/build_llama_cpp.sh   # AVX2 code on an AVX-512 machine, to
#       compare with pagellm's kernels built for an AVX2-only CPU (PAGELLM_CPU_MARCH=x86-64-v3)
#
# About 10-13 minutes on 2 cores the first time. -DGGML_NATIVE=ON builds binaries that crash on
# some of these machines (their AMX path), so the instruction-set options are set one by one from
# what this CPU reports (/proc/cpuinfo), AMX always off. The machines differ from session to
# session (AVX-512 with VNNI on some, AVX2 only on others), so the cache directory is named by
# those options: a build for one CPU is never run on another.
set -euo pipefail
VERSION=0.3.36
FLAGS=$(grep -m1 '^flags' /proc/cpuinfo)
has() { [[ " $FLAGS " == *" $1 "* ]] && echo ON || echo OFF; }
AVX512=$(has avx512f) VNNI=$(has avx512_vnni) BF16=$(has avx512_bf16)
if [[ ${LLAMA_CPP_AVX2_ONLY:-0} == 1 ]]; then AVX512=OFF VNNI=OFF BF16=OFF; fi
ISA=avx2
[[ $AVX512 == ON ]] && ISA+=-avx512
[[ $VNNI == ON ]] && ISA+=-vnni
[[ $BF16 == ON ]] && ISA+=-bf16
ROOT=${LLAMA_CPP_BUILD:-$HOME/.cache/pagellm-llama.cpp-$VERSION-$ISA}
BIN=$ROOT/build/bin
if [[ -x $BIN/llama-server && -x $BIN/llama-bench && -x $BIN/llama-quantize ]]; then
  echo "$BIN"; exit 0
fi
mkdir -p "$ROOT"
if [[ ! -d $ROOT/src ]]; then
  PY=${PYTHON:-python3}
  "$PY" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$ROOT/dl" >&2
  mkdir -p "$ROOT/unpacked"
  tar -xzf "$ROOT"/dl/llama_cpp_python-$VERSION.tar.gz -C "$ROOT/unpacked"
  mv "$ROOT/unpacked/llama_cpp_python-$VERSION/vendor/llama.cpp" "$ROOT/src"
  rm -rf "$ROOT/unpacked" "$ROOT/dl"
fi
cmake -S "$ROOT/src" -B "$ROOT/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
  -DGGML_AVX512=$AVX512 -DGGML_AVX512_VNNI=$VNNI -DGGML_AVX512_BF16=$BF16 \
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >&2
cmake --build "$ROOT/build" --target llama-quantize llama-bench llama-server -j "$(nproc)" >&2
echo "$BIN"

/* Vector instruction throughput on this core: each line runs 12 independent chains (an instruction
 * alone, or two alternating), so latency does not bound them; two instructions that share pipes run
 * no faster mixed than alone. What docs/quantization.md ("A real AVX2-only CPU") cites for AMD Zen 3.
 *
 *   cc -O2 benchmarks/vector_pipes.c -o /tmp/vector_pipes && /tmp/vector_pipes
 *   cc -O2 -march=native benchmarks/vector_pipes.c -o /tmp/vector_pipes && /tmp/vector_pipes  (AVX-512 VNNI lines too)
 *
 * Instructions per nanosecond; divide by the clock (GHz) for instructions per cycle. x86-64 with AVX2.
 * The last AVX2 line is the many-row kernels' step (pair_dot: x's pair broadcast, VPMADDWD against a
 * vector of W, VPADDD into a row's sum), three instructions a step: a third of its rate is the steps'.
 *
 * Built with -march=native on a CPU with AVX-512 VNNI (AMD Zen 4, Intel since Ice Lake), it adds the
 * integer products of the AVX-512 kernels: 512- and 256-bit VPDPBUSD, VPDPWSSD, and VPDPBUSD each
 * behind its own broadcast of x (the one-row and few-row tile kernels' step, q4_k_x8_rows) or with
 * the broadcast folded into its operand. The int8x2 many-row bound in docs/quantization.md
 * ("Why 16 streams stop short of 2x on Zen 4") is the first line's rate. */
#include <stdio.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}
static long long buf[8] __attribute__((aligned(64)));

// `per` instructions an iteration, `reps` iterations; the clobbers cover every register the lines write.
#define TIMED(name, per, reps, ins)                                                                         \
  {                                                                                                         \
    long n = (reps);                                                                                        \
    double t0 = now();                                                                                      \
    __asm__ volatile("1:\n" ins "dec %0\n jnz 1b\n"                                                         \
                     : "+r"(n)                                                                              \
                     : "r"(buf)                                                                             \
                     : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",     \
                       "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");                                        \
    printf("%-40s %5.2f instructions/ns\n", name, (double)(reps) * (per) / (now() - t0) / 1e9);             \
  }
#define LOOP(name, ins) TIMED(name, 12, 100000000, ins)

#if defined(__AVX512VNNI__)
#define R12(f) f(0) f(1) f(2) f(3) f(4) f(5) f(6) f(7) f(8) f(9) f(10) f(11)
#define LOOP512(name, per, ins) TIMED(name, per, 50000000, ins)
#define DPZ(i) "vpdpbusd %%zmm31, %%zmm30, %%zmm" #i "\n"
#define DPY(i) "vpdpbusd %%ymm31, %%ymm30, %%ymm" #i "\n"
#define DWZ(i) "vpdpwssd %%zmm31, %%zmm30, %%zmm" #i "\n"
#define DPE(i) "vpdpbusd 8(%1)%{1to16%}, %%zmm30, %%zmm" #i "\n"
#define DPB(i) "vpbroadcastq 8(%1), %%zmm" #i "\n" "vpdpbusd %%zmm" #i ", %%zmm30, %%zmm1" #i "\n"
#endif

int main(void) {
  LOOP("vpaddd", "vpaddd %%ymm15, %%ymm0, %%ymm0\n" "vpaddd %%ymm15, %%ymm1, %%ymm1\n" "vpaddd %%ymm15, %%ymm2, %%ymm2\n" "vpaddd %%ymm15, %%ymm3, %%ymm3\n" "vpaddd %%ymm15, %%ymm4, %%ymm4\n" "vpaddd %%ymm15, %%ymm5, %%ymm5\n" "vpaddd %%ymm15, %%ymm6, %%ymm6\n" "vpaddd %%ymm15, %%ymm7, %%ymm7\n" "vpaddd %%ymm15, %%ymm8, %%ymm8\n" "vpaddd %%ymm15, %%ymm9, %%ymm9\n" "vpaddd %%ymm15, %%ymm10, %%ymm10\n" "vpaddd %%ymm15, %%ymm11, %%ymm11\n")
  LOOP("vpmaddubsw", "vpmaddubsw %%ymm15, %%ymm0, %%ymm0\n" "vpmaddubsw %%ymm15, %%ymm1, %%ymm1\n" "vpmaddubsw %%ymm15, %%ymm2, %%ymm2\n" "vpmaddubsw %%ymm15, %%ymm3, %%ymm3\n" "vpmaddubsw %%ymm15, %%ymm4, %%ymm4\n" "vpmaddubsw %%ymm15, %%ymm5, %%ymm5\n" "vpmaddubsw %%ymm15, %%ymm6, %%ymm6\n" "vpmaddubsw %%ymm15, %%ymm7, %%ymm7\n" "vpmaddubsw %%ymm15, %%ymm8, %%ymm8\n" "vpmaddubsw %%ymm15, %%ymm9, %%ymm9\n" "vpmaddubsw %%ymm15, %%ymm10, %%ymm10\n" "vpmaddubsw %%ymm15, %%ymm11, %%ymm11\n")
  LOOP("vpmaddwd", "vpmaddwd %%ymm15, %%ymm0, %%ymm0\n" "vpmaddwd %%ymm15, %%ymm1, %%ymm1\n" "vpmaddwd %%ymm15, %%ymm2, %%ymm2\n" "vpmaddwd %%ymm15, %%ymm3, %%ymm3\n" "vpmaddwd %%ymm15, %%ymm4, %%ymm4\n" "vpmaddwd %%ymm15, %%ymm5, %%ymm5\n" "vpmaddwd %%ymm15, %%ymm6, %%ymm6\n" "vpmaddwd %%ymm15, %%ymm7, %%ymm7\n" "vpmaddwd %%ymm15, %%ymm8, %%ymm8\n" "vpmaddwd %%ymm15, %%ymm9, %%ymm9\n" "vpmaddwd %%ymm15, %%ymm10, %%ymm10\n" "vpmaddwd %%ymm15, %%ymm11, %%ymm11\n")
  LOOP("vpsignb", "vpsignb %%ymm15, %%ymm0, %%ymm0\n" "vpsignb %%ymm15, %%ymm1, %%ymm1\n" "vpsignb %%ymm15, %%ymm2, %%ymm2\n" "vpsignb %%ymm15, %%ymm3, %%ymm3\n" "vpsignb %%ymm15, %%ymm4, %%ymm4\n" "vpsignb %%ymm15, %%ymm5, %%ymm5\n" "vpsignb %%ymm15, %%ymm6, %%ymm6\n" "vpsignb %%ymm15, %%ymm7, %%ymm7\n" "vpsignb %%ymm15, %%ymm8, %%ymm8\n" "vpsignb %%ymm15, %%ymm9, %%ymm9\n" "vpsignb %%ymm15, %%ymm10, %%ymm10\n" "vpsignb %%ymm15, %%ymm11, %%ymm11\n")
  LOOP("vfmadd231ps", "vfmadd231ps %%ymm15, %%ymm14, %%ymm0\n" "vfmadd231ps %%ymm15, %%ymm14, %%ymm1\n" "vfmadd231ps %%ymm15, %%ymm14, %%ymm2\n" "vfmadd231ps %%ymm15, %%ymm14, %%ymm3\n" "vfmadd231ps %%ymm15, %%ymm14, %%ymm4\n" "vfmadd231ps %%ymm15, %%ymm14, %%ymm5\n" "vfmadd231ps %%ymm15, %%ymm14, %%ymm6\n" "vfmadd231ps %%ymm15, %%ymm14, %%ymm7\n" "vfmadd231ps %%ymm15, %%ymm14, %%ymm8\n" "vfmadd231ps %%ymm15, %%ymm14, %%ymm9\n" "vfmadd231ps %%ymm15, %%ymm14, %%ymm10\n" "vfmadd231ps %%ymm15, %%ymm14, %%ymm11\n")
  LOOP("vcvtdq2ps", "vcvtdq2ps %%ymm15, %%ymm0\n" "vcvtdq2ps %%ymm15, %%ymm1\n" "vcvtdq2ps %%ymm15, %%ymm2\n" "vcvtdq2ps %%ymm15, %%ymm3\n" "vcvtdq2ps %%ymm15, %%ymm4\n" "vcvtdq2ps %%ymm15, %%ymm5\n" "vcvtdq2ps %%ymm15, %%ymm6\n" "vcvtdq2ps %%ymm15, %%ymm7\n" "vcvtdq2ps %%ymm15, %%ymm8\n" "vcvtdq2ps %%ymm15, %%ymm9\n" "vcvtdq2ps %%ymm15, %%ymm10\n" "vcvtdq2ps %%ymm15, %%ymm11\n")
  LOOP("vpshufb", "vpshufb %%ymm15, %%ymm0, %%ymm0\n" "vpshufb %%ymm15, %%ymm1, %%ymm1\n" "vpshufb %%ymm15, %%ymm2, %%ymm2\n" "vpshufb %%ymm15, %%ymm3, %%ymm3\n" "vpshufb %%ymm15, %%ymm4, %%ymm4\n" "vpshufb %%ymm15, %%ymm5, %%ymm5\n" "vpshufb %%ymm15, %%ymm6, %%ymm6\n" "vpshufb %%ymm15, %%ymm7, %%ymm7\n" "vpshufb %%ymm15, %%ymm8, %%ymm8\n" "vpshufb %%ymm15, %%ymm9, %%ymm9\n" "vpshufb %%ymm15, %%ymm10, %%ymm10\n" "vpshufb %%ymm15, %%ymm11, %%ymm11\n")
  LOOP("vphaddd", "vphaddd %%ymm15, %%ymm0, %%ymm0\n" "vphaddd %%ymm15, %%ymm1, %%ymm1\n" "vphaddd %%ymm15, %%ymm2, %%ymm2\n" "vphaddd %%ymm15, %%ymm3, %%ymm3\n" "vphaddd %%ymm15, %%ymm4, %%ymm4\n" "vphaddd %%ymm15, %%ymm5, %%ymm5\n" "vphaddd %%ymm15, %%ymm6, %%ymm6\n" "vphaddd %%ymm15, %%ymm7, %%ymm7\n" "vphaddd %%ymm15, %%ymm8, %%ymm8\n" "vphaddd %%ymm15, %%ymm9, %%ymm9\n" "vphaddd %%ymm15, %%ymm10, %%ymm10\n" "vphaddd %%ymm15, %%ymm11, %%ymm11\n")
  LOOP("vpermps", "vpermps %%ymm15, %%ymm14, %%ymm0\n" "vpermps %%ymm15, %%ymm14, %%ymm1\n" "vpermps %%ymm15, %%ymm14, %%ymm2\n" "vpermps %%ymm15, %%ymm14, %%ymm3\n" "vpermps %%ymm15, %%ymm14, %%ymm4\n" "vpermps %%ymm15, %%ymm14, %%ymm5\n" "vpermps %%ymm15, %%ymm14, %%ymm6\n" "vpermps %%ymm15, %%ymm14, %%ymm7\n" "vpermps %%ymm15, %%ymm14, %%ymm8\n" "vpermps %%ymm15, %%ymm14, %%ymm9\n" "vpermps %%ymm15, %%ymm14, %%ymm10\n" "vpermps %%ymm15, %%ymm14, %%ymm11\n")
  LOOP("vpmaddubsw + vpsignb", "vpmaddubsw %%ymm15, %%ymm0, %%ymm0\n" "vpsignb %%ymm15, %%ymm1, %%ymm1\n" "vpmaddubsw %%ymm15, %%ymm2, %%ymm2\n" "vpsignb %%ymm15, %%ymm3, %%ymm3\n" "vpmaddubsw %%ymm15, %%ymm4, %%ymm4\n" "vpsignb %%ymm15, %%ymm5, %%ymm5\n" "vpmaddubsw %%ymm15, %%ymm6, %%ymm6\n" "vpsignb %%ymm15, %%ymm7, %%ymm7\n" "vpmaddubsw %%ymm15, %%ymm8, %%ymm8\n" "vpsignb %%ymm15, %%ymm9, %%ymm9\n" "vpmaddubsw %%ymm15, %%ymm10, %%ymm10\n" "vpsignb %%ymm15, %%ymm11, %%ymm11\n")
  LOOP("vpmaddubsw + vpmaddwd", "vpmaddubsw %%ymm15, %%ymm0, %%ymm0\n" "vpmaddwd %%ymm15, %%ymm1, %%ymm1\n" "vpmaddubsw %%ymm15, %%ymm2, %%ymm2\n" "vpmaddwd %%ymm15, %%ymm3, %%ymm3\n" "vpmaddubsw %%ymm15, %%ymm4, %%ymm4\n" "vpmaddwd %%ymm15, %%ymm5, %%ymm5\n" "vpmaddubsw %%ymm15, %%ymm6, %%ymm6\n" "vpmaddwd %%ymm15, %%ymm7, %%ymm7\n" "vpmaddubsw %%ymm15, %%ymm8, %%ymm8\n" "vpmaddwd %%ymm15, %%ymm9, %%ymm9\n" "vpmaddubsw %%ymm15, %%ymm10, %%ymm10\n" "vpmaddwd %%ymm15, %%ymm11, %%ymm11\n")
  LOOP("vpmaddubsw + vfmadd231ps", "vpmaddubsw %%ymm15, %%ymm0, %%ymm0\n" "vfmadd231ps %%ymm15, %%ymm14, %%ymm1\n" "vpmaddubsw %%ymm15, %%ymm2, %%ymm2\n" "vfmadd231ps %%ymm15, %%ymm14, %%ymm3\n" "vpmaddubsw %%ymm15, %%ymm4, %%ymm4\n" "vfmadd231ps %%ymm15, %%ymm14, %%ymm5\n" "vpmaddubsw %%ymm15, %%ymm6, %%ymm6\n" "vfmadd231ps %%ymm15, %%ymm14, %%ymm7\n" "vpmaddubsw %%ymm15, %%ymm8, %%ymm8\n" "vfmadd231ps %%ymm15, %%ymm14, %%ymm9\n" "vpmaddubsw %%ymm15, %%ymm10, %%ymm10\n" "vfmadd231ps %%ymm15, %%ymm14, %%ymm11\n")
  LOOP("vpmaddubsw + vpaddd", "vpmaddubsw %%ymm15, %%ymm0, %%ymm0\n" "vpaddd %%ymm15, %%ymm1, %%ymm1\n" "vpmaddubsw %%ymm15, %%ymm2, %%ymm2\n" "vpaddd %%ymm15, %%ymm3, %%ymm3\n" "vpmaddubsw %%ymm15, %%ymm4, %%ymm4\n" "vpaddd %%ymm15, %%ymm5, %%ymm5\n" "vpmaddubsw %%ymm15, %%ymm6, %%ymm6\n" "vpaddd %%ymm15, %%ymm7, %%ymm7\n" "vpmaddubsw %%ymm15, %%ymm8, %%ymm8\n" "vpaddd %%ymm15, %%ymm9, %%ymm9\n" "vpmaddubsw %%ymm15, %%ymm10, %%ymm10\n" "vpaddd %%ymm15, %%ymm11, %%ymm11\n")
  LOOP("vpmaddubsw + vpshufb", "vpmaddubsw %%ymm15, %%ymm0, %%ymm0\n" "vpshufb %%ymm15, %%ymm1, %%ymm1\n" "vpmaddubsw %%ymm15, %%ymm2, %%ymm2\n" "vpshufb %%ymm15, %%ymm3, %%ymm3\n" "vpmaddubsw %%ymm15, %%ymm4, %%ymm4\n" "vpshufb %%ymm15, %%ymm5, %%ymm5\n" "vpmaddubsw %%ymm15, %%ymm6, %%ymm6\n" "vpshufb %%ymm15, %%ymm7, %%ymm7\n" "vpmaddubsw %%ymm15, %%ymm8, %%ymm8\n" "vpshufb %%ymm15, %%ymm9, %%ymm9\n" "vpmaddubsw %%ymm15, %%ymm10, %%ymm10\n" "vpshufb %%ymm15, %%ymm11, %%ymm11\n")
  LOOP("vpmaddubsw + vpbroadcastq m64", "vpmaddubsw %%ymm15, %%ymm0, %%ymm0\n" "vpbroadcastq (%1), %%ymm1\n" "vpmaddubsw %%ymm15, %%ymm2, %%ymm2\n" "vpbroadcastq (%1), %%ymm3\n" "vpmaddubsw %%ymm15, %%ymm4, %%ymm4\n" "vpbroadcastq (%1), %%ymm5\n" "vpmaddubsw %%ymm15, %%ymm6, %%ymm6\n" "vpbroadcastq (%1), %%ymm7\n" "vpmaddubsw %%ymm15, %%ymm8, %%ymm8\n" "vpbroadcastq (%1), %%ymm9\n" "vpmaddubsw %%ymm15, %%ymm10, %%ymm10\n" "vpbroadcastq (%1), %%ymm11\n")
  LOOP("vpmaddubsw + vbroadcastsd m64", "vpmaddubsw %%ymm15, %%ymm0, %%ymm0\n" "vbroadcastsd (%1), %%ymm1\n" "vpmaddubsw %%ymm15, %%ymm2, %%ymm2\n" "vbroadcastsd (%1), %%ymm3\n" "vpmaddubsw %%ymm15, %%ymm4, %%ymm4\n" "vbroadcastsd (%1), %%ymm5\n" "vpmaddubsw %%ymm15, %%ymm6, %%ymm6\n" "vbroadcastsd (%1), %%ymm7\n" "vpmaddubsw %%ymm15, %%ymm8, %%ymm8\n" "vbroadcastsd (%1), %%ymm9\n" "vpmaddubsw %%ymm15, %%ymm10, %%ymm10\n" "vbroadcastsd (%1), %%ymm11\n")
  LOOP("vpmaddubsw + vbroadcasti128 m128", "vpmaddubsw %%ymm15, %%ymm0, %%ymm0\n" "vbroadcasti128 (%1), %%ymm1\n" "vpmaddubsw %%ymm15, %%ymm2, %%ymm2\n" "vbroadcasti128 (%1), %%ymm3\n" "vpmaddubsw %%ymm15, %%ymm4, %%ymm4\n" "vbroadcasti128 (%1), %%ymm5\n" "vpmaddubsw %%ymm15, %%ymm6, %%ymm6\n" "vbroadcasti128 (%1), %%ymm7\n" "vpmaddubsw %%ymm15, %%ymm8, %%ymm8\n" "vbroadcasti128 (%1), %%ymm9\n" "vpmaddubsw %%ymm15, %%ymm10, %%ymm10\n" "vbroadcasti128 (%1), %%ymm11\n")
  LOOP("vpmaddwd + vpaddd", "vpmaddwd %%ymm15, %%ymm14, %%ymm0\n" "vpaddd %%ymm15, %%ymm6, %%ymm6\n" "vpmaddwd %%ymm15, %%ymm14, %%ymm1\n" "vpaddd %%ymm15, %%ymm7, %%ymm7\n" "vpmaddwd %%ymm15, %%ymm14, %%ymm2\n" "vpaddd %%ymm15, %%ymm8, %%ymm8\n" "vpmaddwd %%ymm15, %%ymm14, %%ymm3\n" "vpaddd %%ymm15, %%ymm9, %%ymm9\n" "vpmaddwd %%ymm15, %%ymm14, %%ymm4\n" "vpaddd %%ymm15, %%ymm10, %%ymm10\n" "vpmaddwd %%ymm15, %%ymm14, %%ymm5\n" "vpaddd %%ymm15, %%ymm11, %%ymm11\n")
  LOOP("bcast m32 > vpmaddwd > vpaddd (x3)", "vpbroadcastd 0(%1), %%ymm0\n" "vpmaddwd %%ymm15, %%ymm0, %%ymm0\n" "vpaddd %%ymm0, %%ymm4, %%ymm4\n" "vpbroadcastd 4(%1), %%ymm1\n" "vpmaddwd %%ymm15, %%ymm1, %%ymm1\n" "vpaddd %%ymm1, %%ymm5, %%ymm5\n" "vpbroadcastd 8(%1), %%ymm2\n" "vpmaddwd %%ymm15, %%ymm2, %%ymm2\n" "vpaddd %%ymm2, %%ymm6, %%ymm6\n" "vpbroadcastd 12(%1), %%ymm3\n" "vpmaddwd %%ymm15, %%ymm3, %%ymm3\n" "vpaddd %%ymm3, %%ymm7, %%ymm7\n")
#if defined(__AVX512VNNI__)
  LOOP512("vpdpbusd zmm", 12, R12(DPZ))
  LOOP512("vpdpbusd ymm", 12, R12(DPY))
  LOOP512("vpdpwssd zmm", 12, R12(DWZ))
  LOOP512("vpdpbusd zmm, m32{1to16}", 12, R12(DPE))
  LOOP512("vpbroadcastq m64 > vpdpbusd zmm (x6)", 6, DPB(0) DPB(1) DPB(2) DPB(3) DPB(4) DPB(5))
#endif
  return 0;
}

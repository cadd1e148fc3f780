// Matrix products over the GGUF types whose 4-bit codes index a table of 16 values (CPU):
// MXFP4 (gpt-oss's experts), IQ4_NL and IQ4_XS. A run of 32 values is 16 bytes of codes (the
// low nibbles the first 16 values, the high nibbles the next 16) and one float scale:
//
//   MXFP4  (17-byte blocks of 32): an E8M0 exponent byte, then the codes; table: E2M1 doubled
//          {0, 1, 2, 3, 4, 6, 8, 12, and negated}, scale 2^(e - 128) (ggml_e8m0_to_fp32_half).
//   IQ4_NL (18-byte blocks of 32): an fp16 scale d, then the codes; table kvalues_iq4nl.
//   IQ4_XS (136-byte super-blocks of 256): fp16 d, 16 bits of high scale bits, 4 bytes of low
//          ones, then 8 x 16 bytes of codes; run j's scale d * (its 6-bit scale - 32).
//
// So every value is scale * table[code], a product of two floats, whatever the type; the
// kernels here share one loop over those runs (a `Runs` trait per type says where a run's codes
// and scale are). Nothing holds the dense matrix:
//
// - codebook_matmul: y = x @ W^T in float32, for the few rows of x of a decode step. A run's codes
//   become its 32 table values with one byte shuffle (the table fits a 128-bit lane), are widened
//   to float32 and scaled in registers, and are multiplied into every row of x while the row of W
//   is in L1. A value of y sums its terms in one order whatever the number of rows of x, so the
//   batch-invariant mode can use it as it is.
// - codebook_matmul_int8: x rounded to int8 codes per 32 values (one code per value, or two: the
//   `activation_quantization` modes of layers/quant/gguf.py, rounded the same way as quant_ops.cpp
//   rounds them), multiplied by the shuffled table values with integer dot products. One code:
//   the table values are signed, so as llama.cpp does, the product takes |w| (unsigned) and x's
//   codes with w's sign: VPDPBUSD on AVX-512 VNNI, VPMADDUBSW + VPMADDWD on AVX2 (no saturation:
//   |w|, |c| <= 127, a pair sums to at most 32258). Two: both codes as one 16-bit value, VPMADDWD.
// - codebook_dequantize_rows: chosen rows as float32 or bfloat16 (embeddings, tiles of W for
//   torch's GEMM at larger batches).
//
// The tests check every type against gguf-py's dequantization (tests/kernels/test_quant_codebook.py).
#include <torch/extension.h>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

enum : int64_t { IQ4_NL = 20, IQ4_XS = 23, MXFP4 = 39 };
constexpr int kRun = 32;  // values per run of one scale

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return c10::detail::fp16_ieee_to_fp32_value(bits);
#endif
}

// ggml_e8m0_to_fp32_half: 2^(e - 128), built from its bits (subnormal for e < 2).
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

alignas(16) constexpr int8_t kMxfp4Table[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
alignas(16) constexpr int8_t kIq4Table[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                              1,    13,   25,  38,  53,  69,  89,  113};

// Where a type keeps its runs. `scales` fills the float scale of each run of one block.
struct Mxfp4Runs {
  static constexpr int kBlockValues = 32, kBlockBytes = 17;
  static constexpr const int8_t* table = kMxfp4Table;
  static void scales(const uint8_t* b, float* s) { s[0] = e8m0_half(b[0]); }
  static const uint8_t* codes(const uint8_t* b, int) { return b + 1; }
};
struct Iq4NlRuns {
  static constexpr int kBlockValues = 32, kBlockBytes = 18;
  static constexpr const int8_t* table = kIq4Table;
  static void scales(const uint8_t* b, float* s) { s[0] = half_at(b); }
  static const uint8_t* codes(const uint8_t* b, int) { return b + 2; }
};
struct Iq4XsRuns {
  static constexpr int kBlockValues = 256, kBlockBytes = 136;
  static constexpr const int8_t* table = kIq4Table;
  static void scales(const uint8_t* b, float* s) {
    const float d = half_at(b);
    uint16_t high;
    std::memcpy(&high, b + 2, 2);
    for (int j = 0; j < 8; ++j) {
      const int ls = ((b[4 + j / 2] >> (4 * (j % 2))) & 0x0F) | (((high >> (2 * j)) & 3) << 4);
      s[j] = d * static_cast<float>(ls - 32);  // as gguf-py: the run's scale rounded once, then times the value
    }
  }
  static const uint8_t* codes(const uint8_t* b, int j) { return b + 8 + 16 * j; }
};
constexpr int kMaxRunsPerBlock = 8;

// Bytes ahead of the block being multiplied that a product asks the cache for. A decode step's
// experts come from memory, not cache, and a row of MXFP4 blocks is 1.5 KB: the hardware's stream
// prefetcher stops at every 4 KB page and waits to see a new stream start, so without a hint the
// products wait on memory for most of each page (gpt-oss-20b's expert products ran at a fifth of
// their in-cache speed). Rows are contiguous, so the hint runs on into the next rows.
constexpr int64_t kPrefetchAhead = 2048;
inline void prefetch_ahead(const uint8_t* p) { __builtin_prefetch(p + kPrefetchAhead, 0, 3); }

// A run's 32 values, scalar: scale * table[code].
template <class R>
inline void widen_run(const uint8_t* q, float s, float* y) {
  for (int j = 0; j < 16; ++j) {
    y[j] = s * static_cast<float>(R::table[q[j] & 0x0F]);
    y[j + 16] = s * static_cast<float>(R::table[q[j] >> 4]);
  }
}

#if defined(__AVX2__) && defined(__FMA__)
#define PAGELLM_CODEBOOK_VEC 1
// A run's 32 table values as signed bytes, in value order: the low nibbles, then the high ones.
template <class R>
inline __m256i run_values(const uint8_t* q) {
  const __m128i table = _mm_load_si128(reinterpret_cast<const __m128i*>(R::table));
  const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(codes, mask));
  const __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(codes, 4), mask));
  return _mm256_set_m128i(hi, lo);
}

inline float reduce_add8(__m256 v) {
  const __m128 pairs = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 quads = _mm_add_ps(pairs, _mm_movehl_ps(pairs, pairs));
  return _mm_cvtss_f32(_mm_add_ss(quads, _mm_movehdup_ps(quads)));
}

#if defined(__AVX512F__)
// Rows of x per pass over a row of W: 8 rows x 2 accumulators + 2 values in AVX-512's 32 registers.
constexpr int kGroup = 8, kLanes = 16, kVecs = 2;
using VF = __m512;
inline VF vzero() { return _mm512_setzero_ps(); }
inline VF vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, VF v) { _mm512_storeu_ps(p, v); }
inline VF vfmadd(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
inline float vreduce(VF a, VF b) { return _mm512_reduce_add_ps(_mm512_add_ps(a, b)); }
inline void widen(__m256i v, float s, VF* w) {
  const VF scale = _mm512_set1_ps(s);
  w[0] = _mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v))));
  w[1] = _mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1))));
}
#else
// AVX2's 16 registers: 4 rows x 2 accumulators + 4 values.
constexpr int kGroup = 4, kLanes = 8, kVecs = 4;
using VF = __m256;
inline VF vzero() { return _mm256_setzero_ps(); }
inline VF vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, VF v) { _mm256_storeu_ps(p, v); }
inline VF vfmadd(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
inline float vreduce(VF a, VF b) { return reduce_add8(_mm256_add_ps(a, b)); }
inline void widen(__m256i v, float s, VF* w) {
  const VF scale = _mm256_set1_ps(s);
  const __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
  w[0] = _mm256_mul_ps(scale, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)));
  w[1] = _mm256_mul_ps(scale, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))));
  w[2] = _mm256_mul_ps(scale, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)));
  w[3] = _mm256_mul_ps(scale, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))));
}
#endif

// Rows [n0, n1) of y = x @ W^T for M <= kGroup rows of x. Two accumulators per row of x,
// alternating over the run's vectors: the same chains, so the same sums, whatever M is.
template <class R, int M>
void float_rows(const float* x, int64_t K, const uint8_t* w, int64_t row_bytes, float* y, int64_t N, int64_t n0,
                int64_t n1) {
  float s[kMaxRunsPerBlock];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    VF acc[M][2];
    for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = vzero();
    for (int64_t b = 0; b < K / R::kBlockValues; ++b) {
      const uint8_t* block = row + b * R::kBlockBytes;
      prefetch_ahead(block);
      R::scales(block, s);
      for (int j = 0; j < R::kBlockValues / kRun; ++j) {
        VF wv[kVecs];
        widen(run_values<R>(R::codes(block, j)), s[j], wv);
        const float* xr = x + b * R::kBlockValues + j * kRun;
        for (int m = 0; m < M; ++m)
          for (int v = 0; v < kVecs; ++v)
            acc[m][v % 2] = vfmadd(wv[v], vload(xr + m * K + v * kLanes), acc[m][v % 2]);
      }
    }
    for (int m = 0; m < M; ++m) y[m * N + n] = vreduce(acc[m][0], acc[m][1]);
  }
}
#else
constexpr int kGroup = 8;
// Portable loops: one partial sum per run, added in order.
template <class R, int M>
void float_rows(const float* x, int64_t K, const uint8_t* w, int64_t row_bytes, float* y, int64_t N, int64_t n0,
                int64_t n1) {
  float vals[kRun];
  float s[kMaxRunsPerBlock];
  for (int64_t n = n0; n < n1; ++n) {
    float acc[M] = {};
    for (int64_t b = 0; b < K / R::kBlockValues; ++b) {
      const uint8_t* block = w + n * row_bytes + b * R::kBlockBytes;
      R::scales(block, s);
      for (int j = 0; j < R::kBlockValues / kRun; ++j) {
        widen_run<R>(R::codes(block, j), s[j], vals);
        const float* xr = x + b * R::kBlockValues + j * kRun;
        for (int m = 0; m < M; ++m) {
          float part = 0.f;
          for (int i = 0; i < kRun; ++i) part += vals[i] * xr[m * K + i];
          acc[m] += part;
        }
      }
    }
    for (int m = 0; m < M; ++m) y[m * N + n] = acc[m];
  }
}
#endif

// A row of K values as float32 into y (the same products as widen_run, a vector at a time).
template <class R>
void widen_row(const uint8_t* row, int64_t K, float* y) {
  float s[kMaxRunsPerBlock];
  for (int64_t b = 0; b < K / R::kBlockValues; ++b) {
    const uint8_t* block = row + b * R::kBlockBytes;
    R::scales(block, s);
    for (int j = 0; j < R::kBlockValues / kRun; ++j) {
      float* dst = y + b * R::kBlockValues + j * kRun;
#if defined(PAGELLM_CODEBOOK_VEC)
      VF wv[kVecs];
      widen(run_values<R>(R::codes(block, j)), s[j], wv);
      for (int v = 0; v < kVecs; ++v) vstore(dst + v * kLanes, wv[v]);
#else
      widen_run<R>(R::codes(block, j), s[j], dst);
#endif
    }
  }
}

template <class R>
void float_product(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes, float* y, int64_t N,
                   int64_t n0, int64_t n1) {
  // Rows of W a few at a time through every group of x's rows, so a group after the first reads
  // them from L1/L2 instead of memory.
  constexpr int64_t kRowsPerPass = 16;
  for (int64_t p0 = n0; p0 < n1; p0 += kRowsPerPass) {
    const int64_t p1 = std::min(n1, p0 + kRowsPerPass);
    for (int64_t m0 = 0; m0 < M; m0 += kGroup) {
      const float* xm = x + m0 * K;
      float* ym = y + m0 * N;
      switch (std::min<int64_t>(kGroup, M - m0)) {
        case 1: float_rows<R, 1>(xm, K, w, row_bytes, ym, N, p0, p1); break;
        case 2: float_rows<R, 2>(xm, K, w, row_bytes, ym, N, p0, p1); break;
        case 3: float_rows<R, 3>(xm, K, w, row_bytes, ym, N, p0, p1); break;
#if defined(__AVX512F__) || !defined(PAGELLM_CODEBOOK_VEC)
        case 4: float_rows<R, 4>(xm, K, w, row_bytes, ym, N, p0, p1); break;
        case 5: float_rows<R, 5>(xm, K, w, row_bytes, ym, N, p0, p1); break;
        case 6: float_rows<R, 6>(xm, K, w, row_bytes, ym, N, p0, p1); break;
        case 7: float_rows<R, 7>(xm, K, w, row_bytes, ym, N, p0, p1); break;
        default: float_rows<R, 8>(xm, K, w, row_bytes, ym, N, p0, p1); break;
#else
        default: float_rows<R, 4>(xm, K, w, row_bytes, ym, N, p0, p1); break;
#endif
      }
    }
  }
}

#if defined(PAGELLM_CODEBOOK_VEC)
// ---- int8 activations ----------------------------------------------------------------------
// x [M, K] rounded per 32 values: c = round(x * 127 / max|x|) (half to even); with two codes
// also r = round(128 * (x * 127 / max|x| - c)) (the difference as one FMA rounds it), so
// x ~ d * (c + r / 128) with d = max|x| / 127. One code: `codes` c. Two: `wide` 128 c + r in 16
// bits (|128 c + r| <= 16320), multiplied by the table values widened to 16 bits with one
// VPMADDWD per 16 values, which two byte products per code and a shift cost more than. `scale`
// holds d (d / 128 with two codes). A run holding a NaN gets scale NaN, so its row of y is NaN
// rather than a finite number from codes that mean nothing.
struct Rounded {
  std::vector<int8_t> codes;
  std::vector<int16_t> wide;
  std::vector<float> scale;
};

Rounded round_activations(const float* x, int64_t M, int64_t K, bool two) {
  Rounded a;
  if (two) a.wide.resize(M * K);
  else a.codes.resize(M * K);
  a.scale.resize(M * K / kRun);
  at::parallel_for(0, M * K / kRun, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* v = x + r * kRun;
      float amax = 0.f;
      bool nan = false;
      for (int i = 0; i < kRun; ++i) {
        amax = std::max(amax, std::fabs(v[i]));
        nan |= std::isnan(v[i]);
      }
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      const float d = nan ? std::numeric_limits<float>::quiet_NaN() : amax / 127.f;
      a.scale[r] = two ? d / 128.f : d;
      for (int i = 0; i < kRun; ++i) {
        const float c = nan ? 0.f : std::nearbyint(v[i] * inv);
        if (!two) {
          a.codes[r * kRun + i] = static_cast<int8_t>(c);
          continue;
        }
        const float residual = nan ? 0.f : std::nearbyint(std::fma(v[i], inv, -c) * 128.f);
        a.wide[r * kRun + i] = static_cast<int16_t>(128 * static_cast<int>(c) + static_cast<int>(residual));
      }
    }
  });
  return a;
}

inline __m256i load32(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline __m256i load16x16(const int16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// Per pair of values, sum(w * x16) for a run's 32 table values w (bytes) and 32 16-bit x16, as 8
// int32 lanes.
struct Wide {
#if defined(__AVX512BW__)
  __m512i w;
  explicit Wide(__m256i v) : w(_mm512_cvtepi8_epi16(v)) {}
  __m256i dot(const int16_t* x) const {
    const __m512i d = _mm512_madd_epi16(w, _mm512_loadu_si512(x));
    return _mm256_add_epi32(_mm512_castsi512_si256(d), _mm512_extracti64x4_epi64(d, 1));
  }
#else
  __m256i lo, hi;
  explicit Wide(__m256i v)
      : lo(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(v))), hi(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1))) {}
  __m256i dot(const int16_t* x) const {
    return _mm256_add_epi32(_mm256_madd_epi16(lo, load16x16(x)), _mm256_madd_epi16(hi, load16x16(x + 16)));
  }
#endif
};

// Per 4-value lane, sum(|w| * (c with w's sign)) = sum(w * c).
inline __m256i dot4(__m256i aw, __m256i signed_c) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), aw, signed_c);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(aw, signed_c), _mm256_set1_epi16(1));
#endif
}

template <class R, int M, bool kTwo>
void int8_rows(const Rounded& a, int64_t m0, int64_t K, const uint8_t* w, int64_t row_bytes, float* y, int64_t N,
               int64_t n0, int64_t n1) {
  float s[kMaxRunsPerBlock];
  const int8_t* codes = kTwo ? nullptr : a.codes.data() + m0 * K;
  const int16_t* wide = kTwo ? a.wide.data() + m0 * K : nullptr;
  const float* scale = a.scale.data() + m0 * K / kRun;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    __m256 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < K / R::kBlockValues; ++b) {
      const uint8_t* block = row + b * R::kBlockBytes;
      prefetch_ahead(block);
      R::scales(block, s);
      for (int j = 0; j < R::kBlockValues / kRun; ++j) {
        const __m256i wv = run_values<R>(R::codes(block, j));
        const int64_t run = b * (R::kBlockValues / kRun) + j;
        if constexpr (kTwo) {
          const Wide w16(wv);
          for (int m = 0; m < M; ++m)
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(w16.dot(wide + m * K + run * kRun)),
                                     _mm256_set1_ps(s[j] * scale[m * K / kRun + run]), acc[m]);
          continue;
        }
        const __m256i aw = _mm256_sign_epi8(wv, wv);
        for (int m = 0; m < M; ++m) {
          const __m256i dot = dot4(aw, _mm256_sign_epi8(load32(codes + m * K + run * kRun), wv));
          acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(s[j] * scale[m * K / kRun + run]), acc[m]);
        }
      }
    }
    for (int m = 0; m < M; ++m) y[m * N + n] = reduce_add8(acc[m]);
  }
}

template <class R, bool kTwo>
void int8_product(const Rounded& a, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes, float* y, int64_t N,
                  int64_t n0, int64_t n1) {
  constexpr int64_t kRowsPerPass = 16, kRows = 8;
  for (int64_t p0 = n0; p0 < n1; p0 += kRowsPerPass) {
    const int64_t p1 = std::min(n1, p0 + kRowsPerPass);
    for (int64_t m0 = 0; m0 < M; m0 += kRows) {
      float* ym = y + m0 * N;
      switch (std::min<int64_t>(kRows, M - m0)) {
        case 1: int8_rows<R, 1, kTwo>(a, m0, K, w, row_bytes, ym, N, p0, p1); break;
        case 2: int8_rows<R, 2, kTwo>(a, m0, K, w, row_bytes, ym, N, p0, p1); break;
        case 3: int8_rows<R, 3, kTwo>(a, m0, K, w, row_bytes, ym, N, p0, p1); break;
        case 4: int8_rows<R, 4, kTwo>(a, m0, K, w, row_bytes, ym, N, p0, p1); break;
        case 5: int8_rows<R, 5, kTwo>(a, m0, K, w, row_bytes, ym, N, p0, p1); break;
        case 6: int8_rows<R, 6, kTwo>(a, m0, K, w, row_bytes, ym, N, p0, p1); break;
        case 7: int8_rows<R, 7, kTwo>(a, m0, K, w, row_bytes, ym, N, p0, p1); break;
        default: int8_rows<R, 8, kTwo>(a, m0, K, w, row_bytes, ym, N, p0, p1); break;
      }
    }
  }
}
#endif  // PAGELLM_CODEBOOK_VEC

// Calls f(Runs{}) with the trait of `qtype`.
template <class F>
auto by_type(int64_t qtype, F f) {
  switch (qtype) {
    case MXFP4: return f(Mxfp4Runs{});
    case IQ4_NL: return f(Iq4NlRuns{});
    case IQ4_XS: return f(Iq4XsRuns{});
  }
  TORCH_CHECK(false, "GGUF type ", qtype, " is not MXFP4, IQ4_NL or IQ4_XS");
}

void check_weight(const torch::Tensor& w, int64_t qtype, int64_t K) {
  by_type(qtype, [&](auto r) {
    using R = decltype(r);
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(),
                "quantized weight: a contiguous uint8 [rows, row_bytes] tensor expected");
    TORCH_CHECK(K % R::kBlockValues == 0 && w.size(1) == K / R::kBlockValues * R::kBlockBytes,
                "quantized weight: ", w.size(1), " bytes per row do not hold ", K, " values of type ", qtype);
    return 0;
  });
}

torch::Tensor float_x(const torch::Tensor& x, int64_t K, const char* who) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, who, ": x must be [M, ", K, "]");
  return x.to(torch::kFloat32).contiguous();
}
}  // namespace

// x: [M, K]; w: [N, row_bytes] blocks of `qtype`. Returns x @ W^T: [M, N] float32.
torch::Tensor codebook_matmul(const torch::Tensor& x_in, const torch::Tensor& w, int64_t qtype, int64_t K) {
  check_weight(w, qtype, K);
  const torch::Tensor x = float_x(x_in, K, "codebook_matmul");
  const int64_t M = x.size(0), N = w.size(0), row_bytes = w.size(1);
  torch::Tensor y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  by_type(qtype, [&](auto r) {
    using R = decltype(r);
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) { float_product<R>(xp, M, K, wp, row_bytes, yp, N, n0, n1); });
    return 0;
  });
  return y;
}

// x @ W^T with x rounded to one int8 code per value, or two (`two_terms`), per 32 values.
torch::Tensor codebook_matmul_int8(const torch::Tensor& x_in, const torch::Tensor& w, int64_t qtype, int64_t K,
                                   bool two_terms) {
#if defined(PAGELLM_CODEBOOK_VEC)
  check_weight(w, qtype, K);
  const torch::Tensor x = float_x(x_in, K, "codebook_matmul_int8");
  const int64_t M = x.size(0), N = w.size(0), row_bytes = w.size(1);
  torch::Tensor y = torch::empty({M, N}, x.options());
  const Rounded a = round_activations(x.data_ptr<float>(), M, K, two_terms);
  float* yp = y.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  by_type(qtype, [&](auto r) {
    using R = decltype(r);
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      if (two_terms) int8_product<R, true>(a, M, K, wp, row_bytes, yp, N, n0, n1);
      else int8_product<R, false>(a, M, K, wp, row_bytes, yp, N, n0, n1);
    });
    return 0;
  });
  return y;
#else
  TORCH_CHECK(false, "codebook_matmul_int8 needs AVX2, which this build lacks");
#endif
}

// Rows `rows` (int64 [R]) as dense [R, K] rows of float32 or bfloat16.
torch::Tensor codebook_dequantize_rows(const torch::Tensor& w, int64_t qtype, int64_t K, const torch::Tensor& rows_in,
                                       torch::ScalarType dtype) {
  check_weight(w, qtype, K);
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16, "codebook_dequantize_rows: float32 or bfloat16");
  const torch::Tensor rows = rows_in.to(torch::kInt64).contiguous();
  const int64_t R = rows.numel(), N = w.size(0), row_bytes = w.size(1);
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) TORCH_CHECK(rp[r] >= 0 && rp[r] < N, "row ", rp[r], " out of range [0, ", N, ")");
  torch::Tensor out = torch::empty({R, K}, w.options().dtype(dtype));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  by_type(qtype, [&](auto t) {
    using Runs = decltype(t);
    at::parallel_for(0, R, 4, [&](int64_t r0, int64_t r1) {
      std::vector<float> buf(dtype == torch::kFloat32 ? 0 : K);
      for (int64_t r = r0; r < r1; ++r) {
        const uint8_t* row = wp + rp[r] * row_bytes;
        if (dtype == torch::kFloat32) {
          widen_row<Runs>(row, K, out.data_ptr<float>() + r * K);
        } else {
          widen_row<Runs>(row, K, buf.data());
          at::BFloat16* dst = out.data_ptr<at::BFloat16>() + r * K;
          for (int64_t i = 0; i < K; ++i) dst[i] = static_cast<at::BFloat16>(buf[i]);
        }
      }
    });
    return 0;
  });
  return out;
}

// The kernels run without the GIL (as torch's own operators do): a server's event loop thread
// streams its responses while a step's products and attention run, instead of waiting for them.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("codebook_matmul", &codebook_matmul, "x @ W^T with W in MXFP4 / IQ4_NL / IQ4_XS blocks (CPU, float32)",
        py::call_guard<py::gil_scoped_release>());
  m.def("codebook_matmul_int8", &codebook_matmul_int8,
        "x @ W^T with W in MXFP4 / IQ4_NL / IQ4_XS blocks and x rounded to int8 codes (CPU, AVX2)",
        py::arg("x"), py::arg("w"), py::arg("qtype"), py::arg("K"), py::arg("two_terms") = false,
        py::call_guard<py::gil_scoped_release>());
  m.def("codebook_dequantize_rows", &codebook_dequantize_rows, "chosen rows of an MXFP4 / IQ4_NL / IQ4_XS matrix",
        py::call_guard<py::gil_scoped_release>());
#if defined(PAGELLM_CODEBOOK_VEC)
  m.attr("has_int8_activations") = true;
#else
  m.attr("has_int8_activations") = false;
#endif
}

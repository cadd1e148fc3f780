// Matrix products that read GGUF-quantized weights in their blocks (CPU).
//
// A weight is stored as llama.cpp stores it: [N rows] x [row_bytes], each row a run of blocks
// of 32 (Q4_0, Q4_1, Q8_0) or 256 (Q4_K, Q5_K, Q6_K) values with their scales. Nothing here
// ever holds the dense [N, K] matrix:
//
// - gguf_matmul: y = x @ W^T, for a few rows of x (decode steps), or any number of rows in
//   batch-invariant mode, which also brings dense F32 / F16 / BF16 weights here. Each thread
//   takes a range of W's rows; a block is widened to float32 in a small on-stack buffer (L1) and
//   multiplied into one accumulator per row of x while it is hot, so W streams from memory once
//   per step whatever the batch. The arithmetic is float32 (no activation rounding), so the
//   product equals the dense float32 one up to summation order, and that order is the same for
//   every row of x whatever the number of rows.
// - gguf_matmul_int8: the same product with x rounded to one or two int8 codes per value, on
//   AVX-512 VNNI (see "int8 activations" below), and on AMX's int8 tiles for products of many rows
//   of x where the CPU has them (see "AMX tiles").
// - gguf_dequantize_rows: chosen rows of W as dense float32 or bfloat16 rows: the token
//   embedding's lookup, and a tile of W for larger batches, where the Python side multiplies
//   tile by tile with torch's GEMM (compute-bound there, so widening a tile costs little).
//
// The block layouts (and their dequantization formulas) are ggml's; the tests check every
// type against gguf-py's reference dequantization.
#include <torch/extension.h>
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

// The integer kernels' instruction sets ("int8 activations" below): AVX-512 VNNI, else AVX2; and
// AMX tiles beside VNNI. Defined up here because the repacked layouts (repacked_id) depend on them.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define PAGELLM_INT8_VNNI 1
#define PAGELLM_INT8_ACTIVATIONS 1
#elif defined(__AVX2__) && defined(__FMA__)
#define PAGELLM_INT8_ACTIVATIONS 1
#endif
#if defined(PAGELLM_INT8_VNNI) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define PAGELLM_AMX 1
#endif

namespace {

// GGML type ids (gguf.GGMLQuantizationType). F32, F16 and BF16 are dense rows in the same
// kernel: batch-invariant mode multiplies dense weights here too, for its fixed summation order.
enum : int64_t { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30 };
constexpr int QK_K = 256;

// A block's float16 scale. The F16C instruction where the CPU has it: c10's portable conversion
// is ~20 integer operations, and a Q4_1 block of 32 values has two of these scales.
inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return c10::detail::fp16_ieee_to_fp32_value(bits);
#endif
}

// ---- one block -> float32 -------------------------------------------------------------------
void dequant_q4_0(const uint8_t* b, float* y) {
  const float d = half_at(b);
  const uint8_t* qs = b + 2;
  for (int j = 0; j < 16; ++j) {
    y[j] = static_cast<float>((qs[j] & 0x0F) - 8) * d;
    y[j + 16] = static_cast<float>((qs[j] >> 4) - 8) * d;
  }
}

void dequant_q4_1(const uint8_t* b, float* y) {
  const float d = half_at(b), m = half_at(b + 2);
  const uint8_t* qs = b + 4;
  for (int j = 0; j < 16; ++j) {
    y[j] = static_cast<float>(qs[j] & 0x0F) * d + m;
    y[j + 16] = static_cast<float>(qs[j] >> 4) * d + m;
  }
}

// Dense 16-bit blocks of 32 values, widened.
void dequant_f16(const uint8_t* b, float* y) {
  for (int j = 0; j < 32; ++j) y[j] = half_at(b + 2 * j);
}

void dequant_bf16(const uint8_t* b, float* y) {
  for (int j = 0; j < 32; ++j) {
    uint16_t bits;
    std::memcpy(&bits, b + 2 * j, 2);
    const uint32_t wide = static_cast<uint32_t>(bits) << 16;
    std::memcpy(y + j, &wide, 4);
  }
}

void dequant_q8_0(const uint8_t* b, float* y) {
  const float d = half_at(b);
  const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
  for (int j = 0; j < 32; ++j) y[j] = static_cast<float>(qs[j]) * d;
}

// The 6-bit scale and min of sub-block j (0..7) of a Q4_K / Q5_K super-block.
inline void scale_min_k4(int j, const uint8_t* q, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// The inverse of scale_min_k4 over a super-block: 8 scales and 8 mins (6 bits each) packed into
// GGUF's 12 bytes q (every bit of which scale_min_k4 reads, so the bytes come back as they were).
inline void k4_pack_scales(const uint8_t* sc, const uint8_t* m, uint8_t* q) {
  for (int j = 0; j < 4; ++j) {
    q[j] = static_cast<uint8_t>(sc[j] | (sc[j + 4] >> 4) << 6);
    q[j + 4] = static_cast<uint8_t>(m[j] | (m[j + 4] >> 4) << 6);
    q[j + 8] = static_cast<uint8_t>((sc[j + 4] & 0x0F) | (m[j + 4] & 0x0F) << 4);
  }
}

// Sub-blocks 2j and 2j + 1 of a Q4_K / Q5_K super-block `b`, which share 32 bytes of quants
// (low and high nibbles): value = d1 * q - m1 in the first, d2 * q - m2 in the second.
struct PairScales {
  float d1, m1, d2, m2;
};

inline PairScales pair_scales_k4(const uint8_t* b, int j) {
  const float d = half_at(b), dmin = half_at(b + 2);
  uint8_t sc1, m1, sc2, m2;
  scale_min_k4(2 * j, b + 4, &sc1, &m1);
  scale_min_k4(2 * j + 1, b + 4, &sc2, &m2);
  return {d * sc1, dmin * m1, d * sc2, dmin * m2};
}

void dequant_q4_k(const uint8_t* b, float* y) {
  const uint8_t* q = b + 16;
  for (int j = 0; j < 4; ++j) {  // 64 values: two sub-blocks sharing 32 bytes (low, high nibbles)
    const auto [d1, m1, d2, m2] = pair_scales_k4(b, j);
    for (int l = 0; l < 32; ++l) y[l] = d1 * static_cast<float>(q[l] & 0x0F) - m1;
    for (int l = 0; l < 32; ++l) y[l + 32] = d2 * static_cast<float>(q[l] >> 4) - m2;
    q += 32;
    y += 64;
  }
}

void dequant_q5_k(const uint8_t* b, float* y) {
  const uint8_t* qh = b + 16;
  const uint8_t* ql = b + 48;
  for (int j = 0; j < 4; ++j) {
    const auto [d1, m1, d2, m2] = pair_scales_k4(b, j);
    const int lo = 2 * j, hi = 2 * j + 1;  // the bit of qh that holds each value's fifth bit
    for (int l = 0; l < 32; ++l)
      y[l] = d1 * static_cast<float>((ql[l] & 0x0F) | (((qh[l] >> lo) & 1) << 4)) - m1;
    for (int l = 0; l < 32; ++l)
      y[l + 32] = d2 * static_cast<float>((ql[l] >> 4) | (((qh[l] >> hi) & 1) << 4)) - m2;
    ql += 32;
    y += 64;
  }
}

void dequant_q6_k(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half_at(b + 208);
  for (int half = 0; half < 2; ++half) {  // 128 values: 64 bytes of low bits, 32 of high bits
    for (int l = 0; l < 32; ++l) {
      const int is = l / 16;
      const int q1 = ((ql[l] & 0x0F) | (((qh[l] >> 0) & 3) << 4)) - 32;
      const int q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32;
      const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
      const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      y[l] = d * sc[is] * static_cast<float>(q1);
      y[l + 32] = d * sc[is + 2] * static_cast<float>(q2);
      y[l + 64] = d * sc[is + 4] * static_cast<float>(q3);
      y[l + 96] = d * sc[is + 6] * static_cast<float>(q4);
    }
    y += 128;
    ql += 64;
    qh += 32;
    sc += 8;
  }
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define PAGELLM_VEC_DEQUANT 1
// The same dequantizations, a vector at a time: a block is unpacked 16 codes at a time with a few
// shifts and masks on 128-bit lanes and widened once, instead of value by value. (x >> s) & mask
// on 16-bit lanes is per-byte exact here: every mask keeps bits below 8 - s. Each value takes the
// same arithmetic as in the scalar code (one product, or one FMA whose product is exact), so the
// same floats. AVX-512 widens 16 codes into one vector, AVX2 (most desktop CPUs; AMD's before
// Zen 4) into two of 8: VF and store16 below are the one place the two differ.
// The sum of v's 8 lanes, in one fixed order.
inline float reduce_add8(__m256 v) {
  const __m128 pairs = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 quads = _mm_add_ps(pairs, _mm_movehl_ps(pairs, pairs));
  return _mm_cvtss_f32(_mm_add_ss(quads, _mm_movehdup_ps(quads)));
}
#if defined(__AVX512F__)
using VF = __m512;
constexpr int kLanes = 16;
inline VF vzero() { return _mm512_setzero_ps(); }
inline VF vload(const float* p) { return _mm512_loadu_ps(p); }
inline VF vadd(VF a, VF b) { return _mm512_add_ps(a, b); }
inline float vreduce(VF v) { return _mm512_reduce_add_ps(v); }
inline VF vset1(float a) { return _mm512_set1_ps(a); }
inline VF vmul(VF a, VF b) { return _mm512_mul_ps(a, b); }
inline VF vsub(VF a, VF b) { return _mm512_sub_ps(a, b); }
inline VF vfmadd(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
inline VF vfmsub(VF a, VF b, VF c) { return _mm512_fmsub_ps(a, b, c); }
// The 16 bytes of v as float32 (unsigned, or kSigned), mapped by f, stored at y[0..16).
template <bool kSigned = false, class F>
inline void store16(float* y, __m128i v, F f) {
  _mm512_storeu_ps(y, f(_mm512_cvtepi32_ps(kSigned ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v))));
}
// 16 bfloat16 values at b as float32 at y.
inline void widen_bf16_16(const uint8_t* b, float* y) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
  _mm512_storeu_ps(y, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
}
#define VEC(f) f##_avx
#else
using VF = __m256;
constexpr int kLanes = 8;
inline VF vzero() { return _mm256_setzero_ps(); }
inline VF vload(const float* p) { return _mm256_loadu_ps(p); }
inline VF vadd(VF a, VF b) { return _mm256_add_ps(a, b); }
inline float vreduce(VF v) { return reduce_add8(v); }
inline VF vset1(float a) { return _mm256_set1_ps(a); }
inline VF vmul(VF a, VF b) { return _mm256_mul_ps(a, b); }
inline VF vsub(VF a, VF b) { return _mm256_sub_ps(a, b); }
inline VF vfmadd(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
inline VF vfmsub(VF a, VF b, VF c) { return _mm256_fmsub_ps(a, b, c); }
template <bool kSigned = false, class F>
inline void store16(float* y, __m128i v, F f) {
  const __m128i hi = _mm_unpackhi_epi64(v, v);
  _mm256_storeu_ps(y, f(_mm256_cvtepi32_ps(kSigned ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v))));
  _mm256_storeu_ps(y + 8, f(_mm256_cvtepi32_ps(kSigned ? _mm256_cvtepi8_epi32(hi) : _mm256_cvtepu8_epi32(hi))));
}
inline void widen_bf16_16(const uint8_t* b, float* y) {
  for (int i = 0; i < 16; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2 * i));
    _mm256_storeu_ps(y + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
  }
}
#define VEC(f) f##_avx2
#endif
inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline __m128i shr(__m128i v, int s) { return _mm_srli_epi16(v, s); }
inline __m128i and8(__m128i v, int m) { return _mm_and_si128(v, _mm_set1_epi8(static_cast<char>(m))); }

void VEC(dequant_q4_0)(const uint8_t* b, float* y) {
  const VF d = vset1(half_at(b)), eight = vset1(8.f);
  const __m128i q = load16(b + 2);
  const auto f = [&](VF v) { return vmul(vsub(v, eight), d); };
  store16(y, and8(q, 0x0F), f);
  store16(y + 16, and8(shr(q, 4), 0x0F), f);
}

void VEC(dequant_q4_1)(const uint8_t* b, float* y) {
  const VF d = vset1(half_at(b)), m = vset1(half_at(b + 2));
  const __m128i q = load16(b + 4);
  const auto f = [&](VF v) { return vfmadd(v, d, m); };
  store16(y, and8(q, 0x0F), f);
  store16(y + 16, and8(shr(q, 4), 0x0F), f);
}

void VEC(dequant_bf16)(const uint8_t* b, float* y) {
  widen_bf16_16(b, y);
  widen_bf16_16(b + 32, y + 16);
}

void VEC(dequant_q8_0)(const uint8_t* b, float* y) {
  const VF d = vset1(half_at(b));
  const auto f = [&](VF v) { return vmul(v, d); };
  store16<true>(y, load16(b + 2), f);
  store16<true>(y + 16, load16(b + 18), f);
}

// Q4_K and Q5_K: the same super-block of 8 scaled sub-blocks; Q5_K adds each value's fifth
// bit from 32 bytes of high bits (bit 2j / 2j + 1 of qh for sub-blocks 2j / 2j + 1).
template <bool kFifthBit>
void dequant_k4_vec(const uint8_t* b, float* y) {
  const uint8_t* qh = b + 16;  // Q5_K only
  const uint8_t* q = b + (kFifthBit ? 48 : 16);
  for (int j = 0; j < 4; ++j, q += 32, y += 64) {
    const PairScales s = pair_scales_k4(b, j);
    const VF d1 = vset1(s.d1), m1 = vset1(s.m1), d2 = vset1(s.d2), m2 = vset1(s.m2);
    for (int h = 0; h < 2; ++h) {
      const __m128i v = load16(q + 16 * h);
      __m128i lo = and8(v, 0x0F), hi = and8(shr(v, 4), 0x0F);
      if constexpr (kFifthBit) {
        const __m128i hb = load16(qh + 16 * h);
        lo = _mm_or_si128(lo, _mm_slli_epi16(and8(shr(hb, 2 * j), 1), 4));
        hi = _mm_or_si128(hi, _mm_slli_epi16(and8(shr(hb, 2 * j + 1), 1), 4));
      }
      store16(y + 16 * h, lo, [&](VF u) { return vfmsub(d1, u, m1); });
      store16(y + 32 + 16 * h, hi, [&](VF u) { return vfmsub(d2, u, m2); });
    }
  }
}

void VEC(dequant_q4_k)(const uint8_t* b, float* y) { dequant_k4_vec<false>(b, y); }
void VEC(dequant_q5_k)(const uint8_t* b, float* y) { dequant_k4_vec<true>(b, y); }

void VEC(dequant_q6_k)(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half_at(b + 208);
  const VF off = vset1(32.f);
  for (int half = 0; half < 2; ++half, y += 128, ql += 64, qh += 32, sc += 8) {
    for (int l = 0; l < 32; l += 16) {
      const __m128i a = load16(ql + l), c = load16(ql + l + 32), h = load16(qh + l);
      const int is = l / 16;
      const __m128i q[4] = {_mm_or_si128(and8(a, 0x0F), _mm_slli_epi16(and8(h, 3), 4)),
                            _mm_or_si128(and8(c, 0x0F), _mm_slli_epi16(and8(shr(h, 2), 3), 4)),
                            _mm_or_si128(and8(shr(a, 4), 0x0F), _mm_slli_epi16(and8(shr(h, 4), 3), 4)),
                            _mm_or_si128(and8(shr(c, 4), 0x0F), _mm_slli_epi16(and8(shr(h, 6), 3), 4))};
      for (int k = 0; k < 4; ++k) {
        const VF scale = vset1(d * sc[is + 2 * k]);
        store16(y + l + 32 * k, q[k], [&](VF v) { return vmul(scale, vsub(v, off)); });
      }
    }
  }
}
#else
#define VEC(f) f
#endif

struct Format {
  int block;        // values per block
  int bytes;        // bytes per block
  void (*dequant)(const uint8_t*, float*);  // nullptr: float32 values, read in place
};

Format format_of(int64_t qtype) {
  switch (qtype) {
    case F32: return {32, 128, nullptr};
    case F16: return {32, 64, dequant_f16};
    case BF16: return {32, 64, VEC(dequant_bf16)};
    case Q4_0: return {32, 18, VEC(dequant_q4_0)};
    case Q4_1: return {32, 20, VEC(dequant_q4_1)};
    case Q8_0: return {32, 34, VEC(dequant_q8_0)};
    case Q4_K: return {QK_K, 144, VEC(dequant_q4_k)};
    case Q5_K: return {QK_K, 176, VEC(dequant_q5_k)};
    case Q6_K: return {QK_K, 210, VEC(dequant_q6_k)};
  }
  TORCH_CHECK(false, "GGUF type ", qtype, " has no CPU kernel");
}

// Block b's values as float32: in place for F32, else widened into `tmp` (QK_K floats).
inline const float* block_values(const Format& f, const uint8_t* block, float* tmp) {
  if (f.dequant == nullptr) return reinterpret_cast<const float*>(block);
  f.dequant(block, tmp);
  return tmp;
}

// A row of K values as float32 into dst.
inline void widen_row(const Format& f, const uint8_t* row, int64_t K, float* dst) {
  for (int64_t b = 0; b < K / f.block; ++b) {
    const float* v = block_values(f, row + b * f.bytes, dst + b * f.block);
    if (v != dst + b * f.block) std::memcpy(dst + b * f.block, v, f.block * sizeof(float));
  }
}

Format checked(const torch::Tensor& w, int64_t qtype, int64_t K) {
  const Format f = format_of(qtype);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(),
              "quantized weight: a contiguous uint8 [rows, row_bytes] tensor expected");
  TORCH_CHECK(K % f.block == 0 && w.size(1) == K / f.block * f.bytes,
              "quantized weight: ", w.size(1), " bytes per row do not hold ", K, " values of type ", qtype);
  return f;
}

// ---- Q4_K / Q5_K / Q6_K repacked for one row of x ---------------------------------------------
// A decode step multiplies one row of x by every weight, and with GGUF's layout the integer
// kernels spend more time unpacking each super-block (6-bit packed scales, a row's codes in their
// own lanes, one reduction per row) than reading it. So at load the weights of a decode-bound
// model are repacked once, 8 rows at a time, into tiles of 8 rows x 256 values where one 64-byte
// load holds the same 8 bytes of codes of each of the 8 rows (as llama.cpp's block_q4_Kx8): an
// integer dot product against 8 bytes of x broadcast then sums 4 values of one row per 32-bit
// lane, two lanes a row, so no row needs a reduction until its last super-block, and the scales
// sit one byte per (sub-block, row), ready for a byte shuffle. Ids of our own, past GGML's:
enum : int64_t { Q4_0_X8 = 1002, Q4_1_X8 = 1003, Q8_0_X8 = 1008, Q4_K_X8 = 1012, Q5_K_X8 = 1013, Q6_K_X8 = 1014 };
constexpr int64_t kX8Rows = 8;
// Tile (8 rows x 256 values) offsets, in whole cache lines. A tile holds only what the kernels read:
// a decode step streams the tiles from memory, so each byte beyond the file's is time. A group goes
// back to GGUF's layout (products of more rows of x run the GGUF layout's kernels on it) from the
// same bytes: the scales' GGUF packing is rebuilt from their decoded values (k4_pack_scales).
// Q4_K: qs [16 units][8 rows][8 bytes] (unit p: the row's quant bytes 8p..8p+7), d [8] and dmin [8]
// (float16), sc [8 sub-blocks][8 rows] and m [8][8] (6-bit values, one byte each): 1216 bytes for
// 8 x 144 (1.06x).
constexpr int64_t kQ4Tile = 1216, kQ4D = 1024, kQ4Dmin = 1040, kQ4Sc = 1056, kQ4M = 1120;
// Q5_K: Q4_K's tile, then each value's fifth bit in qh [4 quarters][8 rows][8 bytes]: byte i of row r in
// quarter j holds, at bits 2q and 2q + 1, the fifth bits of the low and high nibbles of that row's byte i
// in unit 4j + q (one 64-byte load serves the quarter's 4 units, in their lanes): 1472 bytes for
// 8 x 176 (1.05x).
constexpr int64_t kQ5Tile = 1472, kQ5Qh = 1216;
// Q6_K: ql [16 units][8 rows][8 bytes], qh [8 units][8 rows][8 bytes], sc [16 groups][8 rows]
// (int8), d [8] (float16): 1728 bytes for 8 x 210 (1.03x).
constexpr int64_t kQ6Tile = 1728, kQ6Qh = 1024, kQ6Sc = 1536, kQ6D = 1664;
// Q4_1 (8 rows x 32 values, one block of each row): qs [2 units][8 rows][8 bytes] (unit p: the row's
// code bytes 8p..8p+7: values 8p.. in the low nibbles, 16 + 8p.. in the high), d [8] and m [8]
// (float16): 160 bytes for 8 x 20, the blocks' own bytes.
constexpr int64_t kQ41Tile = 160, kQ41D = 128, kQ41M = 144;
// Q4_0: Q4_1's tile without m (its w = d (u - 8) is Q4_1's d u + m with m = -8 d, which the kernels
// compute; exact in float32): 144 bytes for 8 x 18, the blocks' own bytes.
constexpr int64_t kQ40Tile = 144;
// Q8_0 (AVX-512 VNNI builds without AMX): qs [4 units][8 rows][8 bytes] (unit p: the row's codes
// 8p..8p+7, each stored + 128, so unsigned: u = w + 128, w = d u + m with m = -128 d, which Q4_1's
// kernel takes, its products of unsigned codes and signed x within 32 bits), d [8] (float16): 272
// bytes for 8 x 34, the blocks' own bytes. AVX2's 16-bit pair sums would overflow at 255 * 127 * 2.
constexpr int64_t kQ80Tile = 272, kQ80D = 256;

inline bool is_x8(int64_t qtype) {
  return qtype == Q4_0_X8 || qtype == Q4_1_X8 || qtype == Q8_0_X8 || qtype == Q4_K_X8 || qtype == Q5_K_X8 ||
         qtype == Q6_K_X8;
}
// The GGUF type whose kernels a layout takes: Q4_0's tiles take Q4_1's (and go back as Q4_1 blocks
// with m = -8 d), which its blocks' kernel trailed. (Q8_0's tiles, too, take Q4_1's row kernel; the
// rest of their products are Q8_0's.)
inline int64_t base_type(int64_t qtype) {
  return qtype == Q4_1_X8 || qtype == Q4_0_X8 ? Q4_1
         : qtype == Q8_0_X8                   ? Q8_0
         : qtype == Q4_K_X8                   ? Q4_K
         : qtype == Q5_K_X8                   ? Q5_K
         : qtype == Q6_K_X8                   ? Q6_K
                                              : qtype;
}
// Q8_0 repacks where its tile kernel runs (AVX-512 VNNI builds) and no AMX tiles take its blocks instead.
#if defined(PAGELLM_INT8_VNNI) && !defined(PAGELLM_AMX)
constexpr bool kRepacksQ80 = true;
#else
constexpr bool kRepacksQ80 = false;
#endif
inline int64_t repacked_id(int64_t qtype) {
  return qtype == Q4_0   ? Q4_0_X8
         : qtype == Q4_1 ? Q4_1_X8
         : qtype == Q8_0 ? (kRepacksQ80 ? Q8_0_X8 : 0)
         : qtype == Q4_K ? Q4_K_X8
         : qtype == Q5_K ? Q5_K_X8
         : qtype == Q6_K ? Q6_K_X8
                         : 0;
}
inline int64_t x8_tile(int64_t qtype) {  // a repacked id, or the GGUF type that repacks into it
  const int64_t id = is_x8(qtype) ? qtype : repacked_id(qtype);
  return id == Q4_0_X8   ? kQ40Tile
         : id == Q4_1_X8 ? kQ41Tile
         : id == Q8_0_X8 ? kQ80Tile
         : id == Q4_K_X8 ? kQ4Tile
         : id == Q5_K_X8 ? kQ5Tile
                         : kQ6Tile;
}
// How a weight that takes Q4_1's kernels lies: GGUF's blocks, Q4_1's tiles, Q4_0's (no m: -8 d) or
// Q8_0's (8-bit codes, no m: -128 d). The other types' kernels take it as whether the weight is
// repacked (kBlocks: false).
enum Layout : int { kBlocks = 0, kTiles = 1, kQ40Tiles = 2, kQ80Tiles = 3 };
inline Layout layout_of(int64_t packed) {
  return packed == Q4_0_X8 ? kQ40Tiles : packed == Q8_0_X8 ? kQ80Tiles : is_x8(packed) ? kTiles : kBlocks;
}
inline int64_t q41_tile_bytes(Layout x8) { return x8 == kQ40Tiles ? kQ40Tile : x8 == kQ80Tiles ? kQ80Tile : kQ41Tile; }
// The 8 rows' m of a Q4_1_X8 tile, or of a Q4_0_X8 one (-8 d: the value Q4_1_X8's float16 m held).
inline __m256 q41_tile_mins(const uint8_t* t, Layout x8) {
  const uint8_t* half = t + (x8 == kQ40Tiles ? kQ41D : kQ41M);
  const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(half)));
  return x8 == kQ40Tiles ? _mm256_mul_ps(v, _mm256_set1_ps(-8.f)) : v;
}
// Values of a row that one tile holds: a Q4_1 or Q8_0 block, a K-quant super-block.
inline int64_t x8_values(int64_t qtype) { return base_type(qtype) == Q4_1 || base_type(qtype) == Q8_0 ? 32 : QK_K; }

// Row n's Q4_1 block bl (rows of K values): d, m and its 16 bytes of codes, from GGUF's blocks or
// from a Q4_1_X8 or Q4_0_X8 tile, for the kernels that read Q4_1 a block at a time in any layout.
struct Q41Block {
  float d, m;
  __m128i codes;
};
inline Q41Block q4_1_block(const uint8_t* w, int64_t K, Layout x8, int64_t n, int64_t bl) {
  const int64_t blocks = K / 32;
  if (!x8) {
    const uint8_t* b = w + (n * blocks + bl) * 20;
    return {half_at(b), half_at(b + 2), _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4))};
  }
  const uint8_t* t = w + (n / kX8Rows * blocks + bl) * q41_tile_bytes(x8);
  const int r = static_cast<int>(n % kX8Rows);
  const float d = half_at(t + kQ41D + 2 * r);
  return {d, x8 == kQ40Tiles ? -8.f * d : half_at(t + kQ41M + 2 * r),
          _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(t + 8 * r)),
                             _mm_loadl_epi64(reinterpret_cast<const __m128i*>(t + 64 + 8 * r)))};
}

// Super-block b (Q4_1: block b) of GGUF rows src[0..8) (row_bytes apart) into `tile`, or back (kBack).
template <bool kBack>
void x8_tile_rows(int64_t qtype, uint8_t* src, int64_t row_bytes, int64_t b, uint8_t* tile) {
  // n a constant at each call, so each copy is one move (not a call to memcpy)
  const auto move = [](uint8_t* gguf, uint8_t* packed, auto n) {
    if (kBack) std::memcpy(gguf, packed, decltype(n)::value);
    else std::memcpy(packed, gguf, decltype(n)::value);
  };
  using B2 = std::integral_constant<size_t, 2>;
  using B4 = std::integral_constant<size_t, 4>;
  using B8 = std::integral_constant<size_t, 8>;
  if (!kBack) std::memset(tile, 0, x8_tile(qtype));
  for (int r = 0; r < kX8Rows; ++r) {
    if (qtype == Q4_0) {  // into a Q4_0_X8 tile: d and the codes
      const uint8_t* bl = src + r * row_bytes + b * 18;
      std::memcpy(tile + kQ41D + 2 * r, bl, 2);
      for (int p = 0; p < 2; ++p) std::memcpy(tile + 64 * p + 8 * r, bl + 2 + 8 * p, 8);
    } else if (kBack && qtype == Q4_0_X8) {  // as Q4_1 blocks (base_type), m = -8 d: exact in float16 (2^3 d)
      uint8_t* bl = src + r * row_bytes + b * 20;
      std::memcpy(bl, tile + kQ41D + 2 * r, 2);
      const uint16_t m = c10::Half(-8.f * half_at(bl)).x;
      std::memcpy(bl + 2, &m, 2);
      for (int p = 0; p < 2; ++p) std::memcpy(bl + 4 + 8 * p, tile + 64 * p + 8 * r, 8);
    } else if (base_type(qtype) == Q8_0) {  // codes + 128 (XOR of the sign bit), both ways
      uint8_t* bl = src + r * row_bytes + b * 34;
      move(bl, tile + kQ80D + 2 * r, B2{});
      for (int p = 0; p < 4; ++p) {
        uint8_t* gguf = bl + 2 + 8 * p;
        uint8_t* packed = tile + 64 * p + 8 * r;
        uint8_t *to = kBack ? gguf : packed, *from = kBack ? packed : gguf;
        for (int i = 0; i < 8; ++i) to[i] = static_cast<uint8_t>(from[i] ^ 0x80);
      }
    } else if (base_type(qtype) == Q4_1) {
      uint8_t* bl = src + r * row_bytes + b * 20;
      move(bl, tile + kQ41D + 2 * r, B2{});
      move(bl + 2, tile + kQ41M + 2 * r, B2{});
      for (int p = 0; p < 2; ++p) move(bl + 4 + 8 * p, tile + 64 * p + 8 * r, B8{});
    } else if (base_type(qtype) == Q4_K || base_type(qtype) == Q5_K) {
      const bool five = base_type(qtype) == Q5_K;
      uint8_t* sb = src + r * row_bytes + b * (five ? 176 : 144);
      move(sb, tile + kQ4D + 2 * r, B2{});
      move(sb + 2, tile + kQ4Dmin + 2 * r, B2{});
      for (int p = 0; p < 16; ++p) move(sb + (five ? 48 : 16) + 8 * p, tile + 64 * p + 8 * r, B8{});
      // Q5_K's qh: bit 2j of byte l is the fifth bit of the low nibble of qs byte 32 j + l, bit 2j + 1
      // the high one's; that byte is byte i = l % 8 of unit 4 j + q, q = l / 8 (see kQ5Qh)
      for (int j = 0; five && j < 4; ++j)
        for (int i = 0; i < 8; ++i) {
          uint8_t* packed = tile + kQ5Qh + 64 * j + 8 * r + i;
          if constexpr (kBack) {
            for (int q = 0; q < 4; ++q)
              sb[16 + 8 * q + i] = static_cast<uint8_t>((sb[16 + 8 * q + i] & ~(3 << 2 * j)) |
                                                        (((*packed >> 2 * q) & 3) << 2 * j));
          } else {
            for (int q = 0; q < 4; ++q) *packed |= static_cast<uint8_t>(((sb[16 + 8 * q + i] >> 2 * j) & 3) << 2 * q);
          }
        }
      if constexpr (kBack) {
        uint8_t sc[8], m[8];
        for (int j = 0; j < 8; ++j) sc[j] = tile[kQ4Sc + 8 * j + r], m[j] = tile[kQ4M + 8 * j + r];
        k4_pack_scales(sc, m, sb + 4);
      } else {
        for (int j = 0; j < 8; ++j) scale_min_k4(j, sb + 4, tile + kQ4Sc + 8 * j + r, tile + kQ4M + 8 * j + r);
      }
    } else {
      uint8_t* sb = src + r * row_bytes + b * 210;
      for (int p = 0; p < 16; ++p) move(sb + 8 * p, tile + 64 * p + 8 * r, B8{});
      for (int p = 0; p < 8; ++p) move(sb + 128 + 8 * p, tile + kQ6Qh + 64 * p + 8 * r, B8{});
      for (int g = 0; g < 16; ++g) move(sb + 192 + g, tile + kQ6Sc + 8 * g + r, std::integral_constant<size_t, 1>{});
      move(sb + 208, tile + kQ6D + 2 * r, B2{});
    }
  }
}

// Rows [8 g, 8 g + 8) of a repacked weight back in GGUF's layout, at dst (row_bytes apart).
void x8_unpack_group(int64_t qtype, const uint8_t* w, int64_t K, int64_t g, uint8_t* dst, int64_t row_bytes) {
  const int64_t tiles = K / x8_values(qtype);
  for (int64_t b = 0; b < tiles; ++b)
    x8_tile_rows<true>(qtype, dst, row_bytes, b, const_cast<uint8_t*>(w + (g * tiles + b) * x8_tile(qtype)));
}

// A repacked weight: [N, K / x8_values * tile / 8] uint8, N a multiple of 8; returns GGUF's row bytes.
int64_t checked_x8(const torch::Tensor& w, int64_t qtype, int64_t K) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(),
              "repacked weight: a contiguous uint8 [rows, row_bytes] tensor expected");
  TORCH_CHECK(K % x8_values(qtype) == 0 && w.size(0) % kX8Rows == 0 &&
                  w.size(1) == K / x8_values(qtype) * x8_tile(qtype) / kX8Rows,
              "repacked weight: ", w.size(0), " x ", w.size(1), " bytes do not hold rows of ", K,
              " values of type ", qtype);
  const Format f = format_of(base_type(qtype));
  return K / f.block * f.bytes;
}

// Rows of x per group in the fused kernel: one block unpacked serves them all, each with its own
// accumulators. AVX2 has 16 vector registers to AVX-512's 32: groups of 4.
#if defined(__AVX512F__) || !defined(__AVX2__)
constexpr int kMaxRows = 8;
#else
constexpr int kMaxRows = 4;
#endif
// Rows of W multiplied into all of x before the next ones: at most 48, and at most kPassFloats
// values (768 KiB of float32: the pass stays in L2 while every group of x's rows reads it).
constexpr int64_t kRowsPerPass = 48;
constexpr int64_t kPassFloats = 196608;

// A product's rows split over torch's threads by claiming: each thread takes the next chunk of
// [0, n) from a shared counter until none is left. at::parallel_for hands each thread one even
// share, so a product ends with its slowest thread's share; on shared cores (a VM's vCPUs, a
// process beside) one thread is often slowed for a while, and the other then waits at the end of
// every product. A product of more than a few kClaimBytes of weights (`unit_bytes` an index's)
// goes in chunks of at least that, up to kClaimsPerThread a thread; a smaller one in one chunk a
// thread, as before (below kFineClaimRows rows of x): each chunk's prefetches run past its end into
// lines another thread reads (SmolLM2's 1 MB products in chunks of a sixteenth ran 3-7% slower at
// one row), and long runs keep the hardware prefetchers streaming.
constexpr int64_t kClaimsPerThread = 8, kClaimBytes = 1 << 20;
// From this many rows of x (`rows`) a product is bound by the arithmetic, not the memory: it goes in
// kClaimsPerThread chunks a thread however few its bytes, so that a thread slowed for a while leaves
// the other less to wait for. The prefetches that run past a chunk's end, which made one row's
// small products slower in finer chunks, cost little beside the arithmetic. Against
// the byte-sized chunks (kernel_ab.py, two threads, Zen 3): SmolLM2's Q4_1 shapes at 5 and 16 rows
// 0.98-1.13x (most 1.05-1.07x), the 1B qkv and o in Q4_K and Q6_K 0.98-1.27x; from 2 rows instead,
// SmolLM2's shapes at 2 rows ran 0.89-0.97x and at 3 rows 0.94-1.13x.
constexpr int64_t kFineClaimRows = 4;
template <typename F>
void claimed_for(int64_t n, int64_t unit_bytes, int64_t rows, const F& f) {
  const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  const int64_t by_bytes =
      std::max(n * unit_bytes / kClaimBytes, rows >= kFineClaimRows ? threads * kClaimsPerThread : int64_t{0});
  // a whole number of chunks a thread: 3 chunks of a 3.4 MB product left one thread reading a
  // third of it alone
  const int64_t chunks = (std::max(threads, std::min(threads * kClaimsPerThread, by_bytes)) + threads - 1) /
                         threads * threads;
  if (threads <= 1 || n < 2) {
    if (n > 0) f(int64_t{0}, n);
    return;
  }
  const int64_t chunk = (n + chunks - 1) / chunks;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t c0 = next.fetch_add(chunk); c0 < n; c0 = next.fetch_add(chunk)) f(c0, std::min(n, c0 + chunk));
  });
}

// Software prefetch of the weight rows. A decode step reads every weight once, from memory, and
// the hardware's stream prefetcher alone left the products at about half the speed they reach on
// weights already in cache (Q4_K 1B gate/up: 10 against 18 GB/s). So while a group of rows is
// multiplied, the rows at least `bytes` further on are fetched at the same pace, each block of
// the current rows asking for the same block of those. The float32 kernels fetch 2 KiB ahead;
// the integer kernels, which get through a row several times faster, 8 KiB (on the AMD EPYC, one
// stream, paired rounds against 2 KiB: 1B Q4_K_M steps 8-12% faster, SmolLM2 Q4_1 15%, 1B Q8_0
// 0-5%; at 8 KiB the float32 kernel made SmolLM2 Q4_1's steps 12% slower).
constexpr int64_t kPrefetchBytes = 2048, kIntPrefetchBytes = 8192;
inline int64_t rows_ahead(int64_t group, int64_t row_bytes, int64_t bytes) {
  return std::max<int64_t>(group, (bytes + row_bytes - 1) / row_bytes);
}
inline void prefetch(const uint8_t* p) { __builtin_prefetch(p, 0, 3); }

// Where a block's float32 values come from. Blocks: widened by the format's dequant through a
// pointer (an indirect call; the accumulators survive it in memory). Inlined<D>: the same dequant
// called directly, so it inlines and a 32-value block goes from its bytes to the FMAs in
// registers: at one row of x the call and the round trip through memory cost more than the
// unpacking itself (a decode step's products ran at ~4 GB/s through the pointer). Same values,
// same order of FMAs: the same bits either way. DenseF32: read in place.
// kDense: tiled as dense rows (few rows of x, several of W) rather than as blocks to unpack once
// for up to kMaxRows rows of x.
struct Blocks {
  static constexpr bool kDense = false;
  static const float* values(const Format& f, const uint8_t* block, float* tmp) { return block_values(f, block, tmp); }
};
template <void (*Dequant)(const uint8_t*, float*), bool Dense = false>
struct Inlined {
  static constexpr bool kDense = Dense;
  static const float* values(const Format&, const uint8_t* block, float* tmp) {
    Dequant(block, tmp);
    return tmp;
  }
};
struct DenseF32 {
  static constexpr bool kDense = true;
  static const float* values(const Format&, const uint8_t* block, float*) {
    return reinterpret_cast<const float*>(block);
  }
};
using DenseBF16 = Inlined<VEC(dequant_bf16), true>;

// Rows [n0, n1) of y = x @ W^T for x: [M, K] float32, M <= kMaxRows, NR rows of W at a time.
// Two accumulators per (row of W, row of x), alternating over chunks of kLanes values (16 with
// AVX-512, 8 with AVX2), and NR rows of W
// together when x has few rows: an FMA waits ~4 cycles for its accumulator, so a single chain
// would leave the FMA units idle; NR * M * 2 >= 8 independent chains keep them busy. However M
// and NR tile the product, each value of y adds the same terms in the same order.
template <int M, int NR, typename Src>
void matmul_rows(const float* x, int64_t K, const uint8_t* w, int64_t row_bytes, const Format& f,
                 float* y, int64_t N, int64_t n0, int64_t n1) {
  alignas(64) float tmp[NR][QK_K];
  const int64_t blocks = K / f.block, ahead = rows_ahead(NR, row_bytes, kPrefetchBytes);
  for (int64_t n = n0; n < n1; n += NR) {
#if defined(PAGELLM_VEC_DEQUANT)
    VF acc[NR][M][2];
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < M; ++m) acc[r][m][0] = acc[r][m][1] = vzero();
    const bool fetch = n + ahead + NR <= n1;
    for (int64_t b = 0; b < blocks; ++b) {
      if (fetch)
        for (int r = 0; r < NR; ++r) {  // a block's first and last byte: a dense block spans two lines
          prefetch(w + (n + ahead + r) * row_bytes + b * f.bytes);
          prefetch(w + (n + ahead + r) * row_bytes + (b + 1) * f.bytes - 1);
        }
      const float* wv[NR];
      for (int r = 0; r < NR; ++r) wv[r] = Src::values(f, w + (n + r) * row_bytes + b * f.bytes, tmp[r]);
      const float* xb = x + b * f.block;
      for (int i = 0; i < f.block; i += 2 * kLanes) {
        for (int m = 0; m < M; ++m) {
          const VF x0 = vload(xb + m * K + i), x1 = vload(xb + m * K + i + kLanes);
          for (int r = 0; r < NR; ++r) {
            acc[r][m][0] = vfmadd(vload(wv[r] + i), x0, acc[r][m][0]);
            acc[r][m][1] = vfmadd(vload(wv[r] + i + kLanes), x1, acc[r][m][1]);
          }
        }
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < M; ++m) y[m * N + n + r] = vreduce(vadd(acc[r][m][0], acc[r][m][1]));
#else
    // One partial sum per 32 values, whatever the block size: quantized rows (blocks of 256 for
    // the K-quants) and the same rows widened (read as blocks of 32) sum in the same order.
    float acc[NR][M] = {};
    for (int64_t b = 0; b < blocks; ++b) {
      const float* wv[NR];
      for (int r = 0; r < NR; ++r) wv[r] = Src::values(f, w + (n + r) * row_bytes + b * f.bytes, tmp[r]);
      const float* xb = x + b * f.block;
      for (int i0 = 0; i0 < f.block; i0 += 32)
        for (int r = 0; r < NR; ++r)
          for (int m = 0; m < M; ++m) {
            float s = 0.f;
            for (int i = i0; i < i0 + 32; ++i) s += wv[r][i] * xb[m * K + i];
            acc[r][m] += s;
          }
    }
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < M; ++m) y[m * N + n + r] = acc[r][m];
#endif
  }
}

// Rows [n0, n1): whole groups of NR, then the rest one at a time.
template <int M, int NR, typename Src>
void rows_in_groups(const float* x, int64_t K, const uint8_t* w, int64_t row_bytes, const Format& f, float* y,
                    int64_t N, int64_t n0, int64_t n1) {
  const int64_t grouped = n0 + (n1 - n0) / NR * NR;
  matmul_rows<M, NR, Src>(x, K, w, row_bytes, f, y, N, n0, grouped);
  if (grouped < n1) matmul_rows<M, 1, Src>(x, K, w, row_bytes, f, y, N, grouped, n1);
}

// Rows of W taken together against M rows of x: enough independent accumulator chains
// (NR * M * 2) to keep the FMA units busy, few enough to stay in registers. AVX-512 (32
// registers): dense rows as 4 rows of x against 3 of W (24 accumulators, 14 loads per 24 FMAs),
// the tiling that keeps the FMA units busiest. AVX2 (16): at most 8 accumulators.
constexpr int rows_of_w(int M, bool dense) {
#if defined(__AVX512F__)
  return M == 1 ? 4 : M == 2 ? (dense ? 4 : 2) : M == 3 ? (dense ? 4 : 1) : M == 4 ? (dense ? 3 : 1) : 1;
#else
  return M == 1 ? 4 : M == 2 ? 2 : 1;
#endif
}

// Rows [n0, n1) of W into every row of x. Quantized blocks: x in groups of kMaxRows rows, so a
// block is unpacked once per group. Dense rows: groups of 4.
template <typename Src>
void multiply_rows(const float* xp, int64_t M, int64_t K, const uint8_t* wp, int64_t row_bytes, const Format& f,
                   float* yp, int64_t N, int64_t n0, int64_t n1) {
  constexpr bool dense = Src::kDense;
  const int64_t group = dense ? 4 : kMaxRows;
  for (int64_t m0 = 0; m0 < M; m0 += group) {
    const float* xm = xp + m0 * K;
    float* ym = yp + m0 * N;
    switch (std::min<int64_t>(group, M - m0)) {
      case 1: rows_in_groups<1, rows_of_w(1, dense), Src>(xm, K, wp, row_bytes, f, ym, N, n0, n1); break;
      case 2: rows_in_groups<2, rows_of_w(2, dense), Src>(xm, K, wp, row_bytes, f, ym, N, n0, n1); break;
      case 3: rows_in_groups<3, rows_of_w(3, dense), Src>(xm, K, wp, row_bytes, f, ym, N, n0, n1); break;
      case 4: rows_in_groups<4, rows_of_w(4, dense), Src>(xm, K, wp, row_bytes, f, ym, N, n0, n1); break;
      case 5: rows_in_groups<5, 1, Src>(xm, K, wp, row_bytes, f, ym, N, n0, n1); break;
      case 6: rows_in_groups<6, 1, Src>(xm, K, wp, row_bytes, f, ym, N, n0, n1); break;
      case 7: rows_in_groups<7, 1, Src>(xm, K, wp, row_bytes, f, ym, N, n0, n1); break;
      default: rows_in_groups<8, 1, Src>(xm, K, wp, row_bytes, f, ym, N, n0, n1); break;
    }
  }
}


// ---- int8 activations: integer dot products (AVX-512 VNNI, or AVX2) -------------------------
// What llama.cpp does on CPUs: each row of x is rounded to int8 codes with one float scale per 32
// values (as a Q8_0 block), and a weight block's codes are multiplied by them with VPDPBUSD, 64
// byte products an instruction summed 4 at a time into 16 int32 lanes. Nothing is widened to
// float32 but those lane sums, so a product does far less work per weight than widening every
// value (1.4-1.9x faster at one row; the 4-bit types are still bound by their unpacking, not by
// memory). It rounds the activations, so it is not the dense product: the Python side offers it
// as a mode (`activation_quantization` "int8" / "int8x2"), measured against the exact one.
//
// Every type's value is an affine map of an unsigned code u: w = a * u + b, with a and b fixed
// over runs of at least 4 values (a block, a sub-block, a 16-value Q6_K group). So over one
// int32 lane (4 values, one activation scale dx, codes c):
//     sum(w * x) = a * dx * sum(u * c) + b * dx * sum(c)
// The kernel feeds VPDPBUSD the unsigned codes u (Q8_0's signed codes shifted by 128, Q6_K's by
// 32, and so on), and per lane it keeps a (`dsc`) and b (`msc`); x brings, per lane, dx and
// dx * sum(c) (`ActRows`). Each 64-value chunk of a weight row costs one VPDPBUSD, one convert and
// two FMAs per row of x, after the unpacking.
//
// On AVX2 without AVX-512 (the second implementation below) the same lanes come from VPMADDUBSW
// (pairs of byte products summed into 16 bits, saturating) and VPMADDWD against ones, 32 values
// a vector; x is rounded exactly as there, so both give the same codes and scales. (The build's
// instruction set: PAGELLM_INT8_VNNI / PAGELLM_INT8_ACTIVATIONS, at the top.)

#if defined(PAGELLM_INT8_ACTIVATIONS)
// Bytes of a K-quant super-block (256 values), as a compile-time constant: the kernels' addresses
// fold it (deriving it from row_bytes at run time made Q4_K at one row 2-3% slower).
template <int64_t T>
constexpr int64_t kSuperBytes = T == Q4_K ? 144 : T == Q5_K ? 176 : 210;

// x: [M, K] rounded: codes [M, K] int8, and per 4-value lane its scale and scaled code sum.
// Two terms (`residual`): a second code per value for what the first left, on a 128 times finer
// scale: x ~ d * (c + r / 128), r in [-64, 64]. A lane's dot is then sum(u * (128 c + r)), two
// VPDPBUSD and a shift, and the activations carry ~15 bits against the block's largest value.
struct ActRows {
  std::vector<int8_t> codes, residual;
  std::vector<float> lane_scale, lane_sum;
  std::vector<float> block_sum;    // quantize_super and quantize_activations: per 32 values, d * the sum of their codes
  std::vector<float> super_scale;  // quantize_super only: per 256 values, d (lane_scale, lane_sum empty)
  std::vector<int16_t> sums16;     // quantize_super for Q6_K only: per 16 values, the sum of their codes (its offset)
  std::vector<int16_t> wide;       // quantize_super with `wide` only: 128 c + r per value (codes, residual empty)
  std::vector<float> block_scale;  // quantize_activations: per 32 values, the lanes' scale once
  std::vector<int16_t> joined;     // AVX2 quantize_activations with `joined`: join_codes' 16-bit values (Q8_0)
};

// Rows m0.. of an ActRows, by pointer.
struct ActView {
  const int8_t *codes, *residual;
  const float *scale, *sum, *block_sum;
  const int16_t* sums16;
  const int16_t* wide;
  const float* block_scale;
  const int16_t* joined;
  const int32_t* lane_offsets = nullptr;  // Q8_0's tiles: per block, -128 times each lane's sum of x's codes
};

// Whether a product takes x a super-block at a time (quantize_super, int8_super_rows): the
// K-quants; with two codes per value only Q4_K and Q5_K (Q6_K's offset term would need its
// per-16 code sums in 32 bits).
constexpr bool super_activations(int64_t qtype, bool two_terms) {
  return qtype == Q4_K || qtype == Q5_K || (qtype == Q6_K && !two_terms);
}

// x's codes as one 16-bit value each, for the kernels that multiply 16-bit words: 128 c + r with
// two codes (within +-16,320), c with one (residual null). n a multiple of 16.
inline void join_codes(const int8_t* codes, const int8_t* residual, int64_t n, int16_t* out) {
  for (int64_t i = 0; i < n; i += 16) {
    __m256i v = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i)));
    if (residual != nullptr)
      v = _mm256_add_epi16(_mm256_slli_epi16(v, 7),
                           _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(residual + i))));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), v);
  }
}

// The loop the row kernels share: rows [n0, n1) of W, NR at a time, with an accumulator per row of
// W and of x (VF: AVX-512's 16 lanes, AVX2's 8); blocks(n, fetch, acc) adds group n's products
// (fetch: the rows `ahead` further on exist, to prefetch), and each accumulator's lanes, summed in
// one fixed order (vreduce), are y's value.
template <int M, int NR, class Blocks>
inline void row_groups(int64_t n0, int64_t n1, int64_t ahead, float* y, int64_t N, Blocks&& blocks) {
  for (int64_t n = n0; n < n1; n += NR) {
    VF acc[NR][M];
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = vzero();
    blocks(n, n + ahead + NR <= n1, acc);
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < M; ++m) y[m * N + n + r] = vreduce(acc[r][m]);
  }
}

// A block of 32 of x's joined codes (ActRows::joined) and of W's Q8_0 codes sign-extended to 16
// bits, as the registers hold them: AVX-512 one vector each, AVX2 two. joined_dot: their VPMADDWD
// integer sums (AVX-512 16 lanes of 2 values, AVX2 8 of 4; within 2^23, so exact), as floats.
#if defined(PAGELLM_INT8_VNNI)
struct Joined32 { __m512i v; };
inline Joined32 joined_x(const int16_t* p) { return {_mm512_loadu_si512(p)}; }
inline Joined32 joined_w(const uint8_t* codes) {
  return {_mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes)))};
}
inline VF joined_dot(Joined32 w, Joined32 x) { return _mm512_cvtepi32_ps(_mm512_madd_epi16(w.v, x.v)); }
#else
struct Joined32 { __m256i lo, hi; };
inline Joined32 joined_x(const int16_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16))};
}
inline Joined32 joined_w(const uint8_t* codes) {
  return {_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes))),
          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16)))};
}
inline VF joined_dot(Joined32 w, Joined32 x) {
  return _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_madd_epi16(w.lo, x.lo), _mm256_madd_epi16(w.hi, x.hi)));
}
#endif

// Rows [n0, n1) of y = x @ W^T for Q8_0, x's codes joined into one 16-bit value each (128 c + r with
// two codes, within +-16,320; c with one) and W's codes sign-extended to 16 bits: per block of 32
// values and row of x, joined_dot's integer sums, then one convert and one FMA by W's d times x's
// block scale (scalars, broadcast). AVX2 builds take it at every row count (joins_codes): the
// blocks' byte products (blocks8_rows) took eight multiply-pipe instructions a block with two codes
// (three sign fixes, two VPMADDUBSW, two VPMADDWD, the FMA) and a gather of 8 blocks' scales and a
// permute per block; AMD's Zen 3 runs all the multiplies and sign fixes on the same two pipes and
// gathers slowly, and there this form is 1.35-1.65x as fast at one row (one thread: 12.5-14.4 GB/s
// against 8.4-9.3 on the 1B shapes, a core streams 15) and 1.3-2.0x at 2-8 rows
// (benchmarks/kernel_ab.py). AVX-512 VNNI builds take it up to 5 rows of x (joins_codes). Blocks in
// order, each row's lanes in one FMA chain, whatever M and NR are: a row's sums keep their bits
// beside other rows of x.
template <int M, int NR>
void q8_0_joined_rows(ActView a, int64_t K, const uint8_t* w, int64_t row_bytes, float* y, int64_t N, int64_t n0,
                      int64_t n1) {
  constexpr int64_t kBytes = 34;
  const int64_t blocks = K / 32;
  const int64_t ahead = rows_ahead(NR, row_bytes, kIntPrefetchBytes);
  row_groups<M, NR>(n0, n1, ahead, y, N, [&](int64_t n, bool fetch, VF (&acc)[NR][M]) {
    for (int64_t b0 = 0; b0 < blocks; b0 += 8) {
      const int64_t b1 = std::min<int64_t>(blocks, b0 + 8);
      if (fetch)
        for (int r = 0; r < NR; ++r)
          for (int64_t l = 0; l < (b1 - b0) * kBytes; l += 64) prefetch(w + (n + ahead + r) * row_bytes + b0 * kBytes + l);
      for (int64_t b = b0; b < b1; ++b) {
        Joined32 xv[M];
        float xs[M];
        for (int m = 0; m < M; ++m) {
          xv[m] = joined_x(a.joined + m * K + 32 * b);
          xs[m] = a.block_scale[m * blocks + b];
        }
        for (int r = 0; r < NR; ++r) {
          const uint8_t* blk = w + (n + r) * row_bytes + b * kBytes;
          const Joined32 wv = joined_w(blk + 2);
          const float d = half_at(blk);
          for (int m = 0; m < M; ++m) acc[r][m] = vfmadd(joined_dot(wv, xv[m]), vset1(d * xs[m]), acc[r][m]);
        }
      }
    }
  });
}
#endif

#if defined(PAGELLM_INT8_VNNI)


// 32 values v0, v1 times inv, rounded half to even (r0, r1) and saturated to int8 codes.
struct Rounded32 {
  __m512 r0, r1;
  __m256i codes;
};
inline Rounded32 round32(__m512 v0, __m512 v1, __m512 inv) {
  const __m512 r0 = _mm512_roundscale_ps(_mm512_mul_ps(v0, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r1 = _mm512_roundscale_ps(_mm512_mul_ps(v1, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return {r0, r1, _mm256_set_m128i(_mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(r1)),
                                   _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(r0)))};
}

// The second codes of 16 values v that round32 rounded to r with `inv`: what rounding left,
// v * inv - r in [-1/2, 1/2] (one rounding: FMA), in steps of 1/128, as int32 in [-64, 64].
inline __m512i residual16(__m512 v, __m512 inv, __m512 r) {
  return _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_fmsub_ps(v, inv, r), _mm512_set1_ps(128.f)));
}

// residual16 of 32 values v0, v1, as int8 codes.
inline __m256i residual32(__m512 v0, __m512 v1, __m512 inv, __m512 r0, __m512 r1) {
  return _mm256_set_m128i(_mm512_cvtsepi32_epi8(residual16(v1, inv, r1)),
                          _mm512_cvtsepi32_epi8(residual16(v0, inv, r0)));
}

// `joined`: also each value's codes as one 16-bit value (join_codes), for q8_0_joined_rows.
ActRows quantize_activations(const float* x, int64_t M, int64_t K, bool two_terms, bool joined = false) {
  ActRows a{std::vector<int8_t>(M * K), std::vector<int8_t>(two_terms ? M * K : 0), std::vector<float>(M * K / 4),
            std::vector<float>(M * K / 4)};
  a.block_scale.resize(M * K / 32);  // for blocks16_rows
  a.block_sum.resize(M * K / 32);
  if (joined) a.joined.resize(M * K);
  const __m512 sign = _mm512_set1_ps(-0.0f);
  const __m256i ones = _mm256_set1_epi8(1);
  for (int64_t i = 0; i < M * K; i += 32) {
    const __m512 v0 = _mm512_loadu_ps(x + i), v1 = _mm512_loadu_ps(x + i + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, v0), _mm512_andnot_ps(sign, v1)));
    // A NaN or infinity in the block (VMAXPS drops NaNs) makes its scale NaN, so the row's products
    // come out NaN as the float32 product's would, and request isolation sees them.
    const bool finite = (_mm512_fpclass_ps_mask(v0, 0x99) | _mm512_fpclass_ps_mask(v1, 0x99)) == 0;
    const float d = finite ? amax / 127.f : std::numeric_limits<float>::quiet_NaN();
    const float inv = finite && amax > 0.f ? 127.f / amax : 0.f;
    const __m512 s = _mm512_set1_ps(inv);
    const auto [r0, r1, codes] = round32(v0, v1, s);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.codes.data() + i), codes);
    __m256i sums = _mm256_dpbusd_epi32(_mm256_setzero_si256(), ones, codes);
    float lane_d = d;
    if (two_terms) {
      const __m256i res = residual32(v0, v1, s, r0, r1);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.residual.data() + i), res);
      sums = _mm256_dpbusd_epi32(_mm256_slli_epi32(sums, 7), ones, res);
      lane_d = d / 128.f;
    }
    const __m256 dv = _mm256_set1_ps(lane_d);
    const __m256 lane_sums = _mm256_mul_ps(_mm256_cvtepi32_ps(sums), dv);
    _mm256_storeu_ps(a.lane_sum.data() + i / 4, lane_sums);
    _mm256_storeu_ps(a.lane_scale.data() + i / 4, dv);
    a.block_scale[i / 32] = lane_d;
    a.block_sum[i / 32] = reduce_add8(lane_sums);
    if (joined) join_codes(a.codes.data() + i, two_terms ? a.residual.data() + i : nullptr, 32, a.joined.data() + i);
  }
  return a;
}


// x rounded with one scale per 256 values, as llama.cpp's Q8_K, for the K-quants' products
// (int8_super_rows): with the activation scale constant over a weight super-block, the
// sub-blocks' integer scales apply to integer sums and a super-block converts to float once,
// instead of every 64 values. block_sum as in quantize_activations (d * sum of codes per 32, with
// two codes d / 128 * sum(128 c + r)); with `sums16` (Q6_K's offset term), those of the first codes.
// `wide` (two codes only): each value's two codes as one 16-bit value 128 c + r instead
// (wide_super_rows).
ActRows quantize_super(const float* x, int64_t M, int64_t K, bool two_terms, bool sums16, bool wide = false) {
  ActRows a{std::vector<int8_t>(wide ? 0 : M * K), std::vector<int8_t>(two_terms && !wide ? M * K : 0), {}, {},
            std::vector<float>(M * K / 32), std::vector<float>(M * K / QK_K),
            std::vector<int16_t>(sums16 ? M * K / 16 : 0), std::vector<int16_t>(wide ? M * K : 0)};
  const __m512 sign = _mm512_set1_ps(-0.0f);
  const __m256i ones = _mm256_set1_epi8(1);
  for (int64_t i = 0; i < M * K; i += QK_K) {
    __m512 amax = _mm512_setzero_ps();
    __mmask16 bad = 0;  // a NaN or infinity makes the super-block's scale NaN (see quantize_activations)
    for (int k = 0; k < QK_K; k += 16) {
      const __m512 v = _mm512_loadu_ps(x + i + k);
      amax = _mm512_max_ps(amax, _mm512_andnot_ps(sign, v));
      bad |= _mm512_fpclass_ps_mask(v, 0x99);
    }
    const float m = _mm512_reduce_max_ps(amax);
    const float d = bad == 0 ? m / 127.f : std::numeric_limits<float>::quiet_NaN();
    const __m512 inv = _mm512_set1_ps(bad == 0 && m > 0.f ? 127.f / m : 0.f);
    a.super_scale[i / QK_K] = d;
    for (int k = 0; k < QK_K; k += 32) {
      const __m512 v0 = _mm512_loadu_ps(x + i + k), v1 = _mm512_loadu_ps(x + i + k + 16);
      const auto [r0, r1, codes] = round32(v0, v1, inv);
      if (wide) {  // the same codes as round32 and residual32 (both in range: no saturation), joined
        const __m512i w0 = _mm512_add_epi32(_mm512_slli_epi32(_mm512_cvtps_epi32(r0), 7), residual16(v0, inv, r0));
        const __m512i w1 = _mm512_add_epi32(_mm512_slli_epi32(_mm512_cvtps_epi32(r1), 7), residual16(v1, inv, r1));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.wide.data() + i + k), _mm512_cvtepi32_epi16(w0));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.wide.data() + i + k + 16), _mm512_cvtepi32_epi16(w1));
        a.block_sum[(i + k) / 32] =
            static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(w0, w1))) * (d / 128.f);
        continue;
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.codes.data() + i + k), codes);
      const __m256i sums = _mm256_dpbusd_epi32(_mm256_setzero_si256(), ones, codes);
      if (sums16) {
        // lane 0: values 0..15, lane 4: 16..31
        const __m256i quads = _mm256_hadd_epi32(_mm256_hadd_epi32(sums, sums), sums);
        a.sums16[(i + k) / 16] = static_cast<int16_t>(_mm256_extract_epi32(quads, 0));
        a.sums16[(i + k) / 16 + 1] = static_cast<int16_t>(_mm256_extract_epi32(quads, 4));
      }
      if (!two_terms) {
        a.block_sum[(i + k) / 32] = reduce_add8(_mm256_cvtepi32_ps(sums)) * d;
        continue;
      }
      const __m256i res = residual32(v0, v1, inv, r0, r1);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.residual.data() + i + k), res);
      const __m256i both = _mm256_dpbusd_epi32(_mm256_slli_epi32(sums, 7), ones, res);
      a.block_sum[(i + k) / 32] = reduce_add8(_mm256_cvtepi32_ps(both)) * (d / 128.f);
    }
  }
  return a;
}

// One 64-value chunk of a weight row: the unsigned codes, and per lane a (dsc) and b (msc).
struct Chunk {
  __m512i u;
  __m512 dsc, msc;
};

inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline __m256i and8(__m256i v, int m) { return _mm256_and_si256(v, _mm256_set1_epi8(static_cast<char>(m))); }
inline __m256i shr(__m256i v, int s) { return _mm256_srli_epi16(v, s); }
inline __m256i shl(__m256i v, int s) { return _mm256_slli_epi16(v, s); }
inline __m512i join(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }
// Float16 values at a (2 or 4 bytes) and b, widened together: [a0, (a1,) b0, (b1)].
inline __m128 halves_at(const uint8_t* a, const uint8_t* b, int bytes) {
  int32_t va = 0, vb = 0;
  std::memcpy(&va, a, bytes);
  std::memcpy(&vb, b, bytes);
  return _mm_cvtph_ps(bytes == 2 ? _mm_insert_epi16(_mm_cvtsi32_si128(va), vb, 1)
                                 : _mm_insert_epi32(_mm_cvtsi32_si128(va), vb, 1));
}
// Two 32-value blocks' 16 bytes of nibbles, at a and b, as 64 codes in value order: block a's low
// nibbles (its values 0..15), its high nibbles (16..31), then block b's.
inline __m512i nibbles(const uint8_t* a, const uint8_t* b) {
  const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
                                            _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1);
  // [a, a, b, b] in 128-bit lanes, the second of each pair shifted by 4: one mask gives the codes
  const __m512i aabb = _mm512_shuffle_i64x2(_mm512_castsi256_si512(v), _mm512_castsi256_si512(v), _MM_SHUFFLE(1, 1, 0, 0));
  const __m512i by = _mm512_set_epi64(0x0004000400040004, 0x0004000400040004, 0, 0, 0x0004000400040004,
                                      0x0004000400040004, 0, 0);
  return _mm512_and_si512(_mm512_srlv_epi16(aabb, by), _mm512_set1_epi8(0x0F));
}


// A Q4_K / Q5_K super-block's 8 six-bit scales and mins (12 bytes at sb + 4) as [sc0..7, m0..7]:
// sc_j = q_j & 63 and m_j = q_{j+4} & 63 for j < 4; for j >= 4 the low four bits come from
// q_{j+4} (sc: its low nibble, m: its high one) and the top two from q_{j-4} (sc) or q_j (m).
inline __m128i k4_scales_and_mins(const uint8_t* sb) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 4));  // 12 bytes, then 4 of the codes
  const __m128i low = _mm_shuffle_epi8(q, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
  const __m128i top = _mm_shuffle_epi8(q, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
  // bytes 12..15 take q_8..11's high nibble
  const __m128i lows = _mm_mask_blend_epi8(0xF000, low, _mm_srli_epi16(low, 4));
  const __m128i mask = _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15);
  return _mm_or_si128(_mm_and_si128(lows, mask), _mm_and_si128(_mm_srli_epi16(top, 2), _mm_set1_epi8(0x30)));
}

// A Q6_K super-block's 16 groups' scales d * sc, decoded once for its 4 chunks and kept in a
// register (q6_k_rows; Q4_K and Q5_K take x per 256 values, int8_super_rows).
inline __m512 q6_k_scales(const uint8_t* sb) {
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 192)))),
                       _mm512_set1_ps(half_at(sb + 208)));
}

// Quarter j of a Q4_K / Q5_K super-block: its 64 codes in value order (sub-blocks 2j, 2j + 1).
template <int64_t T>
inline __m512i k4_codes(const uint8_t* sb, int j) {
  const uint8_t* qs = sb + (T == Q4_K ? 16 : 48) + 32 * j;
  if constexpr (T == Q4_K) {  // the 32 bytes in both halves, the upper half shifted by 4: one mask, 64 codes
    const __m512i v = _mm512_broadcast_i64x4(load32(qs));
    const __m512i by = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    return _mm512_and_si512(_mm512_srlv_epi16(v, by), _mm512_set1_epi8(0x0F));
  } else {
    const __m256i v = load32(qs), h = load32(sb + 16);
    const __m256i lo = _mm256_or_si256(and8(v, 0x0F), shl(and8(shr(h, 2 * j), 1), 4));
    const __m256i hi = _mm256_or_si256(and8(shr(v, 4), 0x0F), shl(and8(shr(h, 2 * j + 1), 1), 4));
    return join(lo, hi);
  }
}

// Quarter j of a Q6_K super-block: its 64 unsigned codes (0..63, the value + 32) in value order,
// four 16-value groups with scales 4j..4j+3 (see dequant_q6_k).
inline __m512i k6_codes(const uint8_t* sb, int j) {
  const int half = j / 2, part = j % 2;
  // Low four bits: a's and b's nibbles `part`; top two: h's bit pairs 2 part (a) and 2 part + 1 (b),
  // both halves at once (h in both, shifted 2 more in the upper half).
  const __m512i ab = join(load32(sb + 64 * half), load32(sb + 64 * half + 32));
  const __m512i h = _mm512_broadcast_i64x4(load32(sb + 128 + 32 * half));
  const __m512i by = _mm512_inserti64x4(_mm512_set1_epi16(static_cast<int16_t>(4 * part)),
                                        _mm256_set1_epi16(static_cast<int16_t>(4 * part + 2)), 1);
  const __m512i low = _mm512_and_si512(_mm512_srli_epi16(ab, 4 * part), _mm512_set1_epi8(0x0F));
  const __m512i top = _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(h, by), _mm512_set1_epi8(3)), 4);
  return _mm512_or_si512(low, top);
}

// Quarter j (64 values) of a Q6_K super-block sb whose scales are `dm` (q6_k_scales).
inline Chunk q6_k_chunk(const uint8_t* sb, int j, __m512 dm) {
  const __m512 d = _mm512_permutexvar_ps(
      _mm512_setr_epi32(4 * j, 4 * j, 4 * j, 4 * j, 4 * j + 1, 4 * j + 1, 4 * j + 1, 4 * j + 1, 4 * j + 2, 4 * j + 2,
                        4 * j + 2, 4 * j + 2, 4 * j + 3, 4 * j + 3, 4 * j + 3, 4 * j + 3), dm);
  return {k6_codes(sb, j), d, _mm512_mul_ps(d, _mm512_set1_ps(-32.f))};
}

// A 64-value chunk of W's unsigned codes u times x's codes at `at` (x rounded per 32 values): per
// lane the sum of 4 products, with two codes 128 (u . c) + u . r.
template <bool kTwo>
inline __m512i x_dot(__m512i u, const ActView& a, int64_t at) {
  const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, _mm512_loadu_si512(a.codes + at));
  if constexpr (!kTwo) return dot;
  return _mm512_dpbusd_epi32(_mm512_slli_epi32(dot, 7), u, _mm512_loadu_si512(a.residual + at));
}

// Rows [n0, n1) of y = x @ W^T for M rows of x (rounded per 32 values), NR rows of W at a time,
// for Q6_K with two codes per value (the 32-value blocks: blocks16_rows; the other K-quants, and
// Q6_K with one code: int8_super_rows), a super-block (4 chunks) at a time, its scales decoded into
// a register first, prefetching the rows ahead as matmul_rows does (measured there: Q4_K 1B gate/up
// 10.5 -> 17.9 GB/s).
template <int M, int NR, bool kTwo>
void q6_k_rows(ActView a, int64_t K, const uint8_t* w, int64_t row_bytes, float* y, int64_t N, int64_t n0,
               int64_t n1) {
  // chunk_bytes: a 64-value chunk's share of the row, for the prefetch (52.5 rounds down).
  const int64_t chunks = K / 64, chunk_bytes = row_bytes / chunks;
  const int64_t ahead = rows_ahead(NR, row_bytes, kIntPrefetchBytes);
  for (int64_t n = n0; n < n1; n += NR) {
    __m512 acc[NR][M];
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
    const bool fetch = n + ahead + NR <= n1;
    for (int64_t c0 = 0; c0 < chunks; c0 += 4) {
      __m512 dm[NR];
      for (int r = 0; r < NR; ++r) dm[r] = q6_k_scales(w + (n + r) * row_bytes + (c0 / 4) * kSuperBytes<Q6_K>);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const int64_t c = c0 + j;
        if (fetch)
          for (int r = 0; r < NR; ++r) prefetch(w + (n + ahead + r) * row_bytes + c * chunk_bytes);
        for (int r = 0; r < NR; ++r) {
          const Chunk ch = q6_k_chunk(w + (n + r) * row_bytes + (c0 / 4) * kSuperBytes<Q6_K>, j, dm[r]);
          for (int m = 0; m < M; ++m) {
            const int64_t at = m * K + 64 * c;
            const __m512i dot = x_dot<kTwo>(ch.u, a, at);
            const __m512 dx = _mm512_loadu_ps(a.scale + at / 4);
            acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(ch.dsc, dx), acc[r][m]);
            acc[r][m] = _mm512_fmadd_ps(_mm512_loadu_ps(a.sum + at / 4), ch.msc, acc[r][m]);
          }
        }
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < M; ++m) y[m * N + n + r] = _mm512_reduce_add_ps(acc[r][m]);
  }
}

// Super-block b of a Q4_K / Q5_K row at sb: returns its d and sets `sm` to its scales and mins
// [sc0..7, m0..7]; adds its mins' term, -dmin * m_j against x's per-32 sums (block_sum), into
// mins[m] for each of the M rows of x (summed once per super-block, not per chunk).
template <int M>
inline float k4_super_header(const uint8_t* sb, const float* block_sum, int64_t K, int64_t b, __m256* mins,
                             __m128i& sm) {
  sm = k4_scales_and_mins(sb);
  const __m128 dd = halves_at(sb, sb, 4);  // [d, dmin, ...]
  const __m256 neg_m = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8))),
                                     _mm256_set1_ps(-_mm_cvtss_f32(_mm_movehdup_ps(dd))));
  for (int m = 0; m < M; ++m)
    mins[m] = _mm256_fmadd_ps(neg_m, _mm256_loadu_ps(block_sum + m * K / 32 + 8 * b), mins[m]);
  return _mm_cvtss_f32(dd);
}

// The K-quants against x from quantize_super. Per 64-value chunk and row of x:
// VPMADDUBSW multiplies codes by x's codes and sums pairs into 16 bits (at most 2 * 63 * 127),
// VPDPWSSD multiplies those by their sub-blocks' integer scales (Q4_K / Q5_K: 6-bit, per 32
// values; Q6_K: signed 8-bit, per 16) and accumulates in int32; once per super-block the sums
// convert to float, times d * dx. Against x per 32 values: no convert, scale product or FMA per chunk,
// which bound that kernel on this machine (Q4_K at one row streamed ~30 GB/s of weights where
// memory reads ~50; Q6_K at 16 rows ran at a third of Q4_K's weights per second). The codes are
// unsigned: Q4_K / Q5_K subtract a min per sub-block (summed in float, 8 mins against the 8
// blocks' code sums), Q6_K 32 from every code (32 times the 16 groups' scales against x's
// per-16 code sums, an integer term the accumulator starts from).
template <int64_t T, int M, int NR, bool kTwo>
void int8_super_rows(ActView a, int64_t K, const uint8_t* w, int64_t row_bytes, float* y, int64_t N, int64_t n0,
                     int64_t n1) {
  constexpr bool kK6 = T == Q6_K;
  static_assert(!(kK6 && kTwo), "Q6_K with two codes per value takes x per 32 values (q6_k_rows)");
  // 16-bit lane i of chunk j takes the scale of sub-block kPer * j + i / kLanes
  constexpr int kPer = kK6 ? 4 : 2, kShift = kK6 ? 3 : 4;
  const int64_t supers = K / QK_K, chunk_bytes = row_bytes / (K / 64);
  const int64_t ahead = rows_ahead(NR, row_bytes, kIntPrefetchBytes);
  const __m512i lane_sub = _mm512_srli_epi16(
      _mm512_setr_epi32(0x10000, 0x30002, 0x50004, 0x70006, 0x90008, 0xB000A, 0xD000C, 0xF000E, 0x110010, 0x130012,
                        0x150014, 0x170016, 0x190018, 0x1B001A, 0x1D001C, 0x1F001E), kShift);  // i / kLanes
  for (int64_t n = n0; n < n1; n += NR) {
    __m512 acc[NR][M];
    __m256 mins[NR][M];
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps(), mins[r][m] = _mm256_setzero_ps();
    const bool fetch = n + ahead + NR <= n1;
    for (int64_t b = 0; b < supers; ++b) {
      for (int r = 0; r < NR; ++r) {
        const uint8_t* sb = w + (n + r) * row_bytes + b * kSuperBytes<T>;
        __m512i sc, sums[M], second[M];  // second: the residual codes' sums (kTwo)
        float d;
        if constexpr (kK6) {
          const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 192)));
          sc = _mm512_zextsi256_si512(sc16);
          d = half_at(sb + 208);
          for (int m = 0; m < M; ++m) {
            const __m256i bs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.sums16 + m * K / 16 + 16 * b));
            const __m256i offset = _mm256_slli_epi32(_mm256_madd_epi16(sc16, bs), 5);  // 32 * sc * sum(c)
            sums[m] = _mm512_zextsi256_si512(_mm256_sub_epi32(_mm256_setzero_si256(), offset));
          }
        } else {
          __m128i sm;
          d = k4_super_header<M>(sb, a.block_sum, K, b, mins[r], sm);
          sc = _mm512_cvtepu8_epi16(_mm256_castsi128_si256(sm));
          for (int m = 0; m < M; ++m) sums[m] = second[m] = _mm512_setzero_si512();
        }
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) {
          if (fetch) prefetch(w + (n + ahead + r) * row_bytes + (4 * b + j) * chunk_bytes);
          __m512i u;
          if constexpr (kK6) u = k6_codes(sb, j);
          else u = k4_codes<T>(sb, j);
          const __m512i scj = _mm512_permutexvar_epi16(_mm512_add_epi16(lane_sub, _mm512_set1_epi16(kPer * j)), sc);
          for (int m = 0; m < M; ++m) {
            sums[m] = _mm512_dpwssd_epi32(
                sums[m], _mm512_maddubs_epi16(u, _mm512_loadu_si512(a.codes + m * K + 256 * b + 64 * j)), scj);
            if constexpr (kTwo)
              second[m] = _mm512_dpwssd_epi32(
                  second[m], _mm512_maddubs_epi16(u, _mm512_loadu_si512(a.residual + m * K + 256 * b + 64 * j)), scj);
          }
        }
        // two codes: x = dx (c + r / 128), so the sum is (128 sum(u c) + sum(u r)) dx / 128, which
        // fits int32 (a lane's first sum is at most 4 * 2 * 2 * 31 * 127 * 63, times 128 < 2^31)
        for (int m = 0; m < M; ++m) {
          const __m512i total = kTwo ? _mm512_add_epi32(_mm512_slli_epi32(sums[m], 7), second[m]) : sums[m];
          const float dx = kTwo ? a.scale[m * supers + b] / 128.f : a.scale[m * supers + b];
          acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_set1_ps(d * dx), acc[r][m]);
        }
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < M; ++m)
        y[m * N + n + r] = _mm512_reduce_add_ps(acc[r][m]) + (kK6 ? 0.f : reduce_add8(mins[r][m]));
  }
}

// int8_super_rows with two codes per value for several rows of x: x as one 16-bit value per value,
// 128 c + r (quantize_super's `wide`), and the weight's codes widened to 16 bits and multiplied by
// their sub-block's scale once per chunk for the whole group of x's rows (Q4_K / Q5_K: u * sc <=
// 31 * 63; Q6_K: its offset folded in, (u - 32) * sc in [-4096, 4096]). Each row of x then costs one
// VPDPWSSD per 32 values, where int8_super_rows' two codes cost two VPMADDUBSW + VPDPWSSD per 64:
// at 16 rows, 1B shapes, Q4_K 4.7 -> 4.1 ms. The same integer sums as int8_super_rows (in other
// lanes; a lane's at most 16 * 4096 * 16320 < 2^31), and Q6_K's per 256 values.
template <int64_t T, int M, int NR>
void wide_super_rows(ActView a, int64_t K, const uint8_t* w, int64_t row_bytes, float* y, int64_t N, int64_t n0,
                     int64_t n1) {
  constexpr bool kK6 = T == Q6_K;
  const int64_t supers = K / QK_K, chunk_bytes = row_bytes / (K / 64);
  const int64_t ahead = rows_ahead(NR, row_bytes, kIntPrefetchBytes);
  for (int64_t n = n0; n < n1; n += NR) {
    __m512 acc[NR][M];
    __m256 mins[NR][M];
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps(), mins[r][m] = _mm256_setzero_ps();
    const bool fetch = n + ahead + NR <= n1;
    for (int64_t b = 0; b < supers; ++b) {
      for (int r = 0; r < NR; ++r) {
        const uint8_t* sb = w + (n + r) * row_bytes + b * kSuperBytes<T>;
        alignas(16) int8_t sc[16];  // Q4_K / Q5_K: [sc0..7, m0..7] (6 bits); Q6_K: 16 signed scales
        float d;
        if constexpr (kK6) {
          std::memcpy(sc, sb + 192, 16);
          d = half_at(sb + 208);
        } else {
          __m128i sm;
          d = k4_super_header<M>(sb, a.block_sum, K, b, mins[r], sm);
          _mm_store_si128(reinterpret_cast<__m128i*>(sc), sm);
        }
        __m512i sums[M];
        for (int m = 0; m < M; ++m) sums[m] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) {
          if (fetch) prefetch(w + (n + ahead + r) * row_bytes + (4 * b + j) * chunk_bytes);
          __m512i lo, hi;  // values 0..31 and 32..63 of the chunk, 16 bits each, times their scales
          if constexpr (kK6) {
            const __m512i q = _mm512_sub_epi8(k6_codes(sb, j), _mm512_set1_epi8(32));
            // 16 values a scale: groups 4j, 4j + 1 in the low half, 4j + 2, 4j + 3 in the high one
            const auto scales = [&](int g) {
              return _mm512_inserti64x4(_mm512_set1_epi16(sc[g]), _mm256_set1_epi16(sc[g + 1]), 1);
            };
            lo = _mm512_mullo_epi16(_mm512_cvtepi8_epi16(_mm512_castsi512_si256(q)), scales(4 * j));
            hi = _mm512_mullo_epi16(_mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(q, 1)), scales(4 * j + 2));
          } else {
            if constexpr (T == Q4_K) {  // a byte's two nibbles are one code of each sub-block
              const __m512i v = _mm512_cvtepu8_epi16(load32(sb + 16 + 32 * j));
              lo = _mm512_and_si512(v, _mm512_set1_epi16(0x0F));
              hi = _mm512_srli_epi16(v, 4);
            } else {
              const __m512i u = k4_codes<T>(sb, j);
              lo = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(u));
              hi = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(u, 1));
            }
            lo = _mm512_mullo_epi16(lo, _mm512_set1_epi16(static_cast<uint8_t>(sc[2 * j])));
            hi = _mm512_mullo_epi16(hi, _mm512_set1_epi16(static_cast<uint8_t>(sc[2 * j + 1])));
          }
          for (int m = 0; m < M; ++m) {
            const int16_t* xm = a.wide + m * K + 256 * b + 64 * j;
            sums[m] = _mm512_dpwssd_epi32(sums[m], lo, _mm512_loadu_si512(xm));
            sums[m] = _mm512_dpwssd_epi32(sums[m], hi, _mm512_loadu_si512(xm + 32));
          }
        }
        for (int m = 0; m < M; ++m)
          acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[m]),
                                      _mm512_set1_ps(d * (a.scale[m * supers + b] / 128.f)), acc[r][m]);
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < M; ++m)
        y[m * N + n + r] = _mm512_reduce_add_ps(acc[r][m]) + (kK6 ? 0.f : reduce_add8(mins[r][m]));
  }
}

// The first n (all past 16) of 16 lanes.
inline __mmask16 first_lanes(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << n) - 1); }

// The 4 bytes at `first` and at every `stride` bytes after it, 16 of them (lanes past n zero), one
// a lane, in one gather: the float16 scales at the head of blocks (16 of a row's blocks, or one
// block of 16 rows), which word_halves takes apart. A block at a time, the scales cost about as
// much as the blocks' codes.
inline __m512i words16(const uint8_t* first, int64_t stride, int64_t n) {
  const __m512i at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                        _mm512_set1_epi32(static_cast<int32_t>(stride)));
  return _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), first_lanes(n), at, first, 1);
}

// The float16 value in each lane's low (high: its high) 16 bits, as floats.
inline __m512 word_halves(__m512i words, bool high) {
  return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(high ? _mm512_srli_epi32(words, 16) : words));
}

// Chunk c (blocks 2c and 2c + 1) of a row of a 32-value type: its 64 codes, unsigned (Q8_0's signed
// code + 128), in value order.
template <int64_t T>
inline __m512i chunk_codes(const uint8_t* row, int64_t c) {
  if constexpr (T == Q4_0 || T == Q4_1) {
    constexpr int64_t kBytes = T == Q4_0 ? 18 : 20, kHead = T == Q4_0 ? 2 : 4;
    const uint8_t* a = row + 2 * c * kBytes;
    return nibbles(a + kHead, a + kBytes + kHead);
  } else {
    const uint8_t* a = row + 2 * c * 34;
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));  // signed code + 128
    return join(_mm256_xor_si256(load32(a + 2), flip), _mm256_xor_si256(load32(a + 36), flip));
  }
}

// Rows [n0, n1) of y = x @ W^T for the 32-value blocks (Q4_0, Q4_1, Q8_0), x per 32 values, as
// q6_k_rows computes Q6_K's but 16 blocks (8 chunks) at a time: their float16 scales come in one gather (words16),
// W's scale times x's (block_scale) is one multiply for the 16 blocks and is spread over a chunk's
// two blocks by one permute, and the offset term (Q4_1: m times x's block sum; Q4_0: -8 d and Q8_0:
// -128 d times it) is one multiply-add for the 16 instead of one a chunk. Per chunk and row of x
// that leaves the products, one convert and one FMA (a multiply and two FMAs before), and a chunk's
// scales are no longer unpacked one pair at a time.
template <int64_t T, int M, int NR, bool kTwo>
void blocks16_rows(ActView a, int64_t K, const uint8_t* w, int64_t row_bytes, float* y, int64_t N, int64_t n0,
                   int64_t n1) {
  static_assert(T == Q4_0 || T == Q4_1 || T == Q8_0, "blocks16_rows takes the 32-value blocks");
  constexpr int64_t kBytes = T == Q4_0 ? 18 : T == Q4_1 ? 20 : 34;
  const int64_t blocks = K / 32, chunk_bytes = 2 * kBytes;
  const int64_t ahead = rows_ahead(NR, row_bytes, kIntPrefetchBytes);
  for (int64_t n = n0; n < n1; n += NR) {
    __m512 acc[NR][M];
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
    const bool fetch = n + ahead + NR <= n1;
    for (int64_t b0 = 0; b0 < blocks; b0 += 16) {
      const int nb = static_cast<int>(std::min<int64_t>(16, blocks - b0));  // even: K is a multiple of 64
      const __mmask16 live = first_lanes(nb);
      for (int r = 0; r < NR; ++r) {
        const uint8_t* row = w + (n + r) * row_bytes;
        const __m512i heads = words16(row + b0 * kBytes, kBytes, nb);  // d (Q4_1: and m)
        const __m512 d = word_halves(heads, false);
        const __m512 offset = T == Q4_1 ? word_halves(heads, true)
                                        : _mm512_mul_ps(d, _mm512_set1_ps(T == Q4_0 ? -8.f : -128.f));
        __m512 scale[M];  // W's d times x's scale, a block a lane
        for (int m = 0; m < M; ++m) {
          const int64_t at = m * blocks + b0;
          scale[m] = _mm512_mul_ps(d, _mm512_maskz_loadu_ps(live, a.block_scale + at));
          acc[r][m] = _mm512_fmadd_ps(offset, _mm512_maskz_loadu_ps(live, a.block_sum + at), acc[r][m]);
        }
        for (int j = 0; j < nb / 2; ++j) {
          const int64_t c = b0 / 2 + j;
          if (fetch) prefetch(w + (n + ahead + r) * row_bytes + c * chunk_bytes);
          const __m512i u = chunk_codes<T>(row, c);
          const __m512i pick = _mm512_inserti64x4(_mm512_set1_epi32(2 * j), _mm256_set1_epi32(2 * j + 1), 1);
          for (int m = 0; m < M; ++m) {
            const __m512i dot = x_dot<kTwo>(u, a, m * K + 64 * c);
            acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(pick, scale[m]), acc[r][m]);
          }
        }
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < M; ++m) y[m * N + n + r] = _mm512_reduce_add_ps(acc[r][m]);
  }
}

// The row kernels as types, so that one switch serves both: x per 32 values (the 32-value blocks,
// Q6_K with two codes), and per 256 (int8_super_rows).
template <int64_t T, bool kTwo>
struct LaneRows {
  template <int M, int NR>
  static void run(ActView a, int64_t K, const uint8_t* w, int64_t row_bytes, float* y, int64_t N, int64_t n0,
                  int64_t n1) {
    if constexpr (T == Q6_K) q6_k_rows<M, NR, kTwo>(a, K, w, row_bytes, y, N, n0, n1);
    else if constexpr (T == Q8_0) {
      if (a.joined != nullptr) q8_0_joined_rows<M, NR>(a, K, w, row_bytes, y, N, n0, n1);
      else blocks16_rows<T, M, NR, kTwo>(a, K, w, row_bytes, y, N, n0, n1);
    } else blocks16_rows<T, M, NR, kTwo>(a, K, w, row_bytes, y, N, n0, n1);
  }
};
template <int64_t T, bool kTwo>
struct SuperRows {
  template <int M, int NR>
  static void run(ActView a, int64_t K, const uint8_t* w, int64_t row_bytes, float* y, int64_t N, int64_t n0,
                  int64_t n1) {
    int8_super_rows<T, M, NR, kTwo>(a, K, w, row_bytes, y, N, n0, n1);
  }
};

template <int64_t T>
struct WideRows {
  template <int M, int NR>
  static void run(ActView a, int64_t K, const uint8_t* w, int64_t row_bytes, float* y, int64_t N, int64_t n0,
                  int64_t n1) {
    wide_super_rows<T, M, NR>(a, K, w, row_bytes, y, N, n0, n1);
  }
};

#elif defined(PAGELLM_INT8_ACTIVATIONS)  // AVX2

// Byte lanes of a vector of 8 int32 quads packed to int8: packs interleave 128-bit halves.
inline __m256i pack_codes(__m256 r0, __m256 r1, __m256 r2, __m256 r3) {
  const __m256i p01 = _mm256_packs_epi32(_mm256_cvtps_epi32(r0), _mm256_cvtps_epi32(r1));
  const __m256i p23 = _mm256_packs_epi32(_mm256_cvtps_epi32(r2), _mm256_cvtps_epi32(r3));
  return _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p01, p23), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// Per 4-byte lane, the sum of u[i] * c[i] (u unsigned bytes, c signed; a pair's sum must fit 16
// bits, which every caller's codes do, so both forms give the same sums). CPUs with AVX-VNNI but
// no AVX-512 (Intel's since Alder Lake) do it in one instruction, VEX-encoded VPDPBUSD.
inline __m256i dot4(__m256i u, __m256i c) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, c);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, c), _mm256_set1_epi16(1));
#endif
}

// 128 (u . c) + u . r per 4-byte lane (two codes): without VNNI the factor 128 rides on the
// widening multiply-add of c's pairs (within int32: 128 * 2 * 32,512), which spares a shift.
inline __m256i dot4_two(__m256i u, __m256i c, __m256i r) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_slli_epi32(dot4(u, c), 7), u, r);
#else
  return _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(u, c), _mm256_set1_epi16(128)),
                          _mm256_madd_epi16(_mm256_maddubs_epi16(u, r), _mm256_set1_epi16(1)));
#endif
}

// 32 values of W (u: unsigned codes; with `signs`, the magnitudes of signed codes whose signs go
// onto x's) times x's codes at `at` (x rounded per 32 values): dot4, or with two codes dot4_two.
template <bool kTwo, bool kSigned>
inline __m256i x_dot(__m256i u, __m256i signs, const ActView& a, int64_t at) {
  __m256i cx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.codes + at));
  if constexpr (kSigned) cx = _mm256_sign_epi8(cx, signs);
  if constexpr (!kTwo) return dot4(u, cx);
  __m256i rx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.residual + at));
  if constexpr (kSigned) rx = _mm256_sign_epi8(rx, signs);
  return dot4_two(u, cx, rx);
}

// The scale of n values at x (n a multiple of 8), as the AVX-512 quantizers take it: d = max|x| / 127
// and its inverse 127 / max|x|; a NaN or infinity makes d NaN (so are the products of that row)
// and the inverse 0, an all-zero run the inverse 0.
struct BlockScale {
  float d, inv;
};
inline BlockScale block_scale(const float* x, int n) {
  const __m256 sign = _mm256_set1_ps(-0.0f), inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  __m256 mag = _mm256_setzero_ps();
  int finite = 0xFF;
  for (int k = 0; k < n; k += 8) {
    const __m256 av = _mm256_andnot_ps(sign, _mm256_loadu_ps(x + k));
    mag = _mm256_max_ps(mag, av);
    finite &= _mm256_movemask_ps(_mm256_cmp_ps(av, inf, _CMP_LT_OQ));  // false for NaN and infinities
  }
  const __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mag), _mm256_extractf128_ps(mag, 1));
  const __m128 m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_movehdup_ps(m2)));
  const bool ok = finite == 0xFF;
  return {ok ? amax / 127.f : std::numeric_limits<float>::quiet_NaN(), ok && amax > 0.f ? 127.f / amax : 0.f};
}

// 32 values at x times inv, rounded half to even and saturated to int8: the codes stored at
// `codes`; returns per 4-value lane their sum. With `residual`, the second codes (what rounding
// left, times 128, as residual32 in the AVX-512 code) are stored there, and the lane sums are of
// 128 c + r.
inline __m256i round32(const float* x, __m256 inv, int8_t* codes, int8_t* residual) {
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m256i ones = _mm256_set1_epi8(1);
  __m256 v[4], r[4];
  for (int q = 0; q < 4; ++q) {
    v[q] = _mm256_loadu_ps(x + 8 * q);
    r[q] = _mm256_round_ps(_mm256_mul_ps(v[q], inv), kNearest);
  }
  const __m256i c = pack_codes(r[0], r[1], r[2], r[3]);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes), c);
  const __m256i sums = dot4(ones, c);
  if (residual == nullptr) return sums;
  const __m256 f = _mm256_set1_ps(128.f);
  __m256 e[4];
  for (int q = 0; q < 4; ++q) e[q] = _mm256_mul_ps(_mm256_fmsub_ps(v[q], inv, r[q]), f);
  const __m256i res = pack_codes(e[0], e[1], e[2], e[3]);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(residual), res);
  return _mm256_add_epi32(_mm256_slli_epi32(sums, 7), dot4(ones, res));
}

// As the AVX-512 quantize_activations, 8 lanes at a time: the same codes, scales and sums. With
// `joined`, also each value's codes as one 16-bit value (join_codes), for q8_0_joined_rows.
ActRows quantize_activations(const float* x, int64_t M, int64_t K, bool two_terms, bool joined = false) {
  ActRows a{std::vector<int8_t>(M * K), std::vector<int8_t>(two_terms ? M * K : 0), std::vector<float>(M * K / 4),
            std::vector<float>(M * K / 4)};
  a.block_scale.resize(M * K / 32);  // for blocks8_rows
  a.block_sum.resize(M * K / 32);
  if (joined) a.joined.resize(M * K);
  for (int64_t i = 0; i < M * K; i += 32) {
    const BlockScale s = block_scale(x + i, 32);
    const __m256i sums = round32(x + i, _mm256_set1_ps(s.inv), a.codes.data() + i,
                                 two_terms ? a.residual.data() + i : nullptr);
    if (joined) join_codes(a.codes.data() + i, two_terms ? a.residual.data() + i : nullptr, 32, a.joined.data() + i);
    const __m256 dv = _mm256_set1_ps(two_terms ? s.d / 128.f : s.d);
    const __m256 lane_sums = _mm256_mul_ps(_mm256_cvtepi32_ps(sums), dv);
    _mm256_storeu_ps(a.lane_sum.data() + i / 4, lane_sums);
    _mm256_storeu_ps(a.lane_scale.data() + i / 4, dv);
    a.block_scale[i / 32] = _mm256_cvtss_f32(dv);
    a.block_sum[i / 32] = reduce_add8(lane_sums);
  }
  return a;
}

inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline __m256i and8(__m256i v, int m) { return _mm256_and_si256(v, _mm256_set1_epi8(static_cast<char>(m))); }
inline __m256i shr(__m256i v, int s) { return _mm256_srli_epi16(v, s); }
inline __m256i shl(__m256i v, int s) { return _mm256_slli_epi16(v, s); }

// A Q6_K super-block's 16 group scales d * sc as floats, decoded once for its 4 chunks.
inline void q6_k_scales(const uint8_t* sb, float* s) {
  const int8_t* sc = reinterpret_cast<const int8_t*>(sb + 192);
  const float d = half_at(sb + 208);
  for (int g = 0; g < 16; ++g) s[g] = d * sc[g];
}

// The 32 codes of half h (0, 1) of chunk j (0..3) of a K-quant super-block sb, in value order:
// Q4_K / Q5_K sub-block 2 j + h (unsigned); Q6_K values 64 j + 32 h.., groups 4 j + 2 h and + 1
// (see k6_codes), signed (the 6-bit code - 32), which spares an offset term.
template <int64_t T>
inline __m256i k_codes(const uint8_t* sb, int j, int h) {
  if constexpr (T == Q6_K) {
    const int half = j / 2, part = j % 2;
    const __m256i lo = and8(shr(load32(sb + 64 * half + 32 * h), 4 * part), 0x0F);
    const __m256i top = shl(and8(shr(load32(sb + 128 + 32 * half), 4 * part + 2 * h), 3), 4);
    return _mm256_sub_epi8(_mm256_or_si256(lo, top), _mm256_set1_epi8(32));
  } else {
    const __m256i v = load32(sb + (T == Q4_K ? 16 : 48) + 32 * j);
    const __m256i u = h == 0 ? and8(v, 0x0F) : and8(shr(v, 4), 0x0F);
    if constexpr (T == Q5_K) return _mm256_or_si256(u, shl(and8(shr(load32(sb + 16), 2 * j + h), 1), 4));
    return u;
  }
}

// Rows [n0, n1) of y = x @ W^T for M rows of x (rounded per 32 values), NR rows of W at a time,
// for Q6_K with two codes per value (the 32-value blocks: blocks8_rows; the other K-quants, and
// Q6_K with one code: int8_super_rows), a super-block (4 chunks) at a time, its scales decoded once.
// Per 32 values (two 16-value groups) and row of x: VPMADDUBSW and VPMADDWD give the 8 lanes'
// integer sums (the signed codes' magnitudes against x's codes with their signs, so a pair stays
// within 16 bits), then one convert and one FMA.
template <int M, int NR, bool kTwo>
void q6_k_rows(ActView a, int64_t K, const uint8_t* w, int64_t row_bytes, float* y, int64_t N, int64_t n0,
               int64_t n1) {
  const int64_t chunks = K / 64, chunk_bytes = row_bytes / chunks;
  const int64_t ahead = rows_ahead(NR, row_bytes, kIntPrefetchBytes);
  float scales[NR][16];
  row_groups<M, NR>(n0, n1, ahead, y, N, [&](int64_t n, bool fetch, __m256 (&acc)[NR][M]) {
    for (int64_t c0 = 0; c0 < chunks; c0 += 4) {
      const int64_t sb = (c0 / 4) * kSuperBytes<Q6_K>;
      for (int r = 0; r < NR; ++r) q6_k_scales(w + (n + r) * row_bytes + sb, scales[r]);
      for (int j = 0; j < 4; ++j) {
        const int64_t c = c0 + j;
        if (fetch)
          for (int r = 0; r < NR; ++r) prefetch(w + (n + ahead + r) * row_bytes + c * chunk_bytes);
        for (int r = 0; r < NR; ++r)
          for (int h = 0; h < 2; ++h) {
            const __m256i codes = k_codes<Q6_K>(w + (n + r) * row_bytes + sb, j, h);
            const __m256 dsc = _mm256_set_m128(_mm_set1_ps(scales[r][4 * j + 2 * h + 1]), _mm_set1_ps(scales[r][4 * j + 2 * h]));
            const __m256i u = _mm256_sign_epi8(codes, codes);
            for (int m = 0; m < M; ++m) {
              const int64_t at = m * K + 64 * c + 32 * h;
              const __m256i dot = x_dot<kTwo, true>(u, codes, a, at);
              const __m256 dx = _mm256_loadu_ps(a.scale + at / 4);
              acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dsc, dx), acc[r][m]);
            }
          }
      }
    }
  });
}

// The float16 pairs at the head of n (<= 8) consecutive blocks, `block_bytes` apart from `first`, in
// one gather (lanes past n zero): the first halves (every type's d) and the second (Q4_1's m).
inline void block_heads8(const uint8_t* first, int64_t block_bytes, int n, __m256& d, __m256& m) {
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lanes);
  const __m256i words = _mm256_mask_i32gather_epi32(
      _mm256_setzero_si256(), reinterpret_cast<const int*>(first),
      _mm256_mullo_epi32(lanes, _mm256_set1_epi32(static_cast<int>(block_bytes))), live, 1);
  // each 128-bit lane's first halves into its low 8 bytes, its second halves into the high 8; then
  // both lanes' first halves side by side, and their second halves
  const __m256i split = _mm256_shuffle_epi8(words, _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                                                    0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
  const __m256i halves = _mm256_permute4x64_epi64(split, 0xD8);
  d = _mm256_cvtph_ps(_mm256_castsi256_si128(halves));
  m = _mm256_cvtph_ps(_mm256_extracti128_si256(halves, 1));
}

// Rows [n0, n1) of y = x @ W^T for Q4_0 and Q4_1 blocks (Q8_0: q8_0_joined_rows), x per 32 values, as
// q6_k_rows computes Q6_K's but 8 blocks at a time: their float16 scales come in one gather (block_heads8), W's scale
// times x's (block_scale) is one multiply for the 8 blocks and picked out per block by one
// permute, and the offset term (Q4_1: m times x's block sum; Q4_0: -8 d times it) is one
// multiply-add for the 8 instead of one a block. Per block and row of x that leaves the products,
// one convert and one FMA: the scalar conversions and broadcasts of a block's float16 values had
// cost about as much as its products.
template <int64_t T, int M, int NR, bool kTwo>
void blocks8_rows(ActView a, int64_t K, const uint8_t* w, int64_t row_bytes, float* y, int64_t N, int64_t n0,
                  int64_t n1) {
  static_assert(T == Q4_0 || T == Q4_1, "blocks8_rows takes the 4-bit 32-value blocks");
  constexpr int64_t kBytes = T == Q4_0 ? 18 : 20, kHead = T == Q4_1 ? 4 : 2;
  const int64_t blocks = K / 32;
  const int64_t ahead = rows_ahead(NR, row_bytes, kIntPrefetchBytes);
  row_groups<M, NR>(n0, n1, ahead, y, N, [&](int64_t n, bool fetch, __m256 (&acc)[NR][M]) {
    for (int64_t b0 = 0; b0 < blocks; b0 += 8) {
      const int nb = static_cast<int>(std::min<int64_t>(8, blocks - b0));
      const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(nb), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      if (fetch)
        for (int r = 0; r < NR; ++r)
          for (int64_t l = 0; l < nb * kBytes; l += 64) prefetch(w + (n + ahead + r) * row_bytes + b0 * kBytes + l);
      for (int r = 0; r < NR; ++r) {
        const uint8_t* row = w + (n + r) * row_bytes + b0 * kBytes;
        __m256 d, mh;
        block_heads8(row, kBytes, nb, d, mh);
        __m256 scale[M];  // W's d times x's scale, a block a lane
        for (int m = 0; m < M; ++m) {
          const int64_t at = m * blocks + b0;
          scale[m] = _mm256_mul_ps(d, _mm256_maskload_ps(a.block_scale + at, live));
          const __m256 offset = T == Q4_1 ? mh : _mm256_mul_ps(d, _mm256_set1_ps(-8.f));
          acc[r][m] = _mm256_fmadd_ps(offset, _mm256_maskload_ps(a.block_sum + at, live), acc[r][m]);
        }
        for (int i = 0; i < nb; ++i) {
          const __m128i q = load16(row + i * kBytes + kHead);
          const __m256i u = _mm256_set_m128i(and8(shr(q, 4), 0x0F), and8(q, 0x0F));
          const __m256i pick = _mm256_set1_epi32(i);
          for (int m = 0; m < M; ++m) {
            const __m256i dot = x_dot<kTwo, false>(u, u, a, m * K + 32 * (b0 + i));
            acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_permutevar8x32_ps(scale[m], pick), acc[r][m]);
          }
        }
      }
    }
  });
}

template <int64_t T, bool kTwo>
struct LaneRows {
  template <int M, int NR>
  static void run(ActView a, int64_t K, const uint8_t* w, int64_t row_bytes, float* y, int64_t N, int64_t n0,
                  int64_t n1) {
    if constexpr (T == Q6_K) q6_k_rows<M, NR, kTwo>(a, K, w, row_bytes, y, N, n0, n1);
    else if constexpr (T == Q8_0) q8_0_joined_rows<M, NR>(a, K, w, row_bytes, y, N, n0, n1);
    else blocks8_rows<T, M, NR, kTwo>(a, K, w, row_bytes, y, N, n0, n1);
  }
};

// As the AVX-512 quantize_super: x with one scale per 256 values, the same codes, scales and block
// sums; no per-16 code sums, which int8_super_rows here has no use for (Q6_K's codes are signed).
ActRows quantize_super(const float* x, int64_t M, int64_t K, bool two_terms) {
  ActRows a{std::vector<int8_t>(M * K), std::vector<int8_t>(two_terms ? M * K : 0), {}, {},
            std::vector<float>(M * K / 32), std::vector<float>(M * K / QK_K)};
  for (int64_t i = 0; i < M * K; i += QK_K) {
    const BlockScale s = block_scale(x + i, QK_K);
    const __m256 inv = _mm256_set1_ps(s.inv);
    a.super_scale[i / QK_K] = s.d;
    for (int64_t k = i; k < i + QK_K; k += 32) {
      const __m256i sums = round32(x + k, inv, a.codes.data() + k, two_terms ? a.residual.data() + k : nullptr);
      a.block_sum[k / 32] = reduce_add8(_mm256_cvtepi32_ps(sums)) * (two_terms ? s.d / 128.f : s.d);
    }
  }
  return a;
}

// The K-quants against x from quantize_super, as the AVX-512 int8_super_rows: per 32
// values and row of x, VPMADDUBSW multiplies codes into 16-bit pair sums and VPMADDWD applies the
// sub-blocks' integer scales (Q4_K / Q5_K: 6-bit, per 32 values; Q6_K: signed 8-bit, per 16) into
// int32; once per super-block the sums convert to float, times d * dx. Q6_K's codes are signed
// (k_codes), so no offset term; Q4_K / Q5_K's mins as in the AVX-512 kernel.
template <int64_t T, int M, int NR, bool kTwo>
void int8_super_rows(ActView a, int64_t K, const uint8_t* w, int64_t row_bytes, float* y, int64_t N, int64_t n0,
                     int64_t n1) {
  constexpr bool kK6 = T == Q6_K;
  const int64_t supers = K / QK_K, chunk_bytes = row_bytes / (K / 64);
  const int64_t ahead = rows_ahead(NR, row_bytes, kIntPrefetchBytes);
  alignas(32) float mins8[8];
  for (int64_t n = n0; n < n1; n += NR) {
    __m256 acc[NR][M], mins[NR][M];
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = mins[r][m] = _mm256_setzero_ps();
    const bool fetch = n + ahead + NR <= n1;
    for (int64_t b = 0; b < supers; ++b) {
      for (int r = 0; r < NR; ++r) {
        const uint8_t* sb = w + (n + r) * row_bytes + b * kSuperBytes<T>;
        int16_t sc[16];  // Q4_K / Q5_K: the 8 sub-blocks' scales; Q6_K: the 16 groups'
        float d;
        if constexpr (kK6) {
          for (int g = 0; g < 16; ++g) sc[g] = reinterpret_cast<const int8_t*>(sb + 192)[g];
          d = half_at(sb + 208);
        } else {
          d = half_at(sb);
          const float dmin = half_at(sb + 2);
          for (int j = 0; j < 8; ++j) {
            uint8_t s6, m6;
            scale_min_k4(j, sb + 4, &s6, &m6);
            sc[j] = s6;
            mins8[j] = -dmin * m6;
          }
          for (int m = 0; m < M; ++m)
            mins[r][m] = _mm256_fmadd_ps(_mm256_load_ps(mins8), _mm256_loadu_ps(a.block_sum + m * K / 32 + 8 * b),
                                         mins[r][m]);
        }
        __m256i sums[M], second[M];  // second: the residual codes' sums (kTwo)
        for (int m = 0; m < M; ++m) sums[m] = second[m] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) {
          if (fetch) prefetch(w + (n + ahead + r) * row_bytes + (4 * b + j) * chunk_bytes);
          for (int h = 0; h < 2; ++h) {
            const __m256i u = k_codes<T>(sb, j, h);
            const __m256i uu = kK6 ? _mm256_sign_epi8(u, u) : u;
            const __m256i scv = kK6 ? _mm256_set_m128i(_mm_set1_epi16(sc[4 * j + 2 * h + 1]),
                                                       _mm_set1_epi16(sc[4 * j + 2 * h]))
                                    : _mm256_set1_epi16(sc[2 * j + h]);
            for (int m = 0; m < M; ++m) {
              const int64_t at = m * K + 256 * b + 64 * j + 32 * h;
              __m256i cx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.codes + at));
              if constexpr (kK6) cx = _mm256_sign_epi8(cx, u);
              sums[m] = _mm256_add_epi32(sums[m], _mm256_madd_epi16(_mm256_maddubs_epi16(uu, cx), scv));
              if constexpr (kTwo) {
                const __m256i rx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.residual + at));
                second[m] = _mm256_add_epi32(second[m], _mm256_madd_epi16(_mm256_maddubs_epi16(uu, rx), scv));
              }
            }
          }
        }
        // two codes (Q4_K / Q5_K only): (128 sum(u c) + sum(u r)) dx / 128, within int32 as there
        for (int m = 0; m < M; ++m) {
          const __m256i total = kTwo ? _mm256_add_epi32(_mm256_slli_epi32(sums[m], 7), second[m]) : sums[m];
          const float dx = kTwo ? a.scale[m * supers + b] / 128.f : a.scale[m * supers + b];
          acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_set1_ps(d * dx), acc[r][m]);
        }
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < M; ++m) y[m * N + n + r] = reduce_add8(acc[r][m]) + (kK6 ? 0.f : reduce_add8(mins[r][m]));
  }
}

template <int64_t T, bool kTwo>
struct SuperRows {
  template <int M, int NR>
  static void run(ActView a, int64_t K, const uint8_t* w, int64_t row_bytes, float* y, int64_t N, int64_t n0,
                  int64_t n1) {
    int8_super_rows<T, M, NR, kTwo>(a, K, w, row_bytes, y, N, n0, n1);
  }
};
#endif

#if defined(PAGELLM_INT8_ACTIVATIONS)
// ---- single-row kernels over repacked tiles (Q4_1_X8, Q4_K_X8, Q5_K_X8, Q6_K_X8) --------------
// One vector holds kXRows rows' lanes, two 32-bit lanes a row (the row's 8 bytes of a unit: 4
// values each); AVX-512 one vector for a tile's 8 rows, AVX2 two of 4, taken one after the other
// within each tile. (Taken over the whole row one after the other, as they were, the second half's
// pass found every line in cache and the first's every line in memory, so the core computed half
// the time with no line to fetch: Q6_K one row, one thread, 1.1-1.2x slower.)
#if defined(PAGELLM_INT8_VNNI)
using XI = __m512i;
using XF = __m512;
constexpr int kXRows = 8;
inline XI xi_zero() { return _mm512_setzero_si512(); }
inline XI xi_load(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline XI xi_bcast64(const int8_t* p) { return _mm512_broadcastq_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline XI xi_bcast128(const uint8_t* p) { return _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline XI xi_bytes(int8_t b) { return _mm512_set1_epi8(b); }
inline XI xi_and(XI a, XI b) { return _mm512_and_si512(a, b); }
inline XI xi_or(XI a, XI b) { return _mm512_or_si512(a, b); }
inline XI xi_srli16(XI a, int s) { return _mm512_srli_epi16(a, s); }
inline XI xi_slli16(XI a, int s) { return _mm512_slli_epi16(a, s); }
inline XI xi_slli32(XI a, int s) { return _mm512_slli_epi32(a, s); }
inline XI xi_srai32(XI a, int s) { return _mm512_srai_epi32(a, s); }
inline XI xi_add32(XI a, XI b) { return _mm512_add_epi32(a, b); }
inline XI xi_sub32(XI a, XI b) { return _mm512_sub_epi32(a, b); }
inline XI xi_shuffle(XI a, XI c) { return _mm512_shuffle_epi8(a, c); }
inline XI xi_controls(const int8_t* c) { return _mm512_loadu_si512(c); }
// acc + per 32-bit lane the sum of 4 products of unsigned u and signed c
inline XI xi_dot4(XI acc, XI u, XI c) { return _mm512_dpbusd_epi32(acc, u, c); }
// acc + per 32-bit lane a.lo16 * b.lo16 + a.hi16 * b.hi16
inline XI xi_madd16(XI acc, XI a, XI b) { return _mm512_dpwssd_epi32(acc, a, b); }
inline XF xf_zero() { return _mm512_setzero_ps(); }
inline XF xf_cvt(XI a) { return _mm512_cvtepi32_ps(a); }
inline XF xf_mul(XF a, XF b) { return _mm512_mul_ps(a, b); }
inline XF xf_fmadd(XF a, XF b, XF c) { return _mm512_fmadd_ps(a, b, c); }
inline XF xf_set1(float a) { return _mm512_set1_ps(a); }
inline void xf_store(float* p, XF v) { _mm512_storeu_ps(p, v); }
// The 8 float16 values at p, each in its row's two lanes (rows [kXRows h, kXRows h + kXRows)).
inline XF xf_row_halves(const uint8_t* p, int) {
  const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7),
                               _mm512_castps256_ps512(v));
}
#else
using XI = __m256i;
using XF = __m256;
constexpr int kXRows = 4;
inline XI xi_zero() { return _mm256_setzero_si256(); }
inline XI xi_load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline XI xi_bcast64(const int8_t* p) { return _mm256_broadcastq_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline XI xi_bcast128(const uint8_t* p) { return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline XI xi_bytes(int8_t b) { return _mm256_set1_epi8(b); }
inline XI xi_and(XI a, XI b) { return _mm256_and_si256(a, b); }
inline XI xi_or(XI a, XI b) { return _mm256_or_si256(a, b); }
inline XI xi_srli16(XI a, int s) { return _mm256_srli_epi16(a, s); }
inline XI xi_slli16(XI a, int s) { return _mm256_slli_epi16(a, s); }
inline XI xi_slli32(XI a, int s) { return _mm256_slli_epi32(a, s); }
inline XI xi_srai32(XI a, int s) { return _mm256_srai_epi32(a, s); }
inline XI xi_add32(XI a, XI b) { return _mm256_add_epi32(a, b); }
inline XI xi_sub32(XI a, XI b) { return _mm256_sub_epi32(a, b); }
inline XI xi_shuffle(XI a, XI c) { return _mm256_shuffle_epi8(a, c); }
inline XI xi_controls(const int8_t* c) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c)); }
inline XI xi_dot4(XI acc, XI u, XI c) { return _mm256_add_epi32(acc, dot4(u, c)); }
inline XI xi_madd16(XI acc, XI a, XI b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
inline XF xf_zero() { return _mm256_setzero_ps(); }
inline XF xf_cvt(XI a) { return _mm256_cvtepi32_ps(a); }
inline XF xf_mul(XF a, XF b) { return _mm256_mul_ps(a, b); }
inline XF xf_fmadd(XF a, XF b, XF c) { return _mm256_fmadd_ps(a, b, c); }
inline XF xf_set1(float a) { return _mm256_set1_ps(a); }
inline void xf_store(float* p, XF v) { _mm256_storeu_ps(p, v); }
inline XF xf_row_halves(const uint8_t* p, int h) {
  const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const int r = kXRows * h;
  return _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(r, r, r + 1, r + 1, r + 2, r + 2, r + 3, r + 3));
}
#endif
constexpr int kXVecs = kX8Rows / kXRows;
constexpr int kXBytes = kXRows * 8;  // one vector's share of a 64-byte unit

// AVX2 without a VNNI form (AMD before Zen 4, Intel before Alder Lake) multiplies bytes in two steps,
// VPMADDUBSW into 16-bit pairs and VPMADDWD into 32-bit lanes. Where a sub-block's products stay
// within 16 bits (Q4_K: 4 units of 2 products of 15 * 127, at most 15,240 a pair), its pairs are
// summed in 16 bits and widened once, by the multiply-add that applies the sub-block's scale (the
// scale in both halves of each lane): 2 instructions a unit and code instead of 3.
#if !defined(PAGELLM_INT8_VNNI) && !defined(__AVXVNNI__)
#define PAGELLM_PAIRS16
constexpr bool kPairs16 = true;
#else
constexpr bool kPairs16 = false;
#endif
// acc + u times c, by pairs (kPairs16: 16-bit lanes, each the sum of 2 products) or by quads.
inline XI xi_dot_pairs(XI acc, XI u, XI c) {
#if defined(PAGELLM_PAIRS16)
  return _mm256_add_epi16(acc, _mm256_maddubs_epi16(u, c));
#else
  return xi_dot4(acc, u, c);
#endif
}
// u0 c0 + u1 c1 by pairs (kPairs16) or quads: at most twice a pair's products, within 16 bits.
inline XI xi_dot_two(XI u0, XI c0, XI u1, XI c1) { return xi_dot_pairs(xi_dot_pairs(xi_zero(), u0, c0), u1, c1); }
// xi_dot_pairs' sums as 32-bit lanes, times 2^shift.
inline XI xi_widen(XI v, int shift) {
#if defined(PAGELLM_PAIRS16)
  return _mm256_madd_epi16(v, _mm256_set1_epi16(static_cast<int16_t>(1 << shift)));
#else
  return shift ? xi_slli32(v, shift) : v;
#endif
}

// Byte-shuffle controls that put the scale byte of each lane's row (of 8 at the start of the
// shuffled 16 bytes, or of the 8 after them: `second`) into the lane's byte `at` (`pairs`: and
// `at` + 2, the scale of both 16-bit halves), zeroing the rest.
inline XI scale_controls(int h, bool second, int at, bool pairs = false) {
  int8_t c[4 * 2 * kXRows];
  for (int i = 0; i < 2 * kXRows; ++i)
    for (int k = 0; k < 4; ++k)
      c[4 * i + k] = k == at || (pairs && k == at + 2) ? static_cast<int8_t>(kXRows * h + i / 2 + (second ? 8 : 0)) : -1;
  return xi_controls(c);
}

// The tiles are one stream in the order the kernels read them. While a tile is multiplied, both
// kernels fetch its lines kIntPrefetchBytes ahead (lines [l0, l1) of a tile of `bytes` at t) into
// L2, not L1 (PREFETCHT1): on the Intel Xeon an L1 prefetch holds one of the core's few L1 miss
// buffers until its line arrives, and a stream fetched into L1 ran the one-row products at 6-8 GB/s
// of the core's 16; into L2, 8-11 (benchmarks/kernel_ab.py, one thread: Q4_K 1.1-1.4x, Q6_K
// 1.1-1.5x, in AVX-512 and AVX2 builds). AMD documents T1 into L2 from Zen 4 on; its earlier cores
// fetch into L1 as T0 does. Q4_K's kernel used to leave rows of 2048 values to the hardware's
// prefetcher alone (faster than an L1 prefetch); with the L2 one, fetching ahead wins on every shape.
inline void prefetch_tile(const uint8_t* t, int64_t bytes, int l0, int l1) {
  for (int l = l0; l < l1 && 64 * l < bytes; ++l) __builtin_prefetch(t + kIntPrefetchBytes + 64 * l, 0, 2);
}

// Rows' two lanes summed: the 8 rows' sums from the kXVecs accumulators' lanes.
inline void row_sums(const XF* acc, float* y) {
  alignas(64) float lanes[2 * kXRows];
  for (int h = 0; h < kXVecs; ++h) {
    xf_store(lanes, acc[h]);
    for (int r = 0; r < kXRows; ++r) y[kXRows * h + r] = lanes[2 * r] + lanes[2 * r + 1];
  }
}
// As row_sums, then each row's term of the blocks' minimums (mins: the 8 rows' lanes) added.
inline void row_sums(const XF* acc, __m256 mins, float* y) {
  row_sums(acc, y);
  alignas(32) float mv[kX8Rows];
  _mm256_store_ps(mv, mins);
  for (int i = 0; i < kX8Rows; ++i) y[i] += mv[i];
}

// v's bit `from` of each byte at bit 4, the other bits of the byte zero (repacked Q5_K's fifth bits, kQ5Qh).
inline XI bit_at_4(XI v, int from) {
  return xi_and(from <= 4 ? xi_slli16(v, 4 - from) : xi_srli16(v, from - 4), xi_bytes(0x10));
}
inline __m128i bit_at_4(__m128i v, int from) {
  return _mm_and_si128(from <= 4 ? _mm_slli_epi16(v, 4 - from) : _mm_srli_epi16(v, from - 4), _mm_set1_epi8(0x10));
}

// 8 rows of a Q4_K_X8 weight (tiles: their K / 256 tiles) times R rows of x from quantize_super:
// y[r][0..8). Per sub-block the 16 values a lane sums (unsigned 4-bit codes times x's codes: within
// 16 bits, at most 16 * 15 * 127) take the sub-block's scale in one 16-bit multiply-add, into
// int32 (Σ over the super-block at most 8 * 63 * 30480: the two codes' sums apart, the first one
// shifted by 7 only at the end, within 2^31); per super-block one convert, times d * dx. The mins'
// term against x's per-32 sums, as int8_super_rows. The R rows share each load and unpacking of the
// codes, the scales' shuffles and the mins' widening; each row's arithmetic is the one-row kernel's,
// in the same order, so a row's sums do not depend on R.
// kFive: a Q5_K_X8 weight, each code's fifth bit joined from the quarter's qh vector (kQ5Qh). Its
// codes (0..31) bound a lane's 16 products at 16 * 31 * 127, past 16 bits: VNNI's 32-bit sums take the
// scale every 2 units (8 products) instead of 4 (AVX2's pairs: 4 units of 2 * 31 * 127 each still fit
// 16 bits); and the super-block's first-code sums (at most 8 * 63 * 62992) times 128 would pass 2^31,
// so the two codes' sums convert apart, each times its own scale.
template <int R, bool kTwo, bool kFive = false>
void q4_k_x8_rows(const ActView* a, int64_t K, const uint8_t* tiles, float* const* y) {
  constexpr int64_t kTile = kFive ? kQ5Tile : kQ4Tile;
  constexpr int kLinesPerQuarter = static_cast<int>((kTile / 64 + 3) / 4);
  constexpr int kRun = kFive && !kPairs16 ? 2 : 4;  // units whose products sum before the scale
  const int64_t supers = K / QK_K;
  const XI low = xi_bytes(0x0F);
  XF acc[R][kXVecs];
  __m256 mins[R];
  XI firsts[kXVecs], seconds[kXVecs];
  for (int r = 0; r < R; ++r) mins[r] = _mm256_setzero_ps();
  for (int h = 0; h < kXVecs; ++h) {
    firsts[h] = scale_controls(h, false, 0, kPairs16), seconds[h] = scale_controls(h, true, 0, kPairs16);
    for (int r = 0; r < R; ++r) acc[r][h] = xf_zero();
  }
  for (int64_t b = 0; b < supers; ++b) {
    const uint8_t* tb = tiles + b * kTile;
    for (int h = 0; h < kXVecs; ++h) {
      const XI first = firsts[h], second = seconds[h];
      const uint8_t* t = tb + h * kXBytes;
      XI sums[R], second_sums[R];
      for (int r = 0; r < R; ++r) sums[r] = second_sums[r] = xi_zero();
      for (int j = 0; j < 4; ++j) {  // sub-blocks 2j (low nibbles), 2j + 1 (high)
        if (h == 0) prefetch_tile(tb, kTile, kLinesPerQuarter * j, kLinesPerQuarter * (j + 1));
        const XI s = xi_bcast128(tb + kQ4Sc + 16 * j);
        const XI s0 = xi_shuffle(s, first), s1 = xi_shuffle(s, second);
        XI qh = xi_zero();
        if constexpr (kFive) qh = xi_load(t + kQ5Qh + 64 * j);
        for (int q0 = 0; q0 < 4; q0 += kRun) {
          XI c0[R], c1[R], r0[R], r1[R];
          for (int r = 0; r < R; ++r) c0[r] = c1[r] = r0[r] = r1[r] = xi_zero();
#pragma GCC unroll 4
          for (int q = q0; q < q0 + kRun; ++q) {
            const XI v = xi_load(t + (4 * j + q) * 64);
            XI lo = xi_and(v, low), hi = xi_and(xi_srli16(v, 4), low);
            if constexpr (kFive) lo = xi_or(lo, bit_at_4(qh, 2 * q)), hi = xi_or(hi, bit_at_4(qh, 2 * q + 1));
            const int64_t at = QK_K * b + 64 * j + 8 * q;
            for (int r = 0; r < R; ++r) {
              c0[r] = xi_dot_pairs(c0[r], lo, xi_bcast64(a[r].codes + at));
              c1[r] = xi_dot_pairs(c1[r], hi, xi_bcast64(a[r].codes + at + 32));
              if constexpr (kTwo) {
                r0[r] = xi_dot_pairs(r0[r], lo, xi_bcast64(a[r].residual + at));
                r1[r] = xi_dot_pairs(r1[r], hi, xi_bcast64(a[r].residual + at + 32));
              }
            }
          }
          for (int r = 0; r < R; ++r) {
            sums[r] = xi_madd16(xi_madd16(sums[r], c0[r], s0), c1[r], s1);
            if constexpr (kTwo) second_sums[r] = xi_madd16(xi_madd16(second_sums[r], r0[r], s0), r1[r], s1);
          }
        }
      }
      const XF d = xf_row_halves(tb + kQ4D, h);
      for (int r = 0; r < R; ++r) {
        if constexpr (kFive && kTwo) {
          acc[r][h] = xf_fmadd(xf_cvt(sums[r]), xf_mul(d, xf_set1(a[r].scale[b])), acc[r][h]);
          acc[r][h] = xf_fmadd(xf_cvt(second_sums[r]), xf_mul(d, xf_set1(a[r].scale[b] / 128.f)), acc[r][h]);
        } else {
          const XI total = kTwo ? xi_add32(xi_slli32(sums[r], 7), second_sums[r]) : sums[r];
          const float dx = kTwo ? a[r].scale[b] / 128.f : a[r].scale[b];
          acc[r][h] = xf_fmadd(xf_cvt(total), xf_mul(d, xf_set1(dx)), acc[r][h]);
        }
      }
      if (h == 0) {  // the mins' term while the tile is in L1 (a pass of its own read the group again from L2)
        __m256 m[R];
        for (int r = 0; r < R; ++r) m[r] = _mm256_setzero_ps();
        for (int sb = 0; sb < 8; ++sb) {
          const __m256 mv = _mm256_cvtepi32_ps(
              _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(tb + kQ4M + 8 * sb))));
          for (int r = 0; r < R; ++r) m[r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(a[r].block_sum[8 * b + sb]), m[r]);
        }
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tb + kQ4Dmin)));
        for (int r = 0; r < R; ++r) mins[r] = _mm256_fnmadd_ps(m[r], dmin, mins[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) row_sums(acc[r], mins[r], y[r]);
}

// 8 rows of a Q4_1_X8 weight (tiles: their K / 32 tiles) times R rows of x from quantize_activations
// (x per 32 values): y[r][0..8). Per block and row of x, a lane's products (unsigned 4-bit codes
// times x's codes, by pairs: at most 4 * 2 * 15 * 127, within 16 bits) widen once into int32,
// convert once and take d * dx in one FMA; m times x's block sum beside, as blocks16_rows. The R rows
// share each tile's loads and unpacking; each row's arithmetic is the one-row kernel's, in the same
// order, so a row's sums do not depend on R. Each broadcast of x serves the tile's kXVecs vectors at
// once: loaded per vector, the compiler hoisted AVX2's 16 broadcasts (2 rows) out of the loop over the
// vectors and spilled them to the stack (2-7 rows of x 1.03-1.08x faster this way on Zen 3). kL:
// kQ40Tiles, m = -8 d (the same value Q4_1_X8's float16 m held, so the same bits); kQ80Tiles, Q8_0's
// codes u = w + 128 in 4 units (VNNI: a lane's 16 products of 255 * 127 in 32 bits), whose lanes take
// -128 times their sum of x's codes in integers (lane_offsets) before the convert: each lane's sum
// is then its Σ w x exactly, as the blocks' (a float m = -128 d term beside lost 1-2 positions of
// greedy agreement in 4,096 to the cancellation).
template <int R, bool kTwo, Layout kL = kTiles>
void q4_1_x8_rows(const ActView* a, int64_t K, const uint8_t* tiles, float* const* y) {
  constexpr bool kQ40 = kL == kQ40Tiles, kQ80 = kL == kQ80Tiles;
  static_assert(!kQ80 || !kPairs16, "Q8_0's tiles need 32-bit sums of their products");
  constexpr int64_t kTile = kQ40 ? kQ40Tile : kQ80 ? kQ80Tile : kQ41Tile, kD = kQ80 ? kQ80D : kQ41D;
  const int64_t blocks = K / 32;
  const XI low = xi_bytes(0x0F);
  XF acc[R][kXVecs];
  __m256 mins[R];
  for (int r = 0; r < R; ++r) {
    mins[r] = _mm256_setzero_ps();
    for (int h = 0; h < kXVecs; ++h) acc[r][h] = xf_zero();
  }
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* tile = tiles + b * kTile;
    prefetch_tile(tile, kTile, 0, kQ80 ? 5 : 3);
    XI c[R][kXVecs], e[R][kXVecs];
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < kXVecs; ++h) c[r][h] = e[r][h] = xi_zero();
    for (int p = 0; kQ80 && p < 4; ++p) {  // unit p: values 8p.. of the 8 rows, as they are
      const int64_t at = 32 * b + 8 * p;
      XI v[kXVecs];
      for (int h = 0; h < kXVecs; ++h) v[h] = xi_load(tile + 64 * p + h * kXBytes);
      for (int r = 0; r < R; ++r) {
        XI x = xi_bcast64(a[r].codes + at);
        for (int h = 0; h < kXVecs; ++h) c[r][h] = xi_dot_pairs(c[r][h], v[h], x);
        if constexpr (kTwo) {
          x = xi_bcast64(a[r].residual + at);
          for (int h = 0; h < kXVecs; ++h) e[r][h] = xi_dot_pairs(e[r][h], v[h], x);
        }
      }
    }
    for (int p = 0; !kQ80 && p < 2; ++p) {
      XI lo[kXVecs], hi[kXVecs];
      for (int h = 0; h < kXVecs; ++h) {
        const XI v = xi_load(tile + 64 * p + h * kXBytes);
        lo[h] = xi_and(v, low), hi[h] = xi_and(xi_srli16(v, 4), low);
      }
      const int64_t at = 32 * b + 8 * p;
      for (int r = 0; r < R; ++r) {
        XI x = xi_bcast64(a[r].codes + at);
        for (int h = 0; h < kXVecs; ++h) c[r][h] = xi_dot_pairs(c[r][h], lo[h], x);
        x = xi_bcast64(a[r].codes + at + 16);
        for (int h = 0; h < kXVecs; ++h) c[r][h] = xi_dot_pairs(c[r][h], hi[h], x);
        if constexpr (kTwo) {
          x = xi_bcast64(a[r].residual + at);
          for (int h = 0; h < kXVecs; ++h) e[r][h] = xi_dot_pairs(e[r][h], lo[h], x);
          x = xi_bcast64(a[r].residual + at + 16);
          for (int h = 0; h < kXVecs; ++h) e[r][h] = xi_dot_pairs(e[r][h], hi[h], x);
        }
      }
    }
    for (int h = 0; h < kXVecs; ++h) {
      const XF d = xf_row_halves(tile + kD, h);
      for (int r = 0; r < R; ++r) {
        XI total = xi_widen(c[r][h], kTwo ? 7 : 0);
        if constexpr (kTwo) total = xi_add32(total, xi_widen(e[r][h], 0));
        if constexpr (kQ80)
          total = xi_add32(total, xi_bcast64(reinterpret_cast<const int8_t*>(a[r].lane_offsets + 2 * b)));
        acc[r][h] = xf_fmadd(xf_cvt(total), xf_mul(d, xf_set1(a[r].block_scale[b])), acc[r][h]);
      }
    }
    if constexpr (!kQ80) {
      const __m256 m = q41_tile_mins(tile, kL);
      for (int r = 0; r < R; ++r) mins[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(a[r].block_sum[b]), mins[r]);
    }
  }
  for (int r = 0; r < R; ++r) row_sums(acc[r], mins[r], y[r]);
}

// Rows of x that q4_1_x8_rows takes together: AVX-512's 32 registers hold five rows' accumulators
// (kernel_ab.py, one thread, SmolLM2's shapes, four against two: 4-7 rows 1.10-1.25x; five against
// four on Zen 4, two threads: 5 rows, a speculative verification of 4 proposals, 1.06-1.12x, 4-16
// rows 0.98-1.09x); AVX2's 16 two (four: 0.91-1.05x, spilled).
#if defined(PAGELLM_INT8_VNNI)
constexpr int64_t kQ41TileRows = 5;
#else
constexpr int64_t kQ41TileRows = 2;
#endif

// Up to kX8MaxRowLoop rows of x times a Q4_1_X8 weight, kQ41TileRows rows at a time, x rounded per 32
// values as the blocks' kernels round it.
#if !defined(PAGELLM_INT8_VNNI)
std::vector<int16_t> pair_rows_x16(const ActRows& a, int64_t M, int64_t K, bool two_terms, int64_t per);
void q4_1_x8_many(const ActView* a, const int16_t* x16, int64_t M, int64_t K, const uint8_t* tiles, Layout x8,
                  float* y, int64_t N, int64_t g);
// From this many rows of x q4_1_x8_many takes the products (the same bits as q4_1_x8_rows): each tile's
// widening pays from 8 rows. A/B in one process, turn about, AVX2 build on Zen 3, SmolLM2's four Q4_1
// shapes, one thread, against q4_1_x8_rows: 8 rows 0.98-1.03x, 10 rows 1.03-1.06x, 12 rows
// 1.05-1.09x, 16 rows 1.12-1.19x (against it before its broadcasts stopped spilling, 5 rows 0.80-0.85x,
// 9 rows 1.08-1.15x, 16 rows 1.29-1.34x).
constexpr int64_t kQ41PairMinRows = 8;
#endif

// R rows of x times one group of tiles, in the layout's kernel.
template <int R>
void q4_1_x8_dispatch(bool two_terms, Layout x8, const ActView* v, int64_t K, const uint8_t* tiles, float* const* y) {
  if (x8 == kQ40Tiles) {
    two_terms ? q4_1_x8_rows<R, true, kQ40Tiles>(v, K, tiles, y) : q4_1_x8_rows<R, false, kQ40Tiles>(v, K, tiles, y);
  } else if (x8 == kQ80Tiles) {
#if defined(PAGELLM_INT8_VNNI)
    two_terms ? q4_1_x8_rows<R, true, kQ80Tiles>(v, K, tiles, y) : q4_1_x8_rows<R, false, kQ80Tiles>(v, K, tiles, y);
#endif
  } else {
    two_terms ? q4_1_x8_rows<R, true>(v, K, tiles, y) : q4_1_x8_rows<R, false>(v, K, tiles, y);
  }
}

// f(std::integral_constant<int, n>) for the rows of a pass, n = 1..R: the kernels' row count a
// compile-time constant, so each row's accumulator stays in a register.
template <int R, class F>
inline void with_rows(int n, F&& f) {
  if constexpr (R > 1)
    if (n < R) return with_rows<R - 1>(n, f);
  f(std::integral_constant<int, R>{});
}

#if defined(PAGELLM_INT8_VNNI)
// ---- AVX-512 VNNI: tiles widened to 16 bits for many rows of x ----------------------------------
// x's 16-bit values (128 c + r, or c) as the widened kernels broadcast them (q8_0_x8_wide, q6_k_x8_wide):
// per 8 values the pairs in the order the widened vectors take them (0 1 4 5 | 2 3 6 7: lanes 2 r and
// 2 r + 1 together), and the rows' runs of 64 values side by side, [K / 64][M][64]: a pass's 16 rows
// read K * 2 bytes apart would fall in the same sets of L1 (K a power of two).
std::vector<int16_t> wide_x16(const ActRows& a, int64_t M, int64_t K, bool two_terms) {
  constexpr int kOrder[8] = {0, 1, 4, 5, 2, 3, 6, 7};
  std::vector<int16_t> x16(M * K);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t at = 0; at < K; at += 8)
      for (int j = 0; j < 8; ++j) {
        const int64_t i = m * K + at + kOrder[j];
        x16[(at / 64 * M + m) * 64 + at % 64 + j] =
            static_cast<int16_t>(two_terms ? 128 * a.codes[i] + a.residual[i] : a.codes[i]);
      }
  return x16;
}
// Byte-shuffle controls that widen bytes 0, 1 (`second` 0) or 2, 3 (1) of each 32-bit lane into its
// two 16-bit values: of a tile's unit (a row's 8 bytes in lanes 2 r, 2 r + 1), lane 2 r's values 0, 1
// and lane 2 r + 1's 4, 5 (or 2, 3 and 6, 7), as wide_x16 orders x.
inline XI word_pairs(int second) {
  int8_t c[64];
  for (int i = 0; i < 64; ++i) c[i] = i % 2 ? -1 : static_cast<int8_t>(i / 4 * 4 % 16 + 2 * second + i % 4 / 2);
  return xi_controls(c);
}
// Rows of x per pass of the widened kernels: their accumulators beside the widened vectors of W.
constexpr int kWidePassRows = 16;
// Group g (8 rows of W) times the M rows of x in passes of up to kWidePassRows rows: f(rows, m0, yg),
// `rows` the pass's row count as a compile-time constant (with_rows), yg its rows of y at the group.
template <class F>
inline void wide_passes(int64_t M, int64_t N, int64_t g, float* y, F&& f) {
  for (int64_t m0 = 0; m0 < M; m0 += kWidePassRows) {
    const int n = static_cast<int>(std::min<int64_t>(M - m0, kWidePassRows));
    float* yg[kWidePassRows];
    for (int i = 0; i < n; ++i) yg[i] = y + (m0 + i) * N + kX8Rows * g;
    with_rows<kWidePassRows>(n, [&](auto rows) { f(rows, m0, static_cast<float* const*>(yg)); });
  }
}

// Q8_0's tiles in 16 bits for many rows of x (decode steps of many streams): per row and block
// q4_1_x8_rows<kQ80Tiles> spends eight VPDPBUSD, then the first codes' shift, the second codes' add,
// the offset of the codes stored + 128 and the float steps. Here each tile (a block of 8 rows) is
// widened once per pass of up to 16 rows into its signed codes (u - 128: no offset term), eight vectors
// of the 8 rows' pairs, and a row of x takes eight VPDPWSSD against its 16-bit values, then the byte
// kernel's convert and FMA. A lane sums the byte kernel's values (lane 2 r: values 0..3 of each 8 of
// the block, 2 r + 1: 4..7), exactly: the same bits, so the row loop takes it from kQ80WideMinRows
// rows whatever the rows beside. kernel_ab.py --types Q8_0, two threads, Zen 4, 1B shapes, against
// the byte kernel: 3 rows 0.88-1.09x, 5 rows 0.99-1.19x, 9 rows 1.01-1.08x, 16 rows 1.05-1.19x.
// (Q4_1's and Q4_0's tiles in the same form ran 0.74-1.0x at 2-16 rows on SmolLM2's shapes: their
// byte kernel has no offset, and 4-bit codes need two VPDPBUSD where 16 bits need four VPDPWSSD.)
template <int R>
void q8_0_x8_wide(const ActView* a, const int16_t* x16, int64_t chunk, const uint8_t* tiles, int64_t K, float* const* y) {
  const int64_t blocks = K / 32;
  const XI bias = _mm512_set1_epi16(128), pairs0 = word_pairs(0), pairs1 = word_pairs(1);
  XF acc[R];
  for (int r = 0; r < R; ++r) acc[r] = xf_zero();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* tile = tiles + b * kQ80Tile;
    prefetch_tile(tile, kQ80Tile, 0, 5);
    XI w[8];  // unit p's values 8 p + {0, 1, 4, 5} (pairs 0) and 8 p + {2, 3, 6, 7} (pairs 1)
    for (int p = 0; p < 4; ++p) {
      const XI v = xi_load(tile + 64 * p);
      w[2 * p] = _mm512_sub_epi16(xi_shuffle(v, pairs0), bias);
      w[2 * p + 1] = _mm512_sub_epi16(xi_shuffle(v, pairs1), bias);
    }
    const XF d = xf_row_halves(tile + kQ80D, 0);
    const int8_t* xb = reinterpret_cast<const int8_t*>(x16 + 32 * b / 64 * chunk + 32 * b % 64);
    for (int r = 0; r < R; ++r) {
      XI total = xi_zero();
#pragma GCC unroll 8
      for (int k = 0; k < 8; ++k) total = xi_madd16(total, w[k], xi_bcast64(xb + 128 * r + 8 * k));
      acc[r] = xf_fmadd(xf_cvt(total), xf_mul(d, xf_set1(a[r].block_scale[b])), acc[r]);
    }
  }
  const __m256 no_mins = _mm256_setzero_ps();  // as the byte kernel's Q8_0 rows: their minimums' term 0
  for (int r = 0; r < R; ++r) row_sums(&acc[r], no_mins, y[r]);
}
// From this many rows of x repacked Q8_0's row loop takes q8_0_x8_wide.
constexpr int64_t kQ80WideMinRows = 9;
#endif

void q4_1_x8_row_loop(const float* x, int64_t M, const uint8_t* w, Layout x8, int64_t K, int64_t N, bool two_terms,
                      float* y) {
  const ActRows a = quantize_activations(x, M, K, two_terms);
  std::vector<ActView> views;
  for (int64_t m = 0; m < M; ++m)
    views.push_back({a.codes.data() + m * K, two_terms ? a.residual.data() + m * K : nullptr, nullptr, nullptr,
                     a.block_sum.data() + m * K / 32, nullptr, nullptr, a.block_scale.data() + m * K / 32});
#if !defined(PAGELLM_INT8_VNNI)
  const bool many = M >= kQ41PairMinRows;  // q4_1_x8_many
  const std::vector<int16_t> x16 = many ? pair_rows_x16(a, M, K, two_terms, 32) : std::vector<int16_t>();
#else
  const bool many = x8 == kQ80Tiles && M >= kQ80WideMinRows;  // q8_0_x8_wide
  const std::vector<int16_t> x16 = many ? wide_x16(a, M, K, two_terms) : std::vector<int16_t>();
#endif
  std::vector<int32_t> offsets;  // Q8_0's tiles in the byte kernel: [M][K / 32][2 lanes] (ActView::lane_offsets)
  if (x8 == kQ80Tiles && !many) {
    offsets.assign(M * K / 16, 0);
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t i = 0; i < K; ++i) {  // lane 0 of a block: its values 0-3, 8-11, ...; lane 1 the rest
        const int64_t at = m * K + i;
        const int32_t v = two_terms ? 128 * a.codes[at] + a.residual[at] : a.codes[at];
        offsets[m * K / 16 + i / 32 * 2 + i / 4 % 2] -= 128 * v;
      }
      views[m].lane_offsets = offsets.data() + m * K / 16;
    }
  }
  const int64_t group_bytes = K / 32 * q41_tile_bytes(x8);
  claimed_for(N / kX8Rows, group_bytes, M, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* tiles = w + g * group_bytes;
      if (many) {
#if !defined(PAGELLM_INT8_VNNI)
        q4_1_x8_many(views.data(), x16.data(), M, K, tiles, x8, y, N, g);
#else
        wide_passes(M, N, g, y, [&](auto rows, int64_t m0, float* const* yg) {
          q8_0_x8_wide<decltype(rows)::value>(views.data() + m0, x16.data() + 64 * m0, 64 * M, tiles, K, yg);
        });
#endif
        continue;
      }
      for (int64_t m = 0; m < M; m += kQ41TileRows) {
        float* yg[kQ41TileRows];
        for (int i = 0; i < kQ41TileRows; ++i) yg[i] = y + std::min(m + i, M - 1) * N + kX8Rows * g;
        with_rows<kQ41TileRows>(static_cast<int>(std::min(M - m, kQ41TileRows)), [&](auto rows) {
          q4_1_x8_dispatch<decltype(rows)::value>(two_terms, x8, views.data() + m, K, tiles, yg);
        });
      }
    }
  });
}

// Rows of x that q4_k_x8_rows takes together: AVX-512's 32 registers hold three rows' accumulators
// (with two codes, 7 vectors a row) beside the shared ones against Q4_K (three against two,
// kernel_ab.py, two threads, Zen 4, the 1B shapes: 3-9 rows 1.03-1.13x, 16 rows 0.99-1.04x), two
// against Q5_K, whose fifth bits take more (three: 9-16 rows 0.92-0.94x). AVX2's 16 do not hold
// two, but two rows that share each tile's loads and unpacking, some accumulators in L1, still beat
// one row after the other (kernel_ab.py, AVX2 build, one thread: 2 rows 1.11-1.19x, 16 rows 1.02-1.05x).
#if defined(PAGELLM_INT8_VNNI)
constexpr int64_t kQ4TileRows = 3;
#else
constexpr int64_t kQ4TileRows = 2;
#endif
constexpr int64_t kQ5TileRows = 2;

// q4_k_x8_rows for R rows of x against repacked Q4_K or (five) Q5_K, one or two codes per value.
template <int R>
void k_x8_dispatch(bool five, bool two, const ActView* a, int64_t K, const uint8_t* tiles, float* const* y) {
  if (five) two ? q4_k_x8_rows<R, true, true>(a, K, tiles, y) : q4_k_x8_rows<R, false, true>(a, K, tiles, y);
  else two ? q4_k_x8_rows<R, true>(a, K, tiles, y) : q4_k_x8_rows<R, false>(a, K, tiles, y);
}

#if !defined(PAGELLM_INT8_VNNI)
// ---- AVX2: decode steps of many streams over repacked Q4_K and Q6_K --------------------------
// With two codes per value, AVX2 has no VNNI form for bytes: q4_k_x8_rows spends two VPMADDUBSW and
// two 16-bit adds per unit of 4 rows x 8 values and row of x, unpacks each tile again per 2 rows of
// x, applies the scales per sub-block and spills accumulators past its 16 registers, so a step of
// 16 streams ran at a third of the byte multipliers' rate. Here each tile is widened once into
// 16-bit values, the sub-blocks' scales folded in (u * sc <= 15 * 63), one vector per pair of
// adjacent values of all 8 rows (q4_k_tile_pairs); a row of x then takes one VPMADDWD + VPADDD
// (AVX-VNNI: one VPDPWSSD) per pair against its 16-bit value 128 c + r broadcast, and up to
// kPairRows rows of x share each vector of W, their accumulators in registers.
//
// The sums are q4_k_x8_rows' own bits: the tile kernel sums each row in two 32-bit lanes (the first
// 4 bytes of each of the row's 8-byte units, values 0..3 of every 8, and the last 4), exact integers
// per super-block that then take one convert and one FMA times d * dx. Here the pairs of each lane's
// set go to an accumulator of their own (`set` 0 and 1), whose exact integer sum (at most
// 128 * 945 * 16320 < 2^31) is the same, and the float steps are the same in the same order; so a
// row gets the same bits whichever kernel takes it, and with whichever rows beside it.
constexpr int kPairsPerTile = QK_K / 2;  // vectors of 8 rows x 2 values per super-block
constexpr int kPairRows = 8;  // rows of x per pass: 8 accumulators, W's vector, x's pair
// From this many rows of x q4_k_x8_many and q6_k_x8_many take the products (the same bits as the
// tile kernels), by type. kernel_ab.py, AVX2 build, one thread, against the tile kernels: Q4_K at
// 2 / 3 / 4 / 8 / 16 rows 0.8x / 0.94x / 1.05-1.14x / 1.32-1.40x / 1.48-1.57x; Q6_K at 4 / 5 / 8 /
// 16 0.85-0.90x / 1.06-1.16x / 1.17-1.21x / 1.40-1.45x.
constexpr int64_t pair_min_rows(int64_t qtype) {
  return qtype == Q4_K ? 4 : qtype == Q6_K ? 5 : std::numeric_limits<int64_t>::max();  // Q5_K: the tiles' kernel
}

// The value (within its super-block) of the first of the pair at `at` of q4_k_tile_pairs' layout:
// [set][sub-block][u], u = 2 q + k: values 8 q + 4 set + 2 k.. of the sub-block (q = 0..3, k = 0, 1).
constexpr int pair_value(int at) {
  return 32 * (at / 8 % 8) + 8 * (at % 8 / 2) + 4 * (at / 64) + 2 * (at % 2);
}

// A unit of 8 rows' 8 bytes each (v0: rows 0-3, v1: rows 4-7, a row's 8 bytes together; 4-bit or
// 6-bit codes, one a byte) as 4 vectors of 16-bit values: out[k], lane r: row r's bytes 2k, 2k + 1.
inline void row_byte_pairs(__m256i v0, __m256i v1, __m256i* out) {
  // per 128-bit half (2 rows x 8 bytes): byte pairs 2k, 2k + 1 of both rows side by side, k = 0..3
  const __m256i pairs = _mm256_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15, 0, 1, 8, 9, 2, 3, 10,
                                         11, 4, 5, 12, 13, 6, 7, 14, 15);
  const __m256i halves = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // rows 0-3's byte pair k in qword k
  const __m256i p0 = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(v0, pairs), halves);
  const __m256i p1 = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(v1, pairs), halves);
  const __m256i k02 = _mm256_unpacklo_epi64(p0, p1), k13 = _mm256_unpackhi_epi64(p0, p1);  // pairs 0 | 2, 1 | 3
  out[0] = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(k02));
  out[1] = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(k13));
  out[2] = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(k02, 1));
  out[3] = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(k13, 1));
}

// Super-block tile t of a Q4_K_X8 weight as kPairsPerTile vectors (layout: pair_value) of the 8 rows'
// 16-bit values u * sc, lane r: row r's pair.
inline void q4_k_tile_pairs(const uint8_t* t, __m256i* out) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int sb = 0; sb < 8; ++sb) {
    const __m128i s = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(t + kQ4Sc + 8 * sb));
    const __m256i scale = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(s, s));  // row r's scale in lane r's halves
    const int j = sb / 2, nib = sb % 2;  // sub-block 2j: the low nibbles of units 4j.., 2j + 1 the high
    for (int q = 0; q < 4; ++q) {
      const uint8_t* u = t + 64 * (4 * j + q);
      __m256i v0 = xi_load(u), v1 = xi_load(u + 32), pairs[4];
      if (nib) v0 = _mm256_srli_epi16(v0, 4), v1 = _mm256_srli_epi16(v1, 4);
      row_byte_pairs(_mm256_and_si256(v0, low), _mm256_and_si256(v1, low), pairs);
      for (int k = 0; k < 4; ++k)  // byte pairs 0, 1: set 0; 2, 3: set 1
        out[64 * (k / 2) + 8 * sb + 2 * q + k % 2] = _mm256_mullo_epi16(pairs[k], scale);
    }
  }
}

inline __m256i pair_dot(__m256i acc, __m256i w, __m256i x) {
#if defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(acc, w, x);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(w, x));
#endif
}
// The two 16-bit values of x at p in every 32-bit lane.
inline __m256i x_pair(const int16_t* p) {
  int32_t pair;
  std::memcpy(&pair, p, 4);
  return _mm256_set1_epi32(pair);
}
// R rows of x (xb: their 16-bit values at this super-block, QK_K apart) times one widened tile's
// pairs of one set: per row the set's exact integer sum.
template <int R, int kSet>
inline void q4_k_pair_rows(const int16_t* xb, const __m256i* pairs, __m256i (*sums)[2]) {
  __m256i acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_si256();
  // a loop per sub-block, 8 pairs unrolled: the whole set unrolled (512 multiply-adds at 8 rows)
  // ran from the legacy decoders, past the micro-op cache, at half the multipliers' rate
#pragma GCC unroll 1
  for (int sb = 0; sb < 8; ++sb) {
    const __m256i* w8 = pairs + 64 * kSet + 8 * sb;
    const int16_t* x8 = xb + 32 * sb;
#pragma GCC unroll 8
    for (int u = 0; u < 8; ++u) {
      const __m256i w = _mm256_load_si256(w8 + u);
      for (int r = 0; r < R; ++r) acc[r] = pair_dot(acc[r], w, x_pair(x8 + QK_K * r + pair_value(64 * kSet + u)));
    }
  }
  for (int r = 0; r < R; ++r) sums[r][kSet] = acc[r];
}
template <int R>
inline void q4_k_pair_rows(const int16_t* xb, const __m256i* pairs, __m256i (*sums)[2]) {
  q4_k_pair_rows<R, 0>(xb, pairs, sums);
  q4_k_pair_rows<R, 1>(xb, pairs, sums);
}

// x's rows as the many-row kernels read them: 16-bit values 128 c + r (or c), in blocks of kPairRows
// rows whose blocks of `per` values (a K-quant's super-block, a Q4_1 block) lie together,
// [M / kPairRows blocks][K / per][kPairRows][per], so that one pointer with constant offsets reaches
// every row of a pass.
std::vector<int16_t> pair_rows_x16(const ActRows& a, int64_t M, int64_t K, bool two_terms, int64_t per = QK_K) {
  const int64_t blocks = (M + kPairRows - 1) / kPairRows, supers = K / per;
  std::vector<int16_t> x16(blocks * kPairRows * K);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < supers; ++b) {
      int16_t* out = x16.data() + ((m / kPairRows * supers + b) * kPairRows + m % kPairRows) * per;
      const int64_t at = m * K + per * b;
      for (int64_t i = 0; i < per; ++i)
        out[i] = static_cast<int16_t>(two_terms ? 128 * a.codes[at + i] + a.residual[at + i] : a.codes[at + i]);
    }
  return x16;
}

// Group g (8 rows) of a Q4_K_X8 weight times M rows of x (views: quantize_super's; x16:
// pair_rows_x16): y[m][8 g..8 g + 8), q4_k_x8_rows' bits.
void q4_k_x8_many(const ActView* a, const int16_t* x16, int64_t M, int64_t K, const uint8_t* tiles, bool two_terms,
                  float* y, int64_t N, int64_t g) {
  const int64_t supers = K / QK_K;
  std::vector<__m256> acc(2 * M, _mm256_setzero_ps()), mins(M, _mm256_setzero_ps());
  alignas(32) __m256i pairs[kPairsPerTile];
  __m256i sums[kPairRows][2];
  for (int64_t b = 0; b < supers; ++b) {
    const uint8_t* t = tiles + b * kQ4Tile;
    prefetch_tile(t, kQ4Tile, 0, kQ4Tile / 64);
    q4_k_tile_pairs(t, pairs);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + kQ4D)));
    for (int64_t m0 = 0; m0 < M; m0 += kPairRows) {
      const int n = static_cast<int>(std::min<int64_t>(kPairRows, M - m0));
      const int16_t* xb = x16 + (m0 / kPairRows * supers + b) * kPairRows * QK_K;
      with_rows<kPairRows>(n, [&](auto rows) { q4_k_pair_rows<decltype(rows)::value>(xb, pairs, sums); });
      for (int r = 0; r < n; ++r) {
        const float dx = two_terms ? a[m0 + r].scale[b] / 128.f : a[m0 + r].scale[b];
        const __m256 ddx = _mm256_mul_ps(d, _mm256_set1_ps(dx));
        for (int set = 0; set < 2; ++set)
          acc[2 * (m0 + r) + set] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r][set]), ddx, acc[2 * (m0 + r) + set]);
      }
    }
    // the mins' term, as q4_k_x8_rows: per row the sub-blocks' m against x's per-32 sums, then dmin
    __m256 mv[8];
    for (int sb = 0; sb < 8; ++sb)
      mv[sb] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(t + kQ4M + 8 * sb))));
    const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + kQ4Dmin)));
    for (int64_t m = 0; m < M; ++m) {
      __m256 s = _mm256_setzero_ps();
      for (int sb = 0; sb < 8; ++sb) s = _mm256_fmadd_ps(mv[sb], _mm256_set1_ps(a[m].block_sum[8 * b + sb]), s);
      mins[m] = _mm256_fnmadd_ps(s, dmin, mins[m]);
    }
  }
  for (int64_t m = 0; m < M; ++m)
    _mm256_storeu_ps(y + m * N + kX8Rows * g, _mm256_add_ps(_mm256_add_ps(acc[2 * m], acc[2 * m + 1]), mins[m]));
}

// ---- the same for repacked Q6_K -------------------------------------------------------------
// q6_k_x8_rows sums a row's two lanes per 16-value group (lane 2r: values 0..3 and 8..11 of the
// group, 2r + 1: 4..7 and 12..15), converts each sum once, times the group's scale, then d * dx
// into the lane's float accumulator, groups in the order 0, 2, 4, 6, 1, 3, 5, 7, 8, 10, ... Here
// the tile's values are widened as (u - 32) * sc (within [-4096, 4096]) in pairs, per group 4
// vectors of each lane's set ([set][group][4]: values 16 g + 8 (p / 2) + 4 set + 2 (p % 2)), and
// each lane's integer sum is the same exact integer times sc: its conversion rounds the exact
// product once, as the tile kernel's float multiply of an exactly converted sum does (that sum is
// below 2^24). So the same bits, in the same order.
constexpr int q6_pair_value(int set, int grp, int p) { return 16 * grp + 8 * (p / 2) + 4 * set + 2 * (p % 2); }
constexpr int kQ6GroupOrder[16] = {0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15};

// Super-block tile t of a Q6_K_X8 weight as kPairsPerTile vectors (layout above) of the 8 rows'
// 16-bit values (u - 32) * sc, lane r: row r's pair.
inline void q6_k_tile_pairs(const uint8_t* t, __m256i* out) {
  const __m256i low = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30), off = _mm256_set1_epi16(32);
  for (int n = 0; n < 2; ++n) {
    for (int u = 0; u < 4; ++u) {  // values 128 n + 32 i + 8 u.. (i = 0..3), as q6_k_x8_rows
      __m256i codes[2][4];
      for (int hv = 0; hv < 2; ++hv) {  // rows 0-3, 4-7
        const __m256i A = xi_load(t + 64 * (8 * n + u) + 32 * hv), B = xi_load(t + 64 * (8 * n + 4 + u) + 32 * hv);
        const __m256i H = xi_load(t + kQ6Qh + 64 * (4 * n + u) + 32 * hv);
        codes[hv][0] = _mm256_or_si256(_mm256_and_si256(A, low), _mm256_and_si256(_mm256_slli_epi16(H, 4), top));
        codes[hv][1] = _mm256_or_si256(_mm256_and_si256(B, low), _mm256_and_si256(_mm256_slli_epi16(H, 2), top));
        codes[hv][2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(A, 4), low), _mm256_and_si256(H, top));
        codes[hv][3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(B, 4), low),
                                       _mm256_and_si256(_mm256_srli_epi16(H, 2), top));
      }
      for (int i = 0; i < 4; ++i) {
        const int grp = 8 * n + 2 * i + u / 2;
        const __m128i s = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(t + kQ6Sc + 8 * grp));
        const __m256i scale = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(s, s));
        __m256i pairs[4];
        row_byte_pairs(codes[0][i], codes[1][i], pairs);
        for (int k = 0; k < 4; ++k)
          out[64 * (k / 2) + 4 * grp + 2 * (u % 2) + k % 2] = _mm256_mullo_epi16(_mm256_sub_epi16(pairs[k], off), scale);
      }
    }
  }
}

// R rows of x (xb: their 16-bit values at this super-block, QK_K apart; ddx[r][j]: d * dx of
// their values 32 j..) times one widened Q6_K tile, into their lanes' float sums acc[r][set].
template <int R>
inline void q6_k_pair_rows(const int16_t* xb, const __m256i* pairs, const __m256 (*ddx)[8], __m256 (*acc)[2]) {
#pragma GCC unroll 1
  for (int step = 0; step < 16; ++step) {
    const int grp = kQ6GroupOrder[step];
    for (int set = 0; set < 2; ++set) {
      const __m256i* w4 = pairs + 64 * set + 4 * grp;
      __m256i s[R];
      for (int r = 0; r < R; ++r) s[r] = _mm256_setzero_si256();
      for (int p = 0; p < 4; ++p) {
        const __m256i w = _mm256_load_si256(w4 + p);
        for (int r = 0; r < R; ++r) s[r] = pair_dot(s[r], w, x_pair(xb + QK_K * r + q6_pair_value(set, grp, p)));
      }
      for (int r = 0; r < R; ++r) acc[r][set] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r]), ddx[r][grp / 2], acc[r][set]);
    }
  }
}

// Group g (8 rows) of a Q6_K_X8 weight times M rows of x (views as x8_row_loop gives q6_k_x8_rows;
// per32: their scales per 32 values, else per super-block; x16: pair_rows_x16): q6_k_x8_rows' bits.
void q6_k_x8_many(const ActView* a, const int16_t* x16, int64_t M, int64_t K, const uint8_t* tiles, bool two_terms,
                  bool per32, float* y, int64_t N, int64_t g) {
  const int64_t supers = K / QK_K;
  std::vector<__m256> acc(2 * M, _mm256_setzero_ps());
  alignas(32) __m256i pairs[kPairsPerTile];
  __m256 ddx[kPairRows][8];
  for (int64_t b = 0; b < supers; ++b) {
    const uint8_t* t = tiles + b * kQ6Tile;
    prefetch_tile(t, kQ6Tile, 0, (kQ6Tile + 63) / 64);
    q6_k_tile_pairs(t, pairs);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + kQ6D)));
    for (int64_t m0 = 0; m0 < M; m0 += kPairRows) {
      const int n = static_cast<int>(std::min<int64_t>(kPairRows, M - m0));
      for (int r = 0; r < n; ++r)
        for (int j = 0; j < 8; ++j) {
          // quantize_activations' scales take two codes' 1/128 in, quantize_super's do not
          const float dx = per32 ? a[m0 + r].scale[8 * b + j] : two_terms ? a[m0 + r].scale[b] / 128.f : a[m0 + r].scale[b];
          ddx[r][j] = _mm256_mul_ps(d, _mm256_set1_ps(dx));
        }
      const int16_t* xb = x16 + (m0 / kPairRows * supers + b) * kPairRows * QK_K;
      with_rows<kPairRows>(n, [&](auto rows) {
        q6_k_pair_rows<decltype(rows)::value>(xb, pairs, ddx, reinterpret_cast<__m256 (*)[2]>(acc.data() + 2 * m0));
      });
    }
  }
  for (int64_t m = 0; m < M; ++m) _mm256_storeu_ps(y + m * N + kX8Rows * g, _mm256_add_ps(acc[2 * m], acc[2 * m + 1]));
}

// ---- the same for repacked Q4_1 -------------------------------------------------------------
// q4_1_x8_rows spends, per block and row of x, four VPMADDUBSW and four 16-bit adds per vector of W
// (two codes), widens both sums, and unpacks each tile again for every 2 rows of x. Here each tile is widened once
// into 16-bit codes, one vector per pair of adjacent values of all 8 rows, and a row of x takes one
// VPMADDWD + VPADDD per pair against its 16-bit values 128 c + r (or c).
// The same bits: q4_1_x8_rows sums each row in two 32-bit lanes per block (its codes' bytes 0..3 of
// both units, values 0..3, 8..11 in the low nibbles and 16..19, 24..27 in the high; and bytes 4..7),
// exact integers that convert once and take d * dx in one FMA into the lane's float accumulator;
// here the pairs of each lane's set go to an accumulator of their own, whose exact sums are the same
// integers, through the same float steps in the same order. The mins' term is the same FMA.
constexpr int kQ41Pairs = 16;  // vectors of 8 rows x 2 values per block: [set][8]
// The first value of the pair at j (0..7) of set `set`: low nibbles of units 0, 1, then high.
constexpr int q41_pair_value(int set, int j) { return 16 * (j / 4) + 8 * (j / 2 % 2) + 4 * set + 2 * (j % 2); }

// Block tile t of a Q4_1_X8 weight as kQ41Pairs vectors (layout: q41_pair_value) of the 8 rows' 16-bit
// codes, lane r: row r's pair.
inline void q4_1_tile_pairs(const uint8_t* t, __m256i* out) {
  const __m256i low = _mm256_set1_epi16(0x0F);
  for (int p = 0; p < 2; ++p) {
    __m256i pairs[4];  // bytes 2k, 2k + 1 of each row: values 8p + 2k.. low, 16 + 8p + 2k.. high
    row_byte_pairs(xi_load(t + 64 * p), xi_load(t + 64 * p + 32), pairs);
    for (int k = 0; k < 4; ++k) {
      const int set = k / 2, j = 2 * p + k % 2;
      out[8 * set + j] = _mm256_and_si256(pairs[k], low);
      out[8 * set + 4 + j] = _mm256_srli_epi16(pairs[k], 4);
    }
  }
}

// R rows of x (xb: their 16-bit values at this block, 32 apart) times one widened Q4_1 tile: per row
// each set's exact integer sum.
template <int R>
inline void q4_1_pair_rows(const int16_t* xb, const __m256i* pairs, __m256i (*sums)[2]) {
  for (int set = 0; set < 2; ++set) {
    __m256i acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const __m256i w = _mm256_load_si256(pairs + 8 * set + j);
      for (int r = 0; r < R; ++r) acc[r] = pair_dot(acc[r], w, x_pair(xb + 32 * r + q41_pair_value(set, j)));
    }
    for (int r = 0; r < R; ++r) sums[r][set] = acc[r];
  }
}

// Group g (8 rows) of a Q4_1_X8 weight times M rows of x (views: quantize_activations'; x16:
// pair_rows_x16 per 32 values): y[m][8 g..8 g + 8), q4_1_x8_rows' bits.
void q4_1_x8_many(const ActView* a, const int16_t* x16, int64_t M, int64_t K, const uint8_t* tiles, Layout x8,
                  float* y, int64_t N, int64_t g) {
  const int64_t blocks = K / 32, tile_bytes = q41_tile_bytes(x8);
  std::vector<__m256> acc(2 * M, _mm256_setzero_ps()), mins(M, _mm256_setzero_ps());
  alignas(32) __m256i pairs[kQ41Pairs];
  __m256i sums[kPairRows][2];
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* t = tiles + b * tile_bytes;
    prefetch_tile(t, tile_bytes, 0, 3);
    q4_1_tile_pairs(t, pairs);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + kQ41D)));
    const __m256 mv = q41_tile_mins(t, x8);
    for (int64_t m0 = 0; m0 < M; m0 += kPairRows) {
      const int n = static_cast<int>(std::min<int64_t>(kPairRows, M - m0));
      const int16_t* xb = x16 + (m0 / kPairRows * blocks + b) * kPairRows * 32;
      with_rows<kPairRows>(n, [&](auto rows) { q4_1_pair_rows<decltype(rows)::value>(xb, pairs, sums); });
      for (int r = 0; r < n; ++r) {
        const __m256 ddx = _mm256_mul_ps(d, _mm256_set1_ps(a[m0 + r].block_scale[b]));
        for (int set = 0; set < 2; ++set)
          acc[2 * (m0 + r) + set] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r][set]), ddx, acc[2 * (m0 + r) + set]);
      }
    }
    for (int64_t m = 0; m < M; ++m) mins[m] = _mm256_fmadd_ps(mv, _mm256_set1_ps(a[m].block_sum[b]), mins[m]);
  }
  for (int64_t m = 0; m < M; ++m) {  // row_sums' order: the two lanes, then the minimums' term
    const __m256 lanes = _mm256_add_ps(acc[2 * m], acc[2 * m + 1]);
    _mm256_storeu_ps(y + m * N + kX8Rows * g, _mm256_add_ps(lanes, mins[m]));
  }
}

#endif

#if !defined(PAGELLM_INT8_VNNI)
// Per 16 values of row m of x (a Q6_K group), per lane parity, 32 times the sum of the codes a lane of
// q6_k_x8_rows takes (values 0..3 and 8..11 of the group, or 4..7 and 12..15; with two codes of
// 128 c + r): the offset term of the codes stored + 32, subtracted in integers per group.
std::vector<int32_t> q6_k_x8_offsets(const ActRows& a, int64_t m, int64_t K, bool two_terms) {
  std::vector<int32_t> o(K / 8);
  for (int64_t i = 0; i < K; ++i) {
    const int64_t at = m * K + i;
    const int32_t v = two_terms ? 128 * a.codes[at] + a.residual[at] : a.codes[at];
    o[i / 16 * 2 + (i / 4) % 2] += 32 * v;
  }
  return o;
}

// 8 rows of a Q6_K_X8 weight times M (1..4) rows of x, rounded as the blocks' kernels round them
// (kPer32: two codes per 32 values, quantize_activations, as q6_k_rows; else per 256 values,
// quantize_super, as int8_super_rows and wide_super_rows). One load of ql's units p and p + 4 and of qh's unit p (per
// 128-value half) gives 4 vectors of codes (values 8p, 32 + 8p, 64 + 8p and 96 + 8p of the half, as
// dequant_q6_k), unpacked once for the M rows of x, as are the groups' scales; per 16-value group a
// lane's sum (at most 8 * 63 * 16320 before the offset, 8 * 32 * 16320 after) converts to float
// once, times its scale and d * dx. Row m of x: a[m], offsets[m], its 8 sums at y[m].
template <int M, bool kTwo, bool kPer32>
void q6_k_x8_rows(const ActView* a, const int32_t* const* offsets, int64_t K, const uint8_t* tiles, float* const* y) {
  const int64_t supers = K / QK_K;
  const XI low = xi_bytes(0x0F), top = xi_bytes(0x30);
  XF acc[M][kXVecs];
  XI firsts[kXVecs], seconds[kXVecs];
  for (int h = 0; h < kXVecs; ++h) {
    firsts[h] = scale_controls(h, false, 3), seconds[h] = scale_controls(h, true, 3);
    for (int m = 0; m < M; ++m) acc[m][h] = xf_zero();
  }
  for (int64_t b = 0; b < supers; ++b) {
    for (int h = 0; h < kXVecs; ++h) {
      const XI first = firsts[h], second = seconds[h];
      const uint8_t* t = tiles + b * kQ6Tile + h * kXBytes;
      const XF d = xf_row_halves(tiles + b * kQ6Tile + kQ6D, h);
      // The half's sums in registers through the super-block, and each group's codes and scale made
      // just before its products (their bytes read again from L1 per group): with all 8 vectors of
      // codes and 4 scales made first, AVX2's 16 registers spilled, and acc[m][h] (h a run-time
      // index) went through the stack between the (n, gp) steps, each FMA of the chain behind a
      // store and a load.
      XF ah[M];
      for (int m = 0; m < M; ++m) ah[m] = acc[m][h];
      for (int n = 0; n < 2; ++n) {
        for (int gp = 0; gp < 2; ++gp) {  // groups 8n + 2i + gp of the super-block, i = 0..3
          if (h == 0) prefetch_tile(tiles + b * kQ6Tile, kQ6Tile, 8 * (2 * n + gp), 8 * (2 * n + gp) + 8);
#pragma GCC unroll 4
          for (int i = 0; i < 4; ++i) {
            XI v[2];  // the codes of values 32 i + 16 gp .. + 15 of this half, p = 0, 1: 8 each
            for (int p = 0; p < 2; ++p) {
              const int u = 2 * gp + p;
              const XI H = xi_load(t + kQ6Qh + (4 * n + u) * 64);
              const XI L = xi_load(t + (8 * n + 4 * (i % 2) + u) * 64);  // A (i = 0, 2) or B (1, 3)
              v[p] = i == 0   ? xi_or(xi_and(L, low), xi_and(xi_slli16(H, 4), top))
                     : i == 1 ? xi_or(xi_and(L, low), xi_and(xi_slli16(H, 2), top))
                     : i == 2 ? xi_or(xi_and(xi_srli16(L, 4), low), xi_and(H, top))
                              : xi_or(xi_and(xi_srli16(L, 4), low), xi_and(xi_srli16(H, 2), top));
            }
            const XF sc = xf_cvt(xi_srai32(
                xi_shuffle(xi_bcast128(tiles + b * kQ6Tile + kQ6Sc + 16 * (4 * n + i)), gp ? second : first), 24));
            for (int m = 0; m < M; ++m) {
              const int64_t at = QK_K * b + 128 * n + 32 * i + 16 * gp;
              const int64_t g = 16 * b + 8 * n + 2 * i + gp;
              // 6-bit codes: two pairs' products, at most 2 * 2 * 63 * 128, within 16 bits (kPairs16)
              XI total = xi_widen(xi_dot_two(v[0], xi_bcast64(a[m].codes + at), v[1],
                                             xi_bcast64(a[m].codes + at + 8)), kTwo ? 7 : 0);
              if constexpr (kTwo)
                total = xi_add32(total, xi_widen(xi_dot_two(v[0], xi_bcast64(a[m].residual + at), v[1],
                                                            xi_bcast64(a[m].residual + at + 8)), 0));
              total = xi_sub32(total, xi_bcast64(reinterpret_cast<const int8_t*>(offsets[m] + 2 * g)));
              // quantize_activations' scales take two codes' 1/128 in, quantize_super's do not
              const float dx = kPer32 ? a[m].scale[(QK_K * b + 128 * n + 32 * i) / 32]
                                      : kTwo ? a[m].scale[b] / 128.f : a[m].scale[b];
              ah[m] = xf_fmadd(xf_mul(xf_cvt(total), sc), xf_mul(d, xf_set1(dx)), ah[m]);
            }
          }
        }
      }
      for (int m = 0; m < M; ++m) acc[m][h] = ah[m];
    }
  }
  for (int m = 0; m < M; ++m) row_sums(acc[m], y[m]);
}

// Rows of x that q6_k_x8_rows takes together: each tile's codes unpacked once for them.
constexpr int64_t kQ6TileRows = 4;
template <int M>
void q6_k_x8_dispatch(bool two_terms, bool per32, const ActView* a, const int32_t* const* o, int64_t K,
                      const uint8_t* tiles, float* const* y) {
  if (!two_terms) q6_k_x8_rows<M, false, false>(a, o, K, tiles, y);
  else if (per32) q6_k_x8_rows<M, true, true>(a, o, K, tiles, y);
  else q6_k_x8_rows<M, true, false>(a, o, K, tiles, y);
}
#else
// ---- AVX-512 VNNI: repacked Q6_K, its codes widened once for up to 16 rows of x ---------------
// A 16-bit form of the tile kernel: per 16-value group and row of x, the byte kernel took four
// VPDPBUSD (two codes) and then a shift, an add, the offset's subtraction, a convert, the scale's
// multiply, d * dx and an FMA, so Q6_K ran at two thirds of Q4_K's values per second from 2 rows on
// (1B shapes at 16 rows, one thread: ~150 cycles per tile and row of x against Q4_K's ~100). Here
// each pair of groups (32 values, one scale of x per32) is widened once for all the rows of a pass
// into 16-bit values (u - 32) * sc (within +-4,096: no offset term, the scale folded in), eight
// vectors of the 8 rows' pairs, and a row of x then takes eight VPDPWSSD against its 16-bit values
// 128 c + r (or c), one convert and one FMA. A lane sums, per 32 values, the 16 products that the byte
// kernel's lane summed in its two groups (lane 2 r: values 0..3 and 8..11 of each group, 2 r + 1:
// 4..7 and 12..15), within 2^31 (16 * 4,096 * 16,320), exactly, and converts once. Up to 16 rows a
// pass: every row count takes this kernel, so a row's sums do not depend on the rows beside it.
// kernel_ab.py, two threads, Zen 4, against the byte kernel: 1 row 0.99-1.03x, 2 rows 0.95-1.0x,
// 3 rows 1.08-1.17x, 5-6 rows 1.27-1.36x, 9 rows 1.35-1.47x, 16 rows 1.36-1.54x.
// 8 rows of a Q6_K_X8 weight times R rows of x (a: as q6_k_rows rounds them with kPer32, else
// quantize_super's; x16: wide_x16's, at the pass's first row, `chunk` values per run of 64): y[r][0..8).
template <int R, bool kTwo, bool kPer32>
void q6_k_x8_wide(const ActView* a, const int16_t* x16, int64_t chunk, const uint8_t* tiles, int64_t K, float* const* y) {
  const int64_t supers = K / QK_K;
  const XI low = xi_bytes(0x0F), top = xi_bytes(0x30), bias = _mm512_set1_epi16(32);
  const XI first = scale_controls(0, false, 1, true), second = scale_controls(0, true, 1, true);
  const XI pairs0 = word_pairs(0), pairs1 = word_pairs(1);
  XF acc[R];
  for (int r = 0; r < R; ++r) acc[r] = xf_zero();
  for (int64_t b = 0; b < supers; ++b) {
    const uint8_t* t = tiles + b * kQ6Tile;
    const XF d = xf_row_halves(t + kQ6D, 0);
    for (int n = 0; n < 2; ++n) {
      prefetch_tile(t, kQ6Tile, 16 * n, 16 * n + 16);
#pragma GCC unroll 1
      for (int i = 0; i < 4; ++i) {  // values 128 n + 32 i.. (groups 8 n + 2 i and 8 n + 2 i + 1)
        // the groups' int8 scales, each lane's row's in both 16-bit halves
        const XI sb = xi_bcast128(t + kQ6Sc + 16 * (4 * n + i));
        XI w[8];
        for (int gp = 0; gp < 2; ++gp) {
          const XI sc = _mm512_srai_epi16(xi_shuffle(sb, gp ? second : first), 8);
          for (int p = 0; p < 2; ++p) {  // as q6_k_x8_rows: the group's values 8 p.. of its 8 rows
            const int u = 2 * gp + p;
            const XI H = xi_load(t + kQ6Qh + (4 * n + u) * 64);
            const XI L = xi_load(t + (8 * n + 4 * (i % 2) + u) * 64);
            const XI v = i == 0   ? xi_or(xi_and(L, low), xi_and(xi_slli16(H, 4), top))
                         : i == 1 ? xi_or(xi_and(L, low), xi_and(xi_slli16(H, 2), top))
                         : i == 2 ? xi_or(xi_and(xi_srli16(L, 4), low), xi_and(H, top))
                                  : xi_or(xi_and(xi_srli16(L, 4), low), xi_and(xi_srli16(H, 2), top));
            w[4 * gp + 2 * p] = _mm512_mullo_epi16(_mm512_sub_epi16(xi_shuffle(v, pairs0), bias), sc);
            w[4 * gp + 2 * p + 1] = _mm512_mullo_epi16(_mm512_sub_epi16(xi_shuffle(v, pairs1), bias), sc);
          }
        }
        const int64_t at = QK_K * b + 128 * n + 32 * i;
        for (int r = 0; r < R; ++r) {
          const int8_t* xp = reinterpret_cast<const int8_t*>(x16 + at / 64 * chunk + 64 * r + at % 64);
          XI total = xi_zero();
#pragma GCC unroll 8
          for (int k = 0; k < 8; ++k) total = xi_madd16(total, w[k], xi_bcast64(xp + 8 * k));
          const float dx = kPer32 ? a[r].scale[at / 32] : kTwo ? a[r].scale[b] / 128.f : a[r].scale[b];
          acc[r] = xf_fmadd(xf_cvt(total), xf_mul(d, xf_set1(dx)), acc[r]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) row_sums(&acc[r], y[r]);
}

template <int R>
void q6_k_x8_wide_dispatch(bool two_terms, bool per32, const ActView* a, const int16_t* x16, int64_t chunk,
                           const uint8_t* tiles, int64_t K, float* const* y) {
  if (!two_terms) q6_k_x8_wide<R, false, false>(a, x16, chunk, tiles, K, y);
  else if (per32) q6_k_x8_wide<R, true, true>(a, x16, chunk, tiles, K, y);
  else q6_k_x8_wide<R, true, false>(a, x16, chunk, tiles, K, y);
}
#endif

// ---- many rows of x times tiles of 8 rows of W (prefills) ------------------------------------
// A prompt's products multiply each weight by tens to thousands of rows of x: compute-bound, so
// the weight is unpacked once per group of 8 rows for all of them and the rows' arithmetic is what
// counts. A group is widened once into 16-bit values, the integer sub-block scales folded in
// (Q4_K: u * sc <= 15 * 63; Q5_K, from GGUF's blocks or its tiles: u * sc <= 31 * 63; Q6_K: (u - 32) * sc in
// [-4096, 4096]; Q8_0: its codes), as
// [slice of 8 values][8 rows][8] (x8_widen_group): a vector of it holds 4 rows (AVX-512) or 2 (AVX2)
// x 8 values. x comes rounded as the integer kernels of fewer rows round it for the type (Q4_K,
// Q6_K: quantize_super, one scale per 256 values; Q8_0: quantize_activations, per 32), one code c or
// two joined into one 16-bit value 128 c + r, and one VPDPWSSD (AVX2: VPMADDWD + VPADDD) per 8 values
// x 4 (2) rows of W x one row of x sums 2 products per 32-bit lane. A row's lanes are exact integer
// sums until a float scale changes: one convert and FMA, times d * dx, per super-block (Q4_K; Q5_K,
// whose lanes hold at most 64 * 1953 * 16320, within 2^31), per
// 128 values (Q6_K: the most its lanes hold below 2^31, 32 * 4096 * 16320), per block (Q8_0, whose
// float16 scale is per 32). Q4_K's mins, -dmin * m_j against x's per-32 sums, are float products
// summed beside. Against the float32 path, which widened tiles for torch's GEMM: the same rounding
// of x as a decode step's products, and no float32 weight tile.
constexpr int kW16Lanes = static_cast<int>(sizeof(XF) / sizeof(float));  // 32-bit lanes per vector
constexpr int kW16Vecs = kX8Rows * kX8Rows * 2 / static_cast<int>(sizeof(XI));  // vectors per slice
constexpr int kSlices = QK_K / 8;
// Rows of x per pass: AVX-512, 4 (4 x 2 int32 + 4 x 2 float accumulators); AVX2, whose slice takes 4
// vectors, 2 against the K-quants and 1 against Q8_0, whose float scale per block spills the
// accumulators of 2 (2048 x 2048, 64 and 256 rows, CPU time A/B on a loaded machine: 2 against 1,
// Q4_K 1.1-1.2x faster, Q8_0 0.9x).
#if defined(PAGELLM_INT8_VNNI)
inline XF xf_load(const float* p) { return _mm512_loadu_ps(p); }
constexpr int prefill_rows(int64_t) { return 4; }
#else
inline XF xf_load(const float* p) { return _mm256_loadu_ps(p); }
constexpr int prefill_rows(int64_t qtype) { return qtype == Q8_0 || qtype == Q4_0 || qtype == Q4_1 ? 1 : 2; }
#endif
// Slices of 8 values summed in integers between float scales, and slices per scale of x.
constexpr int flush_slices(int64_t qtype) { return qtype == Q4_K || qtype == Q5_K ? 32 : qtype == Q6_K ? 16 : 4; }
constexpr int x_scale_slices(int64_t qtype) { return qtype == Q8_0 || qtype == Q4_0 || qtype == Q4_1 ? 4 : 32; }

// Group g (rows 8 g.. of W: of a repacked weight, its tiles; of Q8_0 blocks, the rows that exist, the
// rest zero) as 16-bit values at buf [K / 8 slices][8 rows][8], the float scale of each span of
// flush_slices at dvec [spans][8 rows][4 lanes], and Q4_K's dmin * m_j at mins [K / 32][8 rows].
void x8_widen_group(int64_t qtype, const uint8_t* w, int64_t K, int64_t N, int64_t g, int16_t* buf, float* dvec,
                    float* mins, Layout x8) {
  const __m128i low = _mm_set1_epi8(0x0F), top = _mm_set1_epi8(0x30);
  const __m256i off = _mm256_set1_epi16(32);
  const auto put = [&](int16_t* out, int slice, int k, __m128i codes, __m256i scale, bool centred) {
    __m256i v = _mm256_cvtepu8_epi16(codes);
    if (centred) v = _mm256_sub_epi16(v, off);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + slice * 64 + 16 * k), _mm256_mullo_epi16(v, scale));
  };
  // rows 2k, 2k + 1's scale of a sub-block (Q6_K: group), each over its row's 8 values
  const auto pair_scale = [](int a, int b) {
    return _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>(b)), _mm_set1_epi16(static_cast<int16_t>(a)));
  };
  const auto load = [](const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); };
  const auto lanes = [&](int64_t span, int r, float d) {
    for (int l = 0; l < 4; ++l) dvec[span * 32 + 4 * r + l] = d;
  };
  // Row r's values 16 h.. of 32-value block bl, as 16-bit values: slices 4 bl + 2 h and 4 bl + 2 h + 1.
  const auto put_half_block = [&](int64_t bl, int h, int r, __m256i v) {
    int16_t* out = buf + (4 * bl + 2 * h) * 64 + 8 * r;
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(v));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 64), _mm256_extracti128_si256(v, 1));
  };
  const int64_t supers = K / QK_K;
  if (qtype == Q4_1) {  // codes u (0..15) as they are; d per block a float scale, m * (x's block sum) beside
    const int64_t blocks = K / 32;
    for (int r = 0; r < kX8Rows; ++r) {
      const int64_t n = kX8Rows * g + r;
      for (int64_t bl = 0; bl < blocks; ++bl) {
        const Q41Block b = n < N ? q4_1_block(w, K, x8, n, bl) : Q41Block{0.f, 0.f, _mm_setzero_si128()};
        lanes(bl, r, b.d);
        // stored negated: the mins' pass subtracts (Q4_K's are dmin * m_j), Q4_1's w = d * u + m adds
        mins[bl * 8 + r] = -b.m;
        const __m128i q = b.codes;
        for (int h = 0; h < 2; ++h)  // values 16 h.. (low nibbles, then high)
          put_half_block(bl, h, r, _mm256_cvtepu8_epi16(_mm_and_si128(h ? _mm_srli_epi16(q, 4) : q, low)));
      }
    }
    return;
  }
  if (qtype == Q5_K && !x8) {  // GGUF's blocks: codes u (0..31) times the sub-block's 6-bit scale, as Q4_K
    for (int r = 0; r < kX8Rows; ++r) {
      const int64_t n = kX8Rows * g + r;
      for (int64_t b = 0; b < supers; ++b) {
        const uint8_t* sb = w + (n * supers + b) * 176;
        uint8_t sc[8] = {}, m[8] = {};
        if (n < N)
          for (int j = 0; j < 8; ++j) scale_min_k4(j, sb + 4, sc + j, m + j);
        lanes(b, r, n < N ? half_at(sb) : 0.f);
        const float dmin = n < N ? half_at(sb + 2) : 0.f;
        for (int j = 0; j < 8; ++j) mins[(b * 8 + j) * 8 + r] = dmin * m[j];
        for (int j = 0; j < 8; ++j) {  // sub-block j: the low (even j) or high nibbles of 32 bytes of qs
          const __m256i scale = _mm256_set1_epi16(sc[j]);
          for (int h = 0; h < 2; ++h) {  // its values 16 h..
            __m256i v = _mm256_setzero_si256();
            if (n < N) {
              const __m128i q = load(sb + 48 + 32 * (j / 2) + 16 * h), high = load(sb + 16 + 16 * h);
              const __m128i lo4 = _mm_and_si128(j % 2 ? _mm_srli_epi16(q, 4) : q, low);
              const __m128i bit = _mm_and_si128(_mm_srli_epi16(high, j), _mm_set1_epi8(1));  // qh's bit j
              v = _mm256_mullo_epi16(_mm256_cvtepu8_epi16(_mm_or_si128(lo4, _mm_slli_epi16(bit, 4))), scale);
            }
            put_half_block(8 * b + j, h, r, v);
          }
        }
      }
    }
    return;
  }
  if (qtype == Q8_0 && x8 == kQ80Tiles) {  // a unit of a tile is a slice of buf (8 rows x 8 values), its codes + 128
    const __m128i sign = _mm_set1_epi8(static_cast<char>(0x80));
    for (int64_t bl = 0; bl < K / 32; ++bl) {
      const uint8_t* t = w + (g * (K / 32) + bl) * kQ80Tile;
      for (int r = 0; r < kX8Rows; ++r) lanes(bl, r, half_at(t + kQ80D + 2 * r));
      for (int q = 0; q < 16; ++q)  // unit q / 4, its quarter q % 4: rows 2 (q % 4), 2 (q % 4) + 1
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(buf + 4 * bl * 64 + 16 * q),
                            _mm256_cvtepi8_epi16(_mm_xor_si128(load(t + 16 * q), sign)));
    }
    return;
  }
  if (qtype == Q4_0 || qtype == Q8_0) {  // GGUF's blocks (or Q4_0's tiles), a float scale d per 32 values
    const int64_t block_bytes = qtype == Q4_0 ? 18 : 34, blocks = K / 32, row_bytes = blocks * block_bytes;
    for (int r = 0; r < kX8Rows; ++r) {
      const int64_t n = kX8Rows * g + r;
      for (int64_t bl = 0; bl < blocks; ++bl) {
        const uint8_t* b = w + n * row_bytes + bl * block_bytes;
        const Q41Block t = x8 == kQ40Tiles ? q4_1_block(w, K, x8, n, bl) : Q41Block{};
        lanes(bl, r, n >= N ? 0.f : x8 == kQ40Tiles ? t.d : half_at(b));
        for (int h = 0; h < 2; ++h) {  // values 16 h..: Q8_0's codes; Q4_0's u - 8, low nibbles then high
          __m256i v = _mm256_setzero_si256();
          if (n < N && qtype == Q8_0) {
            v = _mm256_cvtepi8_epi16(load(b + 2 + 16 * h));
          } else if (n < N) {
            const __m128i q = x8 == kQ40Tiles ? t.codes : load(b + 2);
            v = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm_and_si128(h ? _mm_srli_epi16(q, 4) : q, low)),
                                 _mm256_set1_epi16(8));
          }
          put_half_block(bl, h, r, v);
        }
      }
    }
    return;
  }
  const int64_t tile_bytes = x8_tile(repacked_id(qtype));
  const uint8_t* tiles = w + g * supers * tile_bytes;
  for (int64_t b = 0; b < supers; ++b) {
    int16_t* out = buf + b * kSlices * 64;
    if (qtype == Q4_K || qtype == Q5_K) {  // repacked Q5_K: Q4_K's tile and the codes' fifth bits (kQ5Qh)
      const uint8_t* t = tiles + b * tile_bytes;
      for (int r = 0; r < kX8Rows; ++r) {
        const float dmin = half_at(t + kQ4Dmin + 2 * r);
        lanes(b, r, half_at(t + kQ4D + 2 * r));
        for (int j = 0; j < 8; ++j) mins[(b * 8 + j) * 8 + r] = dmin * t[kQ4M + 8 * j + r];
      }
      for (int j = 0; j < 4; ++j) {
        // the rows' scales of sub-blocks 2j (low nibbles) and 2j + 1 (high), built once for the 4
        // units that share them: this widening runs once per group of W for every product of at
        // least widen_min_rows rows (decode steps of many streams), where scales built per store
        // took as long as the rows' products
        __m256i lo_scale[4], hi_scale[4];
        for (int k = 0; k < 4; ++k) {
          lo_scale[k] = pair_scale(t[kQ4Sc + 16 * j + 2 * k], t[kQ4Sc + 16 * j + 2 * k + 1]);
          hi_scale[k] = pair_scale(t[kQ4Sc + 16 * j + 8 + 2 * k], t[kQ4Sc + 16 * j + 8 + 2 * k + 1]);
        }
        for (int k = 0; k < 4; ++k) {  // rows 2k, 2k + 1
          // Q5_K: the fifth bits of units 4j + q at bit 4 (qh's bits 2q: low nibbles, 2q + 1: high),
          // u * sc <= 31 * 63 within 16 bits
          __m128i lo5[4] = {}, hi5[4] = {};
          if (qtype == Q5_K) {
            const __m128i h = load(t + kQ5Qh + 64 * j + 16 * k);
#pragma GCC unroll 4
            for (int q = 0; q < 4; ++q) lo5[q] = bit_at_4(h, 2 * q), hi5[q] = bit_at_4(h, 2 * q + 1);
          }
          for (int q = 0; q < 4; ++q) {  // unit 4j + q: bytes 8q.. of sub-blocks 2j (low), 2j + 1 (high)
            const __m128i v = load(t + 64 * (4 * j + q) + 16 * k);
            put(out, 8 * j + q, k, _mm_or_si128(_mm_and_si128(v, low), lo5[q]), lo_scale[k], false);
            const __m128i hi = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(v, 4), low), hi5[q]);
            put(out, 8 * j + 4 + q, k, hi, hi_scale[k], false);
          }
        }
      }
      continue;
    }
    const uint8_t* t = tiles + b * kQ6Tile;
    const int8_t* sc = reinterpret_cast<const int8_t*>(t + kQ6Sc);
    for (int r = 0; r < kX8Rows; ++r) {
      const float d = half_at(t + kQ6D + 2 * r);
      lanes(2 * b, r, d), lanes(2 * b + 1, r, d);
    }
    for (int n = 0; n < 2; ++n) {
      for (int u = 0; u < 4; ++u) {  // values 128 n + 32 i + 8 u.. (i = 0..3), as q6_k_x8_rows
        for (int k = 0; k < 4; ++k) {
          const __m128i A = load(t + 64 * (8 * n + u) + 16 * k), B = load(t + 64 * (8 * n + 4 + u) + 16 * k);
          const __m128i H = load(t + kQ6Qh + 64 * (4 * n + u) + 16 * k);
          const __m128i codes[4] = {
              _mm_or_si128(_mm_and_si128(A, low), _mm_and_si128(_mm_slli_epi16(H, 4), top)),
              _mm_or_si128(_mm_and_si128(B, low), _mm_and_si128(_mm_slli_epi16(H, 2), top)),
              _mm_or_si128(_mm_and_si128(_mm_srli_epi16(A, 4), low), _mm_and_si128(H, top)),
              _mm_or_si128(_mm_and_si128(_mm_srli_epi16(B, 4), low), _mm_and_si128(_mm_srli_epi16(H, 2), top))};
          for (int i = 0; i < 4; ++i) {
            const int grp = 8 * n + 2 * i + u / 2;
            put(out, 16 * n + 4 * i + u, k, codes[i], pair_scale(sc[8 * grp + 2 * k], sc[8 * grp + 2 * k + 1]), true);
          }
        }
      }
    }
  }
}

// MB rows of x (x16: their 16-bit values, K apart; xs: their scales, one per kXScale slices, K / 8 /
// kXScale apart) times one widened group (x8_widen_group): part[m][0..8), Q4_K's mins apart.
template <int MB, int kFlush, int kXScale>
void x8_wide_rows(const int16_t* x16, const float* xs, int64_t K, const int16_t* buf, const float* dvec,
                  float (*part)[kX8Rows]) {
  const int64_t spans = K / 8 / kFlush, xs_stride = K / 8 / kXScale;
  XF facc[MB][kW16Vecs];
  for (int mi = 0; mi < MB; ++mi)
    for (int v = 0; v < kW16Vecs; ++v) facc[mi][v] = xf_zero();
  for (int64_t sp = 0; sp < spans; ++sp) {
    XI iacc[MB][kW16Vecs];
    for (int mi = 0; mi < MB; ++mi)
      for (int v = 0; v < kW16Vecs; ++v) iacc[mi][v] = xi_zero();
#pragma GCC unroll 4
    for (int s = 0; s < kFlush; ++s) {
      const int64_t slice = sp * kFlush + s;
      XI w[kW16Vecs];
      for (int v = 0; v < kW16Vecs; ++v)
        w[v] = xi_load(reinterpret_cast<const uint8_t*>(buf + slice * 64 + v * 2 * kW16Lanes));
      for (int mi = 0; mi < MB; ++mi) {
        const XI xb = xi_bcast128(reinterpret_cast<const uint8_t*>(x16 + mi * K + 8 * slice));
        for (int v = 0; v < kW16Vecs; ++v) iacc[mi][v] = xi_madd16(iacc[mi][v], w[v], xb);
      }
    }
    for (int mi = 0; mi < MB; ++mi) {
      const XF dx = xf_set1(xs[mi * xs_stride + sp * kFlush / kXScale]);
      for (int v = 0; v < kW16Vecs; ++v)
        facc[mi][v] = xf_fmadd(xf_cvt(iacc[mi][v]), xf_mul(xf_load(dvec + sp * 32 + v * kW16Lanes), dx), facc[mi][v]);
    }
  }
  // Each row of W's 4 lanes summed in order, ((l0 + l1) + l2) + l3.
#if defined(PAGELLM_INT8_VNNI)
  // AVX-512: 4 rows of W a vector, their sums in each 128-bit lane's first element, gathered by one
  // two-source permute, where the scalar loop below stored each vector and added its lanes one by
  // one (Q4_K's prefill products 1.03-1.08x on one thread this way, Q6_K's 1.01-1.04x)
  static_assert(kW16Vecs == 2, "two vectors of 4 rows of W");
  const __m512i firsts = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 0, 0, 0, 0, 0, 0, 0);
  for (int mi = 0; mi < MB; ++mi) {
    __m512 s[kW16Vecs];
    for (int v = 0; v < kW16Vecs; ++v) {
      const __m512 f = facc[mi][v];
      s[v] = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(f, _mm512_permute_ps(f, 1)), _mm512_permute_ps(f, 2)),
                           _mm512_permute_ps(f, 3));
    }
    _mm256_storeu_ps(part[mi], _mm512_castps512_ps256(_mm512_permutex2var_ps(s[0], firsts, s[1])));
  }
#else
  for (int mi = 0; mi < MB; ++mi) {
    alignas(64) float lanes[kW16Lanes];
    for (int v = 0; v < kW16Vecs; ++v) {
      xf_store(lanes, facc[mi][v]);
      for (int r = 0; r < kW16Lanes / 4; ++r)
        part[mi][v * kW16Lanes / 4 + r] = lanes[4 * r] + lanes[4 * r + 1] + lanes[4 * r + 2] + lanes[4 * r + 3];
    }
  }
#endif
}

// Rows [m, m + MB) of x times widened group g, into y. Q4_K and Q4_1 subtract the mins' term first:
// x's per-32 sums (bsums, K / 32 a row) against Q4_K's dmin * m_j (Q4_1's -m) at mins [K / 32][8
// rows of W] (the other types never read mins), on two FMA chains (K / 32 is even): one, each FMA
// waiting on the last, cost the 1B's prompts 7-16% of their Q4_K products; four ran no faster than
// two. Subtracted here, from the MB rows' sums before they are stored, with each load of mins
// serving them all, rather than in a second pass over y's rows (N floats apart) a row at a time:
// the same values and operations, Q4_K's prefill products 1.02-1.09x on Zen 4 (kernel_ab.py, 64
// and 256 rows).
template <int MB, int64_t T>
void x8_prefill_rows(const int16_t* x16, const float* xs, int64_t m, int64_t K, const int16_t* buf, const float* dvec,
                     const float* bsums, const float* mins, float* y, int64_t N, int64_t g) {
  constexpr int kXScale = x_scale_slices(T);
  alignas(32) float part[MB][kX8Rows];
  x8_wide_rows<MB, flush_slices(T), kXScale>(x16 + m * K, xs + m * (K / 8 / kXScale), K, buf, dvec, part);
  if constexpr (T == Q4_K || T == Q5_K || T == Q4_1) {
    __m256 a0[MB], a1[MB];
    for (int mi = 0; mi < MB; ++mi) a0[mi] = a1[mi] = _mm256_setzero_ps();
    for (int64_t j = 0; j < K / 32; j += 2) {
      const __m256 m0 = _mm256_loadu_ps(mins + 8 * j), m1 = _mm256_loadu_ps(mins + 8 * j + 8);
      for (int mi = 0; mi < MB; ++mi) {
        const float* bs = bsums + (m + mi) * K / 32;
        a0[mi] = _mm256_fmadd_ps(_mm256_set1_ps(bs[j]), m0, a0[mi]);
        a1[mi] = _mm256_fmadd_ps(_mm256_set1_ps(bs[j + 1]), m1, a1[mi]);
      }
    }
    for (int mi = 0; mi < MB; ++mi)
      _mm256_store_ps(part[mi], _mm256_sub_ps(_mm256_load_ps(part[mi]), _mm256_add_ps(a0[mi], a1[mi])));
  }
  const int64_t rows = std::min<int64_t>(kX8Rows, N - kX8Rows * g);  // a last group past N: Q4_1's, Q8_0's blocks
  for (int mi = 0; mi < MB; ++mi) std::memcpy(y + (m + mi) * N + kX8Rows * g, part[mi], rows * sizeof(float));
}

template <int64_t T>
void x8_prefill_group(const int16_t* x16, const float* xs, int64_t M, int64_t K, const int16_t* buf, const float* dvec,
                      const float* bsums, const float* mins, float* y, int64_t N, int64_t g) {
  constexpr int kRows = prefill_rows(T);
  int64_t m = 0;
  for (; m + kRows <= M; m += kRows) x8_prefill_rows<kRows, T>(x16, xs, m, K, buf, dvec, bsums, mins, y, N, g);
  for (; m < M; ++m) x8_prefill_rows<1, T>(x16, xs, m, K, buf, dvec, bsums, mins, y, N, g);
}

// x [M, K] float32 times W [N, ...]: a repacked weight (Q4_K_X8 / Q5_K_X8 / Q6_K_X8 / Q4_1_X8, qtype its GGUF
// type) or Q8_0's, Q5_K's or Q4_1's blocks; y [M, N], x rounded with one or two codes (see above). Each thread widens a group of
// 8 rows of W at a time and runs every row of x past it, prefill_rows at a time.
void x8_prefill_chunk(const float* x, int64_t M, const uint8_t* w, int64_t qtype, int64_t K, int64_t N,
                      bool two_terms, float* y, Layout x8) {
  const bool per32 = qtype == Q8_0 || qtype == Q4_0 || qtype == Q4_1;
#if defined(PAGELLM_INT8_VNNI)
  const ActRows a = per32 ? quantize_activations(x, M, K, two_terms) : quantize_super(x, M, K, two_terms, false, two_terms);
#else
  const ActRows a = per32 ? quantize_activations(x, M, K, two_terms) : quantize_super(x, M, K, two_terms);
#endif
  std::vector<int16_t> joined;
  const int16_t* x16 = a.wide.data();
  if (a.wide.empty()) {  // one code c, or the two joined here: 128 c + r, as the wide quantizer stores them
    joined.resize(M * K);
    join_codes(a.codes.data(), two_terms ? a.residual.data() : nullptr, M * K, joined.data());
    x16 = joined.data();
  }
  // x's scales of the 16-bit values: per 32 (quantize_activations' lane scales take two codes' 1/128
  // in already) or per 256 (quantize_super's do not)
  std::vector<float> xs;
  if (per32) {
    xs = a.block_scale;
  } else {
    xs = a.super_scale;
    if (two_terms)
      for (float& s : xs) s /= 128.f;
  }
  const bool has_mins = qtype == Q4_K || qtype == Q5_K || qtype == Q4_1;
  const float* bsums = a.block_sum.data();  // x's per-32 sums
  at::parallel_for(0, (N + kX8Rows - 1) / kX8Rows, 1, [&](int64_t g0, int64_t g1) {
    std::vector<int16_t> buf(K * kX8Rows);
    std::vector<float> dvec(K / 8 / flush_slices(qtype) * 32), mins(has_mins ? K / 4 : 0);
    for (int64_t g = g0; g < g1; ++g) {
      x8_widen_group(qtype, w, K, N, g, buf.data(), dvec.data(), mins.data(), x8);
      const float* gm = mins.data();
      switch (qtype) {
        case Q4_K: x8_prefill_group<Q4_K>(x16, xs.data(), M, K, buf.data(), dvec.data(), bsums, gm, y, N, g); break;
        case Q5_K: x8_prefill_group<Q5_K>(x16, xs.data(), M, K, buf.data(), dvec.data(), bsums, gm, y, N, g); break;
        case Q6_K: x8_prefill_group<Q6_K>(x16, xs.data(), M, K, buf.data(), dvec.data(), bsums, gm, y, N, g); break;
        case Q4_1: x8_prefill_group<Q4_1>(x16, xs.data(), M, K, buf.data(), dvec.data(), bsums, gm, y, N, g); break;
        case Q4_0: x8_prefill_group<Q4_0>(x16, xs.data(), M, K, buf.data(), dvec.data(), bsums, gm, y, N, g); break;
        default: x8_prefill_group<Q8_0>(x16, xs.data(), M, K, buf.data(), dvec.data(), bsums, gm, y, N, g); break;
      }
    }
  });
}
// x8_prefill_chunk over chunks of x's rows whose 16-bit values (2 K bytes a row) take about 1 MiB, so
// that every group of W reads them from L2, not from memory (a step's 2048 rows of 2048 values are
// 8 MiB, read again for each group of 8 rows). Each chunk widens W's groups again, so only where a
// chunk keeps at least 256 rows (K <= 2048); longer rows take x whole. A/B, one thread, 1024 rows
// against one chunk: 2048 x 2048 1.3x faster in chunks of 256; 2048 x 8192 0.9x in chunks of 64,
// 0.95x in chunks of 256 (4 MiB, past L2). Rows are rounded each on its own: chunks change no value.
void x8_prefill(const float* x, int64_t M, const uint8_t* w, int64_t qtype, int64_t K, int64_t N, bool two_terms,
                float* y, Layout x8) {
  const int64_t fit = (int64_t{1} << 20) / (2 * K) / 4 * 4;
  const int64_t chunk = fit >= 256 ? fit : M;
  for (int64_t m0 = 0; m0 < M; m0 += chunk)
    x8_prefill_chunk(x + m0 * K, std::min(chunk, M - m0), w, qtype, K, N, two_terms, y + m0 * N, x8);
}
#endif  // PAGELLM_INT8_ACTIVATIONS

#if defined(PAGELLM_AMX)
// ---- AMX tiles: many rows of x against repacked Q4_K / Q6_K (Q8_0's and Q4_1's blocks below) ----
// On CPUs with AMX (Intel Sapphire Rapids and later) one TDPBSUD / TDPBSSD multiplies 16 rows of x's
// int8 codes by 16 rows of W's 8-bit values over 64 values into 16 x 16 exact int32 sums, where the
// 16-bit kernel (x8_prefill) takes 64 VPDPWSSD for the same. The tiles have no place for W's
// sub-block scales, and a product of each sub-block's sums by its scale (per row of W, every 32 or
// 16 values) cost more than the tiles' work; so each super-block of 16 rows of W is widened once
// with its integer scales folded in, w = sc * q (Q4_K: q 0..15, sc 0..63; Q6_K: q - 32, sc int8),
// and split into two 8-bit parts, w = F hi + lo (Q4_K: F 8, hi = sh q and lo = sl q for sc = 8 sh +
// sl; Q6_K: F 64, lo 0..63), each a tile: four products per 64 values (x's two codes times the two
// parts) summed in four tiles over the super-block, joined in integers (F hi + lo: below 2^31) and
// scaled once per super-block by W's d and x's scale. x is rounded as the other products of repacked
// weights round it (quantize_super: one scale per 256 values, one or two codes), so the sums are the
// same integers; only the float32 summation order differs. Q4_K's mins go beside, as x8_prefill's.
// Bytes of each group of W fetched ahead of the super-block being widened (1B Q4_K_M, 16 streams,
// in one process: none, 4, 8, 12, 16, 24, 32 KiB: 64 steps in 11.1, 8.6, 8.6, 7.7, 6.8-7.1, 7.1, 7.7 s).
constexpr int64_t kAmxAhead = 16384;
constexpr int64_t kAmxRows = 16;          // rows of x per tile, and rows of W (two groups of 8)
// Products of fewer rows of x keep the other kernels: a tile of 16 rows costs about the same for
// any number of them, and W's widening into tiles is paid per product (1B shapes, one thread,
// interleaved, against the row, blocks' and 16-bit kernels: Q4_K 0.6x at 4 rows, 1.1x at 8, 1.9x at
// 16, 3x at 64; Q6_K 0.8-0.9x at 4, 1.1-1.3x at 6, 2-3x at 16; Q8_0 0.6-1.0x at 4, 0.9-1.4x at 6,
// 1.4-2.3x at 16; Q4_1 (SmolLM2's shapes) 1.55-1.85x at 16, and since its scales are gathered
// (words16) 1.07-1.22x at 5 and 1.38-1.56x at 6 on one thread, yet SmolLM2's decode steps of
// 5 and 6 streams on two threads ran 7-10% slower from 5 or 6 rows than from 8). Repacked Q4_1
// keeps its row loop to kQ41RowLoopMax rows whatever these say (see there).
constexpr int64_t amx_default_rows(int64_t qtype) { return qtype == Q4_K || qtype == Q4_1 ? 8 : 6; }
constexpr int64_t kAmxTypes[4] = {Q4_K, Q6_K, Q8_0, Q4_1};
constexpr bool amx_serves(int64_t qtype) {  // amx_slot gives any other type Q4_1's slot: ask this first
  for (int64_t t : kAmxTypes)
    if (t == qtype) return true;
  return false;
}
constexpr int amx_slot(int64_t qtype) { return qtype == Q4_K ? 0 : qtype == Q6_K ? 1 : qtype == Q8_0 ? 2 : 3; }
// The crossovers in force: set_amx_min_rows moves them, for the measurements that find them.
std::atomic<int64_t> amx_from_rows[4] = {amx_default_rows(Q4_K), amx_default_rows(Q6_K), amx_default_rows(Q8_0),
                                         amx_default_rows(Q4_1)};
inline int64_t amx_min_rows(int64_t qtype) { return amx_from_rows[amx_slot(qtype)].load(std::memory_order_relaxed); }

// Whether this process may use the tiles: Linux hands out their state only on request.
bool amx_permitted() {
  static const bool permitted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
}
std::atomic<bool> amx_wanted{true};  // set_amx: off for A/B measurements and the tests' comparisons

struct alignas(64) AmxConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Eight tiles of 16 rows x 64 bytes: tmm0-3 the sums (x's first code times W's hi, times lo; its
// second code times hi, times lo), tmm4-5 x's two codes over 64 values, tmm6-7 W's hi and lo parts
// (16 rows of 4 values of each of W's 16 rows). The configuration is per thread.
void amx_configure(int64_t x_rows) {
  AmxConfig c;
  for (int t = 0; t < 8; ++t) c.rows[t] = t < 6 ? x_rows : kAmxRows, c.colsb[t] = 64;
  _tile_loadconfig(&c);
}

// One super-block of W's rows 16 p.. (groups 2 p and 2 p + 1 of a repacked weight), as the tiles
// take it: hi and lo [4 x 64 values][16 tile rows][16 rows of W][4 values], d per row of W, and Q4_K's
// dmin * m per sub-block and row.
struct AmxBlock {
  alignas(64) uint8_t hi[4096];
  alignas(64) uint8_t lo[4096];
  alignas(64) float d[16];
  alignas(64) float mins[8][16];
};

// The two groups' tiles hold each row's 8 bytes of a unit together (two 32-bit lanes); AMX's
// tiles want 4 values of each of 16 rows side by side: the first lanes of both groups' rows, then
// the second ones.
inline void amx_split_lanes(const uint8_t* a, const uint8_t* b, __m512i& first, __m512i& second) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i va = _mm512_loadu_si512(a), vb = b ? _mm512_loadu_si512(b) : _mm512_setzero_si512();
  first = _mm512_permutex2var_epi32(va, even, vb);
  second = _mm512_permutex2var_epi32(va, _mm512_add_epi32(even, _mm512_set1_epi32(1)), vb);
}

// Q6_K: 4 values of each of W's 16 rows (`codes`, q - 32) times their rows' integer scales (sc: 16
// bits, each row's repeated over its 4 values, rows 0-7 and 8-15), split into 64 hi + lo at byte
// offset `at` of the block.
inline void amx_put(__m512i codes, __m512i sc_low, __m512i sc_high, AmxBlock& s, int at) {
  const __m512i mask = _mm512_set1_epi16(63);
  const __m512i w0 = _mm512_mullo_epi16(_mm512_cvtepi8_epi16(_mm512_castsi512_si256(codes)), sc_low);
  const __m512i w1 = _mm512_mullo_epi16(_mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(codes, 1)), sc_high);
  const auto join = [](__m512i a, __m512i b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(a)), _mm512_cvtepi16_epi8(b), 1);
  };
  _mm512_store_si512(s.hi + at, join(_mm512_srai_epi16(w0, 6), _mm512_srai_epi16(w1, 6)));
  _mm512_store_si512(s.lo + at, join(_mm512_and_si512(w0, mask), _mm512_and_si512(w1, mask)));
}

// The 16 bytes at a and b (rows 0-7, 8-15 of W: a byte each, 8 bytes apart in each group's tile).
inline __m128i amx_row_bytes(const uint8_t* a, const uint8_t* b) {
  return _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a)),
                            b ? _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b)) : _mm_setzero_si128());
}

// The 16 float16 values at a and b (rows 0-7, 8-15 of W), as floats.
inline __m512 amx_row_halves(const uint8_t* a, const uint8_t* b) {
  return _mm512_cvtph_ps(_mm256_set_m128i(b ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)) : _mm_setzero_si128(),
                                          _mm_loadu_si128(reinterpret_cast<const __m128i*>(a))));
}

// A span's integer scales of W's 16 rows (16 bits each) as amx_put takes them.
inline void amx_scales(__m256i sc, __m512i& low, __m512i& high) {
  const __m512i i = _mm512_srli_epi16(_mm512_setr_epi64(0x0003000200010000LL, 0x0007000600050004LL, 0x000B000A00090008LL,
                                                         0x000F000E000D000CLL, 0x0013001200110010LL, 0x0017001600150014LL,
                                                         0x001B001A00190018LL, 0x001F001E001D001CLL), 2);  // lane l: l / 4
  const __m512i v = _mm512_castsi256_si512(sc);
  low = _mm512_permutexvar_epi16(i, v);
  high = _mm512_permutexvar_epi16(_mm512_add_epi16(i, _mm512_set1_epi16(8)), v);
}

// Q4_K: w = sc * q with sc = 8 sh + sl (sh, sl 0..7) is 8 (sh q) + (sl q), both parts below 128, and
// each part is one byte lookup (VPERMI2B into the 128 products s * q, index 16 s + q) instead of a
// widening, a 16-bit product and a narrowing per 32 values. Unit p of a tile holds sub-block 2 j's
// values 8 q..8 q + 7 in its low nibbles and sub-block 2 j + 1's in its high ones (j = p / 4, q = p %
// 4): tile rows 2 q and 2 q + 1 of each (a sub-block is 8 tile rows of 64 bytes).
void amx_q4_k_block(const uint8_t* t0, const uint8_t* t1, AmxBlock& s) {
  const auto at = [t1](int64_t o) { return t1 ? t1 + o : nullptr; };
  _mm512_store_ps(s.d, amx_row_halves(t0 + kQ4D, at(kQ4D)));
  const __m512 dmin = amx_row_halves(t0 + kQ4Dmin, at(kQ4Dmin));
  for (int j = 0; j < 8; ++j)
    _mm512_store_ps(s.mins[j], _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                                       amx_row_bytes(t0 + kQ4M + 8 * j, at(kQ4M + 8 * j))))));
  alignas(64) static const auto table = [] {
    std::array<uint8_t, 128> v{};
    for (int i = 0; i < 128; ++i) v[i] = static_cast<uint8_t>((i / 16) * (i % 16));
    return v;
  }();
  const __m512i products0 = _mm512_load_si512(table.data()), products1 = _mm512_load_si512(table.data() + 64);
  const __m512i low = _mm512_set1_epi8(0x0F), bytes = _mm512_set1_epi32(0x01010101);
  // sub-block j's scales of the 16 rows, as lookup indices 16 sh and 16 sl in each row's 4 bytes
  __m512i sh[8], sl[8];
  for (int j = 0; j < 8; ++j) {
    const __m512i sc = _mm512_cvtepu8_epi32(amx_row_bytes(t0 + kQ4Sc + 8 * j, at(kQ4Sc + 8 * j)));
    sh[j] = _mm512_mullo_epi32(_mm512_slli_epi32(_mm512_srli_epi32(sc, 3), 4), bytes);
    sl[j] = _mm512_mullo_epi32(_mm512_slli_epi32(_mm512_and_si512(sc, _mm512_set1_epi32(7)), 4), bytes);
  }
  const auto put = [&](__m512i q, int j, int at) {
    _mm512_store_si512(s.hi + at, _mm512_permutex2var_epi8(products0, _mm512_or_si512(q, sh[j]), products1));
    _mm512_store_si512(s.lo + at, _mm512_permutex2var_epi8(products0, _mm512_or_si512(q, sl[j]), products1));
  };
  for (int p = 0; p < 16; ++p) {
    __m512i first, second;
    amx_split_lanes(t0 + 64 * p, t1 ? t1 + 64 * p : nullptr, first, second);
    const int j = p / 4, at = (2 * j) * 512 + (p % 4) * 128;
    put(_mm512_and_si512(first, low), 2 * j, at);
    put(_mm512_and_si512(second, low), 2 * j, at + 64);
    put(_mm512_and_si512(_mm512_srli_epi16(first, 4), low), 2 * j + 1, at + 512);
    put(_mm512_and_si512(_mm512_srli_epi16(second, 4), low), 2 * j + 1, at + 576);
  }
}

// Q6_K: as x8_widen_group reads its units (values 128 n + 32 i + 8 u.. of each row from ql units
// 8 n + u, 8 n + 4 + u and qh unit 4 n + u), less 32: group 8 n + 2 i + u / 2's tile rows 2 (u % 2)
// and 2 (u % 2) + 1 (a group of 16 values is 4 tile rows).
void amx_q6_k_block(const uint8_t* t0, const uint8_t* t1, AmxBlock& s) {
  const auto at = [](const uint8_t* t, int64_t o) { return t ? t + o : nullptr; };
  _mm512_store_ps(s.d, amx_row_halves(t0 + kQ6D, at(t1, kQ6D)));
  const __m512i low = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30), off = _mm512_set1_epi8(32);
  for (int n = 0; n < 2; ++n) {
    for (int u = 0; u < 4; ++u) {
      __m512i A[2], B[2], H[2];
      amx_split_lanes(t0 + 64 * (8 * n + u), at(t1, 64 * (8 * n + u)), A[0], A[1]);
      amx_split_lanes(t0 + 64 * (8 * n + 4 + u), at(t1, 64 * (8 * n + 4 + u)), B[0], B[1]);
      amx_split_lanes(t0 + kQ6Qh + 64 * (4 * n + u), at(t1, kQ6Qh + 64 * (4 * n + u)), H[0], H[1]);
      for (int i = 0; i < 4; ++i) {
        const int g = 8 * n + 2 * i + u / 2;
        __m512i sc_low, sc_high;
        amx_scales(_mm256_cvtepi8_epi16(amx_row_bytes(t0 + kQ6Sc + 8 * g, at(t1, kQ6Sc + 8 * g))), sc_low, sc_high);
        for (int h = 0; h < 2; ++h) {
          const __m512i a = i % 2 ? B[h] : A[h];
          const __m512i qh = i == 0 ? _mm512_slli_epi16(H[h], 4) : i == 1 ? _mm512_slli_epi16(H[h], 2)
                             : i == 2 ? H[h] : _mm512_srli_epi16(H[h], 2);
          const __m512i ql = i < 2 ? a : _mm512_srli_epi16(a, 4);
          const __m512i codes = _mm512_or_si512(_mm512_and_si512(ql, low), _mm512_and_si512(qh, top));
          amx_put(_mm512_sub_epi8(codes, off), sc_low, sc_high, s, g * 256 + (2 * (u % 2) + h) * 64);
        }
      }
    }
  }
}

// 16 rows of x (codes, residual: their values of this super-block, as amx_tiles lays them out)
// times one AmxBlock, added into acc[row][W's 16 rows]: xs the rows' scales of the super-block (two
// codes: already / 128), K / 256 apart; bsum (Q4_K) their d * code sums per 32 values, K / 32 apart.
template <int64_t T, bool kTwo>
void amx_block_rows(const int8_t* codes, const int8_t* residual, int64_t K, const AmxBlock& s, const float* xs,
                    const float* bsum, int64_t rows, float (*acc)[16]) {
  constexpr int kShift = T == Q4_K ? 3 : 6;  // w = 2^kShift hi + lo
  alignas(64) int32_t sums[4][16][16];
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (kTwo) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int c = 0; c < 4; ++c) {
    _tile_loadd(6, s.hi + 1024 * c, 64);
    _tile_loadd(7, s.lo + 1024 * c, 64);
    _tile_loadd(4, codes + 1024 * c, 64);
    if constexpr (T == Q4_K) _tile_dpbsud(0, 4, 6);
    else _tile_dpbssd(0, 4, 6);
    _tile_dpbsud(1, 4, 7);
    if constexpr (kTwo) {
      _tile_loadd(5, residual + 1024 * c, 64);
      if constexpr (T == Q4_K) _tile_dpbsud(2, 5, 6);
      else _tile_dpbssd(2, 5, 6);
      _tile_dpbsud(3, 5, 7);
    }
  }
  _tile_stored(0, sums[0], 64);
  _tile_stored(1, sums[1], 64);
  if constexpr (kTwo) {
    _tile_stored(2, sums[2], 64);
    _tile_stored(3, sums[3], 64);
  }
  const __m512 d = _mm512_load_ps(s.d);
  for (int r = 0; r < rows; ++r) {
    const auto joined = [&](int k) {
      return _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(sums[k][r]), kShift), _mm512_load_si512(sums[k + 1][r]));
    };
    __m512 v = _mm512_cvtepi32_ps(joined(0));
    if constexpr (kTwo) v = _mm512_fmadd_ps(v, _mm512_set1_ps(128.f), _mm512_cvtepi32_ps(joined(2)));
    __m512 a = _mm512_fmadd_ps(v, _mm512_mul_ps(d, _mm512_set1_ps(xs[r * (K / QK_K)])), _mm512_loadu_ps(acc[r]));
    if constexpr (T == Q4_K)
      for (int j = 0; j < 8; ++j) a = _mm512_fnmadd_ps(_mm512_set1_ps(bsum[r * (K / 32) + j]), _mm512_load_ps(s.mins[j]), a);
    _mm512_storeu_ps(acc[r], a);
  }
}

// x's codes [M, K] as the tiles read them: [padded / 16][K / 64][16 rows][64 values], rows past M
// zero. Read in place, a tile's 16 rows K bytes apart fell in the same few sets of L1 (K a power of
// two) and came from L2 every time.
std::vector<int8_t> amx_tiles(const std::vector<int8_t>& codes, int64_t M, int64_t padded, int64_t K) {
  std::vector<int8_t> out(padded * K);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < K / 64; ++c)
      std::memcpy(out.data() + ((m / kAmxRows) * (K / 64) + c) * 1024 + (m % kAmxRows) * 64, codes.data() + m * K + 64 * c, 64);
  return out;
}

// x [M, K] times a repacked weight (qtype Q4_K or Q6_K, N rows, a multiple of 8), into y [M, N].
// Threads take pairs of W's groups; each builds a pair's AmxBlock once per super-block and runs
// every 16 rows of x past it.
template <int64_t T, bool kTwo>
void amx_x8_chunk(const float* x, int64_t M, const uint8_t* w, int64_t K, int64_t N, float* y) {
  ActRows a = quantize_super(x, M, K, kTwo, false);
  const int64_t padded = (M + kAmxRows - 1) / kAmxRows * kAmxRows, supers = K / QK_K;
  const std::vector<int8_t> codes = amx_tiles(a.codes, M, padded, K);
  const std::vector<int8_t> residual = kTwo ? amx_tiles(a.residual, M, padded, K) : std::vector<int8_t>();
  a.super_scale.resize(padded * supers);  // rows past M: zero scales and sums (their sums are not stored)
  a.block_sum.resize(padded * K / 32);
  if (kTwo)
    for (float& s : a.super_scale) s /= 128.f;
  const int64_t groups = N / kX8Rows, tile_bytes = T == Q4_K ? kQ4Tile : kQ6Tile, group_bytes = supers * tile_bytes;
  const int64_t tiles = padded / kAmxRows;
  at::parallel_for(0, (groups + 1) / 2, 1, [&](int64_t p0, int64_t p1) {
    amx_configure(std::min(M, kAmxRows));
    AmxBlock s;
    std::vector<float> acc(tiles * kAmxRows * 16);
    for (int64_t p = p0; p < p1; ++p) {
      std::fill(acc.begin(), acc.end(), 0.f);
      const uint8_t* g0 = w + 2 * p * group_bytes;
      const uint8_t* g1 = 2 * p + 1 < groups ? g0 + group_bytes : nullptr;
      for (int64_t b = 0; b < supers; ++b) {
        // a decode step's products read W from memory once, and the tiles' work between two reads of
        // it left the hardware's prefetcher behind (16 rows of x, Q4_K gate/up: 3.6 ms a call without,
        // 1.7 with, where the same product on weights in cache takes about as long)
        for (int64_t i = 0; i < tile_bytes; i += 64) {
          prefetch(g0 + b * tile_bytes + kAmxAhead + i);
          prefetch(g0 + group_bytes + b * tile_bytes + kAmxAhead + i);
        }
        if constexpr (T == Q4_K) amx_q4_k_block(g0 + b * tile_bytes, g1 ? g1 + b * tile_bytes : nullptr, s);
        else amx_q6_k_block(g0 + b * tile_bytes, g1 ? g1 + b * tile_bytes : nullptr, s);
        for (int64_t t = 0; t < tiles; ++t) {
          const int64_t m = t * kAmxRows;
          const int64_t at = m * K + b * QK_K * kAmxRows;  // tile t, chunks 4 b..
          amx_block_rows<T, kTwo>(codes.data() + at, kTwo ? residual.data() + at : nullptr,
                                  K, s, a.super_scale.data() + m * supers + b, a.block_sum.data() + m * (K / 32) + b * 8,
                                  std::min(kAmxRows, M - m), reinterpret_cast<float(*)[16]>(acc.data() + m * 16));
        }
      }
      const int64_t n0 = 16 * p, cols = std::min<int64_t>(16, N - n0);
      for (int64_t m = 0; m < M; ++m) std::memcpy(y + m * N + n0, acc.data() + m * 16, cols * sizeof(float));
    }
    _tile_release();
  });
}

// ---- Q8_0's blocks on AMX tiles ----
// Q8_0 keeps a float16 scale per 32 values of each row, so its sums cannot be joined in integers
// past a block: each block is one product per code (32 values deep), its sums scaled into float
// accumulators, one vector per row of x with W's 16 rows in its lanes, which stay in registers
// over the whole row (x rounded per 32 values, as the blocks' other kernels round it). A block's
// 16 rows of codes go into the tiles' layout by a transpose of 4-byte lanes.

// Four vectors' 128-bit parts transposed: out[j] holds part j of v[0], v[1], v[2], v[3] in turn (the
// last step of the blocks' transposes, each part the same 4-value lane of 4 rows).
inline void amx_transpose_parts(const __m512i* v, __m512i* out) {
  const __m512i t0 = _mm512_shuffle_i32x4(v[0], v[1], 0x44), t1 = _mm512_shuffle_i32x4(v[0], v[1], 0xEE);
  const __m512i t2 = _mm512_shuffle_i32x4(v[2], v[3], 0x44), t3 = _mm512_shuffle_i32x4(v[2], v[3], 0xEE);
  out[0] = _mm512_shuffle_i32x4(t0, t2, 0x88), out[1] = _mm512_shuffle_i32x4(t0, t2, 0xDD);
  out[2] = _mm512_shuffle_i32x4(t1, t3, 0x88), out[3] = _mm512_shuffle_i32x4(t1, t3, 0xDD);
}

// Block bl of W's rows n0.. (`rows` of them, the rest zero) as a tile: [8][16 rows][4 values], and
// the rows' scales d[16].
void amx_q8_0_block(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t rows, int64_t bl, uint8_t* out,
                    float* d) {
  const auto row = [&](int64_t i) { return w + (n0 + i) * row_bytes + bl * 34; };
  const auto codes = [&](int64_t i) {
    return i < rows ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row(i) + 2)) : _mm256_setzero_si256();
  };
  _mm512_storeu_ps(d, word_halves(words16(row(0), row_bytes, rows), false));
  // rows 4 g..4 g + 3: their 4-value lanes 0-3 (first) and 4-7 (second), lane j of the 4 rows in
  // 128-bit part j
  __m512i first[4], second[4];
  alignas(64) static const int32_t pick[16] = {0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11, 19, 27};
  const __m512i lo = _mm512_load_si512(pick), hi = _mm512_add_epi32(lo, _mm512_set1_epi32(4));
  for (int g = 0; g < 4; ++g) {
    const __m512i a = _mm512_inserti64x4(_mm512_castsi256_si512(codes(4 * g)), codes(4 * g + 1), 1);
    const __m512i b = _mm512_inserti64x4(_mm512_castsi256_si512(codes(4 * g + 2)), codes(4 * g + 3), 1);
    first[g] = _mm512_permutex2var_epi32(a, lo, b);
    second[g] = _mm512_permutex2var_epi32(a, hi, b);
  }
  // 128-bit parts transposed over the 4 groups: tile row j holds lane j of all 16 rows
  for (int h = 0; h < 2; ++h) {
    __m512i lanes[4];
    amx_transpose_parts(h ? second : first, lanes);
    for (int j = 0; j < 4; ++j) _mm512_storeu_si512(out + h * 256 + 64 * j, lanes[j]);
  }
}

// Q4_1's block bl of W's rows n0.. (`rows` of them, the rest zero; x8: from Q4_1_X8 tiles) as a
// tile: [8][16 rows][4 values] (low nibbles: values 0-15, tile rows 0-3; high: 16-31, rows 4-7), the
// rows' d[16] and m[16].
void amx_q4_1_block(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t rows, int64_t bl, uint8_t* out,
                    float* d, float* m, Layout x8) {
  // rows 4 g..4 g + 3's 16 bytes of codes, 128 bits each (a[g]), then lane j of the 4 rows in 128-bit part j
  __m512i a[4];
  if (x8) {  // two tiles of 8 rows (N a multiple of 8: rows is 8 or 16)
    const int64_t blocks = row_bytes / 20;
    const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11), second = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
    for (int t = 0; t < 2; ++t) {
      if (8 * t >= rows) {
        a[2 * t] = a[2 * t + 1] = _mm512_setzero_si512();
        for (int i = 0; i < 8; ++i) d[8 * t + i] = m[8 * t + i] = 0.f;
        continue;
      }
      const uint8_t* tile = w + ((n0 / kX8Rows + t) * blocks + bl) * q41_tile_bytes(x8);
      _mm256_storeu_ps(d + 8 * t, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tile + kQ41D))));
      _mm256_storeu_ps(m + 8 * t, q41_tile_mins(tile, x8));
      // units 0 and 1 hold bytes 0-7 and 8-15 of each row: joined by qwords, rows 0, 2, 4, 6 and 1, 3, 5, 7
      const __m512i u0 = _mm512_loadu_si512(tile), u1 = _mm512_loadu_si512(tile + 64);
      const __m512i even = _mm512_unpacklo_epi64(u0, u1), odd = _mm512_unpackhi_epi64(u0, u1);
      a[2 * t] = _mm512_permutex2var_epi64(even, first, odd);
      a[2 * t + 1] = _mm512_permutex2var_epi64(even, second, odd);
    }
  } else {
    const auto row = [&](int64_t i) { return w + (n0 + i) * row_bytes + bl * 20; };
    const __m512i dm = words16(row(0), row_bytes, rows);  // d, m
    _mm512_storeu_ps(d, word_halves(dm, false));
    _mm512_storeu_ps(m, word_halves(dm, true));
    const auto codes = [&](int64_t i) {
      return i < rows ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(row(i) + 4)) : _mm_setzero_si128();
    };
    for (int g = 0; g < 4; ++g)
      a[g] = _mm512_inserti32x4(_mm512_inserti32x4(_mm512_inserti32x4(_mm512_castsi128_si512(codes(4 * g)),
                                                                      codes(4 * g + 1), 1), codes(4 * g + 2), 2),
                                codes(4 * g + 3), 3);
  }
  alignas(64) static const int32_t pick[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};
  const __m512i order = _mm512_load_si512(pick);
  __m512i v[4];
  for (int g = 0; g < 4; ++g) v[g] = _mm512_permutexvar_epi32(order, a[g]);
  __m512i lanes[4];
  amx_transpose_parts(v, lanes);
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int j = 0; j < 4; ++j) {
    _mm512_storeu_si512(out + 64 * j, _mm512_and_si512(lanes[j], low));
    _mm512_storeu_si512(out + 256 + 64 * j, _mm512_and_si512(_mm512_srli_epi16(lanes[j], 4), low));
  }
}

// Tiles for Q8_0 and Q4_1: tmm0-1 a block's sums (x's first and second code), tmm2-3 the next
// block's (so a block's products run while the last one's sums are scaled), tmm4-5 16 rows of x's two
// codes over 32 values, tmm6 W's block (8 rows of 4 values of each of 16 rows).
void amx_configure_blocks(int64_t x_rows) {
  AmxConfig c;
  for (int t = 0; t < 4; ++t) c.rows[t] = x_rows, c.colsb[t] = 64;
  for (int t = 4; t < 6; ++t) c.rows[t] = x_rows, c.colsb[t] = 32;
  c.rows[6] = 8, c.colsb[6] = 64;
  _tile_loadconfig(&c);
}

// A block's sums into tiles A (first code) and B (second), W's codes signed (Q8_0) or not (Q4_1):
// GCC's tile intrinsics take the tiles' numbers as literals, hence a macro for the two pairs.
#define PAGELLM_AMX_BLOCK_SUMS(A, B, DOT)           \
  do {                                              \
    _tile_loadd(6, block, 64);                      \
    _tile_loadd(4, codes, 64);                      \
    _tile_zero(A);                                  \
    DOT(A, 4, 6);                                   \
    if constexpr (kTwo) {                           \
      _tile_loadd(5, residual, 64);                 \
      _tile_zero(B);                                \
      DOT(B, 5, 6);                                 \
      _tile_stored(B, sums[1], 64);                 \
    }                                               \
    _tile_stored(A, sums[0], 64);                   \
  } while (0)

template <int64_t T, bool kTwo>
inline void amx_block_sums(bool odd, const int8_t* codes, const int8_t* residual, const uint8_t* block,
                           int32_t (*sums)[16][16]) {
  if constexpr (T == Q8_0) {
    if (odd) PAGELLM_AMX_BLOCK_SUMS(2, 3, _tile_dpbssd);
    else PAGELLM_AMX_BLOCK_SUMS(0, 1, _tile_dpbssd);
  } else {
    if (odd) PAGELLM_AMX_BLOCK_SUMS(2, 3, _tile_dpbsud);
    else PAGELLM_AMX_BLOCK_SUMS(0, 1, _tile_dpbsud);
  }
}
#undef PAGELLM_AMX_BLOCK_SUMS

// Q8_0 / Q4_1 (T) blocks times x [M, K] into y [M, N]: threads take 16 rows of W at a time, turn
// every block of them into a tile once, and run every 16 rows of x past them. Q4_1's w = d u + m
// adds m times x's sum over the block (quantize_activations' lane sums) beside.
template <int64_t T, bool kTwo>
void amx_blocks_chunk(const float* x, int64_t M, const uint8_t* w, int64_t K, int64_t N, float* y, Layout x8) {
  const ActRows a = quantize_activations(x, M, K, kTwo);
  const int64_t padded = (M + kAmxRows - 1) / kAmxRows * kAmxRows, blocks = K / 32;
  const int64_t row_bytes = blocks * (T == Q8_0 ? 34 : 20);
  const std::vector<int8_t> codes = amx_tiles(a.codes, M, padded, K);
  const std::vector<int8_t> residual = kTwo ? amx_tiles(a.residual, M, padded, K) : std::vector<int8_t>();
  // per row and block: x's scale (two codes: its / 128), and (Q4_1) x's sum over the block; rows
  // past M zero
  std::vector<float> xs = a.block_scale, xsum = T == Q4_1 ? a.block_sum : std::vector<float>();
  xs.resize(padded * blocks);
  if constexpr (T == Q4_1) xsum.resize(padded * blocks);
  at::parallel_for(0, (N + 15) / 16, 1, [&](int64_t p0, int64_t p1) {
    amx_configure_blocks(std::min(M, kAmxRows));
    std::vector<uint8_t> tiles(blocks * 512);
    std::vector<float> d(blocks * 16), mins(T == Q4_1 ? blocks * 16 : 0);
    alignas(64) int32_t sums[2][2][16][16];
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = 16 * p, rows = std::min<int64_t>(16, N - n0);
      for (int64_t b = 0; b < blocks; ++b) {
        if constexpr (T == Q8_0) amx_q8_0_block(w, row_bytes, n0, rows, b, tiles.data() + b * 512, d.data() + b * 16);
        else amx_q4_1_block(w, row_bytes, n0, rows, b, tiles.data() + b * 512, d.data() + b * 16, mins.data() + b * 16, x8);
      }
      for (int64_t t = 0; t < padded / kAmxRows; ++t) {
        __m512 acc[16];
        for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
        const float* xt = xs.data() + t * kAmxRows * blocks;
        const int64_t valid = std::min(kAmxRows, M - t * kAmxRows);
        const auto scale = [&](int64_t b, int32_t (*s)[16][16]) {
          const __m512 db = _mm512_loadu_ps(d.data() + b * 16);
          for (int r = 0; r < valid; ++r) {
            __m512i v = _mm512_load_si512(s[0][r]);
            if constexpr (kTwo) v = _mm512_add_epi32(_mm512_slli_epi32(v, 7), _mm512_load_si512(s[1][r]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), _mm512_mul_ps(db, _mm512_set1_ps(xt[r * blocks + b])), acc[r]);
            if constexpr (T == Q4_1)
              acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(mins.data() + b * 16),
                                       _mm512_set1_ps(xsum[(t * kAmxRows + r) * blocks + b]), acc[r]);
          }
        };
        for (int64_t b = 0; b < blocks; ++b) {
          const int64_t at = t * kAmxRows * K + (b / 2) * 1024 + (b % 2) * 32;  // tile t, chunk b / 2, its half b % 2
          const int8_t* r = kTwo ? residual.data() + at : nullptr;
          amx_block_sums<T, kTwo>(b % 2, codes.data() + at, r, tiles.data() + b * 512, sums[b % 2]);
          scale(b, sums[b % 2]);
        }
        for (int64_t r = 0; r < kAmxRows && t * kAmxRows + r < M; ++r) {
          alignas(64) float out[16];
          _mm512_store_ps(out, acc[r]);
          std::memcpy(y + (t * kAmxRows + r) * N + n0, out, rows * sizeof(float));
        }
      }
    }
    _tile_release();
  });
}

// x [M, K] times a repacked Q4_K / Q6_K weight or Q8_0's or Q4_1's blocks on AMX tiles, into y [M, N]:
// over chunks of x's rows whose codes take about 1 MiB (L2), as x8_prefill.
void amx_product(const float* x, int64_t M, const uint8_t* w, int64_t qtype, int64_t K, int64_t N, bool two_terms,
                 float* y, Layout x8) {
  const int64_t fit = std::max<int64_t>(kAmxRows, (int64_t{1} << 20) / (2 * K) / kAmxRows * kAmxRows);
  for (int64_t m0 = 0; m0 < M; m0 += fit) {
    const int64_t rows = std::min(fit, M - m0);
    const float* xc = x + m0 * K;
    float* yc = y + m0 * N;
    if (qtype == Q8_0)
      two_terms ? amx_blocks_chunk<Q8_0, true>(xc, rows, w, K, N, yc, kBlocks)
                : amx_blocks_chunk<Q8_0, false>(xc, rows, w, K, N, yc, kBlocks);
    else if (qtype == Q4_1) two_terms ? amx_blocks_chunk<Q4_1, true>(xc, rows, w, K, N, yc, x8) : amx_blocks_chunk<Q4_1, false>(xc, rows, w, K, N, yc, x8);
    else if (qtype == Q4_K) two_terms ? amx_x8_chunk<Q4_K, true>(xc, rows, w, K, N, yc) : amx_x8_chunk<Q4_K, false>(xc, rows, w, K, N, yc);
    else two_terms ? amx_x8_chunk<Q6_K, true>(xc, rows, w, K, N, yc) : amx_x8_chunk<Q6_K, false>(xc, rows, w, K, N, yc);
  }
}

inline bool amx_takes(bool x8, int64_t qtype, int64_t M) {
  return amx_serves(qtype) && (x8 || qtype == Q8_0 || qtype == Q4_1) && M >= amx_min_rows(qtype) && amx_wanted &&
         amx_permitted();
}
#else
inline bool amx_takes(bool, int64_t, int64_t) { return false; }
#endif

#if defined(PAGELLM_INT8_ACTIVATIONS)
// Rows of W taken together against a single row of x (a decode step of one sequence). A product
// of one row is bound by how fast W's rows arrive from memory, and each row read at once is a
// stream the CPU's prefetchers follow on their own: with 2 rows a thread read the 1B shapes at
// ~11 GB/s against ~22 that one core streams; 8 rows at once read them at 14-20 (Q8_0, Q4_K; AMD
// EPYC Zen 4, one thread, A/B in one process; AVX2 builds likewise, Q8_0 12.6 -> 17.3 GB/s), and
// share each chunk of x's codes among 8 accumulators. Q6_K's AVX-512 kernel keeps each row's 16
// group scales in a register: 4 rows (8 measured slower on the 2048-value rows). Q4_0 and Q4_1
// keep 2: with 8, their products on SmolLM2's shapes (576-value rows) read 0.8-1.0x as fast.
template <int64_t T>
constexpr int single_row_group() {
  if constexpr (T == Q8_0 || T == Q4_K || T == Q5_K) return 8;
#if defined(PAGELLM_INT8_VNNI)
  if constexpr (T == Q6_K) return 4;
#else
  if constexpr (T == Q6_K) return 8;
#endif
  return 2;
}

// AVX2 builds (AMD Zen 3 measured) take Q8_0's rows one at a time against a single row of x, up
// to rows of 4096 values: a thread's share of W is then one stream in address order, and its
// 8 rows at once, 34 cache lines each on the 1B shapes, had read it at 0.75 of what torch's sum
// of the same bytes reads. kernel_ab.py --types Q8_0 --rows 1 --threads 2: 1B shapes 1.05-1.17x,
// SmolLM2's 1.23-1.53x (its head 1.52x); the 8192-value rows of 1B down 1.03x on 2 threads but
// 0.83x on one, so they keep 8. The bits are the same (each row's blocks in order in one chain).
// AVX-512 VNNI builds likewise (Zen 4, two threads, against 8 rows at once in blocks16_rows: 1B
// shapes 1.15-1.46x, SmolLM2's 1.13-1.16x, its head 0.97x, 1B down unchanged).
template <int64_t T>
constexpr bool rows_one_at_a_time(int64_t K) {
  return T == Q8_0 && K <= 4096;
}

// Rows [n0, n1) of W into `rows` (1..8) rows of x, one accumulator each; for a single row of x,
// single_row_group<T> rows of W at a time, then the rest one by one.
template <int64_t T, class Rows>
void multiply_group(int64_t rows, ActView v, int64_t K, const uint8_t* w, int64_t row_bytes, float* y, int64_t N,
                    int64_t n0, int64_t n1) {
  constexpr int kSingle = single_row_group<T>();
  const int64_t grouped = rows_one_at_a_time<T>(K) ? n0 : n0 + (n1 - n0) / kSingle * kSingle;
  switch (rows) {
    case 1:
      if (grouped > n0) Rows::template run<1, kSingle>(v, K, w, row_bytes, y, N, n0, grouped);
      if (grouped < n1) Rows::template run<1, 1>(v, K, w, row_bytes, y, N, grouped, n1);
      break;
    case 2: Rows::template run<2, 1>(v, K, w, row_bytes, y, N, n0, n1); break;
    case 3: Rows::template run<3, 1>(v, K, w, row_bytes, y, N, n0, n1); break;
    case 4: Rows::template run<4, 1>(v, K, w, row_bytes, y, N, n0, n1); break;
    case 5: Rows::template run<5, 1>(v, K, w, row_bytes, y, N, n0, n1); break;
    case 6: Rows::template run<6, 1>(v, K, w, row_bytes, y, N, n0, n1); break;
    case 7: Rows::template run<7, 1>(v, K, w, row_bytes, y, N, n0, n1); break;
    default: Rows::template run<8, 1>(v, K, w, row_bytes, y, N, n0, n1); break;
  }
}

// Rows [n0, n1) of W into every row of x: x in groups of rows, so a weight chunk is unpacked once
// per group. Groups of 8, since unpacking bounds a product of several rows (A/B at 6, 8 and 16
// rows: Q4_1 +10-20%, Q4_K +12-43% against groups of 4; Q8_0 on an AMD EPYC, SmolLM2's 49152-row
// head at 8-16 rows +6-13%), but of 4 where K > 4096, whose 8 rows of codes overflow L1 (1B down,
// K = 8192, at 8-16 rows: Q4_K +35-39%, Q6_K +27-32%, Q4_0 / Q4_1 / Q8_0 +29-160%) and for Q6_K
// with two codes per value, where 8 measured slower.
// With more than one group, W's rows go kIntPassBytes at a time through every group, so the
// groups after the first read them from L2 rather than streaming the thread's whole share again
// (1B Q4_K_M decode steps of 16 and 32 streams: 3-7% faster with passes of 192-384 KiB).
constexpr int64_t kIntPassBytes = 256 * 1024;
template <int64_t T, bool kTwo>
void int8_multiply(const ActRows& a, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes, float* y, int64_t N,
                   int64_t n0, int64_t n1) {
  constexpr bool kSuperActs = super_activations(T, kTwo);
  const bool wide = !a.wide.empty(), super = kSuperActs || wide;  // wide: quantize_super's
  const int64_t group = T == Q6_K && kTwo && !wide ? 4 : (K > 4096 ? 4 : 8);
  const int64_t pass = M > group ? std::max<int64_t>(2, kIntPassBytes / row_bytes / 2 * 2) : n1 - n0;
  for (int64_t p0 = n0; p0 < n1; p0 += pass) {
    const int64_t p1 = std::min(n1, p0 + pass);
    for (int64_t m0 = 0; m0 < M; m0 += group) {
      const ActView v{wide ? nullptr : a.codes.data() + m0 * K, kTwo && !wide ? a.residual.data() + m0 * K : nullptr,
                      super ? a.super_scale.data() + m0 * K / QK_K : a.lane_scale.data() + m0 * K / 4,
                      super ? nullptr : a.lane_sum.data() + m0 * K / 4,
                      a.block_sum.empty() ? nullptr : a.block_sum.data() + m0 * K / 32,
                      a.sums16.empty() ? nullptr : a.sums16.data() + m0 * K / 16,
                      a.wide.empty() ? nullptr : a.wide.data() + m0 * K,
                      a.block_scale.empty() ? nullptr : a.block_scale.data() + m0 * K / 32,
                      a.joined.empty() ? nullptr : a.joined.data() + m0 * K};
      const int64_t rows = std::min<int64_t>(group, M - m0);
#if defined(PAGELLM_INT8_VNNI)
      if constexpr (T == Q4_K || T == Q5_K || T == Q6_K)
        if (wide) {
          multiply_group<T, WideRows<T>>(rows, v, K, w, row_bytes, y + m0 * N, N, p0, p1);
          continue;
        }
#endif
      if constexpr (kSuperActs) multiply_group<T, SuperRows<T, kTwo>>(rows, v, K, w, row_bytes, y + m0 * N, N, p0, p1);
      else multiply_group<T, LaneRows<T, kTwo>>(rows, v, K, w, row_bytes, y + m0 * N, N, p0, p1);
    }
  }
}

template <int64_t T>
void int8_product(const ActRows& a, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes, float* y, int64_t N,
                  int64_t n0, int64_t n1) {
  if (a.residual.empty() && a.wide.empty()) int8_multiply<T, false>(a, M, K, w, row_bytes, y, N, n0, n1);
  else int8_multiply<T, true>(a, M, K, w, row_bytes, y, N, n0, n1);
}
#endif  // PAGELLM_INT8_ACTIVATIONS
}  // namespace

// x: [M, K] float32; w: [N, row_bytes] uint8 blocks. Returns x @ W^T: [M, N] float32.
torch::Tensor gguf_matmul(const torch::Tensor& x_in, const torch::Tensor& w, int64_t packed_type, int64_t K) {
  // Repacked weights (Q4_K_X8, Q5_K_X8, Q6_K_X8, Q4_1_X8): each group of 8 rows back in GGUF's layout
  // (L1), then as those.
  const bool x8 = is_x8(packed_type);
  const int64_t qtype = base_type(packed_type);
  const Format f = format_of(qtype);
  const int64_t row_bytes = x8 ? checked_x8(w, packed_type, K) : (checked(w, qtype, K), w.size(1));
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == K, "gguf_matmul: x must be [M, ", K, "]");
  const torch::Tensor x = x_in.to(torch::kFloat32).contiguous();
  const int64_t M = x.size(0), N = w.size(0);
  torch::Tensor y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  // W's rows split over threads; each thread takes its rows kRowsPerPass at a time (L2-sized) and
  // multiplies them into every group of kMaxRows rows of x (one accumulator register each), so W
  // streams from memory once per product however many rows x has. A value of y sums its K terms
  // in one fixed order whatever M is, which batch-invariant mode relies on.
  // Past one group of rows of x, quantized rows are widened once per pass into a float32 buffer
  // (L2) and multiplied as dense rows, instead of once per group: the same values in the same
  // order of FMAs, so the same bits, at a fraction of the unpacking.
  const int64_t pass = std::max<int64_t>(4, std::min<int64_t>(kRowsPerPass, kPassFloats / K));
  const bool widen_once = qtype != F32 && M > kMaxRows;
  const Format dense = format_of(F32);
  const auto rows = [&](const uint8_t* wp, float* yp, int64_t n0, int64_t n1) {
    std::vector<float> buf(widen_once ? static_cast<size_t>(pass * K) : 0);
    for (int64_t p0 = n0; p0 < n1; p0 += pass) {
      const int64_t p1 = std::min(n1, p0 + pass);
      if (widen_once) {
        for (int64_t n = p0; n < p1; ++n) widen_row(f, wp + n * row_bytes, K, buf.data() + (n - p0) * K);
        multiply_rows<DenseF32>(xp, M, K, reinterpret_cast<const uint8_t*>(buf.data()), K * 4, dense, yp + p0, N, 0,
                                p1 - p0);
      } else {
        switch (qtype) {
          case F32: multiply_rows<DenseF32>(xp, M, K, wp, row_bytes, f, yp, N, p0, p1); break;
          case BF16: multiply_rows<DenseBF16>(xp, M, K, wp, row_bytes, f, yp, N, p0, p1); break;
          case Q4_0: multiply_rows<Inlined<VEC(dequant_q4_0)>>(xp, M, K, wp, row_bytes, f, yp, N, p0, p1); break;
          case Q4_1: multiply_rows<Inlined<VEC(dequant_q4_1)>>(xp, M, K, wp, row_bytes, f, yp, N, p0, p1); break;
          case Q8_0: multiply_rows<Inlined<VEC(dequant_q8_0)>>(xp, M, K, wp, row_bytes, f, yp, N, p0, p1); break;
          case Q4_K: multiply_rows<Inlined<VEC(dequant_q4_k)>>(xp, M, K, wp, row_bytes, f, yp, N, p0, p1); break;
          case Q5_K: multiply_rows<Inlined<VEC(dequant_q5_k)>>(xp, M, K, wp, row_bytes, f, yp, N, p0, p1); break;
          case Q6_K: multiply_rows<Inlined<VEC(dequant_q6_k)>>(xp, M, K, wp, row_bytes, f, yp, N, p0, p1); break;
          default: multiply_rows<Blocks>(xp, M, K, wp, row_bytes, f, yp, N, p0, p1); break;  // F16
        }
      }
    }
  };
  float* yp = y.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  if (!x8) {
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) { rows(wp, yp, n0, n1); });
    return y;
  }
  at::parallel_for(0, N / kX8Rows, 2, [&](int64_t g0, int64_t g1) {
    std::vector<uint8_t> group(kX8Rows * row_bytes);
    for (int64_t g = g0; g < g1; ++g) {
      x8_unpack_group(packed_type, wp, K, g, group.data(), row_bytes);
      rows(group.data(), yp + kX8Rows * g, 0, kX8Rows);
    }
  });
  return y;
}

#if defined(PAGELLM_INT8_ACTIVATIONS)
// With two codes per value, the K-quants' products of at least this many rows of x take the 16-bit
// kernel (wide_super_rows), whose per-chunk widening the rows share; fewer take int8_super_rows
// (Q4_K, Q5_K) or q6_k_rows (Q6_K, x per 32 values). 1B shapes, ms at 1 / 2 / 4 / 16 rows, int8
// codes against 16 bits: Q4_K 0.55 / 0.81 / 1.29 / 5.24 against 0.71 / 0.93 / 1.16 / 3.74, Q6_K
// 0.30 / 0.64 / 1.21 / 4.01 against 0.38 / 0.45 / 0.60 / 2.41. All three nevertheless keep the row
// kernels up to 5 rows: the bound decides how x is rounded (per 256 values here, per 32 in q6_k_rows
// and in the repacked Q6_K tiles, the form a load gives Q6_K in these modes), and a row whose sums
// depend on the rows beside it made a speculative verification of up to 4 proposals (5 rows) give
// other logits than decoding the same tokens one by one (Q6_K was taken from 2 rows, Q4_K and Q5_K
// from 4). From the 6th row the AMX tiles take these products on CPUs that have them anyway.
constexpr int64_t wide_min_rows(int64_t qtype) { return qtype == Q6_K || qtype == Q4_K || qtype == Q5_K ? 6 : 0; }

// Rows of x that take the tiles' kernels (q4_k_x8_rows 2 rows at once, q6_k_x8_rows up to 4
// rows at once), each group of 8 rows of W read from memory once and from cache by the next rows of
// x: every batch the integer kernels take (32 rows; ratios against the blocks: docs/quantization.md,
// "Repacked Q4_K and Q6_K"). More (prefills) take x8_prefill, which widens each group once for all of them.
constexpr int64_t kX8MaxRowLoop = 32;
// From this many rows of x (decode steps of many streams) a product whose weight x8_prefill widens
// takes it even at decode-sized batches, by type (0: never below kX8MaxRowLoop + 1): compute-bound
// there, and one widening of each group of 8 rows serves all the rows of x, where the row kernels
// unpack each tile again per 2 rows (q4_k_x8_rows) or per 4 (q6_k_x8_rows), and the blocks' kernels
// unpack a chunk per group of 8 rows and convert per 32 values per row. Q4_1 and Q8_0 past the 8
// rows that int8x2 gives the blocks' kernels in Python (which gave them the float32 kernel there);
// the tiles where their row kernels stop winning. benchmarks/kernel_ab.py, one thread, interleaved,
// on a loaded machine: SmolLM2 shapes at 16 rows 1.1-1.6x the blocks' integer kernel (1.2-1.65x the
// float32 one); the 1B shapes at 16 rows Q6_K 0.95-1.14x and Q4_K 0.6-0.9x the tiles' kernels, at
// 24 rows Q6_K 1.3x and Q4_K 0.94-1.16x, at 32 Q6_K 1.3-1.8x and Q4_K 1.2x. Repacked Q5_K keeps its
// row loop to 32 rows: widened from 9 rows, its products ran 0.51-0.58x the tiles' kernel at 9 rows,
// 0.73-0.76x at 16, 0.87-0.93x at 24, 1.0-1.03x at 32 (kernel_ab.py, two threads, Zen 4).
constexpr int64_t widen_min_rows(int64_t qtype) {
#if defined(PAGELLM_INT8_VNNI)
  return qtype == Q4_1 || qtype == Q8_0 ? 9 : qtype == Q6_K ? 17 : qtype == Q4_K ? 25 : 0;
#else
  return 0;
#endif
}
// Repacked Q4_1's row loop (q4_1_x8_row_loop) runs products of up to this many rows of x, ahead of
// the AMX tiles and the widening: 8 rows 1.2-1.4x as fast as the tiles, 9-16 rows 1.0-1.5x the
// tiles and 1.0-1.3x the widening (SmolLM2's four Q4_1 shapes, two threads, turn about), which win
// from 24. These are the sizes of speculative verifications and of steps of 8-16 streams.
constexpr int64_t kQ41RowLoopMax = 16;
#if !defined(PAGELLM_INT8_VNNI)
// The rows of x up to which AVX2 builds' prompts take x8_prefill for these weights (ids as the
// products take them), float32 tiles for torch's GEMM past them (0: no cap). Against the tiles
// (x86-64-v3 build, torch held to AVX2, on an AVX-512 machine, two threads, turn about;
// kernel_ab.py --base-product widened): repacked Q4_1, SmolLM2's four shapes, at 33 and 48 rows
// 1.1-1.55x, at 64 1.0-2.1x, at 96 0.88-1.27x, at 256 0.75-1.0x (Q4_1's blocks fell to 0.90x at 64
// already: they keep the tiles); Q4_0's blocks, the 1B shapes, 1.5-1.8x at 33, 1.17-1.28x at 64,
// 0.90-0.98x at 256, 0.6-0.9x at 1024; Q5_K's blocks 2.8-3.1x at 33, 2.0x at 64, 1.06-1.15x at 256,
// 0.95x at 512, 0.70-0.85x at 1024, where each chunk of x widens the blocks again. AVX-512 VNNI
// builds take every row count (the same A/B: Q4_0 1.3-1.7x at 1024 rows, Q5_K 1.5-2.1x).
constexpr int64_t avx2_prefill_max_rows(int64_t id) {
  return id == Q4_1_X8 || id == Q4_0_X8 || id == Q4_0 ? 64 : id == Q5_K || id == Q5_K_X8 ? 256 : 0;
}
#endif

inline bool widens(int64_t qtype, int64_t M) {
#if !defined(PAGELLM_INT8_VNNI)
  // AVX2 builds' many-row Q4_K kernel takes prompts too (the same rounding of x, per 256 values):
  // 1B pp256 in the AVX2 build, three rounds turn about, 3-9% faster than x8_prefill
  if (qtype == Q4_K) return false;
#endif
  const int64_t from = widen_min_rows(qtype);
  return M > kX8MaxRowLoop || (from > 0 && M >= from);
}

// Rows of x times a repacked weight (up to kX8MaxRowLoop, and more where widens says no), x rounded
// as the GGUF layout's kernels round it for these rows: the same codes, so the same sums up to
// float32 summation order.
void x8_row_loop(const float* x, int64_t M, const uint8_t* w, int64_t qtype, Layout x8, int64_t K, int64_t N,
                 bool two_terms, float* y) {
  if (qtype == Q4_1 || qtype == Q8_0) return q4_1_x8_row_loop(x, M, w, x8, K, N, two_terms, y);
#if defined(PAGELLM_INT8_VNNI)
  // The blocks' wide_super_rows rounds x per 256 values from wide_min_rows; repacked Q6_K keeps x per
  // 32 in its row loop up to where x8_prefill takes it (widen_min_rows): per 256 from 6 rows, the 1B
  // Q4_K_M shape (its head Q6_K) kept greedy agreement 99.88% on AMD Zen 4 (5 positions of 4,096, steps
  // of up to 16 rows), per 32 99.93% (3), as AVX2 builds; Q6_K's products 0.92-1.16x as fast at 6-16
  // rows (kernel_ab.py, two runs; the head at 9 rows 0.92-0.94x). A verification of up to 15
  // proposals now rounds x as decoding its tokens one by one does.
  const bool wide = two_terms && qtype != Q6_K && M >= wide_min_rows(qtype);
#else
  const bool wide = false;
#endif
  const bool per_super = qtype == Q4_K || qtype == Q5_K || !two_terms || wide;
#if defined(PAGELLM_INT8_VNNI)
  const ActRows a = per_super ? quantize_super(x, M, K, two_terms, false) : quantize_activations(x, M, K, two_terms);
#else
  const ActRows a = per_super ? quantize_super(x, M, K, two_terms) : quantize_activations(x, M, K, two_terms);
#endif
  // Q6_K: x's scales one per 32 values (not per lane: a row of 8192 values' lanes with its codes
  // and the tiles streaming through overflowed L1), and the offsets' sums
#if !defined(PAGELLM_INT8_VNNI)
  const bool many = M >= pair_min_rows(qtype);  // the pair kernels (q4_k_x8_many, q6_k_x8_many)
#endif
  std::vector<float> scale32;
  std::vector<int32_t> offsets;  // q6_k_x8_rows' alone
  if (qtype == Q6_K) {
#if !defined(PAGELLM_INT8_VNNI)
    for (int64_t m = 0; m < M && !many; ++m) {
      const std::vector<int32_t> o = q6_k_x8_offsets(a, m, K, two_terms);
      offsets.insert(offsets.end(), o.begin(), o.end());
    }
#endif
    if (!per_super)
      for (int64_t i = 0; i < M * K; i += 32) scale32.push_back(a.lane_scale[i / 4]);
  }
  const int64_t group_bytes = K / QK_K * x8_tile(repacked_id(qtype));
  std::vector<ActView> views;
  for (int64_t m = 0; m < M; ++m)
    views.push_back({a.codes.data() + m * K, two_terms ? a.residual.data() + m * K : nullptr,
                     per_super ? a.super_scale.data() + m * K / QK_K : scale32.data() + m * K / 32, nullptr,
                     per_super ? a.block_sum.data() + m * K / 32 : nullptr, nullptr, nullptr});
#if !defined(PAGELLM_INT8_VNNI)
  const std::vector<int16_t> x16 = many ? pair_rows_x16(a, M, K, two_terms) : std::vector<int16_t>();
#else
  const std::vector<int16_t> x16 = qtype == Q6_K ? wide_x16(a, M, K, two_terms) : std::vector<int16_t>();
#endif
  claimed_for(N / kX8Rows, group_bytes, M, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* tiles = w + g * group_bytes;
#if !defined(PAGELLM_INT8_VNNI)
      if (many) {
        if (qtype == Q4_K) q4_k_x8_many(views.data(), x16.data(), M, K, tiles, two_terms, y, N, g);
        else q6_k_x8_many(views.data(), x16.data(), M, K, tiles, two_terms, !per_super, y, N, g);
        continue;
      }
#endif
      if (qtype == Q4_K || qtype == Q5_K) {
        const int64_t per = qtype == Q5_K ? kQ5TileRows : kQ4TileRows;
        for (int64_t m = 0; m < M; m += per) {
          float* yg[kQ4TileRows];
          for (int64_t i = 0; i < per && m + i < M; ++i) yg[i] = y + (m + i) * N + kX8Rows * g;
          with_rows<kQ4TileRows>(static_cast<int>(std::min<int64_t>(M - m, per)), [&](auto rows) {
            k_x8_dispatch<decltype(rows)::value>(qtype == Q5_K, two_terms, views.data() + m, K, tiles, yg);
          });
        }
        continue;
      }
#if defined(PAGELLM_INT8_VNNI)
      wide_passes(M, N, g, y, [&](auto rows, int64_t m0, float* const* yg) {  // Q6_K
        q6_k_x8_wide_dispatch<decltype(rows)::value>(two_terms, !per_super, views.data() + m0, x16.data() + 64 * m0,
                                                     64 * M, tiles, K, yg);
      });
#else
      for (int64_t m0 = 0; m0 < M; m0 += kQ6TileRows) {
        const int32_t* o[kQ6TileRows];
        float* yg[kQ6TileRows];
        for (int64_t m = m0; m < std::min(M, m0 + kQ6TileRows); ++m)
          o[m - m0] = offsets.data() + m * K / 8, yg[m - m0] = y + m * N + kX8Rows * g;
        with_rows<kQ6TileRows>(static_cast<int>(std::min(M - m0, kQ6TileRows)), [&](auto rows) {
          q6_k_x8_dispatch<decltype(rows)::value>(two_terms, !per_super, views.data() + m0, o, K, tiles, yg);
        });
      }
#endif
    }
  });
}
#endif

// Whether Q8_0's products of M rows of x (of K values) take x's two codes joined into 16-bit values
// (q8_0_joined_rows) instead of bytes. AVX2: always. AVX-512 VNNI: where x's groups (int8_multiply)
// have at most 5 rows, the rows that keep their bits beside each other
// (test_quant_ops.py): at 1-5 rows the joined vectors ran 1.03-1.48x blocks16_rows on AMD's Zen 4
// (its gathers of scales and byte products), but a group of 8 rows of 2,048 values reads 32 KB of
// joined x per row of W, out of L1: 0.70x there (benchmarks/kernel_ab.py, two threads).
constexpr bool joins_codes(int64_t qtype, int64_t M, int64_t K) {
#if defined(PAGELLM_INT8_VNNI)
  return qtype == Q8_0 && (M <= 5 || K > 4096);
#else
  return qtype == Q8_0;
#endif
}

// x @ W^T with x rounded to int8 per 32 values (the int8-activation mode; see above). K a
// multiple of 64. Not summed in a batch-invariant order: each row's sums do not depend on M, but
// the mode is not the exact product the invariant mode promises.
torch::Tensor gguf_matmul_int8(const torch::Tensor& x_in, const torch::Tensor& w, int64_t packed_type, int64_t K,
                               bool two_terms) {
#if defined(PAGELLM_INT8_ACTIVATIONS)
  const Layout x8 = layout_of(packed_type);
  const int64_t qtype = base_type(packed_type);
  const int64_t row_bytes = x8 ? checked_x8(w, packed_type, K) : (checked(w, qtype, K), w.size(1));
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == K, "gguf_matmul_int8: x must be [M, ", K, "]");
  TORCH_CHECK(K % 64 == 0, "gguf_matmul_int8: K = ", K, " is not a multiple of 64");
  const torch::Tensor x = x_in.to(torch::kFloat32).contiguous();
  const int64_t M = x.size(0), N = w.size(0);
  torch::Tensor y = torch::empty({M, N}, x.options());
  // repacked Q4_1, Q4_0 and Q8_0: Q4_1's row loop
  const bool q4_1_rows = x8 && (qtype == Q4_1 || qtype == Q8_0) && M <= kQ41RowLoopMax;
  if (!q4_1_rows && amx_takes(x8, qtype, M)) {
#if defined(PAGELLM_AMX)
    amx_product(x.data_ptr<float>(), M, w.data_ptr<uint8_t>(), qtype, K, N, two_terms, y.data_ptr<float>(), x8);
#endif
    return y;
  }
  if (x8 && (q4_1_rows || !widens(qtype, M))) {
    x8_row_loop(x.data_ptr<float>(), M, w.data_ptr<uint8_t>(), qtype, x8, K, N, two_terms, y.data_ptr<float>());
    return y;
  }
  // prefills, and the decode-sized batches of widen_min_rows: each group of 8 rows of W widened once
  if (x8 || ((qtype == Q8_0 || qtype == Q5_K || qtype == Q4_0) && M > kX8MaxRowLoop) ||
      ((qtype == Q4_1 || qtype == Q8_0) && widens(qtype, M))) {
    // Q4_0's tiles widen as its blocks do, codes u - 8 and no minimums' term, rather than as Q4_1's
    // tiles (u, and m = -8 d times x's block sums): 1B shapes' prompts of 64 and 256 rows 1.07-1.09x
    const int64_t widened = x8 == kQ40Tiles ? Q4_0 : qtype;
    x8_prefill(x.data_ptr<float>(), M, w.data_ptr<uint8_t>(), widened, K, N, two_terms, y.data_ptr<float>(), x8);
    return y;
  }
#if defined(PAGELLM_INT8_VNNI)
  const bool wide = two_terms && wide_min_rows(qtype) > 0 && M >= wide_min_rows(qtype);
#else
  const bool wide = false;
#endif
  const ActRows a = wide || super_activations(qtype, two_terms)
#if defined(PAGELLM_INT8_VNNI)
                        ? quantize_super(x.data_ptr<float>(), M, K, two_terms, qtype == Q6_K && !wide, wide)
#else
                        ? quantize_super(x.data_ptr<float>(), M, K, two_terms)
#endif
                        : quantize_activations(x.data_ptr<float>(), M, K, two_terms, joins_codes(qtype, M, K));
  float* yp = y.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const auto rows = [&](const uint8_t* wp, float* yp, int64_t n0, int64_t n1) {
    switch (qtype) {
      case Q4_0: int8_product<Q4_0>(a, M, K, wp, row_bytes, yp, N, n0, n1); break;
      case Q4_1: int8_product<Q4_1>(a, M, K, wp, row_bytes, yp, N, n0, n1); break;
      case Q8_0: int8_product<Q8_0>(a, M, K, wp, row_bytes, yp, N, n0, n1); break;
      case Q4_K: int8_product<Q4_K>(a, M, K, wp, row_bytes, yp, N, n0, n1); break;
      case Q5_K: int8_product<Q5_K>(a, M, K, wp, row_bytes, yp, N, n0, n1); break;
      case Q6_K: int8_product<Q6_K>(a, M, K, wp, row_bytes, yp, N, n0, n1); break;
      default: TORCH_CHECK(false, "gguf_matmul_int8: GGUF type ", qtype, " has no integer kernel");
    }
  };
  // claimed in runs of 16 rows, as the repacked layouts' products are (claimed_for)
  claimed_for((N + 15) / 16, 16 * row_bytes, M,
              [&](int64_t c0, int64_t c1) { rows(wp, yp, 16 * c0, std::min(N, 16 * c1)); });
  return y;
#else
  TORCH_CHECK(false, "gguf_matmul_int8 needs AVX2 or AVX-512 VNNI, which this build lacks");
#endif
}

// Rows `rows` (int64 [R]) of the quantized matrix as dense [R, K] rows of `dtype` (float32 or bfloat16).
torch::Tensor gguf_dequantize_rows(const torch::Tensor& w, int64_t packed_type, int64_t K, const torch::Tensor& rows_in,
                                   torch::ScalarType dtype) {
  const bool x8 = is_x8(packed_type);
  const Format f = format_of(base_type(packed_type));
  const int64_t row_bytes = x8 ? checked_x8(w, packed_type, K) : (checked(w, packed_type, K), w.size(1));
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16, "gguf_dequantize_rows: float32 or bfloat16");
  const torch::Tensor rows = rows_in.to(torch::kInt64).contiguous();
  const int64_t R = rows.numel(), N = w.size(0), blocks = K / f.block;
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) TORCH_CHECK(rp[r] >= 0 && rp[r] < N, "row ", rp[r], " out of range [0, ", N, ")");
  torch::Tensor out = torch::empty({R, K}, w.options().dtype(dtype));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  at::parallel_for(0, R, 4, [&](int64_t r0, int64_t r1) {
    alignas(64) float tmp[QK_K];
    std::vector<uint8_t> group(x8 ? kX8Rows * row_bytes : 0);  // repacked: the row's 8, in GGUF's layout
    int64_t unpacked = -1;
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* row = wp + rp[r] * row_bytes;
      if (x8) {
        if (rp[r] / kX8Rows != unpacked) {
          unpacked = rp[r] / kX8Rows;
          x8_unpack_group(packed_type, wp, K, unpacked, group.data(), row_bytes);
        }
        row = group.data() + rp[r] % kX8Rows * row_bytes;
      }
      if (dtype == torch::kFloat32) {
        widen_row(f, row, K, out.data_ptr<float>() + r * K);
      } else {
        at::BFloat16* dst = out.data_ptr<at::BFloat16>() + r * K;
        for (int64_t b = 0; b < blocks; ++b) {
          const float* v = block_values(f, row + b * f.bytes, tmp);
          for (int i = 0; i < f.block; ++i) dst[b * f.block + i] = static_cast<at::BFloat16>(v[i]);
        }
      }
    }
  });
  return out;
}

// A Q4_0 / Q4_1 / Q4_K / Q5_K / Q6_K weight [N, row_bytes] (N a multiple of 8) in tiles of 8 rows (Q4_1_X8 ...),
// or (`back`) a repacked one in GGUF's layout again.
torch::Tensor gguf_repack(const torch::Tensor& w, int64_t qtype, int64_t K, bool back) {
  const int64_t packed = back ? qtype : repacked_id(qtype);
  TORCH_CHECK(is_x8(packed),
              "gguf_repack: Q4_0, Q4_1, Q4_K, Q5_K or Q6_K weights (Q8_0 in AVX-512 VNNI builds without AMX; or, back, "
              "their repacked ids), got type ",
              qtype);
  TORCH_CHECK(w.size(0) % kX8Rows == 0, "gguf_repack: ", w.size(0), " rows are not a multiple of ", kX8Rows);
  const int64_t N = w.size(0), supers = K / x8_values(packed), tile = x8_tile(packed);
  const int64_t row_bytes = back ? checked_x8(w, packed, K) : (checked(w, qtype, K), w.size(1));
  torch::Tensor out = back ? torch::empty({N, row_bytes}, w.options())
                           : torch::empty({N, supers * tile / kX8Rows}, w.options());
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, N / kX8Rows, 16, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      if (back) {
        x8_unpack_group(packed, src, K, g, dst + g * kX8Rows * row_bytes, row_bytes);
      } else {
        for (int64_t b = 0; b < supers; ++b)
          x8_tile_rows<false>(qtype, const_cast<uint8_t*>(src) + g * kX8Rows * row_bytes, row_bytes, b,
                              dst + (g * supers + b) * tile);
      }
    }
  });
  return out;
}

// The kernels run without the GIL (as torch's own operators do): a server's event loop thread
// streams its responses while a step's products and attention run, instead of waiting for them.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gguf_matmul", &gguf_matmul, "x @ W^T with W in GGUF blocks (CPU, float32; a few rows of x)",
        py::call_guard<py::gil_scoped_release>());
  m.def("gguf_matmul_int8", &gguf_matmul_int8,
        "x @ W^T with W in GGUF blocks and x rounded to int8 (CPU, AVX2 or VNNI)",
        py::arg("x"), py::arg("w"), py::arg("qtype"), py::arg("K"), py::arg("two_terms") = false,
        py::call_guard<py::gil_scoped_release>());
#if defined(PAGELLM_INT8_ACTIVATIONS)
  m.attr("has_int8_activations") = true;
  // x8_prefill: past kX8MaxRowLoop rows of x, the weights of these types (ids as the products take them).
  // In AVX-512 VNNI builds Q4_1 too, repacked and in blocks: against widening float32 tiles for
  // torch's GEMM, SmolLM2's shapes 1.7-2.6x at 33 rows, 1.3-1.5x at 256 (two threads, turn about).
  // AVX2 builds give it repacked Q4_1 too; there Q4_1, Q4_0 and Q5_K stop at avx2_prefill_max_rows.
  py::list prefill;
  py::dict prefill_max;  // the types whose integer prefill stops at a number of rows
  for (int64_t t : {static_cast<int64_t>(Q4_K_X8), static_cast<int64_t>(Q6_K_X8), static_cast<int64_t>(Q8_0),
                    static_cast<int64_t>(Q5_K), static_cast<int64_t>(Q5_K_X8), static_cast<int64_t>(Q4_0)})
    prefill.append(t);
#if defined(PAGELLM_INT8_VNNI)
  for (int64_t t : {static_cast<int64_t>(Q4_1_X8), static_cast<int64_t>(Q4_0_X8), static_cast<int64_t>(Q4_1)})
    prefill.append(t);
  if (kRepacksQ80) prefill.append(static_cast<int64_t>(Q8_0_X8));
#else
  for (int64_t t : {static_cast<int64_t>(Q4_1_X8), static_cast<int64_t>(Q4_0_X8)}) prefill.append(t);
  for (int64_t t : {static_cast<int64_t>(Q4_1_X8), static_cast<int64_t>(Q4_0_X8), static_cast<int64_t>(Q4_0),
                    static_cast<int64_t>(Q5_K), static_cast<int64_t>(Q5_K_X8)})
    prefill_max[py::int_(t)] = avx2_prefill_max_rows(t);
#endif
  m.attr("prefill_types") = py::tuple(prefill);
  m.attr("prefill_max_rows") = prefill_max;
  m.attr("prefill_min_rows") = kX8MaxRowLoop + 1;
  // ... and the GGUF types whose products take it from fewer rows (widen_min_rows): Python's int8x2
  // bounds give them the integer kernels up to kX8MaxRowLoop rows
  py::dict widen_from;
  for (int64_t t : {Q4_1, Q8_0, Q4_K, Q6_K})
    if (widen_min_rows(t) > 0) widen_from[py::int_(t)] = widen_min_rows(t);
  m.attr("widen_min_rows") = widen_from;
  m.attr("q4_1_row_loop_max") = kQ41RowLoopMax;
#else
  m.attr("q4_1_row_loop_max") = 0;
  m.attr("widen_min_rows") = py::dict();
  m.attr("has_int8_activations") = false;
  m.attr("prefill_types") = py::tuple();
  m.attr("prefill_max_rows") = py::dict();
  m.attr("prefill_min_rows") = 0;
#endif
  // The float32 kernel's vector width: 16 lanes with AVX-512, 8 with AVX2 (0: portable loops), and
  // the integer kernels' instruction set: layers/quant/gguf.py picks each mode's row bounds by them.
#if defined(PAGELLM_INT8_VNNI)
  m.attr("int8_kernel") = "avx512_vnni";
  py::dict wide;  // two codes per value: the 16-bit kernel from this many rows, by GGUF type
  for (int64_t t : {Q4_K, Q5_K, Q6_K}) wide[py::int_(t)] = wide_min_rows(t);
  wide[py::int_(static_cast<int64_t>(Q6_K_X8))] = widen_min_rows(Q6_K);  // repacked: from the widening
  m.attr("int8x2_wide_min_rows") = wide;
  m.attr("pair_min_rows") = py::dict();
#elif defined(PAGELLM_INT8_ACTIVATIONS)
  m.attr("int8_kernel") = "avx2";
  m.attr("int8x2_wide_min_rows") = py::dict();
  py::dict pairs;  // the repacked types' many-row kernels (q4_k_x8_many, q6_k_x8_many, q4_1_x8_many) from this many rows
  for (int64_t t : {Q4_K, Q6_K}) pairs[py::int_(repacked_id(t))] = pair_min_rows(t);
  for (int64_t t : {Q4_0, Q4_1}) pairs[py::int_(repacked_id(t))] = kQ41PairMinRows;
  m.attr("pair_min_rows") = pairs;
#else
  m.attr("int8_kernel") = "";
  m.attr("int8x2_wide_min_rows") = py::dict();
  m.attr("pair_min_rows") = py::dict();
#endif
#if defined(__AVX512F__)
  m.attr("float_lanes") = 16;
#elif defined(PAGELLM_VEC_DEQUANT)
  m.attr("float_lanes") = 8;
#else
  m.attr("float_lanes") = 0;
#endif
  m.def("gguf_dequantize_rows", &gguf_dequantize_rows, "chosen rows of a GGUF-quantized matrix, dense (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("gguf_repack", &gguf_repack,
        "Q4_0 / Q4_1 / Q4_K / Q5_K / Q6_K rows in tiles of 8 for one-row products, or back",
        py::arg("w"), py::arg("qtype"), py::arg("K"), py::arg("back") = false,
        py::call_guard<py::gil_scoped_release>());
  py::dict repacked;  // GGUF type -> the id of its repacked layout
  for (int64_t t : {Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K})
    if (repacked_id(t) != 0) repacked[py::int_(t)] = repacked_id(t);
  m.attr("repacked_types") = repacked;
  py::dict bases;  // repacked id -> the GGUF type whose kernels it takes (Q4_0's tiles take Q4_1's)
  for (int64_t t : {Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K})
    if (repacked_id(t) != 0) bases[py::int_(repacked_id(t))] = base_type(repacked_id(t));
  m.attr("repacked_bases") = bases;
  // AMX tiles: from how many rows of x a product against a repacked weight (by its id) takes them
  // (empty: no AMX in this build, CPU or process); set_amx(False) turns them off, returning the
  // previous setting.
  // set_amx_min_rows(id, rows) moves one type's crossover (for the measurements that place them),
  // returning the previous one; amx_min_rows keeps the built-in ones.
  py::dict amx_from;
#if defined(PAGELLM_AMX)
  // by the id a load gives the type in the integer modes: Q8_0 stays in blocks, the others are repacked
  // (Q4_0's tiles take Q4_1's kernels, and so its crossover)
  const auto loaded = [](int64_t id) { return (id == Q8_0 || is_x8(id)) && amx_serves(base_type(id)); };
  if (amx_permitted())
    for (int64_t id : {int64_t{Q8_0}, int64_t{Q4_0_X8}, int64_t{Q4_1_X8}, int64_t{Q4_K_X8}, int64_t{Q6_K_X8}})
      if (loaded(id)) amx_from[py::int_(id)] = amx_default_rows(base_type(id));
  m.attr("amx_min_rows") = amx_from;
  m.def("set_amx", [](bool on) { return amx_wanted.exchange(on); });
  m.def("set_amx_min_rows", [loaded](int64_t id, int64_t rows) {
    TORCH_CHECK(amx_permitted(), "set_amx_min_rows: this process may not use AMX tiles (Linux refused their state)");
    TORCH_CHECK(loaded(id), "set_amx_min_rows: type id ", id, " takes no AMX tiles");
    TORCH_CHECK(rows >= 1, "set_amx_min_rows: rows must be >= 1, got ", rows);
    return amx_from_rows[amx_slot(base_type(id))].exchange(rows);
  });
#else
  m.attr("amx_min_rows") = amx_from;
  m.def("set_amx", [](bool) { return false; });
  m.def("set_amx_min_rows", [](int64_t, int64_t) {
    TORCH_CHECK(false, "set_amx_min_rows: no AMX tiles in this build, CPU or process");
    return int64_t{0};
  });
#endif
}

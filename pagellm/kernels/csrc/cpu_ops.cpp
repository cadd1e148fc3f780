// Fused kernels for the CPU path, float32 and bfloat16 (and float16 KV caches).
//
// - paged_attention: query tokens each against their sequence's cached K/V, read in place
//   through the block table (decodes: one token per sequence; in batch-invariant mode
//   prefill tokens too, each reading its own prefix). The torch path has to gather every sequence's blocks into a padded copy
//   first (a write and a second read of all K/V); reading the blocks where they lie
//   moves a third of the bytes and skips the padding. A bfloat16 cache is widened to
//   float32 as it is read (a 16-bit shift), a float16 one by F16C's conversion (one instruction
//   per 8 values), so either moves half the bytes of a float32 one with the same float32
//   arithmetic. (For one query token, widening a float16 run once per KV head into float32 rows
//   for its G query heads measured 0.75-0.91x on AVX2 against widening each element per head:
//   F16C's conversion costs less than the stores and loads of the widened rows. A run of several
//   tokens widens bfloat16 and 8-bit rows once: kWidenOnce.) An 8-bit cache (int8, fp8 e4m3 or e5m2; see
//   pagellm/kv_format.py) stores each token's row of one KV head as D one-byte codes
//   and a float16 scale: the codes are widened as they are read and the scale multiplies the
//   row's dot product (K) or its softmax weight (V), so the values are never written out in a
//   wider type. (Widening a block once into float32 rows for all G query heads measured slower:
//   the kernel is bound by the bytes it moves through the caches, not by the widening.) With
//   AVX-512, a block's 16 query-key dot products
//   are reduced together and the softmax's exp is vectorized (scores16, exp16); AVX2 does
//   the same with 8 (scores8, exp8); other CPUs run the portable loops. A bfloat16 or
//   8-bit cache read by a large GQA group is widened once per tile for all its query heads
//   and tokens instead (attend_run_lanes, AVX-512).
// - rotary_embedding_: rotate-half RoPE applied in place to q and k, one pass instead
//   of torch's five (two slices, a negation, a concatenation, two products, a sum).
//   Same arithmetic as the reference (x * cos + rotate_half(x) * sin, no fused
//   multiply-add), so the results are bit-identical to it.
// - silu_and_mul: silu(gate) * up of the MLP in one pass over [T, 2I].
// - rms_norm: RMSNorm of float32 or bfloat16 rows in one pass; add_rms_norm: the residual add
//   before it in the same call.
// - store_kv: a step's K/V rows into the paged cache, as its dtype or as 8-bit codes.
// - decode_attention_qkv: a decode step's q/k norms (where the family has them), RoPE, store_kv
//   and paged_attention from the fused q/k/v projection in one call (the Python-level splitting
//   and checks around those calls cost more than the attention on a short step).
// - row_logsumexp: the sampler's logsumexp, each row summed in one order whatever the batch, and
//   the index of each row's maximum (a greedy step's token).
// - gdn_decode_step: Gated DeltaNet's (Qwen3.5's) decode step from in_proj's output to out_proj's
//   input (convolution step, SiLU, l2norms, gates, delta rule, gated norm), its states read and
//   updated in place in their pool blocks: the torch path copies each 2 MiB state out and back
//   and spends about twenty small operations around the arithmetic.
// The element-wise kernels take float32 or bfloat16; bfloat16 is computed in float32 and
// rounded once per output.
//
// Built with OpenMP so that at::parallel_for spreads work over torch's intra-op threads
// (it runs serially in an extension compiled without it); torch's own libgomp is the
// one that gets loaded, as it carries the same soname.
#include <torch/extension.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include <ATen/Parallel.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

// K/V elements as stored: float, bfloat16 as its raw 16 bits (the top half of a float), or
// float16 (F16: its bits, widened by the CPU's F16C conversion).
inline float widen(float x) { return x; }
inline float widen(uint16_t x) {
  const uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
struct F16 { uint16_t bits; };

// One-byte codes of an 8-bit cache; each row of D codes is followed by its float16 scale.
struct I8 { int8_t bits; };
struct E4M3 { uint8_t bits; };  // fp8: sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities
struct E5M2 { uint8_t bits; };  // fp8: the top byte of a float16
// The KV formats' numbering is pagellm/kv_format.py's KVCode, given by the build (kernels/cpu.py).
#if !defined(PAGELLM_KV_PLAIN) || !defined(PAGELLM_KV_INT8) || !defined(PAGELLM_KV_FP8_E4M3) || \
    !defined(PAGELLM_KV_FP8_E5M2)
#error "build through pagellm/kernels/cpu.py, which defines the KV format codes (kv_format.kernel_defines)"
#endif
enum KVCode : int64_t {
  kKvPlain = PAGELLM_KV_PLAIN, kKvInt8 = PAGELLM_KV_INT8, kKvE4M3 = PAGELLM_KV_FP8_E4M3, kKvE5M2 = PAGELLM_KV_FP8_E5M2
};
inline bool known_kv_code(int64_t c) { return c == kKvPlain || c == kKvInt8 || c == kKvE4M3 || c == kKvE5M2; }

template <typename T> constexpr bool kQuantized = sizeof(T) == 1;

inline float half_bits_to_float(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }
// fp8 codes widen through float16, which the CPU converts in one instruction: e5m2 is a
// float16's top byte; e4m3's exponent and mantissa bits, moved into a float16's fields, read as
// a float16 2^(15 - 7) times too small (subnormals included), and that exact factor joins the
// row's scale (row_scale) rather than costing a product per element.
inline float widen(I8 c) { return static_cast<float>(c.bits); }
inline float widen(E4M3 c) {
  return half_bits_to_float(static_cast<uint16_t>(((c.bits & 0x80) << 8) | ((c.bits & 0x7F) << 7)));
}
inline float widen(E5M2 c) { return half_bits_to_float(static_cast<uint16_t>(c.bits << 8)); }
inline float widen(F16 h) { return half_bits_to_float(h.bits); }
constexpr float kF16Max = 65504.f;  // float16's largest finite number (kv_format.py's _F16_MAX)

// The scale of the row of D elements at `row` (1 for float32 and bfloat16 rows), times the
// factor its widened codes lack (256 for e4m3).
template <typename T>
inline float row_scale(const T* row, int64_t D) {
  if constexpr (kQuantized<T>) {
    uint16_t h;
    std::memcpy(&h, reinterpret_cast<const uint8_t*>(row) + D, sizeof h);
    return half_bits_to_float(h) * (std::is_same_v<T, E4M3> ? 256.f : 1.f);
  } else {
    return 1.f;
  }
}
// Elements between two KV heads' rows: D, plus the two bytes of the scale for 8-bit codes.
template <typename T>
constexpr int64_t head_stride(int64_t D) { return kQuantized<T> ? D + 2 : D; }

// A run of one sequence's context, [begin, end), attended by all the query heads of nq
// consecutive query tokens q0 .. q0 + nq - 1 of that sequence (a decode token alone, or a
// verification step's 1 + k tokens, which then read each K/V block once between them).
struct WorkItem {
  int64_t q0, nq, begin, end;
  int64_t part;  // the first of nq rows in the partial-results buffer, -1 if the run is the whole context
};

#if defined(__AVX512F__)
// 16 K/V elements widened to float32.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  const __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
}
inline __m512 load16(const F16* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512 load16(const I8* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 load16(const E4M3* p) {
  // Each byte sign-extended to 16 bits and shifted left by 7: exponent and mantissa land at bits
  // 13..7, the sign at bit 15 (and a copy at bit 14, cleared).
  const __m256i x = _mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 7);
  return _mm512_cvtph_ps(_mm256_and_si256(x, _mm256_set1_epi16(static_cast<short>(0xBFFF))));
}
inline __m512 load16(const E5M2* p) {
  const __m256i h = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 8);
  return _mm512_cvtph_ps(h);
}


// The 16 horizontal sums of v[0..15], as one vector in token order: a transpose-and-add tree
// (15 adds and 30 shuffles) instead of 16 separate reductions of about 8 instructions each.
// hsum16 from its first level: a[i] holds token pair (2i, 2i+1)'s 256-bit halves added.
inline __m512 hsum16_from_pairs(const __m512 a[8]) {
  __m512 b[4];
  for (int i = 0; i < 4; ++i)  // 128-bit lanes: lane L of b[i] holds token 4i+L's 4 partial sums
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
  const __m512 u01 = _mm512_add_ps(_mm512_unpacklo_ps(b[0], b[1]), _mm512_unpackhi_ps(b[0], b[1]));
  const __m512 u23 = _mm512_add_ps(_mm512_unpacklo_ps(b[2], b[3]), _mm512_unpackhi_ps(b[2], b[3]));
  // Element 4L + k now sums token 4k + L; put token t at element t.
  const __m512 f = _mm512_add_ps(
      _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(u01), _mm512_castps_pd(u23))),
      _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(u01), _mm512_castps_pd(u23))));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, f);
}

inline __m512 hsum16(__m512 v[16]) {
  __m512 a[8];
  for (int i = 0; i < 8; ++i)  // 256-bit halves: token pair (2i, 2i+1), 8 partial sums each
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  return hsum16_from_pairs(a);
}

// Scores of up to 16 tokens (rows of `row` elements from k) against one query head of DT
// dimensions: s[t] = scale * q . k_t for t < n.
template <int DT, typename T>
inline void scores16(const float* q, const T* k, int64_t row, int64_t n, float scale, float* s) {
  __m512 qv[DT / 16], v[16];
  for (int c = 0; c < DT / 16; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
  for (int t = 0; t < 16; ++t) {
    if (t < n) {
      __m512 p = _mm512_mul_ps(qv[0], load16(k + t * row));
      for (int c = 1; c < DT / 16; ++c) p = _mm512_fmadd_ps(qv[c], load16(k + t * row + 16 * c), p);
      v[t] = p;
    } else {
      v[t] = _mm512_setzero_ps();
    }
  }
  __m512 r = _mm512_mul_ps(hsum16(v), _mm512_set1_ps(scale));
  if constexpr (kQuantized<T>) {  // each token's row scale
    alignas(64) float rs[16] = {};
    for (int t = 0; t < n; ++t) rs[t] = row_scale(k + t * row, DT);
    r = _mm512_mul_ps(r, _mm512_load_ps(rs));
  }
  _mm512_mask_storeu_ps(s, static_cast<__mmask16>((1u << n) - 1), r);
}

// scores16 for two query heads of one KV head, which read the same K rows: each row of K loaded
// once for both, and each pair of tokens' products folded at once into hsum16's first level, so
// two heads' partial sums stay in registers. Every score is scores16's arithmetic, operation for
// operation (the same products, the same tree): the same bits.
template <int DT, typename T>
inline void scores16_pair(const float* qa, const float* qb, const T* k, int64_t row, int64_t n, float scale,
                          float* sa, float* sb) {
  constexpr int C = DT / 16;
  __m512 qva[C], qvb[C], a[2][8];
  for (int c = 0; c < C; ++c) {
    qva[c] = _mm512_loadu_ps(qa + 16 * c);
    qvb[c] = _mm512_loadu_ps(qb + 16 * c);
  }
  for (int i = 0; i < 8; ++i) {
    __m512 va[2], vb[2];
    for (int j = 0; j < 2; ++j) {
      const int t = 2 * i + j;
      if (t < n) {
        const T* kt = k + t * row;
        __m512 x = load16(kt);
        __m512 pa = _mm512_mul_ps(qva[0], x), pb = _mm512_mul_ps(qvb[0], x);
        for (int c = 1; c < C; ++c) {
          x = load16(kt + 16 * c);
          pa = _mm512_fmadd_ps(qva[c], x, pa);
          pb = _mm512_fmadd_ps(qvb[c], x, pb);
        }
        va[j] = pa;
        vb[j] = pb;
      } else {
        va[j] = vb[j] = _mm512_setzero_ps();
      }
    }
    a[0][i] = _mm512_add_ps(_mm512_shuffle_f32x4(va[0], va[1], 0x44), _mm512_shuffle_f32x4(va[0], va[1], 0xEE));
    a[1][i] = _mm512_add_ps(_mm512_shuffle_f32x4(vb[0], vb[1], 0x44), _mm512_shuffle_f32x4(vb[0], vb[1], 0xEE));
  }
  alignas(64) float rs[16] = {};
  if constexpr (kQuantized<T>)
    for (int t = 0; t < n; ++t) rs[t] = row_scale(k + t * row, DT);
  float* out[2] = {sa, sb};
  for (int h = 0; h < 2; ++h) {
    __m512 r = _mm512_mul_ps(hsum16_from_pairs(a[h]), _mm512_set1_ps(scale));
    if constexpr (kQuantized<T>) r = _mm512_mul_ps(r, _mm512_load_ps(rs));
    _mm512_mask_storeu_ps(out[h], static_cast<__mmask16>((1u << n) - 1), r);
  }
}

#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// AVX2 (CPUs without AVX-512: AMD before Zen 4, Intel client cores): scores8, scores16's scheme
// on 8 lanes. Before it, each score was a dot product reduced on its own (the portable loop),
// about a third of a long context's decode attention on an AVX2 build.
#define PAGELLM_SCORES8 1
// 8 K elements widened to float32.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
}
inline __m256 load8(const F16* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 load8(const I8* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 load8(const E4M3* p) {  // as load16's
  const __m128i x = _mm_slli_epi16(_mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))), 7);
  return _mm256_cvtph_ps(_mm_and_si128(x, _mm_set1_epi16(static_cast<short>(0xBFFF))));
}
inline __m256 load8(const E5M2* p) {
  return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))), 8));
}

// The 8 horizontal sums of v[0..7], in token order: three rounds of pairwise adds (hadd) and one
// exchange of 128-bit halves.
inline __m256 hsum8x8(const __m256 v[8]) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// Scores of up to 8 tokens (rows of `row` elements from k) against one query head of DT
// dimensions: s[t] = scale * q . k_t for t < n.
template <int DT, typename T>
inline void scores8(const float* q, const T* k, int64_t row, int64_t n, float scale, float* s) {
  __m256 qv[DT / 8], v[8];
  for (int c = 0; c < DT / 8; ++c) qv[c] = _mm256_loadu_ps(q + 8 * c);
  for (int t = 0; t < 8; ++t) {
    if (t < n) {
      __m256 p = _mm256_mul_ps(qv[0], load8(k + t * row));
      for (int c = 1; c < DT / 8; ++c) p = _mm256_fmadd_ps(qv[c], load8(k + t * row + 8 * c), p);
      v[t] = p;
    } else {
      v[t] = _mm256_setzero_ps();
    }
  }
  const __m256 scores = _mm256_mul_ps(hsum8x8(v), _mm256_set1_ps(scale));
  if constexpr (!kQuantized<T>) {
    // one store: a copy loop of up to 8 floats compiled to REP MOVSD, whose start-up cost was a
    // fifth of a verification's attention on AMD's Zen 3
    if (n == 8) _mm256_storeu_ps(s, scores);
    else _mm256_maskstore_ps(s, _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)),
                                                   _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)), scores);
  } else {
    alignas(32) float r[8];
    _mm256_store_ps(r, scores);
    for (int t = 0; t < n; ++t) s[t] = r[t] * row_scale(k + t * row, DT);
  }
}

// a[0..DT) += sum over t < n of p[t] * (the row's scale) * v_t, v_t the DT elements at v + t * row
// (scales: the rows' scales, `stride` apart, for rows widened beforehand; none: row_scale's). 8
// lanes at a time, up to 64 dimensions a pass, so that their accumulators stay in registers (16
// on AVX2).
template <int DT, typename T>
inline void weigh_rows(const T* v, int64_t row, int64_t n, const float* p, float* a,
                       const float* scales = nullptr, int64_t stride = 0) {
  for (int c0 = 0; c0 < DT; c0 += 64) {
    constexpr int kMost = DT < 64 ? DT / 8 : 8;
    __m256 al[kMost];
    for (int c = 0; c < kMost; ++c) al[c] = _mm256_loadu_ps(a + c0 + 8 * c);
    for (int64_t t = 0; t < n; ++t) {
      const T* vt = v + t * row;
      const __m256 pt = _mm256_set1_ps(p[t] * (scales != nullptr ? scales[t * stride] : row_scale(vt, DT)));
      for (int c = 0; c < kMost; ++c) al[c] = _mm256_fmadd_ps(pt, load8(vt + c0 + 8 * c), al[c]);
    }
    for (int c = 0; c < kMost; ++c) _mm256_storeu_ps(a + c0 + 8 * c, al[c]);
  }
}

// A run of several query tokens (a verification's 1 + k, a short prefill) over a bfloat16 or 8-bit
// cache widens each block's rows once, all KV heads, into float32 rows (and their scales) for every
// token and query head that reads them, where one token widens each element once per query head.
// The widened values are exact, the arithmetic after them the same, so a token's sums are the same
// decoded alone (which keeps widening in place: for one token the stores and loads of the widened
// rows cost more than they save). A/B on Zen 3, 4,000 keys, SmolLM2's and Llama 3.2 1B's heads,
// against widening in place: 5 tokens bfloat16 1.16-1.21x, int8 1.10-1.13x; 2 tokens 0.94-1.40x.
// Not float16, whose F16C conversion costs less than the stores and loads (0.87-0.97x).
template <typename T>
constexpr bool kWidenOnce = !std::is_same_v<T, float> && !std::is_same_v<T, F16>;
constexpr int64_t kWidenFromTokens = 2;

// n rows of KVH heads (`row` elements apart, heads `hs` apart) widened into wide[n][KVH][DT] and,
// for 8-bit codes, their scales into scales[n][KVH].
template <int DT, typename T>
inline void widen_rows(const T* x, int64_t row, int64_t hs, int64_t KVH, int64_t n, float* wide, float* scales) {
  for (int64_t t = 0; t < n; ++t)
    for (int64_t h = 0; h < KVH; ++h) {
      const T* xh = x + t * row + h * hs;
      float* to = wide + (t * KVH + h) * DT;
      for (int c = 0; c < DT / 8; ++c) _mm256_storeu_ps(to + 8 * c, load8(xh + 8 * c));
      scales[t * KVH + h] = row_scale(xh, DT);
    }
}
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// exp of a vector of floats, to about 1 ulp: exp(x) = 2^n * exp(r) with n = round(x / ln 2),
// r = x - n ln 2 in [-ln2/2, ln2/2], exp(r) by Cephes' degree-6 polynomial. glibc's expf is
// scalar: a seventh of the attention kernel's time, most of silu_and_mul's. Below -87.3 expf is
// 0 or denormal anyway; above 88.8 it is +inf (and +inf itself would make r NaN), so x is clamped
// there. max_ps / min_ps return their second operand when either is NaN, so a NaN stays NaN, as
// with expf.
constexpr float kExpLo = -87.33654f, kExpHi = 88.8f, kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
#endif

#if defined(__AVX512F__)
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_set1_ps(kExpHi), _mm512_max_ps(_mm512_set1_ps(kExpLo), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int c = 1; c < 6; ++c) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[c]));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);  // p * 2^n, +inf past the range
}
#elif defined(__AVX2__) && defined(__FMA__)
// exp16's arithmetic on 8 lanes (AVX2). 2^n is built in the exponent bits (n in [-126, 128]; 128
// makes +inf, as scalef does).
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_set1_ps(kExpHi), _mm256_max_ps(_mm256_set1_ps(kExpLo), x));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int c = 1; c < 6; ++c) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[c]));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

inline float hsum8(__m256 v) {
  const __m128 pairs = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 quads = _mm_add_ps(pairs, _mm_movehl_ps(pairs, pairs));
  return _mm_cvtss_f32(_mm_add_ss(quads, _mm_movehdup_ps(quads)));
}
#endif

// Keys per online-softmax update. Each update costs every query head a max, an exp of the old
// max and a rescale of its accumulator, whatever the number of keys; over one block of 16 keys
// that cost matched the dot products themselves, so several blocks' scores are gathered first.
// Tiles start at multiples of kTile (absolute positions), so a query's sums depend on its own
// keys alone, as batch-invariant mode needs.
constexpr int64_t kTile = 64;

// The largest of s[0..n).
inline float max_of(const float* s, int64_t n, float init) {
  float mx = init;
  int64_t t = 0;
#if defined(__AVX512F__)
  if (n >= 16) {
    __m512 m = _mm512_set1_ps(init);
    for (; t + 16 <= n; t += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + t));
    mx = _mm512_reduce_max_ps(m);
  }
#elif defined(__AVX2__)
  // the scalar loop, a dependent MAXSS a key, was a fifth of a verification's attention on Zen 3
  if (n >= 8) {
    __m256 m = _mm256_set1_ps(init);
    for (; t + 8 <= n; t += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + t));
    const __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    const __m128 q = _mm_max_ps(h, _mm_movehl_ps(h, h));
    mx = _mm_cvtss_f32(_mm_max_ss(q, _mm_movehdup_ps(q)));
  }
#endif
  for (; t < n; ++t) mx = std::max(mx, s[t]);
  return mx;
}

// The cache lines of keys [t, t1)'s rows of K or V (all KV heads of a token), asked for into L2 a
// share at a time while the attention kernels' arithmetic goes on, ahead of their reading them. Asked
// for a tile at once, they filled the core's few miss buffers and held the arithmetic back until
// they came: a run took the memory's time plus the arithmetic's, not the larger of the two, and a
// decode step streamed its K/V at half the rate one core reads memory.
template <typename T>
class RowPrefetch {
 public:
  // `shares`: how many ask() calls the lines are spread over
  RowPrefetch(const T* base, const int64_t* table, int64_t BS, int64_t row, int64_t t, int64_t t1, int64_t shares)
      : base_(base), table_(table), BS_(BS), row_(row), row_bytes_(row * static_cast<int64_t>(sizeof(T))), t_(t), t1_(t1) {
    left_ = std::max<int64_t>(0, t1 - t) * ((row_bytes_ + 63) / 64);
    share_ = (left_ + shares - 1) / std::max<int64_t>(1, shares);
    if (t_ < t1_) line_ = row_start(t_);
  }
  void ask() { ask(share_); }
  void rest() { ask(left_); }

 private:
  const char* row_start(int64_t t) const {
    return reinterpret_cast<const char*>(base_ + (table_[t / BS_] * BS_ + t % BS_) * row_);
  }
  void ask(int64_t count) {
    for (count = std::min(count, left_); count > 0; --count, --left_) {
      __builtin_prefetch(line_ + offset_, 0, 2);  // PREFETCHT1: into L2, as the quantized products fetch
      offset_ += 64;
      if (offset_ >= row_bytes_) {  // the next key's row: beside it in its block, or the next block's first
        offset_ = 0;
        if (++t_ < t1_) line_ = t_ % BS_ ? line_ + row_bytes_ : row_start(t_);
      }
    }
  }
  const T* base_;
  const int64_t* table_;
  int64_t BS_, row_, row_bytes_, t_, t1_, offset_ = 0, left_ = 0, share_ = 0;
  const char* line_ = nullptr;
};
// 16 keys, a block at the default block size (12 KiB of K rows for SmolLM2's 3 KV heads of 64, near
// the quantized products' 8 KiB): asked for a whole tile (64 keys) ahead the lines came later than
// the arithmetic wanted them on AMD Zen 4, in both its AVX-512 and AVX2 builds (a decode token
// 1.07-1.4x faster at 16, 1 + k tokens 1.0-1.24x; 32 keys gained less, 8 lost); two tiles ahead
// was slower still.
constexpr int64_t kAhead = 16;

// The query heads of a KV head that weigh its V rows together (AVX-512): their accumulators, DT / 16
// vectors each, stay in registers beside the row's, so each row of a bfloat16 or 8-bit cache is
// widened once for all of them rather than once per head. A float32 row, read in place, gains
// nothing from it: one head at a time.
template <int DT, typename T>
constexpr int64_t kPvHeads = std::is_same_v<T, float> ? 1 : DT <= 64 ? 4 : DT <= 128 ? 2 : 1;

#if defined(__AVX512F__)
// a[i][0..DT) += sum over t < n of p[i][t] * (the row's scale) * v_t for the ng <= kPvHeads query
// heads i, v_t the DT elements at v + t * row. Each head's sums are the one-head loop's, in its
// order: the same bits whichever heads share the pass.
template <int DT, int NG, typename T>
inline void weigh_heads_n(const T* v, int64_t row, int64_t n, const float* const* p, float* const* a) {
  constexpr int C = DT / 16;
  __m512 al[NG][C];
  for (int i = 0; i < NG; ++i)
    for (int c = 0; c < C; ++c) al[i][c] = _mm512_loadu_ps(a[i] + 16 * c);
  for (int64_t t = 0; t < n; ++t) {
    const T* vt = v + t * row;
    const float rs = row_scale(vt, DT);  // an 8-bit row's scale folds into each softmax weight
    __m512 x[C];
    for (int c = 0; c < C; ++c) x[c] = load16(vt + 16 * c);
    for (int i = 0; i < NG; ++i) {
      const __m512 pt = _mm512_set1_ps(p[i][t] * rs);
      for (int c = 0; c < C; ++c) al[i][c] = _mm512_fmadd_ps(pt, x[c], al[i][c]);
    }
  }
  for (int i = 0; i < NG; ++i)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(a[i] + 16 * c, al[i][c]);
}

template <int DT, typename T>
inline void weigh_heads(const T* v, int64_t row, int64_t n, int64_t ng, const float* const* p, float* const* a) {
  if constexpr (kPvHeads<DT, T> >= 4)
    if (ng == 4) return weigh_heads_n<DT, 4>(v, row, n, p, a);
  if constexpr (kPvHeads<DT, T> >= 3)
    if (ng == 3) return weigh_heads_n<DT, 3>(v, row, n, p, a);
  if constexpr (kPvHeads<DT, T> >= 2)
    if (ng == 2) return weigh_heads_n<DT, 2>(v, row, n, p, a);
  weigh_heads_n<DT, 1>(v, row, n, p, a);
}
#endif

// The end of a run for its NQ query tokens: from each head's accumulator acc [NQ, H, D], running
// max m and sum l [NQ, H], the normalised output when the run is the whole context (sinks joining
// the denominator), else (max, sum, unnormalised accumulator) for the combine step.
inline void finish_run(const WorkItem& w, int64_t H, int64_t D, const float* accs, const float* ms, const float* ls,
                       const float* sinks, float* out, float* part_acc, float* part_ml) {
  for (int64_t qi = 0; qi < w.nq; ++qi) {
    const float* acc = accs + qi * H * D;
    const float* m = ms + qi * H;
    const float* l = ls + qi * H;
    if (w.part < 0) {
      float* o = out + qi * H * D;
      for (int64_t hh = 0; hh < H; ++hh) {
        float scale_acc = 1.f, denom = l[hh];
        if (sinks != nullptr) {  // gpt-oss: the sink's logit joins the denominator, attending to nothing
          const float mx = std::max(m[hh], sinks[hh]);
          scale_acc = std::exp(m[hh] - mx);
          denom = l[hh] * scale_acc + std::exp(sinks[hh] - mx);
        }
        const float inv = scale_acc / denom;
        for (int64_t i = 0; i < D; ++i) o[hh * D + i] = acc[hh * D + i] * inv;
      }
    } else {  // a token with no key in this run leaves (-inf, 0, zeros), which the combine weighs 0
      const int64_t part = w.part + qi;
      std::copy(acc, acc + H * D, part_acc + part * H * D);
      for (int64_t hh = 0; hh < H; ++hh) {
        part_ml[(part * H + hh) * 2] = m[hh];
        part_ml[(part * H + hh) * 2 + 1] = l[hh];
      }
    }
  }
}

// Online softmax over the run, one tile of keys at a time, for every query head of every query
// token of the item: each K/V row is read once (all KV heads of a token are one contiguous row)
// and serves the G query heads that share it, and each block of the tile serves every query
// token while it is in L1 (a verification step's 1 + k tokens). Query token i reads keys below
// lens[i] only. Writes the normalised output when the run is the whole context, else (max, sum,
// unnormalised accumulator) for the combine step.
// DT > 0 fixes the head size at compile time so the inner loops unroll; DT == 0 reads D.
template <int DT, typename T>
void attend_run(const WorkItem& w, int64_t Drt, int64_t H, int64_t KVH, int64_t BS, const float* q,
                const int64_t* lens, const T* kp, const T* vp, const int64_t* table, float scale, float softcap,
                const float* sinks, float* out, float* part_acc, float* part_ml, std::vector<float>& buf) {
  const int64_t D = DT > 0 ? DT : Drt;
  const int64_t G = H / KVH, HS = head_stride<T>(D), row = KVH * HS, NQ = w.nq;
#if defined(PAGELLM_SCORES8)
  const bool widen_once = DT > 0 && DT % 8 == 0 && kWidenOnce<T> && NQ >= kWidenFromTokens;
#else
  const bool widen_once = false;
#endif
  const int64_t n_wide = widen_once ? std::min(BS, kTile) * KVH * (D + 1) : 0;
  buf.assign(static_cast<size_t>(NQ * (H * D + 2 * H + H * kTile) + n_wide), 0.f);
  float* accs = buf.data();       // [NQ, H, D]
  float* ms = accs + NQ * H * D;  // [NQ, H]
  float* ls = ms + NQ * H;        // [NQ, H]
  float* ss = ls + NQ * H;        // [NQ, H, kTile] scores of the current tile
  float* wide = ss + NQ * H * kTile;  // widen_once: a block's rows of K (then V) [u][KVH][D], widened
  float* wide_scales = wide + std::min(BS, kTile) * KVH * D;  // and their scales [u][KVH]
  for (int64_t i = 0; i < NQ * H; ++i) ms[i] = -std::numeric_limits<float>::infinity();
  // The first row of key t (the tile's keys lie in up to kTile / BS + 1 blocks anywhere in the pool).
  auto key_row = [&](const T* base, int64_t t) { return base + (table[t / BS] * BS + t % BS) * row; };
  for (int64_t t0 = w.begin; t0 < w.end;) {
    const int64_t t1 = std::min(w.end, (t0 / kTile + 1) * kTile);
    // This token's keys in the tile.
    auto keys_of = [&](int64_t qi) { return std::min(t1, lens[qi]) - t0; };
    // f(u0, qi, n, pf) for each run of contiguous keys (the part of the tile in one block) and, while
    // the run is in L1, each query token reading some of it: keys t0 + u0 .. + n - 1; pf asks for
    // the rows of `ahead` (K's or V's) kAhead keys further on, a share per query head (pf.ask()).
    // widen_once: first the run's rows of that cache that some token reads are widened.
    int64_t most = 0;  // keys of the tile the run's tokens read, at most
    for (int64_t qi = 0; qi < NQ; ++qi) most = std::max(most, keys_of(qi));
    auto each_run = [&](const T* ahead, auto&& f) {
      for (int64_t u0 = 0; u0 < t1 - t0;) {
        const int64_t seg = std::min(BS - (t0 + u0) % BS, t1 - t0 - u0);
        RowPrefetch<T> pf(ahead, table, BS, row, t0 + u0 + kAhead, std::min(w.end, t0 + u0 + kAhead + seg), NQ * H);
#if defined(PAGELLM_SCORES8)
        if (widen_once && most > u0)
          widen_rows<(DT > 0 ? DT : 8)>(key_row(ahead, t0 + u0), row, HS, KVH, std::min(seg, most - u0), wide,
                                        wide_scales);
#endif
        for (int64_t qi = 0; qi < NQ; ++qi) {
          const int64_t n = std::min(seg, keys_of(qi) - u0);
          if (n > 0) f(u0, qi, n, pf);
        }
        pf.rest();
        u0 += seg;
      }
    };
    // Scores.
    each_run(kp, [&](int64_t u0, int64_t qi, int64_t n, RowPrefetch<T>& pf) {
        const T* kb = key_row(kp, t0 + u0);
        const float* qt = q + qi * H * D;
        float* s = ss + qi * H * kTile + u0;
#if defined(__AVX512F__)
        if constexpr (DT > 0 && DT % 16 == 0) {
          for (int64_t h = 0; h < KVH; ++h)
            for (int64_t g = 0; g < G; ++g) {
              pf.ask();
              const int64_t hh = h * G + g;
              if (g + 1 < G && DT <= 64) {  // two heads a pass: each K row loaded once for both
                pf.ask();
                for (int64_t u = 0; u < n; u += 16)
                  scores16_pair<DT, T>(qt + hh * DT, qt + (hh + 1) * DT, kb + u * row + h * HS, row,
                                       std::min<int64_t>(16, n - u), scale, s + hh * kTile + u,
                                       s + (hh + 1) * kTile + u);
                ++g;
                continue;
              }
              for (int64_t u = 0; u < n; u += 16)
                scores16<DT, T>(qt + hh * DT, kb + u * row + h * HS, row, std::min<int64_t>(16, n - u),
                                scale, s + hh * kTile + u);
            }
        } else
#elif defined(PAGELLM_SCORES8)
        if constexpr (DT > 0 && DT % 8 == 0) {
          for (int64_t h = 0; h < KVH; ++h)
            for (int64_t g = 0; g < G; ++g) {
              pf.ask();
              float* sh = s + (h * G + g) * kTile;
              if (!widen_once) {
                for (int64_t u = 0; u < n; u += 8)
                  scores8<DT, T>(qt + (h * G + g) * DT, kb + u * row + h * HS, row, std::min<int64_t>(8, n - u),
                                 scale, sh + u);
                continue;
              }
              for (int64_t u = 0; u < n; u += 8)
                scores8<DT, float>(qt + (h * G + g) * DT, wide + (u * KVH + h) * DT, KVH * DT,
                                   std::min<int64_t>(8, n - u), scale, sh + u);
              if constexpr (kQuantized<T>)  // scores8's last step for 8-bit rows: times each row's scale
                for (int64_t t = 0; t < n; ++t) sh[t] *= wide_scales[t * KVH + h];
            }
        } else
#endif
        {
          for (int64_t t = 0; t < n; ++t) {
            for (int64_t h = 0; h < KVH; ++h) {
              const T* k = kb + t * row + h * HS;
              const float ks = row_scale(k, D);
              for (int64_t g = 0; g < G; ++g) {
                const float* qh = qt + (h * G + g) * D;
                float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                for (int64_t i = 0; i < D; ++i) dot += qh[i] * widen(k[i]);
                s[(h * G + g) * kTile + t] = dot * scale * ks;
              }
            }
          }
        }
    });
    for (int64_t qi = 0; qi < NQ; ++qi) {
      const int64_t nt = keys_of(qi);
      if (nt <= 0) continue;
      float* acc = accs + qi * H * D;
      float* m = ms + qi * H;
      float* l = ls + qi * H;
      float* s = ss + qi * H * kTile;
      if (softcap > 0.f) {  // Gemma 2: cap * tanh(score / cap), as the reference computes it
        for (int64_t hh = 0; hh < H; ++hh)
          for (int64_t t = 0; t < nt; ++t) s[hh * kTile + t] = std::tanh(s[hh * kTile + t] / softcap) * softcap;
      }
      for (int64_t hh = 0; hh < H; ++hh) {
        float* sh = s + hh * kTile;
        const float mx = max_of(sh, nt, m[hh]);
        const float alpha = std::exp(m[hh] - mx);  // 0 on the first tile (exp(-inf))
        float sum = 0.f;
#if defined(__AVX512F__)
        for (int64_t u = 0; u < nt; u += 16) {
          const __mmask16 live = static_cast<__mmask16>((1u << std::min<int64_t>(16, nt - u)) - 1);
          const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, sh + u), _mm512_set1_ps(mx)));
          _mm512_mask_storeu_ps(sh + u, live, e);
          sum += _mm512_mask_reduce_add_ps(live, e);
        }
#elif defined(__AVX2__) && defined(__FMA__)
        int64_t t = 0;
        for (; t + 8 <= nt; t += 8) {
          const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sh + t), _mm256_set1_ps(mx)));
          _mm256_storeu_ps(sh + t, e);
          sum += hsum8(e);
        }
        for (; t < nt; ++t) {
          sh[t] = std::exp(sh[t] - mx);
          sum += sh[t];
        }
#else
        for (int64_t t = 0; t < nt; ++t) {
          sh[t] = std::exp(sh[t] - mx);
          sum += sh[t];
        }
#endif
        l[hh] = l[hh] * alpha + sum;
        m[hh] = mx;
        if (alpha != 1.f) {
          float* a = acc + hh * D;
#pragma omp simd
          for (int64_t i = 0; i < D; ++i) a[i] *= alpha;
        }
      }
    }
    // Softmax-weighted V rows, block by block, every token's heads while the block is in L1; each
    // head's accumulator stays in registers over the block's keys.
    each_run(vp, [&](int64_t u0, int64_t qi, int64_t n, RowPrefetch<T>& pf) {
        for (int64_t h = 0; h < KVH; ++h) {
          const T* vb = key_row(vp, t0 + u0) + h * HS;
#if defined(__AVX512F__)
          if constexpr (DT > 0 && DT % 16 == 0) {
            for (int64_t g0 = 0; g0 < G; g0 += kPvHeads<DT, T>) {
              const int64_t ng = std::min<int64_t>(kPvHeads<DT, T>, G - g0);
              float* a[kPvHeads<DT, T>];
              const float* p[kPvHeads<DT, T>];
              for (int64_t i = 0; i < ng; ++i) {
                pf.ask();
                a[i] = accs + (qi * H + h * G + g0 + i) * D;
                p[i] = ss + (qi * H + h * G + g0 + i) * kTile + u0;
              }
              weigh_heads<DT, T>(vb, row, n, ng, p, a);
            }
            continue;
          }
#endif
          for (int64_t g = 0; g < G; ++g) {
            pf.ask();
            float* a = accs + (qi * H + h * G + g) * D;
            const float* p = ss + (qi * H + h * G + g) * kTile + u0;
#if defined(PAGELLM_SCORES8)  // AVX2 builds only
            if constexpr (DT > 0 && DT % 8 == 0) {
              if (widen_once) weigh_rows<DT>(wide + h * DT, KVH * DT, n, p, a, wide_scales + h, KVH);
              else weigh_rows<DT>(vb, row, n, p, a);
            } else
#endif
            if constexpr (DT > 0) {
              float al[DT];
              for (int64_t i = 0; i < DT; ++i) al[i] = a[i];
              for (int64_t t = 0; t < n; ++t) {
                const T* v = vb + t * row;
                const float pt = p[t] * row_scale(v, DT);
#pragma omp simd
                for (int64_t i = 0; i < DT; ++i) al[i] += pt * widen(v[i]);
              }
              for (int64_t i = 0; i < DT; ++i) a[i] = al[i];
            } else {
              for (int64_t t = 0; t < n; ++t) {
                const T* v = vb + t * row;
                const float pt = p[t] * row_scale(v, D);
#pragma omp simd
                for (int64_t i = 0; i < D; ++i) a[i] += pt * widen(v[i]);
              }
            }
          }
        }
    });
    t0 = t1;
  }
  finish_run(w, H, D, accs, ms, ls, sinks, out, part_acc, part_ml);
}

#if defined(__AVX512F__)
// attend_run with the query heads that share a KV head as the lanes of one vector, for caches
// whose elements must be widened (bfloat16, 8-bit): lane i is query token i / G's head h G + i % G,
// for the run's NQ tokens (NQ G lanes, 16 to a vector). Each tile's K/V rows of a head are widened
// once into float32 rows (their 8-bit scales beside) and serve every lane, where attend_run widens
// every element again for each query head and token that reads it. A score is 16 lanes' dot
// products at once: q transposed once per run ([D][16], times the scale) and each key's elements
// broadcast from memory into the FMA, with no horizontal sums; the online softmax's max, exp and
// sums run down the lanes, once per key for all of them. The products are as many as attend_run's
// (with a lane group full), so a float32 cache, read in place, gains nothing here (measured
// 0.7-1.2x against attend_run) and stays there.
// Which kernel a model takes depends on its group G alone, never on the run's query tokens: a
// token's sums are then the same decoded alone as verified among a speculative step's 1 + k, and
// greedy speculation keeps plain decoding's tokens exactly (taken by the tokens, the lanes kernel
// moved SmolLM2's int8-cache outputs at its 39th to 76th token, from a last-bit difference). From
// G = 8 at head size 64 (gpt-oss's groups) it measured 1.04-1.31x on a decode token and 1.68-1.97x
// on 5 tokens; at 128 a group of 12 is required (8 lanes measured 0.85-1.07x) (bfloat16 and int8
// caches, contexts of 1,024 and 4,000; benchmarks/attention_lanes_ab.py). Same roundings per
// element as attend_run, in another summation order.
constexpr int64_t kLanes = 16;
constexpr int64_t lanes_built_in(int64_t D) { return D <= 64 ? 8 : 12; }
// set_attention_lanes_from's setting, for the measurements and tests that compare the two kernels
// (0: the built-in crossovers): the query heads per KV head from which the lanes kernel is taken.
std::atomic<int64_t> lanes_override{0};
inline int64_t lanes_from(int64_t D) {
  const int64_t n = lanes_override.load(std::memory_order_relaxed);
  return n > 0 ? n : lanes_built_in(D);
}

template <int DT, typename T>
void attend_run_lanes(const WorkItem& w, int64_t H, int64_t KVH, int64_t BS, const float* q, const int64_t* lens,
                      const T* kp, const T* vp, const int64_t* table, float scale, const float* sinks, float* out,
                      float* part_acc, float* part_ml, std::vector<float>& buf) {
  static_assert(DT % 16 == 0 && DT > 0, "the lanes kernel takes head sizes of whole vectors");
  constexpr int64_t D = DT, C = D / 16;
  // Lanes per pass over a tile's V rows: their accumulators (C vectors each) and a V row in registers.
  constexpr int64_t kPass = C <= 4 ? 6 : 2;
  const int64_t G = H / KVH, HS = head_stride<T>(D), row = KVH * HS, NQ = w.nq;
  const int64_t lanes = NQ * G, groups = (lanes + kLanes - 1) / kLanes;
  const int64_t n_acc = NQ * H * D, n_qt = KVH * groups * D * kLanes, n_ml = KVH * groups * kLanes;
  buf.assign(static_cast<size_t>(n_acc + 2 * NQ * H + n_qt + 2 * n_ml + 2 * kTile * D + kTile * kLanes + 2 * kTile), 0.f);
  float* accs = buf.data();        // [NQ, H, D], as attend_run's
  float* ms = accs + n_acc;        // [NQ, H]
  float* ls = ms + NQ * H;         // [NQ, H]
  float* qt = ls + NQ * H;         // [KVH, groups, D, 16]: q times the scale, lanes across
  float* lm = qt + n_qt;           // [KVH, groups, 16]: running max per lane
  float* ll = lm + n_ml;           // [KVH, groups, 16]: running sum per lane
  float* kf = ll + n_ml;           // [kTile, D]: the tile's K rows of one head, widened
  float* vf = kf + kTile * D;      // [kTile, D]: its V rows
  float* sc = vf + kTile * D;      // [kTile, 16]: scores, then softmax weights (times V's row scale)
  float* ks = sc + kTile * kLanes;  // [kTile]: K's row scales
  float* vs = ks + kTile;          // [kTile]: V's
  const float ninf = -std::numeric_limits<float>::infinity();
  std::fill(lm, lm + n_ml, ninf);
  for (int64_t h = 0; h < KVH; ++h)
    for (int64_t i = 0; i < lanes; ++i) {
      const float* qh = q + ((i / G) * H + h * G + i % G) * D;
      float* to = qt + ((h * groups + i / kLanes) * D) * kLanes + i % kLanes;
      for (int64_t d = 0; d < D; ++d) to[d * kLanes] = qh[d] * scale;
    }
  // Each lane's key count (0 past the last lane: it reads nothing), [groups, 16].
  std::vector<int32_t> lane_lens(static_cast<size_t>(groups * kLanes), 0);
  for (int64_t i = 0; i < lanes; ++i) lane_lens[i] = static_cast<int32_t>(lens[i / G]);
  auto key_row = [&](const T* base, int64_t t) { return base + (table[t / BS] * BS + t % BS) * row; };
  for (int64_t t0 = w.begin; t0 < w.end;) {
    const int64_t t1 = std::min(w.end, (t0 / kTile + 1) * kTile), nt = t1 - t0;
    // the next tile's rows, a share per KV head's widening and arithmetic
    RowPrefetch<T> pk(kp, table, BS, row, t1, std::min(w.end, t1 + kTile), KVH);
    RowPrefetch<T> pv(vp, table, BS, row, t1, std::min(w.end, t1 + kTile), KVH);
    for (int64_t h = 0; h < KVH; ++h) {
      pk.ask();
      pv.ask();
      for (int64_t u = 0; u < nt; ++u) {
        const T* k = key_row(kp, t0 + u) + h * HS;
        const T* v = key_row(vp, t0 + u) + h * HS;
        for (int64_t c = 0; c < C; ++c) {
          _mm512_storeu_ps(kf + u * D + 16 * c, load16(k + 16 * c));
          _mm512_storeu_ps(vf + u * D + 16 * c, load16(v + 16 * c));
        }
        ks[u] = row_scale(k, DT);
        vs[u] = row_scale(v, DT);
      }
      for (int64_t g = 0; g < groups; ++g) {
        const float* qg = qt + (h * groups + g) * D * kLanes;
        // Scores of 8 keys at a time (rows past nt are stale and masked below).
        for (int64_t u = 0; u < nt; u += 8) {
          __m512 a[8];
          for (int j = 0; j < 8; ++j) a[j] = _mm512_setzero_ps();
          for (int64_t d = 0; d < D; ++d) {
            const __m512 qd = _mm512_loadu_ps(qg + d * kLanes);
            for (int j = 0; j < 8; ++j) a[j] = _mm512_fmadd_ps(_mm512_set1_ps(kf[(u + j) * D + d]), qd, a[j]);
          }
          for (int j = 0; j < 8; ++j) _mm512_storeu_ps(sc + (u + j) * kLanes, _mm512_mul_ps(a[j], _mm512_set1_ps(ks[u + j])));
        }
        // Online softmax down the lanes: a lane's keys end at its token's length.
        float* mg = lm + (h * groups + g) * kLanes;
        float* lg = ll + (h * groups + g) * kLanes;
        const __m512 m_old = _mm512_loadu_ps(mg);
        const __m512i lens_g = _mm512_loadu_si512(lane_lens.data() + g * kLanes);
        __mmask16 live[kTile];  // the lanes whose token reads key t0 + u
        __m512 mx = m_old;
        for (int64_t u = 0; u < nt; ++u) {
          live[u] = _mm512_cmpgt_epi32_mask(lens_g, _mm512_set1_epi32(static_cast<int32_t>(t0 + u)));
          mx = _mm512_mask_max_ps(mx, live[u], mx, _mm512_loadu_ps(sc + u * kLanes));
        }
        // A lane with no key yet keeps -inf; it subtracts 0 so that nothing becomes NaN.
        const __mmask16 none = _mm512_cmp_ps_mask(mx, _mm512_set1_ps(ninf), _CMP_EQ_OQ);
        const __m512 base = _mm512_mask_mov_ps(mx, none, _mm512_setzero_ps());
        const __m512 alpha = _mm512_maskz_mov_ps(static_cast<__mmask16>(~none), exp16(_mm512_sub_ps(m_old, base)));
        __m512 sum = _mm512_setzero_ps();
        for (int64_t u = 0; u < nt; ++u) {
          const __m512 e = _mm512_maskz_mov_ps(live[u], exp16(_mm512_sub_ps(_mm512_loadu_ps(sc + u * kLanes), base)));
          sum = _mm512_add_ps(sum, e);
          _mm512_storeu_ps(sc + u * kLanes, _mm512_mul_ps(e, _mm512_set1_ps(vs[u])));
        }
        _mm512_storeu_ps(lg, _mm512_fmadd_ps(_mm512_loadu_ps(lg), alpha, sum));
        _mm512_storeu_ps(mg, mx);
        alignas(64) float al[kLanes];
        _mm512_store_ps(al, alpha);
        // Weighted V rows into each lane's accumulator, up to kPass lanes a pass (passes of equal size).
        const int64_t live_lanes = std::min(kLanes, lanes - g * kLanes);
        const int64_t passes = (live_lanes + kPass - 1) / kPass, per_pass = (live_lanes + passes - 1) / passes;
        for (int64_t i0 = 0; i0 < live_lanes; i0 += per_pass) {
          const int64_t np = std::min(per_pass, live_lanes - i0);
          float* at[kPass] = {};
          __m512 acc[kPass][C];
          for (int64_t i = 0; i < kPass; ++i) {
            if (i >= np) break;
            const int64_t lane = g * kLanes + i0 + i;
            at[i] = accs + ((lane / G) * H + h * G + lane % G) * D;
            for (int64_t c = 0; c < C; ++c)
              acc[i][c] = _mm512_mul_ps(_mm512_loadu_ps(at[i] + 16 * c), _mm512_set1_ps(al[i0 + i]));
          }
          for (int64_t u = 0; u < nt; ++u) {
            __m512 v[C];
            for (int64_t c = 0; c < C; ++c) v[c] = _mm512_loadu_ps(vf + u * D + 16 * c);
            const float* p = sc + u * kLanes + i0;
            for (int64_t i = 0; i < kPass; ++i)
              if (i < np)
                for (int64_t c = 0; c < C; ++c) acc[i][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[i]), v[c], acc[i][c]);
          }
          for (int64_t i = 0; i < kPass; ++i)
            if (i < np)
              for (int64_t c = 0; c < C; ++c) _mm512_storeu_ps(at[i] + 16 * c, acc[i][c]);
        }
      }
    }
    t0 = t1;
  }
  for (int64_t h = 0; h < KVH; ++h)
    for (int64_t i = 0; i < lanes; ++i) {
      const int64_t at = (i / G) * H + h * G + i % G, from = (h * groups + i / kLanes) * kLanes + i % kLanes;
      ms[at] = lm[from];
      ls[at] = ll[from];
    }
  finish_run(w, H, D, accs, ms, ls, sinks, out, part_acc, part_ml);
}
#endif

void check_cpu_dtype(const torch::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype, name, " must be a CPU tensor of ", dtype,
              ", got ", t.scalar_type());
}

void check_float_cpu(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && (t.scalar_type() == torch::kFloat || t.scalar_type() == torch::kBFloat16),
              name, " must be a float32 or bfloat16 CPU tensor");
}

}  // namespace

// q: [B, H, D] float32, B query tokens; k_cache, v_cache: [num_blocks, block_size, KVH, D]
// (contiguous), both float32, bfloat16 or float16; block_tables: [S, max_blocks] (int64);
// seq_lens: [B] (int64), the keys query b reads (its position + 1); token_seq: the row of
// block_tables for each query (none: row b). Returns [B, H, D] float32.
//
// Decode reads every cached K/V byte once per step, so it runs at memory bandwidth when
// both threads stream all the time: contexts are cut into runs of about equal length
// (flash-decoding's split-K), which keeps the threads evenly loaded however unequal the
// sequences are, and a sequence cut into several runs is put back together by
// log-sum-exp weights. That length depends on the whole batch, and so do a query's sums;
// fixed_run > 0 cuts every context at the same absolute positions instead, so a query's
// arithmetic depends on its own position and keys alone (batch-invariant mode).
template <typename T>
torch::Tensor paged_attention_impl(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                   torch::Tensor block_tables, torch::Tensor seq_lens, const int64_t* token_seq,
                                   double scale, int64_t window, int64_t chunk, double softcap, const float* sinks,
                                   int64_t fixed_run) {
  q = q.contiguous();
  block_tables = block_tables.to(torch::kLong).contiguous();
  seq_lens = seq_lens.to(torch::kLong).contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_stride<T>(D) && H % KVH == 0, "q and the KV cache disagree on head shapes");
  const int64_t max_blocks = block_tables.size(1);
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const T* kp = static_cast<const T*>(k_cache.data_ptr());
  const T* vp = static_cast<const T*>(v_cache.data_ptr());
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* sl = seq_lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale), fcap = static_cast<float>(softcap);
  // A sliding window of W: the query at position len - 1 reads keys len - W .. len - 1 only.
  // Chunked attention of C (Llama 4): it reads its own chunk's keys, from (len - 1) / C * C on.
  auto first_key = [&](int64_t b) {
    const int64_t from_window = window > 0 ? std::max<int64_t>(0, sl[b] - window) : int64_t{0};
    return chunk > 0 ? std::max(from_window, (sl[b] - 1) / chunk * chunk) : from_window;
  };

  // Consecutive query tokens of one sequence that read the same keys from the same start (a
  // verification step's 1 + k tokens, a short prefill) are attended together, block by block;
  // not in batch-invariant mode, where a query's sums may depend on nothing but its own keys.
  constexpr int64_t kMaxGroup = 16;
  struct Group {
    int64_t first, n, longest;  // tokens first .. first + n - 1; the most keys one of them reads
  };
  std::vector<Group> groups;
  int64_t total = 0;  // keys read, each group's once
  for (int64_t b = 0; b < B;) {
    int64_t n = 1, longest = sl[b];
    while (fixed_run == 0 && token_seq != nullptr && n < kMaxGroup && b + n < B &&
           token_seq[b + n] == token_seq[b] && first_key(b + n) == first_key(b)) {
      longest = std::max(longest, sl[b + n]);
      ++n;
    }
    groups.push_back({b, n, longest});
    total += longest - first_key(b);
    b += n;
  }
  // Runs of whole blocks, sized so that every thread gets several.
  const int64_t threads = at::get_num_threads();
  int64_t run = fixed_run > 0 ? fixed_run : std::max<int64_t>(4 * BS, (total + 8 * threads - 1) / (8 * threads));
  run = (run + BS - 1) / BS * BS;
  std::vector<WorkItem> items;
  // A split query's partial results: rows first_part[b] + r * part_stride[b] for its runs r.
  std::vector<int64_t> first_part(B, -1), part_stride(B, 0), group_end(B, 0);
  int64_t parts = 0;
  for (const Group& g : groups) {
    const int64_t b = g.first, n = g.n, longest = g.longest, start = first_key(b);
    if (longest - start <= run) {
      items.push_back({b, n, start, longest, -1});
      continue;
    }
    for (int64_t i = 0; i < n; ++i) {
      first_part[b + i] = parts + i;
      part_stride[b + i] = n;
      group_end[b + i] = longest;
    }
    for (int64_t t = start; t < longest; t += run, parts += n) items.push_back({b, n, t, std::min(longest, t + run), parts});
  }
  std::vector<float> part_acc(static_cast<size_t>(parts * H * D));
  std::vector<float> part_ml(static_cast<size_t>(parts * H * 2));

  // Threads claim items one at a time: an even share each (at::parallel_for's) left one thread
  // waiting whenever the other was slowed or its share held the shorter runs.
  std::atomic<int64_t> next_item{0};
  const int64_t n_items = static_cast<int64_t>(items.size());
  const int64_t workers = at::in_parallel_region() ? 1 : std::min<int64_t>(at::get_num_threads(), n_items);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::vector<float> buf;
    for (int64_t i = next_item.fetch_add(1); i < n_items; i = next_item.fetch_add(1)) {
      const WorkItem& w = items[i];
      const float* q_b = qp + w.q0 * H * D;
      const int64_t* table = bt + (token_seq != nullptr ? token_seq[w.q0] : w.q0) * max_blocks;
      float* o = op + w.q0 * H * D;
#if defined(__AVX512F__)
      if constexpr (!std::is_same_v<T, float>) {
        if ((D == 64 || D == 128) && fcap == 0.f && H / KVH >= lanes_from(D)) {
          if (D == 64)
            attend_run_lanes<64, T>(w, H, KVH, BS, q_b, sl + w.q0, kp, vp, table, fscale, sinks, o, part_acc.data(),
                                    part_ml.data(), buf);
          else
            attend_run_lanes<128, T>(w, H, KVH, BS, q_b, sl + w.q0, kp, vp, table, fscale, sinks, o,
                                     part_acc.data(), part_ml.data(), buf);
          continue;
        }
      }
#endif
      if (D == 64)
        attend_run<64, T>(w, D, H, KVH, BS, q_b, sl + w.q0, kp, vp, table, fscale, fcap, sinks, o, part_acc.data(),
                          part_ml.data(), buf);
      else if (D == 128)
        attend_run<128, T>(w, D, H, KVH, BS, q_b, sl + w.q0, kp, vp, table, fscale, fcap, sinks, o,
                           part_acc.data(), part_ml.data(), buf);
      else
        attend_run<0, T>(w, D, H, KVH, BS, q_b, sl + w.q0, kp, vp, table, fscale, fcap, sinks, o, part_acc.data(),
                         part_ml.data(), buf);
    }
  });

  // Put split queries back together: weight each run by exp(its max - the overall max). Each
  // (query, head) on its own, spread over the threads like the runs.
  auto combine = [&](int64_t b, int64_t hh) {
    const int64_t n = (group_end[b] - first_key(b) + run - 1) / run;
    float mx = sinks != nullptr ? sinks[hh] : -std::numeric_limits<float>::infinity();
    for (int64_t r = 0; r < n; ++r) mx = std::max(mx, part_ml[((first_part[b] + r * part_stride[b]) * H + hh) * 2]);
    float denom = sinks != nullptr ? std::exp(sinks[hh] - mx) : 0.f;  // the sink joins once, here
    float* o = op + (b * H + hh) * D;
    std::fill(o, o + D, 0.f);
    for (int64_t r = 0; r < n; ++r) {
      const int64_t p = first_part[b] + r * part_stride[b];
      const float w = std::exp(part_ml[(p * H + hh) * 2] - mx);
      denom += w * part_ml[(p * H + hh) * 2 + 1];
      const float* a = part_acc.data() + (p * H + hh) * D;
      for (int64_t i = 0; i < D; ++i) o[i] += w * a[i];
    }
    const float inv = 1.f / denom;
    for (int64_t i = 0; i < D; ++i) o[i] *= inv;
  };
  if (parts > 0)
    at::parallel_for(0, B * H, 8, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i)
        if (first_part[i / H] >= 0) combine(i / H, i % H);
    });
  return out;
}

// window: keys in the last `window` positions only (0: all); chunk: keys in the query's own chunk of
// `chunk` positions only (0: all; Llama 4's chunked attention); softcap: scores capped as
// softcap * tanh(score / softcap) (0: none); sinks: None, or [H] float32 logits, one per query
// head, that join each softmax's denominator and attend to nothing (gpt-oss). kv_format: 0 for
// a float32, bfloat16 or float16 cache (its dtype says which), or the 8-bit format of a uint8 cache of
// [num_blocks, block_size, KVH, D + 2] rows: 1 int8, 2 fp8 e4m3, 3 fp8 e5m2.
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor block_tables, torch::Tensor seq_lens, double scale, int64_t window,
                              int64_t chunk, double softcap, c10::optional<torch::Tensor> sinks,
                              c10::optional<torch::Tensor> token_seq, int64_t fixed_run, int64_t kv_format) {
  check_cpu_dtype(q, "q", torch::kFloat);
  const auto kv = k_cache.scalar_type();
  TORCH_CHECK(k_cache.device().is_cpu() && v_cache.device().is_cpu() && v_cache.scalar_type() == kv,
              "k_cache and v_cache must be CPU tensors of one dtype");
  TORCH_CHECK(kv_format == kKvPlain ? (kv == torch::kFloat || kv == torch::kBFloat16 || kv == torch::kHalf)
                                    : (known_kv_code(kv_format) && kv == torch::kByte),
              "kv_format ", kv_format, " does not match a cache of ", kv,
              " (0: float32, bfloat16 or float16; 1-3: uint8 rows of 8-bit codes and a scale)");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the KV cache must be contiguous");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == q.size(0), "seq_lens must have one entry per query");
  torch::Tensor sink_values;
  if (sinks.has_value()) {
    sink_values = sinks->to(torch::kFloat).contiguous();
    TORCH_CHECK(sink_values.device().is_cpu() && sink_values.dim() == 1 && sink_values.size(0) == q.size(1),
                "sinks must be a [num_heads] CPU tensor");
  }
  const float* sp = sinks.has_value() ? sink_values.data_ptr<float>() : nullptr;
  torch::Tensor rows;
  const int64_t* rp = nullptr;
  if (token_seq.has_value()) {
    rows = token_seq->to(torch::kLong).contiguous();
    TORCH_CHECK(rows.dim() == 1 && rows.size(0) == q.size(0), "token_seq must have one entry per query");
    rp = rows.data_ptr<int64_t>();
    for (int64_t i = 0; i < rows.size(0); ++i)
      TORCH_CHECK(rp[i] >= 0 && rp[i] < block_tables.size(0), "token_seq[", i, "] = ", rp[i], " is no row of block_tables");
  } else {
    TORCH_CHECK(block_tables.size(0) >= q.size(0), "block_tables needs a row per query");
  }
  switch (kv_format) {
    case kKvInt8:
      return paged_attention_impl<I8>(q, k_cache, v_cache, block_tables, seq_lens, rp, scale, window, chunk,
                                      softcap, sp, fixed_run);
    case kKvE4M3:
      return paged_attention_impl<E4M3>(q, k_cache, v_cache, block_tables, seq_lens, rp, scale, window, chunk,
                                        softcap, sp, fixed_run);
    case kKvE5M2:
      return paged_attention_impl<E5M2>(q, k_cache, v_cache, block_tables, seq_lens, rp, scale, window, chunk,
                                        softcap, sp, fixed_run);
    default:
      break;
  }
  if (kv == torch::kBFloat16)
    return paged_attention_impl<uint16_t>(q, k_cache, v_cache, block_tables, seq_lens, rp, scale, window, chunk,
                                          softcap, sp, fixed_run);
  if (kv == torch::kHalf)
    return paged_attention_impl<F16>(q, k_cache, v_cache, block_tables, seq_lens, rp, scale, window, chunk, softcap,
                                     sp, fixed_run);
  return paged_attention_impl<float>(q, k_cache, v_cache, block_tables, seq_lens, rp, scale, window, chunk,
                                     softcap, sp, fixed_run);
}

// Encoding one K/V row into 8-bit codes and its float16 scale, as KVFormat.encode does in torch
// (same float32 operations and the same roundings, so the two agree bit for bit).
inline uint8_t encode_code(I8*, float x) {
  return static_cast<uint8_t>(static_cast<int8_t>(std::nearbyint(std::min(127.f, std::max(-127.f, x)))));
}
inline uint8_t encode_code(E4M3*, float x) { return c10::Float8_e4m3fn(std::min(448.f, std::max(-448.f, x))).x; }
inline uint8_t encode_code(E5M2*, float x) { return c10::Float8_e5m2(std::min(57344.f, std::max(-57344.f, x))).x; }

template <typename T>
void store_rows(const torch::Tensor& x, torch::Tensor& cache, const int64_t* slots, float qmax) {
  const int64_t T_ = x.size(0), KVH = x.size(1), D = x.size(2), HS = D + 2;
  const float* xp = x.data_ptr<float>();
  uint8_t* cp = cache.data_ptr<uint8_t>();
  const int64_t slots_total = cache.size(0) * cache.size(1);
  for (int64_t t = 0; t < T_; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < slots_total, "slot ", slots[t], " is outside the cache's ", slots_total);
  at::parallel_for(0, T_ * KVH, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / KVH, h = i % KVH;
      const float* row = xp + i * D;
      float amax = 0.f;
      for (int64_t j = 0; j < D; ++j) amax = std::max(amax, std::fabs(row[j]));
      const c10::Half scale(std::min(kF16Max, std::max(6.103515625e-05f, amax / qmax)));  // floor: 2^-14
      const float sf = static_cast<float>(scale);
      uint8_t* dst = cp + (slots[t] * KVH + h) * HS;
      for (int64_t j = 0; j < D; ++j) dst[j] = encode_code(static_cast<T*>(nullptr), row[j] / sf);
      std::memcpy(dst + D, &scale.x, sizeof scale.x);
    }
  });
}

// Rows x [T, KVH, D] copied into a float32, bfloat16 or float16 cache [blocks, block_size, KVH, D]
// at `slots`, converted as KVFormat.encode converts (rounded to nearest even; float16 saturates at
// +-65504, where .to() would store an infinity that turns every later score of the head into NaN).
template <typename C>
void copy_rows(const torch::Tensor& x, torch::Tensor& cache, const int64_t* slots) {
  const int64_t T_ = x.size(0), row = x.size(1) * x.size(2);
  const float* xp = x.data_ptr<float>();
  C* cp = static_cast<C*>(cache.data_ptr());
  for (int64_t t = 0; t < T_; ++t) {
    C* dst = cp + slots[t] * row;
    if constexpr (std::is_same_v<C, float>) std::memcpy(dst, xp + t * row, row * sizeof(float));
    else if constexpr (std::is_same_v<C, at::Half>)
      for (int64_t j = 0; j < row; ++j) dst[j] = static_cast<C>(std::min(kF16Max, std::max(-kF16Max, xp[t * row + j])));
    else for (int64_t j = 0; j < row; ++j) dst[j] = static_cast<C>(xp[t * row + j]);
  }
}

// k, v: [T, KVH, D] (float32 or bfloat16; computed in float32); slots: [T] (int64), each in the
// cache. kv_format 0: float32, bfloat16 or float16 caches [num_blocks, block_size, KVH, D] (the rows
// converted to the cache's dtype; two index_copy_ calls in torch cost more than the copy at a
// decode step); 1-3 as in paged_attention (1 int8, 2 fp8 e4m3, 3 fp8 e5m2): uint8 caches
// [num_blocks, block_size, KVH, D + 2] of codes and a float16 scale.
void store_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots,
              int64_t kv_format) {
  TORCH_CHECK(known_kv_code(kv_format), "kv_format ", kv_format, " is no KVCode (pagellm/kv_format.py)");
  check_float_cpu(k, "k");
  check_float_cpu(v, "v");
  const auto dtype = k_cache.scalar_type();
  const int64_t row = kv_format == kKvPlain ? k.size(2) : k.size(2) + 2;
  for (const auto* c : {&k_cache, &v_cache})
    TORCH_CHECK(c->device().is_cpu() && c->scalar_type() == dtype && c->is_contiguous() && c->dim() == 4 &&
                    c->size(2) == k.size(1) && c->size(3) == row &&
                    (kv_format == kKvPlain ? (dtype == torch::kFloat || dtype == torch::kBFloat16 || dtype == torch::kHalf)
                                           : dtype == torch::kByte),
                "the caches must be contiguous ", kv_format == kKvPlain ? "float32, bfloat16 or float16" : "uint8",
                " [blocks, block_size, ",
                k.size(1), ", ", row, "]");
  TORCH_CHECK(k.sizes() == v.sizes() && slots.dim() == 1 && slots.size(0) == k.size(0),
              "k, v and slots disagree on the number of tokens");
  const auto kf = k.to(torch::kFloat).contiguous(), vf = v.to(torch::kFloat).contiguous();
  const auto sl = slots.to(torch::kLong).contiguous();
  const int64_t* sp = sl.data_ptr<int64_t>();
  const int64_t slots_total = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < sl.size(0); ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < slots_total, "slot ", sp[t], " is outside the cache's ", slots_total);
  switch (kv_format) {
    case kKvPlain:
      if (dtype == torch::kFloat) { copy_rows<float>(kf, k_cache, sp); copy_rows<float>(vf, v_cache, sp); }
      else if (dtype == torch::kHalf) { copy_rows<at::Half>(kf, k_cache, sp); copy_rows<at::Half>(vf, v_cache, sp); }
      else { copy_rows<at::BFloat16>(kf, k_cache, sp); copy_rows<at::BFloat16>(vf, v_cache, sp); }
      break;
    case kKvInt8: store_rows<I8>(kf, k_cache, sp, 127.f); store_rows<I8>(vf, v_cache, sp, 127.f); break;
    case kKvE4M3: store_rows<E4M3>(kf, k_cache, sp, 448.f); store_rows<E4M3>(vf, v_cache, sp, 448.f); break;
    default: store_rows<E5M2>(kf, k_cache, sp, 57344.f); store_rows<E5M2>(vf, v_cache, sp, 57344.f); break;
  }
}

// The first index of row r (V values) that holds mx, or the first NaN where `nan`: torch.max's
// index (NaN propagates as the maximum).
inline int64_t first_index_of(const float* r, int64_t V, float mx, bool nan) {
  int64_t i = 0;
#if defined(__AVX2__)
  const __m256 m = _mm256_set1_ps(mx);
  for (; i + 8 <= V; i += 8) {
    const __m256 v = _mm256_loadu_ps(r + i);
    const int hit = _mm256_movemask_ps(nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, m, _CMP_EQ_OQ));
    if (hit) return i + __builtin_ctz(static_cast<unsigned>(hit));
  }
#endif
  for (; i < V; ++i)
    if (nan ? std::isnan(r[i]) : r[i] == mx) return i;
  return 0;
}

// {logsumexp, index of the maximum} of each row of x [B, V] (float32). A row is summed in one fixed
// order whatever B is (a thread takes whole rows), so a token's logprob does not depend on the
// batch: torch reduces a lone row split over threads, and the sampler paid a copy and twice the
// work to keep it invariant. The index is a greedy step's token, found after the pass for the
// maximum: torch's max with indices alone took twice this kernel's time over a 128k vocabulary.
std::vector<torch::Tensor> row_logsumexp(torch::Tensor x) {
  check_cpu_dtype(x, "x", torch::kFloat);
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0, "x must be [B, V] with V > 0");
  x = x.contiguous();
  const int64_t B = x.size(0), V = x.size(1);
  auto out = torch::empty({B}, x.options());
  auto index = torch::empty({B}, x.options().dtype(torch::kLong));
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  int64_t* ip = index.data_ptr<int64_t>();
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float* r = xp + b * V;
      float mx = -std::numeric_limits<float>::infinity();
      bool nan = false;
      int64_t i = 0;
#if defined(__AVX512F__)  // the maximum 16 lanes at a time: the scalar loop took most of the kernel's time
      __m512 vmax = _mm512_set1_ps(mx);
      __mmask16 unordered = 0;
      for (; i + 16 <= V; i += 16) {
        const __m512 v = _mm512_loadu_ps(r + i);
        unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        vmax = _mm512_max_ps(vmax, v);
      }
      mx = _mm512_reduce_max_ps(vmax);
      nan = unordered != 0;
#elif defined(__AVX2__) && defined(__FMA__)
      __m256 vmax = _mm256_set1_ps(mx);
      int unordered = 0;
      for (; i + 8 <= V; i += 8) {
        const __m256 v = _mm256_loadu_ps(r + i);
        unordered |= _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        vmax = _mm256_max_ps(vmax, v);
      }
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, vmax);
      for (float v : lanes) mx = std::max(mx, v);
      nan = unordered != 0;
#endif
      for (; i < V; ++i) { mx = std::max(mx, r[i]); nan |= std::isnan(r[i]); }
      ip[b] = first_index_of(r, V, mx, nan);
      if (nan || !std::isfinite(mx)) {  // as torch: NaN propagates, +inf gives inf, all -inf gives -inf
        op[b] = nan ? std::numeric_limits<float>::quiet_NaN() : mx;
        continue;
      }
      i = 0;
      float sum = 0.f;
#if defined(__AVX512F__)
      const __m512 m = _mm512_set1_ps(mx);
      __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      for (; i + 64 <= V; i += 64)
        for (int a = 0; a < 4; ++a)
          acc[a] = _mm512_add_ps(acc[a], exp16(_mm512_sub_ps(_mm512_loadu_ps(r + i + 16 * a), m)));
      sum = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
#elif defined(__AVX2__) && defined(__FMA__)
      const __m256 m = _mm256_set1_ps(mx);
      __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
      for (; i + 32 <= V; i += 32)
        for (int a = 0; a < 4; ++a)
          acc[a] = _mm256_add_ps(acc[a], exp8(_mm256_sub_ps(_mm256_loadu_ps(r + i + 8 * a), m)));
      sum = hsum8(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
#endif
      for (; i < V; ++i) sum += std::exp(r[i] - mx);
      op[b] = mx + std::log(sum);
    }
  });
  return {out, index};
}

// Element types of the element-wise kernels: float, or bfloat16 computed in float and rounded
// once on the way out (torch's bfloat16 ops round after every op).
inline float f32(float x) { return x; }
inline float f32(at::BFloat16 x) { return static_cast<float>(x); }
template <typename T> inline T from_f32(float x) { return static_cast<T>(x); }

// One token's heads, rotated in place. No contraction into fused multiply-adds (the
// attribute applies to this function's own body, so the loop lives here and not in a
// lambda): x1 * c - x2 * s must round as torch's separate products and sum do.
template <typename T>
__attribute__((noinline, optimize("fp-contract=off"))) static void rope_token(T* x, int64_t NH, int64_t D,
                                                                               const T* c, const T* s) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < NH; ++h) {
    T* a = x + h * D;
    T* b = a + half;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = f32(a[i]), x2 = f32(b[i]);
      a[i] = from_f32<T>(x1 * f32(c[i]) + (-x2) * f32(s[i]));
      b[i] = from_f32<T>(x2 * f32(c[i + half]) + x1 * f32(s[i + half]));
    }
  }
}

// Rotates x: [T, heads, D] (rows may be strided, heads and D contiguous) in place with
// cos, sin: [T, D] (contiguous), rotate-half layout.
template <typename T>
static void rope_inplace(torch::Tensor x, const T* cp, const T* sp) {
  const int64_t N = x.size(0), NH = x.size(1), D = x.size(2);
  const int64_t stride = x.stride(0);
  T* xp = x.data_ptr<T>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) rope_token<T>(xp + t * stride, NH, D, cp + t * D, sp + t * D);
  });
}

void rotary_embedding_(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin) {
  check_float_cpu(q, "q");
  const auto dtype = q.scalar_type();
  for (auto* t : {&q, &k}) {
    check_cpu_dtype(*t, "q/k", dtype);
    TORCH_CHECK(t->dim() == 3 && t->stride(2) == 1 && t->stride(1) == t->size(2),
                "q and k must be [T, heads, D] with contiguous heads");
  }
  check_cpu_dtype(cos, "cos", dtype);
  check_cpu_dtype(sin, "sin", dtype);
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 && cos.sizes() == sin.sizes() &&
                  cos.size(0) == q.size(0) && k.size(0) == q.size(0) && cos.size(1) == q.size(2) &&
                  k.size(2) == q.size(2),
              "cos/sin must be [T, D] for q: [T, H, D] and k: [T, KVH, D]");
  if (dtype == torch::kBFloat16) {
    rope_inplace<at::BFloat16>(q, cos.data_ptr<at::BFloat16>(), sin.data_ptr<at::BFloat16>());
    rope_inplace<at::BFloat16>(k, cos.data_ptr<at::BFloat16>(), sin.data_ptr<at::BFloat16>());
  } else {
    rope_inplace<float>(q, cos.data_ptr<float>(), sin.data_ptr<float>());
    rope_inplace<float>(k, cos.data_ptr<float>(), sin.data_ptr<float>());
  }
}

template <typename T>
static void silu_and_mul_impl(const T* xp, T* op, int64_t N, int64_t I) {
  at::parallel_for(0, N, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* g = xp + t * 2 * I;
      const T* u = g + I;
      T* o = op + t * I;
      int64_t i = 0;
#if defined(__AVX512F__)
      if constexpr (std::is_same_v<T, float>) {  // expf is scalar: 16 at a time, 6x faster on a decode row
        const __m512 one = _mm512_set1_ps(1.f);
        for (; i + 16 <= I; i += 16) {
          const __m512 gi = _mm512_loadu_ps(g + i);
          const __m512 sig = _mm512_div_ps(gi, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), gi))));
          _mm512_storeu_ps(o + i, _mm512_mul_ps(sig, _mm512_loadu_ps(u + i)));
        }
      }
#elif defined(__AVX2__) && defined(__FMA__)
      if constexpr (std::is_same_v<T, float>) {
        const __m256 one = _mm256_set1_ps(1.f);
        for (; i + 8 <= I; i += 8) {
          const __m256 gi = _mm256_loadu_ps(g + i);
          const __m256 sig = _mm256_div_ps(gi, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), gi))));
          _mm256_storeu_ps(o + i, _mm256_mul_ps(sig, _mm256_loadu_ps(u + i)));
        }
      }
#endif
      const int64_t done = i;
#pragma omp simd
      for (int64_t j = done; j < I; ++j) {
        const float gj = f32(g[j]);
        o[j] = from_f32<T>(gj / (1.f + std::exp(-gj)) * f32(u[j]));
      }
    }
  });
}

// x: [T, 2I] (gate then up). Returns silu(gate) * up: [T, I].
torch::Tensor silu_and_mul(torch::Tensor x) {
  check_float_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "x must be [T, 2I] (gate, then up)");
  x = x.contiguous();
  const int64_t N = x.size(0), I = x.size(1) / 2;
  auto out = torch::empty({N, I}, x.options());
  if (x.scalar_type() == torch::kBFloat16)
    silu_and_mul_impl<at::BFloat16>(x.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), N, I);
  else
    silu_and_mul_impl<float>(x.data_ptr<float>(), out.data_ptr<float>(), N, I);
  return out;
}

// RMSNorm of rows as the reference computes it: the mean square and the scaling in float32,
// the normalized row rounded to the model's dtype (a no-op in float32), then multiplied by the
// weight (rounded again). One pass instead of torch's composite of about ten operations (an
// upcast, a square, a mean, an add, rsqrt, products, casts), which costs more than the arithmetic
// on a decode step's single rows. The sum of squares runs in another order than torch's, so
// float32 results can differ from it in the last bits.
// One row of H values; o may be r (each value is read before it is written).
template <typename T>
inline void rms_norm_row(const T* r, const T* wp, T* o, int64_t H, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < H; ++i) ss += f32(r[i]) * f32(r[i]);
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
#pragma omp simd
  for (int64_t i = 0; i < H; ++i) {
    const float normed = f32(from_f32<T>(f32(r[i]) * inv));
    o[i] = from_f32<T>(f32(wp[i]) * normed);
  }
}

template <typename T>
void rms_norm_impl(const T* xp, const T* wp, T* op, int64_t N, int64_t H, float eps) {
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) rms_norm_row<T>(xp + t * H, wp, op + t * H, H, eps);
  });
}

// x: [T, H] float32 or bfloat16, weight: [H] of the same dtype.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_float_cpu(x, "x");
  check_cpu_dtype(weight, "weight", x.scalar_type());
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && weight.size(0) == x.size(1), "x must be [T, H] for a weight of [H]");
  x = x.contiguous();
  weight = weight.contiguous();
  auto out = torch::empty_like(x);
  const float feps = static_cast<float>(eps);
  if (x.scalar_type() == torch::kBFloat16)
    rms_norm_impl<at::BFloat16>(x.data_ptr<at::BFloat16>(), weight.data_ptr<at::BFloat16>(),
                                out.data_ptr<at::BFloat16>(), x.size(0), x.size(1), feps);
  else
    rms_norm_impl<float>(x.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), x.size(0), x.size(1),
                         feps);
  return out;
}

// The residual stream and its RMSNorm in one call: s = x + h (rounded to x's dtype, as torch's
// add rounds), then rms_norm(s). Returns {s, rms_norm(s)}: two dispatches fewer a layer.
template <typename T>
void add_rows(const T* xp, const T* hp, T* sp, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) sp[i] = from_f32<T>(f32(xp[i]) + f32(hp[i]));
}

std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor h, torch::Tensor weight, double eps) {
  check_float_cpu(x, "x");
  check_cpu_dtype(h, "h", x.scalar_type());
  check_cpu_dtype(weight, "weight", x.scalar_type());
  TORCH_CHECK(x.dim() == 2 && x.sizes() == h.sizes() && weight.dim() == 1 && weight.size(0) == x.size(1),
              "x and h must be [T, H] for a weight of [H]");
  x = x.contiguous();
  h = h.contiguous();
  weight = weight.contiguous();
  auto sum = torch::empty_like(x);
  auto out = torch::empty_like(x);
  const float feps = static_cast<float>(eps);
  if (x.scalar_type() == torch::kBFloat16) {
    add_rows<at::BFloat16>(x.data_ptr<at::BFloat16>(), h.data_ptr<at::BFloat16>(), sum.data_ptr<at::BFloat16>(),
                           x.numel());
    rms_norm_impl<at::BFloat16>(sum.data_ptr<at::BFloat16>(), weight.data_ptr<at::BFloat16>(),
                                out.data_ptr<at::BFloat16>(), x.size(0), x.size(1), feps);
  } else {
    add_rows<float>(x.data_ptr<float>(), h.data_ptr<float>(), sum.data_ptr<float>(), x.numel());
    rms_norm_impl<float>(sum.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), x.size(0),
                         x.size(1), feps);
  }
  return {sum, out};
}

// A decode step's attention for one layer from its fused q/k/v projection, in one call: rotate q
// and k in place (cos, sin: [T, D], or none), write k and v into the cache at `slots`, and attend
// for the T decode tokens (token t is the last of block-table row t, of seq_lens[t] keys).
// Returns [T, H * D] in qkv's dtype. The same kernels and arithmetic as rotary_embedding_,
// store_kv and paged_attention called one by one; what it saves is the ~20 Python-level tensor
// operations (split, views, slices, checks) a layer otherwise spends around them, which cost more
// than the attention itself on a short decode step.
torch::Tensor decode_attention_qkv(torch::Tensor qkv, int64_t H, int64_t KVH, c10::optional<torch::Tensor> cos,
                                   c10::optional<torch::Tensor> sin, torch::Tensor k_cache, torch::Tensor v_cache,
                                   torch::Tensor slots, torch::Tensor block_tables, torch::Tensor seq_lens,
                                   double scale, int64_t window, int64_t chunk, double softcap,
                                   c10::optional<torch::Tensor> sinks, int64_t kv_format,
                                   c10::optional<torch::Tensor> q_norm,
                                   c10::optional<torch::Tensor> k_norm, double norm_eps, bool norm_per_head,
                                   c10::optional<torch::Tensor> token_seq) {
  check_float_cpu(qkv, "qkv");
  TORCH_CHECK(H > 0 && KVH > 0 && qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) % (H + 2 * KVH) == 0,
              "qkv must be [T, (H + 2 KVH) * D] with contiguous rows; got ", qkv.sizes(), " for H = ", H,
              ", KVH = ", KVH);
  TORCH_CHECK(cos.has_value() == sin.has_value(), "cos and sin come together");
  const int64_t T = qkv.size(0), D = qkv.size(1) / (H + 2 * KVH);
  // token_seq: each token's row of block_tables (a verification's several tokens of one sequence), and
  // seq_lens then each token's keys; without it token t is row t's one decode token
  TORCH_CHECK(token_seq.has_value() ? token_seq->numel() == T && seq_lens.size(0) >= T
                                    : block_tables.size(0) >= T && seq_lens.size(0) >= T,
              "block_tables and seq_lens need a row per token (or token_seq one per token)");
  auto q = qkv.narrow(1, 0, H * D).view({T, H, D});
  auto k = qkv.narrow(1, H * D, KVH * D).view({T, KVH, D});
  auto v = qkv.narrow(1, (H + KVH) * D, KVH * D).view({T, KVH, D});
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q_norm and k_norm come together");
  if (q_norm.has_value()) {  // before RoPE, in place: per head (Qwen3), or over all heads (OLMo 2)
    check_cpu_dtype(*q_norm, "q_norm", qkv.scalar_type());
    check_cpu_dtype(*k_norm, "k_norm", qkv.scalar_type());
    TORCH_CHECK(q_norm->is_contiguous() && k_norm->is_contiguous() &&
                    q_norm->numel() == (norm_per_head ? D : H * D) && k_norm->numel() == (norm_per_head ? D : KVH * D),
                "q_norm and k_norm must be [D] (per head) or [H * D] and [KVH * D]");
    const float feps = static_cast<float>(norm_eps);
    const int64_t stride = qkv.size(1);
    auto norm_rows = [&](auto* base) {
      using E = std::remove_pointer_t<decltype(base)>;
      const E *qw = q_norm->data_ptr<E>(), *kw = k_norm->data_ptr<E>();
      for (int64_t t = 0; t < T; ++t) {  // a token's heads are contiguous: rows of D, or one row of all
        E* qt = base + t * stride;
        E* kt = qt + H * D;
        if (norm_per_head) {
          for (int64_t h = 0; h < H; ++h) rms_norm_row<E>(qt + h * D, qw, qt + h * D, D, feps);
          for (int64_t h = 0; h < KVH; ++h) rms_norm_row<E>(kt + h * D, kw, kt + h * D, D, feps);
        } else {
          rms_norm_row<E>(qt, qw, qt, H * D, feps);
          rms_norm_row<E>(kt, kw, kt, KVH * D, feps);
        }
      }
    };
    if (qkv.scalar_type() == torch::kBFloat16) norm_rows(qkv.data_ptr<at::BFloat16>());
    else norm_rows(qkv.data_ptr<float>());
  }
  if (cos.has_value()) rotary_embedding_(q, k, *cos, *sin);
  store_kv(k, v, k_cache, v_cache, slots, kv_format);
  auto out = paged_attention(q.to(torch::kFloat), k_cache, v_cache,
                             token_seq.has_value() ? block_tables : block_tables.narrow(0, 0, T),
                             seq_lens.narrow(0, 0, T), scale, window, chunk, softcap, sinks, token_seq, 0, kv_format);
  return out.view({T, H * D}).to(qkv.scalar_type());
}

// ---- Gated DeltaNet's decode step (Qwen3.5), its states read and written where they lie in the pool.
//
// A sequence's state is the bytes of its state blocks, K then V of each block in table order
// (layers/recurrent.py's read_state), fields "conv" [C, K - 1] then "ssm" [Hv, dk, dv], float32.
// PooledState maps a byte of that row to its address; a span of floats that crosses from one
// block half into the next (the layout does not align fields to blocks) is copied into scratch
// and back, every other span is used in place.
struct PooledState {
  uint8_t* k;
  uint8_t* v;
  int64_t k_stride, v_stride, half;  // bytes between blocks; bytes of one block's K (and V) part
  const int64_t* blocks;             // this sequence's state blocks

  uint8_t* at(int64_t byte) const {
    const int64_t part = byte / half;
    const int64_t block = blocks[part / 2];
    return (part % 2 ? v + block * v_stride : k + block * k_stride) + byte % half;
  }

  // fn(float*) on floats [first, first + n) of the state, zeroed first if `fresh`; written back.
  template <typename F>
  void with_span(int64_t first, int64_t n, bool fresh, std::vector<float>& scratch, F&& fn) const {
    const int64_t byte = first * 4, len = n * 4;
    if (byte % half + len <= half) {
      float* p = reinterpret_cast<float*>(at(byte));
      if (fresh) std::fill(p, p + n, 0.f);
      fn(p);
      return;
    }
    scratch.resize(n);
    uint8_t* s = reinterpret_cast<uint8_t*>(scratch.data());
    auto pieces = [&](bool in) {
      for (int64_t done = 0; done < len;) {
        const int64_t b = byte + done, m = std::min(len - done, half - b % half);
        if (in) std::memcpy(s + done, at(b), m);
        else std::memcpy(at(b), s + done, m);
        done += m;
      }
    };
    if (fresh) std::fill(scratch.begin(), scratch.end(), 0.f);
    else pieces(true);
    fn(scratch.data());
    pieces(false);
  }
};

// x * sigmoid(x) in place, vectorized where the file's exp is.
inline void silu_inplace(float* x, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 one = _mm512_set1_ps(1.f);
  for (; i + 16 <= n; i += 16) {
    const __m512 xi = _mm512_loadu_ps(x + i);
    _mm512_storeu_ps(x + i, _mm512_div_ps(xi, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), xi)))));
  }
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 one = _mm256_set1_ps(1.f);
  for (; i + 8 <= n; i += 8) {
    const __m256 xi = _mm256_loadu_ps(x + i);
    _mm256_storeu_ps(x + i, _mm256_div_ps(xi, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), xi)))));
  }
#endif
  for (; i < n; ++i) x[i] = x[i] / (1.f + std::exp(-x[i]));
}

// k_s = k^T S and q_s = q^T S over S [dk, dv] (rows of dv), read once for both: columns in strips
// whose two accumulators stay in registers.
inline void state_products(const float* S, const float* q, const float* k, int64_t dk, int64_t dv, float* q_s,
                           float* k_s) {
  int64_t j = 0;
#if defined(__AVX512F__)
  for (; j + 64 <= dv; j += 64) {
    __m512 aq[4], ak[4];
    for (int u = 0; u < 4; ++u) aq[u] = ak[u] = _mm512_setzero_ps();
    for (int64_t i = 0; i < dk; ++i) {
      const float* row = S + i * dv + j;
      const __m512 qi = _mm512_set1_ps(q[i]), ki = _mm512_set1_ps(k[i]);
      for (int u = 0; u < 4; ++u) {
        const __m512 r = _mm512_loadu_ps(row + 16 * u);
        aq[u] = _mm512_fmadd_ps(qi, r, aq[u]);
        ak[u] = _mm512_fmadd_ps(ki, r, ak[u]);
      }
    }
    for (int u = 0; u < 4; ++u) {
      _mm512_storeu_ps(q_s + j + 16 * u, aq[u]);
      _mm512_storeu_ps(k_s + j + 16 * u, ak[u]);
    }
  }
#elif defined(__AVX2__) && defined(__FMA__)
  for (; j + 32 <= dv; j += 32) {
    __m256 aq[4], ak[4];
    for (int u = 0; u < 4; ++u) aq[u] = ak[u] = _mm256_setzero_ps();
    for (int64_t i = 0; i < dk; ++i) {
      const float* row = S + i * dv + j;
      const __m256 qi = _mm256_set1_ps(q[i]), ki = _mm256_set1_ps(k[i]);
      for (int u = 0; u < 4; ++u) {
        const __m256 r = _mm256_loadu_ps(row + 8 * u);
        aq[u] = _mm256_fmadd_ps(qi, r, aq[u]);
        ak[u] = _mm256_fmadd_ps(ki, r, ak[u]);
      }
    }
    for (int u = 0; u < 4; ++u) {
      _mm256_storeu_ps(q_s + j + 8 * u, aq[u]);
      _mm256_storeu_ps(k_s + j + 8 * u, ak[u]);
    }
  }
#endif
  for (int64_t c = j; c < dv; ++c) q_s[c] = k_s[c] = 0.f;
  for (int64_t i = 0; i < dk; ++i) {
    const float* row = S + i * dv;
#pragma omp simd
    for (int64_t c = j; c < dv; ++c) {
      q_s[c] += q[i] * row[c];
      k_s[c] += k[i] * row[c];
    }
  }
}

inline float sum_of_squares(const float* x, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += x[i] * x[i];
  return s;
}

// proj: [N, C + Hv dv + 2 Hv] float32, in_proj's output for N decode tokens, one per sequence
// (qkv, z, b, a); conv_weight [C, K]; A_log, dt_bias [Hv]; norm_weight [dv]. The states: each
// sequence's `block_ids` row in k_cache / v_cache (any dtype: the bytes), `fresh` the rows that
// start from zeros. Does the convolution's one-token step (its state shifted), SiLU, the q/k
// l2norms and q's scale, g and beta, the delta rule (S updated) and the gated RMSNorm, and
// returns [N, Hv dv] float32 with the heads in out_proj's column order (tiled: value head j of
// each key head's group at j * Hk + key head, llama.cpp's order). The same arithmetic as the
// torch path (layers/gated_delta_net.py), summed in other orders.
torch::Tensor gdn_decode_step(torch::Tensor proj, torch::Tensor conv_weight, torch::Tensor A_log,
                              torch::Tensor dt_bias, torch::Tensor norm_weight, double eps, torch::Tensor k_cache,
                              torch::Tensor v_cache, torch::Tensor block_ids, torch::Tensor fresh, int64_t Hk,
                              int64_t dk, int64_t dv, bool tiled) {
  for (const auto* t : {&proj, &conv_weight, &A_log, &dt_bias, &norm_weight})
    check_cpu_dtype(*t, "gdn_decode_step's float inputs", torch::kFloat);
  check_cpu_dtype(block_ids, "block_ids", torch::kLong);
  check_cpu_dtype(fresh, "fresh", torch::kLong);
  TORCH_CHECK(conv_weight.dim() == 2 && conv_weight.is_contiguous(), "conv_weight must be contiguous [C, K]");
  const int64_t N = proj.size(0), C = conv_weight.size(0), K = conv_weight.size(1);
  TORCH_CHECK(Hk > 0 && dk > 0 && dv > 0 && (C - 2 * Hk * dk) > 0 && (C - 2 * Hk * dk) % dv == 0,
              "conv channels ", C, " are not 2 Hk dk + Hv dv for Hk = ", Hk, ", dk = ", dk, ", dv = ", dv);
  const int64_t Hv = (C - 2 * Hk * dk) / dv, group = Hv / Hk;
  TORCH_CHECK(Hv % Hk == 0, "value heads ", Hv, " must be a multiple of key heads ", Hk);
  TORCH_CHECK(proj.dim() == 2 && proj.stride(1) == 1 && proj.size(1) == C + Hv * dv + 2 * Hv,
              "proj must be [N, ", C + Hv * dv + 2 * Hv, "] with contiguous rows, got ", proj.sizes());
  TORCH_CHECK(A_log.numel() == Hv && dt_bias.numel() == Hv && norm_weight.numel() == dv && A_log.is_contiguous() &&
                  dt_bias.is_contiguous() && norm_weight.is_contiguous(),
              "A_log, dt_bias must be [", Hv, "], norm_weight [", dv, "]");
  TORCH_CHECK(block_ids.dim() == 2 && block_ids.size(0) == N && block_ids.is_contiguous(),
              "block_ids must be contiguous [N, blocks] for N = ", N);
  TORCH_CHECK(k_cache.dim() >= 2 && v_cache.dim() >= 2 && k_cache.size(0) == v_cache.size(0) &&
                  k_cache.select(0, 0).is_contiguous() && v_cache.select(0, 0).is_contiguous() &&
                  k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "k_cache and v_cache must be CPU pools [num_blocks, ...] of contiguous blocks");
  const int64_t half = k_cache.select(0, 0).numel() * k_cache.element_size();
  TORCH_CHECK(half == v_cache.select(0, 0).numel() * v_cache.element_size() && half % 4 == 0,
              "a block's K and V parts must be the same number of bytes, a multiple of 4; got ", half);
  const int64_t conv_floats = C * (K - 1), state_bytes = (conv_floats + Hv * dk * dv) * 4;
  TORCH_CHECK(2 * block_ids.size(1) * half >= state_bytes, "a state of ", state_bytes, " bytes does not fit in ",
              block_ids.size(1), " blocks of 2 x ", half, " bytes");
  const int64_t num_blocks = k_cache.size(0), nb = block_ids.size(1);
  const int64_t* ids = block_ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < N * nb; ++i)
    TORCH_CHECK(ids[i] >= 0 && ids[i] < num_blocks, "block id ", ids[i], " outside the pool's ", num_blocks);
  std::vector<char> is_fresh(N, 0);
  for (int64_t i = 0; i < fresh.numel(); ++i) {
    const int64_t r = fresh.data_ptr<int64_t>()[i];
    TORCH_CHECK(r >= 0 && r < N, "fresh row ", r, " outside the step's ", N, " sequences");
    is_fresh[r] = 1;
  }
  auto seq_state = [&](int64_t n) {
    return PooledState{static_cast<uint8_t*>(k_cache.data_ptr()), static_cast<uint8_t*>(v_cache.data_ptr()),
                       k_cache.stride(0) * k_cache.element_size(), v_cache.stride(0) * v_cache.element_size(), half,
                       ids + n * nb};
  };
  const float* P = proj.data_ptr<float>();
  const int64_t prow = proj.stride(0);
  const float* W = conv_weight.data_ptr<float>();

  // The convolution and SiLU, in strips of channels: conv[n] = silu(w . [state, x]).
  auto conv = torch::empty({N, C}, proj.options());
  float* X = conv.data_ptr<float>();
  constexpr int64_t kStrip = 1024;
  const int64_t strips = (C + kStrip - 1) / kStrip;
  at::parallel_for(0, N * strips, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n = item / strips, c0 = item % strips * kStrip, c1 = std::min(C, c0 + kStrip);
      const float* x = P + n * prow;
      float* o = X + n * C;
      seq_state(n).with_span(c0 * (K - 1), (c1 - c0) * (K - 1), is_fresh[n], scratch, [&](float* st) {
        for (int64_t c = c0; c < c1; ++c) {
          float* s = st + (c - c0) * (K - 1);
          const float* w = W + c * K;
          float acc = w[K - 1] * x[c];
          for (int64_t j = 0; j < K - 1; ++j) acc += w[j] * s[j];
          for (int64_t j = 0; j + 1 < K - 1; ++j) s[j] = s[j + 1];
          if (K > 1) s[K - 2] = x[c];
          o[c] = acc;
        }
      });
      silu_inplace(o + c0, c1 - c0);
    }
  });

  // The delta rule and the gated norm, per (sequence, value head).
  auto out = torch::empty({N, Hv * dv}, proj.options());
  float* O = out.data_ptr<float>();
  const float *alog = A_log.data_ptr<float>(), *dtb = dt_bias.data_ptr<float>(), *nw = norm_weight.data_ptr<float>();
  const float q_scale = 1.f / std::sqrt(static_cast<float>(dk)), feps = static_cast<float>(eps);
  at::parallel_for(0, N * Hv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch, buf(2 * dk + 3 * dv);
    float *q = buf.data(), *k = q + dk, *q_s = k + dk, *k_s = q_s + dv, *o = k_s + dv;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n = item / Hv, h = item % Hv, kh = h / group;
      const float* xn = X + n * C;
      const float *qx = xn + kh * dk, *kx = xn + Hk * dk + kh * dk, *v = xn + 2 * Hk * dk + h * dv;
      const float* z = P + n * prow + C + h * dv;
      const float b = P[n * prow + C + Hv * dv + h], a = P[n * prow + C + Hv * dv + Hv + h];
      // l2norm with transformers' eps, inside the square root; q also by dk^-1/2.
      const float qn = q_scale / std::sqrt(sum_of_squares(qx, dk) + 1e-6f);
      const float kn = 1.f / std::sqrt(sum_of_squares(kx, dk) + 1e-6f);
      float qk = 0.f;
      for (int64_t i = 0; i < dk; ++i) {
        q[i] = qx[i] * qn;
        k[i] = kx[i] * kn;
        qk += q[i] * k[i];
      }
      const float beta = 1.f / (1.f + std::exp(-b));
      const float ad = a + dtb[h];
      const float softplus = ad > 20.f ? ad : std::log1p(std::exp(ad));  // torch's threshold
      const float decay = std::exp(-std::exp(alog[h]) * softplus);
      seq_state(n).with_span(conv_floats + h * dk * dv, dk * dv, is_fresh[n], scratch, [&](float* S) {
        state_products(S, q, k, dk, dv, q_s, k_s);
        // delta = (v - decay k^T S) beta; o = q^T S' = decay q^T S + (q.k) delta; S' = decay S + k delta^T.
        float* delta = k_s;
#pragma omp simd
        for (int64_t c = 0; c < dv; ++c) {
          delta[c] = (v[c] - decay * k_s[c]) * beta;
          o[c] = decay * q_s[c] + qk * delta[c];
        }
        for (int64_t i = 0; i < dk; ++i) {
          float* row = S + i * dv;
          const float ki = k[i];
#pragma omp simd
          for (int64_t c = 0; c < dv; ++c) row[c] = row[c] * decay + ki * delta[c];
        }
      });
      // The gated RMSNorm: normalised, scaled by the weight, times silu(z).
      const float inv = 1.f / std::sqrt(sum_of_squares(o, dv) / static_cast<float>(dv) + feps);
      const int64_t at_col = (tiled ? (h % group) * Hk + kh : h) * dv;
      float* dst = O + n * Hv * dv + at_col;
      for (int64_t c = 0; c < dv; ++c) dst[c] = z[c];
      silu_inplace(dst, dv);
#pragma omp simd
      for (int64_t c = 0; c < dv; ++c) dst[c] *= nw[c] * (o[c] * inv);
    }
  });
  return out;
}

// The kernels run without the GIL (as torch's own operators do): a server's event loop thread
// streams its responses while a step's products and attention run, instead of waiting for them.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "paged attention of query tokens (CPU; float32 q, float32, bfloat16 or 8-bit K/V)",
        py::call_guard<py::gil_scoped_release>());
  m.def("store_kv", &store_kv, "write K/V rows into the paged cache: as its float dtype, or 8-bit codes and a scale (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("row_logsumexp", &row_logsumexp,
        "{logsumexp of each row, in an order that does not depend on the batch; the index of its maximum} (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("rotary_embedding_", &rotary_embedding_, "rotate-half RoPE on q and k, in place (CPU, float32 or bfloat16)",
        py::call_guard<py::gil_scoped_release>());
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up (CPU, float32 or bfloat16)",
        py::call_guard<py::gil_scoped_release>());
  m.def("decode_attention_qkv", &decode_attention_qkv,
        "a decode step's q/k norms, RoPE, K/V store and paged attention from the fused q/k/v projection (CPU)",
        py::arg("qkv"), py::arg("H"), py::arg("KVH"), py::arg("cos"), py::arg("sin"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("slots"), py::arg("block_tables"), py::arg("seq_lens"), py::arg("scale"),
        py::arg("window"), py::arg("chunk"), py::arg("softcap"), py::arg("sinks"), py::arg("kv_format"),
        py::arg("q_norm"), py::arg("k_norm"), py::arg("norm_eps"), py::arg("norm_per_head"),
        py::arg("token_seq") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("add_rms_norm", &add_rms_norm, "x + h and the RMSNorm of it, in one call (CPU, float32 or bfloat16)",
        py::call_guard<py::gil_scoped_release>());
  m.def("gdn_decode_step", &gdn_decode_step,
        "Gated DeltaNet's decode step from in_proj's output, its states updated where they lie in the pool (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, "RMSNorm of float32 or bfloat16 rows, as the reference rounds it (CPU)",
        py::call_guard<py::gil_scoped_release>());
  // From how many query heads per KV head a model's bfloat16 or 8-bit cache is read by
  // attend_run_lanes: set_attention_lanes_from(n) sets it for every head size (0: the built-in
  // crossovers) and returns the previous setting (None in builds without AVX-512, which have only
  // attend_run).
  m.def("set_attention_lanes_from", [](int64_t n) -> std::optional<int64_t> {
#if defined(__AVX512F__)
    TORCH_CHECK(n >= 0, "set_attention_lanes_from: n must be >= 0 (0: the built-in crossovers), got ", n);
    return lanes_override.exchange(n);
#else
    (void)n;
    return std::nullopt;
#endif
  });
}

// Matrix products that read GGUF-quantized weights in their blocks (CPU).
//
// A weight is stored as llama.cpp stores it: [N rows] x [row_bytes], each row a run of blocks
// of 32 (Q4_0, Q4_1, Q8_0) or 256 (Q4_K, Q5_K, Q6_K) values with their scales. Nothing here
// ever holds the dense [N, K] matrix:
//
// - gguf_matmul: y = x @ W^T for a few rows of x (decode steps). Each thread takes a range of
//   W's rows; a block is widened to float32 in a small on-stack buffer (L1) and multiplied
//   into one accumulator per row of x while it is hot, so W streams from memory once per step
//   whatever the batch. The arithmetic is float32 (no activation rounding), so the product
//   equals the dense float32 one up to summation order.
// - gguf_dequantize_rows: chosen rows of W as dense float32 or bfloat16 rows: the token
//   embedding's lookup, and a tile of W for larger batches, where the Python side multiplies
//   tile by tile with torch's GEMM (compute-bound there, so widening a tile costs little).
//
// The block layouts (and their dequantization formulas) are ggml's; the tests check every
// type against gguf-py's reference dequantization.
#include <torch/extension.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

namespace {

// GGML type ids (gguf.GGMLQuantizationType).
enum : int64_t { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };
constexpr int QK_K = 256;

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(bits);
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

void dequant_q4_k(const uint8_t* b, float* y) {
  const float d = half_at(b), dmin = half_at(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* q = b + 16;
  for (int j = 0; j < 4; ++j) {  // 64 values: two sub-blocks sharing 32 bytes (low, high nibbles)
    uint8_t sc, m;
    scale_min_k4(2 * j, scales, &sc, &m);
    const float d1 = d * sc, m1 = dmin * m;
    scale_min_k4(2 * j + 1, scales, &sc, &m);
    const float d2 = d * sc, m2 = dmin * m;
    for (int l = 0; l < 32; ++l) y[l] = d1 * static_cast<float>(q[l] & 0x0F) - m1;
    for (int l = 0; l < 32; ++l) y[l + 32] = d2 * static_cast<float>(q[l] >> 4) - m2;
    q += 32;
    y += 64;
  }
}

void dequant_q5_k(const uint8_t* b, float* y) {
  const float d = half_at(b), dmin = half_at(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* ql = b + 48;
  for (int j = 0; j < 4; ++j) {
    uint8_t sc, m;
    scale_min_k4(2 * j, scales, &sc, &m);
    const float d1 = d * sc, m1 = dmin * m;
    scale_min_k4(2 * j + 1, scales, &sc, &m);
    const float d2 = d * sc, m2 = dmin * m;
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

struct Format {
  int block;        // values per block
  int bytes;        // bytes per block
  void (*dequant)(const uint8_t*, float*);
};

Format format_of(int64_t qtype) {
  switch (qtype) {
    case Q4_0: return {32, 18, dequant_q4_0};
    case Q4_1: return {32, 20, dequant_q4_1};
    case Q8_0: return {32, 34, dequant_q8_0};
    case Q4_K: return {QK_K, 144, dequant_q4_k};
    case Q5_K: return {QK_K, 176, dequant_q5_k};
    case Q6_K: return {QK_K, 210, dequant_q6_k};
  }
  TORCH_CHECK(false, "GGUF type ", qtype, " has no CPU kernel");
}

Format checked(const torch::Tensor& w, int64_t qtype, int64_t K) {
  const Format f = format_of(qtype);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(),
              "quantized weight: a contiguous uint8 [rows, row_bytes] tensor expected");
  TORCH_CHECK(K % f.block == 0 && w.size(1) == K / f.block * f.bytes,
              "quantized weight: ", w.size(1), " bytes per row do not hold ", K, " values of type ", qtype);
  return f;
}

// acc += a[0:n] * b[0:n], n a multiple of 16 (32 or 256 here).
#if defined(__AVX512F__)
inline void fma_into(__m512& acc, const float* a, const float* b, int n) {
  for (int i = 0; i < n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
}
#endif

// Rows [n0, n1) of y = x @ W^T for x: [M, K] float32, M <= kMaxRows.
constexpr int kMaxRows = 8;

void matmul_rows(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes, const Format& f,
                 float* y, int64_t N, int64_t n0, int64_t n1) {
  alignas(64) float tmp[QK_K];
  const int64_t blocks = K / f.block;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
#if defined(__AVX512F__)
    __m512 acc[kMaxRows];
    for (int64_t m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      f.dequant(row + b * f.bytes, tmp);
      const float* xb = x + b * f.block;
      for (int64_t m = 0; m < M; ++m) fma_into(acc[m], tmp, xb + m * K, f.block);
    }
    for (int64_t m = 0; m < M; ++m) y[m * N + n] = _mm512_reduce_add_ps(acc[m]);
#else
    float acc[kMaxRows] = {0};
    for (int64_t b = 0; b < blocks; ++b) {
      f.dequant(row + b * f.bytes, tmp);
      const float* xb = x + b * f.block;
      for (int64_t m = 0; m < M; ++m) {
        float s = 0.f;
        for (int i = 0; i < f.block; ++i) s += tmp[i] * xb[m * K + i];
        acc[m] += s;
      }
    }
    for (int64_t m = 0; m < M; ++m) y[m * N + n] = acc[m];
#endif
  }
}

}  // namespace

// x: [M, K] float32; w: [N, row_bytes] uint8 blocks. Returns x @ W^T: [M, N] float32.
torch::Tensor gguf_matmul(const torch::Tensor& x_in, const torch::Tensor& w, int64_t qtype, int64_t K) {
  const Format f = checked(w, qtype, K);
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == K, "gguf_matmul: x must be [M, ", K, "]");
  const torch::Tensor x = x_in.to(torch::kFloat32).contiguous();
  const int64_t M = x.size(0), N = w.size(0), row_bytes = w.size(1);
  torch::Tensor y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  // Rows of x in groups of kMaxRows (one accumulator register each); W's rows split over threads.
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
    const int64_t mb = std::min<int64_t>(kMaxRows, M - m0);
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      matmul_rows(xp + m0 * K, mb, K, wp, row_bytes, f, yp + m0 * N, N, n0, n1);
    });
  }
  return y;
}

// Rows `rows` (int64 [R]) of the quantized matrix as dense [R, K] rows of `dtype` (float32 or bfloat16).
torch::Tensor gguf_dequantize_rows(const torch::Tensor& w, int64_t qtype, int64_t K, const torch::Tensor& rows_in,
                                   torch::ScalarType dtype) {
  const Format f = checked(w, qtype, K);
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16, "gguf_dequantize_rows: float32 or bfloat16");
  const torch::Tensor rows = rows_in.to(torch::kInt64).contiguous();
  const int64_t R = rows.numel(), N = w.size(0), row_bytes = w.size(1), blocks = K / f.block;
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) TORCH_CHECK(rp[r] >= 0 && rp[r] < N, "row ", rp[r], " out of range [0, ", N, ")");
  torch::Tensor out = torch::empty({R, K}, w.options().dtype(dtype));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  at::parallel_for(0, R, 4, [&](int64_t r0, int64_t r1) {
    alignas(64) float tmp[QK_K];
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* row = wp + rp[r] * row_bytes;
      if (dtype == torch::kFloat32) {
        float* dst = out.data_ptr<float>() + r * K;
        for (int64_t b = 0; b < blocks; ++b) f.dequant(row + b * f.bytes, dst + b * f.block);
      } else {
        at::BFloat16* dst = out.data_ptr<at::BFloat16>() + r * K;
        for (int64_t b = 0; b < blocks; ++b) {
          f.dequant(row + b * f.bytes, tmp);
          for (int i = 0; i < f.block; ++i) dst[b * f.block + i] = static_cast<at::BFloat16>(tmp[i]);
        }
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gguf_matmul", &gguf_matmul, "x @ W^T with W in GGUF blocks (CPU, float32; a few rows of x)");
  m.def("gguf_dequantize_rows", &gguf_dequantize_rows, "chosen rows of a GGUF-quantized matrix, dense (CPU)");
}

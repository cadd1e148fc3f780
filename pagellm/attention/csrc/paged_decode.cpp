// Paged decode attention for the CPU: one query token per sequence, K/V read in
// place through the block table. The torch path has to gather every sequence's
// blocks into a padded copy first (a write and a second read of all K/V); reading
// the blocks where they lie moves a third of the bytes and skips the padding.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

inline void axpy(float* __restrict y, float a, const float* __restrict x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

}  // namespace

// q: [B, H, D]; k_cache, v_cache: [num_blocks, block_size, KVH, D]; block_tables: [B, max_blocks]
// (int64); seq_lens: [B] (int64). Returns [B, H, D]. All float32, contiguous.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat && k_cache.scalar_type() == torch::kFloat, "float32 only");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2);
  const int64_t G = H / KVH, max_blocks = block_tables.size(1);
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* sl = seq_lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t row = KVH * D;  // floats between consecutive token slots
  const float fscale = static_cast<float>(scale);

  // One work item = one sequence and one KV head with the G query heads that share it,
  // so each K/V row is loaded once for all of them.
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / KVH, h = item % KVH;
      const int64_t len = sl[b];
      scores.assign(static_cast<size_t>(G * len), 0.f);
      const float* qh = qp + (b * H + h * G) * D;
      for (int64_t t = 0; t < len; ++t) {
        const int64_t slot = bt[b * max_blocks + t / BS] * BS + t % BS;
        const float* k = kp + slot * row + h * D;
        for (int64_t g = 0; g < G; ++g) scores[g * len + t] = dot(qh + g * D, k, D) * fscale;
      }
      float* o = op + (b * H + h * G) * D;
      for (int64_t g = 0; g < G; ++g) {
        float* s = scores.data() + g * len;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < len; ++t) mx = std::max(mx, s[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) {
          s[t] = std::exp(s[t] - mx);
          sum += s[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; ++t) s[t] *= inv;
        std::fill(o + g * D, o + (g + 1) * D, 0.f);
      }
      for (int64_t t = 0; t < len; ++t) {
        const int64_t slot = bt[b * max_blocks + t / BS] * BS + t % BS;
        const float* v = vp + slot * row + h * D;
        for (int64_t g = 0; g < G; ++g) axpy(o + g * D, scores[g * len + t], v, D);
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention (CPU, float32)");
}

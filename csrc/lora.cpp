#include "lora.h"

#include <algorithm>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TM_LORA_SIMD 1
#endif

namespace tm_lora {

constexpr int64_t kColumns = 64;  // output columns one task accumulates (in registers on the vector paths)

// x . y over n floats.
inline float dot(const float* x, const float* y, int64_t n) {
  int64_t i = 0;
  float total = 0.f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i), acc);
  total = _mm512_reduce_add_ps(acc);
#elif defined(TM_LORA_SIMD)
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), _mm256_loadu_ps(y + i + 8), acc1);
  }
  const __m256 acc = _mm256_add_ps(acc0, acc1);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  total = _mm_cvtss_f32(h);
#endif
  for (; i < n; ++i) total += x[i] * y[i];
  return total;
}

// acc[0 .. n) += h * y[0 .. n).
inline void axpy(float* acc, float h, const float* y, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 hv = _mm512_set1_ps(h);
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(hv, _mm512_loadu_ps(y + i), _mm512_loadu_ps(acc + i)));
#elif defined(TM_LORA_SIMD)
  const __m256 hv = _mm256_set1_ps(h);
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(hv, _mm256_loadu_ps(y + i), _mm256_loadu_ps(acc + i)));
#endif
  for (; i < n; ++i) acc[i] += h * y[i];
}

template <typename T>
const T* checked(const torch::Tensor& t, c10::ScalarType type, int64_t dim, const char* what) {
  TORCH_CHECK(t.scalar_type() == type && t.is_contiguous() && t.dim() == dim && t.device().is_cpu(), what,
              ": a contiguous CPU tensor of ", dim, " dimensions and type ", type);
  return t.data_ptr<T>();
}

}  // namespace tm_lora

// x: [T, K]; a: [S, R, K] (slot s's shrink factors, every shard's stacked); b: [S, R, N] (rank row r's
// expand factors over the outputs); shard_offsets: [shards + 1] output columns of each shard, whose rank
// rows are R / shards consecutive ones (the other columns of those rows are zero and skipped); segments:
// rows seg_starts[g] .. seg_starts[g + 1] run slot seg_slots[g] (-1: the base model, untouched) scaled by
// seg_scales[g]. out: [T, N] += scale * (x A^T) B, accumulated in float32: first every row's x A^T (the
// shrink), then per row and block of output columns the sum over rank rows (the expand), added once.
void lora_add(torch::Tensor x, torch::Tensor a, torch::Tensor b, torch::Tensor shard_offsets, torch::Tensor seg_starts,
              torch::Tensor seg_slots, torch::Tensor seg_scales, torch::Tensor out) {
  using tm_lora::checked;
  const float* xp = checked<float>(x, torch::kFloat, 2, "lora x");
  const float* ap = checked<float>(a, torch::kFloat, 3, "lora a");
  const float* bp = checked<float>(b, torch::kFloat, 3, "lora b");
  float* op = const_cast<float*>(checked<float>(out, torch::kFloat, 2, "lora out"));
  const int64_t* offsets = checked<int64_t>(shard_offsets, torch::kLong, 1, "lora shard_offsets");
  const int64_t* starts = checked<int64_t>(seg_starts, torch::kLong, 1, "lora seg_starts");
  const int64_t* slots = checked<int64_t>(seg_slots, torch::kLong, 1, "lora seg_slots");
  const float* scales = checked<float>(seg_scales, torch::kFloat, 1, "lora seg_scales");
  const int64_t T = x.size(0), K = x.size(1), S = a.size(0), R = a.size(1), N = b.size(2);
  const int64_t G = seg_slots.size(0), shards = shard_offsets.size(0) - 1;
  TORCH_CHECK(a.size(2) == K && b.size(0) == S && b.size(1) == R && out.size(0) == T && out.size(1) == N,
              "lora: x [T, K], a [S, R, K], b [S, R, N] and out [T, N] do not agree");
  TORCH_CHECK(shards > 0 && R % shards == 0 && offsets[0] == 0 && offsets[shards] == N,
              "lora: shard_offsets must split the N outputs among shards that divide the R rank rows");
  TORCH_CHECK(seg_starts.size(0) == G + 1 && seg_scales.size(0) == G && starts[0] == 0 && starts[G] == T,
              "lora: segments must cover the T rows (seg_starts [G + 1], seg_slots and seg_scales [G])");
  std::vector<int64_t> slot_of(T, -1);  // each row's slot
  std::vector<float> scale_of(T, 0.f);
  for (int64_t g = 0; g < G; ++g) {
    TORCH_CHECK(starts[g] <= starts[g + 1] && slots[g] >= -1 && slots[g] < S, "lora: segment ", g,
                " has rows out of order or a slot out of range");
    std::fill(slot_of.begin() + starts[g], slot_of.begin() + starts[g + 1], slots[g]);
    std::fill(scale_of.begin() + starts[g], scale_of.begin() + starts[g + 1], scales[g]);
  }
  std::vector<float> h(T * R);  // the shrink: x A^T per row
  at::parallel_for(0, T * R, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / R, r = i % R, s = slot_of[t];
      h[i] = s < 0 ? 0.f : tm_lora::dot(xp + t * K, ap + (s * R + r) * K, K);
    }
  });
  const int64_t blocks = (N + tm_lora::kColumns - 1) / tm_lora::kColumns, rank = R / shards;
  at::parallel_for(0, T * blocks, 4, [&](int64_t begin, int64_t end) {
    float acc[tm_lora::kColumns];
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / blocks, n0 = i % blocks * tm_lora::kColumns, n1 = std::min(N, n0 + tm_lora::kColumns);
      const int64_t s = slot_of[t];
      if (s < 0) continue;
      std::fill(acc, acc + (n1 - n0), 0.f);
      for (int64_t j = 0; j < shards; ++j) {
        const int64_t lo = std::max(n0, offsets[j]), hi = std::min(n1, offsets[j + 1]);
        for (int64_t r = j * rank; lo < hi && r < (j + 1) * rank; ++r) {
          const float hr = h[t * R + r];
          if (hr != 0.f) tm_lora::axpy(acc + (lo - n0), hr, bp + (s * R + r) * N + lo, hi - lo);
        }
      }
      float* o = op + t * N;
      const float scale = scale_of[t];
      for (int64_t n = n0; n < n1; ++n) o[n] += acc[n - n0] * scale;
    }
  });
}

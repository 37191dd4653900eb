#include "fp8_matmul.h"

#include <algorithm>
#include <cstdint>

#include "fp8.h"

namespace tm_fp8 {

// One e4m3 byte as float, exactly: paged_attention's fp8 conversion (integer exponent arithmetic, so
// no float32 subnormal appears for the runner's flush-to-zero to drop).
inline float e4m3_to_float(uint8_t b) { return fp8_to_f32<4, 3>(b); }

#ifdef TM_FP8_SIMD
// Eight e4m3 bytes at p as eight floats, exactly.
inline __m256 e4m3x8(const uint8_t* p) { return fp8x8<4, 3>(p); }

inline float hsum(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}
#endif

// out[r * N] = x[r] . (w * s) for ROWS activation rows (x row stride K), one weight row w of K bytes
// with scales s per `group` columns.
template <int ROWS>
void rows_dot(const float* x, int64_t K, const uint8_t* w, const float* s, int64_t group, float* out, int64_t N) {
  float total[ROWS] = {};
  for (int64_t g0 = 0, gi = 0; g0 < K; g0 += group, ++gi) {
    const int64_t g1 = std::min(K, g0 + group);
    const float scale = s[gi];
    int64_t j = g0;
#ifdef TM_FP8_SIMD
    if (g1 - g0 >= 8) {
      const __m256 sv = _mm256_set1_ps(scale);
      __m256 acc[ROWS];
      for (int r = 0; r < ROWS; ++r) acc[r] = _mm256_setzero_ps();
      for (; j + 8 <= g1; j += 8) {
        const __m256 wv = _mm256_mul_ps(e4m3x8(w + j), sv);
        for (int r = 0; r < ROWS; ++r) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + j), wv, acc[r]);
      }
      for (int r = 0; r < ROWS; ++r) total[r] += hsum(acc[r]);
    }
#endif
    for (; j < g1; ++j) {
      const float wj = e4m3_to_float(w[j]) * scale;
      for (int r = 0; r < ROWS; ++r) total[r] += x[r * K + j] * wj;
    }
  }
  for (int r = 0; r < ROWS; ++r) out[r * N] = total[r];
}

// A weight and its scales, checked: row n's bytes at w + n * K, its scales at s + n * G.
struct Weight {
  const uint8_t* w;
  const float* s;
  int64_t N, K, G, group;
};

Weight weight_of(const torch::Tensor& weight, const torch::Tensor& scales, int64_t group) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kByte && weight.is_contiguous(),
              "fp8 weight: a contiguous uint8 [N, K] tensor");
  TORCH_CHECK(group > 0 && scales.scalar_type() == torch::kFloat && scales.is_contiguous() &&
                  scales.size(0) == weight.size(0) && scales.size(1) == (weight.size(1) + group - 1) / group,
              "fp8 scales: a contiguous float32 [N, ceil(K / group)] tensor");
  return {weight.data_ptr<uint8_t>(), scales.data_ptr<float>(), weight.size(0), weight.size(1), scales.size(1), group};
}

// A contiguous float32 [rows, cols] tensor's data, or an error naming it.
template <typename T>
T* floats(const torch::Tensor& t, int64_t rows, int64_t cols, const char* what) {
  TORCH_CHECK(
      t.scalar_type() == torch::kFloat && t.is_contiguous() && t.dim() == 2 && t.size(0) == rows && t.size(1) == cols,
      what, ": a contiguous float32 [", rows, ", ", cols, "] tensor");
  return t.data_ptr<float>();
}

}  // namespace tm_fp8

// x: [M, K] float32 (contiguous); out: [M, N] float32 = x @ (weight * scales).T
void fp8_matmul(torch::Tensor x, torch::Tensor weight, torch::Tensor scales, int64_t group, torch::Tensor out) {
  const tm_fp8::Weight W = tm_fp8::weight_of(weight, scales, group);
  const int64_t M = x.size(0), K = W.K, N = W.N;
  const float* xp = tm_fp8::floats<const float>(x, M, K, "fp8_matmul x");
  float* op = tm_fp8::floats<float>(out, M, N, "fp8_matmul out");
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* w = W.w + n * K;
      if (n + 8 < end)
        for (int64_t b = 0; b < K; b += 64) __builtin_prefetch(w + 8 * K + b);
      int64_t i = 0;
      for (; i + 4 <= M; i += 4) tm_fp8::rows_dot<4>(xp + i * K, K, w, W.s + n * W.G, group, op + i * N + n, N);
      for (; i < M; ++i) tm_fp8::rows_dot<1>(xp + i * K, K, w, W.s + n * W.G, group, op + i * N + n, N);
    }
  });
}

// out: [N, K] float32, weight * scales (each value one float32 product).
void fp8_dequantize(torch::Tensor weight, torch::Tensor scales, int64_t group, torch::Tensor out) {
  const tm_fp8::Weight W = tm_fp8::weight_of(weight, scales, group);
  const int64_t K = W.K, G = W.G;
  const uint8_t* wp = W.w;
  const float* sp = W.s;
  float* op = tm_fp8::floats<float>(out, W.N, K, "fp8_dequantize out");
  at::parallel_for(0, W.N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* w = wp + n * K;
      float* o = op + n * K;
      for (int64_t g0 = 0, gi = 0; g0 < K; g0 += group, ++gi) {
        const int64_t g1 = std::min(K, g0 + group);
        const float scale = sp[n * G + gi];
        int64_t j = g0;
#ifdef TM_FP8_SIMD
        const __m256 sv = _mm256_set1_ps(scale);
        for (; j + 8 <= g1; j += 8) _mm256_storeu_ps(o + j, _mm256_mul_ps(tm_fp8::e4m3x8(w + j), sv));
#endif
        for (; j < g1; ++j) o[j] = tm_fp8::e4m3_to_float(w[j]) * scale;
      }
    }
  });
}

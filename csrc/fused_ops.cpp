#include "fused_ops.h"

#include <algorithm>
#include <cmath>

#include "vec_math.h"

// x: [T, H] contiguous. With residual: x += residual first (x then holds the new residual).
// out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * weight.
void add_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight, double eps,
                  torch::Tensor out) {
  const int64_t T = x.size(0), H = x.size(1);
  float* xp = x.data_ptr<float>();
  const float* rp = residual ? residual->data_ptr<float>() : nullptr;
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* row = xp + t * H;
      if (rp) {
        const float* r = rp + t * H;
#pragma omp simd
        for (int64_t i = 0; i < H; ++i) row[i] += r[i];
      }
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < H; ++i) ss += row[i] * row[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + static_cast<float>(eps));
      float* o = op + t * H;
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) o[i] = wp[i] * (row[i] * inv);
    }
  });
}

// x: [T, heads, D] with a contiguous last dim (any token/head strides); its first R features a head rotated
// in place with the rotate-half layout (R < D: partial rotary, the rest kept). cos_sin: [2, max_positions,
// R] contiguous; positions: [T] int64.
void rotary_inplace(torch::Tensor x, torch::Tensor positions, torch::Tensor cos_sin) {
  const int64_t T = x.size(0), NH = x.size(1), D = cos_sin.size(2), half = D / 2;  // D: R, the table's width
  const int64_t st = x.stride(0), sh = x.stride(1), P = cos_sin.size(1);
  TORCH_CHECK(cos_sin.dim() == 3 && cos_sin.size(0) == 2 && cos_sin.is_contiguous() && D % 2 == 0 &&
                  D <= x.size(2) && x.stride(2) == 1,
              "rotary_inplace: a [2, positions, D] table, D even and at most the head's size");
  float* xp = x.data_ptr<float>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cp = cos_sin.data_ptr<float>();
  const float* sp = cp + P * D;
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + pos[t] * D;
      const float* s = sp + pos[t] * D;
      for (int64_t h = 0; h < NH; ++h) {
        float* v = xp + t * st + h * sh;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = v[i], b = v[i + half];
          v[i] = a * c[i] - b * s[i];
          v[i + half] = b * c[i + half] + a * s[i + half];
        }
      }
    }
  });
}

// gate_up: [T, 2I] contiguous -> out [T, I] = act(gate) * up, act(g) = g / (1 + e^(-z(g))): SiLU (z = g) or
// GELU-tanh (z = 2 sqrt(2/pi) (g + 0.044715 g^3): 0.5 (1 + tanh(u)) is the logistic of 2u). e^x sixteen or
// eight lanes at a time where AVX-512 or AVX2 is (std::exp in the loop ran scalar, 1.4 ns an element, the
// chunk's biggest elementwise cost); columns [first, last) only, for callers that split out over threads of
// their own. A column's result does not depend on the range it is in where 8 divides first and last (every
// lane takes the vector steps, 16 or 8 lanes alike).
namespace {

template <bool GELU>
void act_and_mul_columns(const torch::Tensor& gate_up, torch::Tensor& out, int64_t first, int64_t last) {
  const int64_t T = out.size(0), I = out.size(1);
  TORCH_CHECK(gate_up.is_contiguous() && out.is_contiguous() && gate_up.size(0) == T && gate_up.size(1) == 2 * I &&
                  0 <= first && first <= last && last <= I,
              "act_and_mul: gate_up [T, 2I] and out [T, I] contiguous float32, columns within I");
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  constexpr float kA = 1.5957691216057308f, kB = 0.044715f;  // 2 sqrt(2 / pi)
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* g = gp + t * 2 * I;
      const float* u = g + I;
      float* o = op + t * I;
      int64_t i = first;
#if defined(TM_VEC_MATH) && defined(__AVX512F__)
      for (; i + 16 <= last; i += 16) {  // exp16: the same steps as exp8, so the same bits lane for lane
        const __m512 gv = _mm512_loadu_ps(g + i);
        __m512 z = gv;
        if (GELU) z = _mm512_mul_ps(_mm512_set1_ps(kA), _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(kB), gv),
                                                                        _mm512_mul_ps(gv, gv), gv));
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), z));
        const __m512 act = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), e));
        _mm512_storeu_ps(o + i, _mm512_mul_ps(act, _mm512_loadu_ps(u + i)));
      }
#endif
#ifdef TM_VEC_MATH
      const __m256 one = _mm256_set1_ps(1.f);
      for (; i + 8 <= last; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        __m256 z = gv;
        if (GELU) z = _mm256_mul_ps(_mm256_set1_ps(kA), _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(kB), gv),
                                                                        _mm256_mul_ps(gv, gv), gv));
        const __m256 act = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), z))));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(act, _mm256_loadu_ps(u + i)));
      }
#endif
      for (; i < last; ++i) {
        const float z = GELU ? kA * std::fma(kB * g[i], g[i] * g[i], g[i]) : g[i];
        o[i] = g[i] / (1.f + std::exp(-z)) * u[i];
      }
    }
  });
}

}  // namespace

void silu_and_mul(torch::Tensor gate_up, torch::Tensor out) { silu_and_mul_columns(gate_up, out, 0, out.size(1)); }
void silu_and_mul_columns(const torch::Tensor& gate_up, torch::Tensor& out, int64_t first, int64_t last) {
  act_and_mul_columns<false>(gate_up, out, first, last);
}
void gelu_tanh_and_mul(torch::Tensor gate_up, torch::Tensor out) {
  gelu_tanh_and_mul_columns(gate_up, out, 0, out.size(1));
}
void gelu_tanh_and_mul_columns(const torch::Tensor& gate_up, torch::Tensor& out, int64_t first, int64_t last) {
  act_and_mul_columns<true>(gate_up, out, first, last);
}

namespace {

// The index of the first element of x[0, V) equal to `value` (one present).
int64_t first_equal(const float* x, int64_t V, float value) {
  int64_t i = 0;
#ifdef TM_VEC_MATH
  const __m256 v = _mm256_set1_ps(value);
  for (; i + 8 <= V; i += 8) {
    const int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), v, _CMP_EQ_OQ));
    if (hits) return i + __builtin_ctz(hits);
  }
#endif
  while (x[i] != value) ++i;
  return i;
}

int64_t argmax_row(const float* x, int64_t V) {
  float best = -INFINITY;
  bool nan = false;
  int64_t i = 0;
#ifdef TM_VEC_MATH
  __m256 m = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
  for (; i + 8 <= V; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    m = _mm256_max_ps(m, v);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  for (const float lane : lanes) best = std::max(best, lane);
  nan = _mm256_movemask_ps(unordered) != 0;
#endif
  for (; i < V; ++i) {
    nan |= std::isnan(x[i]);
    best = std::max(best, x[i]);
  }
  if (nan) return std::find_if(x, x + V, [](float e) { return std::isnan(e); }) - x;
  return first_equal(x, V, best);
}

}  // namespace

// x: [B, V] float32 contiguous -> out [B] int64: each row's index of its largest value, the first on
// ties, a NaN counting as the largest (as torch's max(dim) does). The greedy sampler's step on a
// vocabulary: torch's max(dim) with indices reads ~2 GB/s; here the maximum (SIMD), then the first
// index holding it (the row still in cache), rows across threads.
void row_argmax(torch::Tensor x, torch::Tensor out) {
  const int64_t B = x.size(0), V = x.size(1);
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) op[b] = argmax_row(xp + b * V, V);
  });
}

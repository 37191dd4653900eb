// What the attention kernels (paged_attention.cpp: decode; prefill_attention.cpp: prompt chunks) share:
// cache elements read as float32 (one at a time, or a vector's lanes at once) and the vector types they
// are written over (Ymm: AVX2's 8 lanes, Zmm: AVX-512's 16), each behind the #if of its instructions.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "fp8.h"
#include "prelude.h"
#include "vec_math.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

// The sums of eight vectors, as one vector (lane j = sum of a[j]).
inline __m256 hsum8(const __m256 a[8]) {
  const __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 lo = _mm256_hadd_ps(h01, h23), hi = _mm256_hadd_ps(h45, h67);
  return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}
#define TM_ATTN_SIMD 1
#endif

// f(element), element a value of the cache's element type, for each type the attention kernels read;
// `what` (the caller) names any other in its error.
template <typename F>
auto with_cache_element(at::ScalarType type, const char* what, F&& f) {
  switch (type) {
    case at::kHalf:
      return f(c10::Half());
    case at::kBFloat16:
      return f(c10::BFloat16());
    case at::kChar:
      return f(int8_t());
    case at::ScalarType::Float8_e4m3fn:
      return f(c10::Float8_e4m3fn());
    case at::ScalarType::Float8_e5m2:
      return f(c10::Float8_e5m2());
    default:
      TORCH_CHECK(type == at::kFloat, what, ": unsupported cache dtype");
      return f(float());
  }
}

// Cache elements: float32, or float16 / bfloat16 / int8 / fp8 read as float32 (int8 and fp8 before their scale).
inline float to_f32(float x) { return x; }
inline float to_f32(c10::Half x) { return static_cast<float>(x); }
inline float to_f32(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_f32(int8_t x) { return x; }
inline float to_f32(c10::Float8_e4m3fn x) { return fp8_to_f32<4, 3>(x.x); }
inline float to_f32(c10::Float8_e5m2 x) { return fp8_to_f32<5, 2>(x.x); }
#ifdef TM_ATTN_SIMD
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const c10::BFloat16* p) {  // a bfloat16 is the top half of a float32
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 load8(const c10::Float8_e4m3fn* p) { return fp8x8<4, 3>(p); }
inline __m256 load8(const c10::Float8_e5m2* p) { return fp8x8<5, 2>(p); }
#endif

// cap * tanh(s / cap) over n scores (Gemma 2's attention soft-cap); cap <= 0: unchanged.
inline void soft_cap(float* s, int64_t n, float cap) {
  if (cap <= 0.f) return;
  for (int64_t i = 0; i < n; ++i) s[i] = cap * std::tanh(s[i] / cap);
}

#ifdef TM_ATTN_SIMD
// The vectors the kernel is written over: 8 float32 lanes (AVX2), or 16 (AVX-512, below). load() reads
// kLanes cache elements as float32; sums8(a) (a: 8 vectors) is the 8-lane vector whose lane j is the sum of
// a[j]'s lanes.
struct Ymm {
  using V = __m256;
  static constexpr int kLanes = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, V a) { _mm256_storeu_ps(p, a); }
  template <typename T>
  static V load(const T* p) {
    return load8(p);
  }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V exp(V a) { return exp8(a); }
  static float reduce_add(V a) {
    const __m128 x = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 y = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(y, _mm_movehdup_ps(y)));
  }
  static float reduce_max(V a) {
    const __m128 x = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 y = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(y, _mm_movehdup_ps(y)));
  }
  static constexpr int kHeads = 1;  // group_scores' 8 sums a head: 8 of the 16 registers
  static __m256 sums8(const V a[8]) { return hsum8(a); }
};

#if defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__AVX512BW__)
struct Zmm {
  using V = __m512;
  static constexpr int kLanes = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, V a) { _mm512_storeu_ps(p, a); }
  template <typename T>  // fp8: two halves of eight
  static V load(const T* p) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(load8(p)), load8(p + 8), 1);
  }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static V load(const c10::BFloat16* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static V load(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V exp(V a) { return exp16(a); }
  static float reduce_add(V a) { return _mm512_reduce_add_ps(a); }
  static float reduce_max(V a) { return _mm512_reduce_max_ps(a); }
  static constexpr int kHeads = 3;  // group_scores' 8 sums a head: 24 of the 32 registers
  // The sums of eight vectors, a transpose by halving: pairs of vectors add their interleaved lanes (32-bit,
  // then 64-bit pairs within each 128-bit quarter), which leaves two vectors of four tokens' sums per
  // quarter; their quarters are then added across.
  static __m256 sums8(const V a[8]) {
    V x[4];
    for (int i = 0; i < 4; ++i)
      x[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    V y[2];
    for (int i = 0; i < 2; ++i) {
      const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(x[2 * i]), _mm512_castps_pd(x[2 * i + 1]));
      const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(x[2 * i]), _mm512_castps_pd(x[2 * i + 1]));
      y[i] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
    }
    // quarters (tokens 0-3 of quarters 0 + 2, of 1 + 3, tokens 4-7 of 0 + 2, of 1 + 3), then their halves added
    const V z = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x44), _mm512_shuffle_f32x4(y[0], y[1], 0xee));
    const __m256 lo = _mm512_castps512_ps256(z), hi = _mm512_extractf32x8_ps(z, 1);
    return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
  }
};
#define TM_ATTN_AVX512 1
#endif
#endif  // TM_ATTN_SIMD

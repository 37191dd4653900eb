// fp8 (e4m3, e5m2) bytes as float32, exactly: paged_attention reads fp8 KV caches with them and
// fp8_matmul its e4m3 weights.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

// An fp8 byte (sign, E exponent bits, M mantissa bits) as float32, subnormals included: computed as
// mantissa * 2^(exponent - bias - M), so no float32 subnormal appears (denormals-are-zero would flush it).
template <int E, int M>
inline float fp8_to_f32(uint8_t b) {
  const int e = (b >> M) & ((1 << E) - 1), m = b & ((1 << M) - 1);
  const float v = std::ldexp(static_cast<float>(e ? m | (1 << M) : m), std::max(e, 1) - ((1 << (E - 1)) - 1) - M);
  return b & 0x80 ? -v : v;
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TM_FP8_SIMD 1

template <int E, int M>  // fp8_to_f32 on eight bytes
inline __m256 fp8x8(const void* p) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i e = _mm256_and_si256(_mm256_srli_epi32(b, M), _mm256_set1_epi32((1 << E) - 1));
  const __m256i normal = _mm256_andnot_si256(_mm256_cmpeq_epi32(e, _mm256_setzero_si256()), _mm256_set1_epi32(1 << M));
  const __m256i mant = _mm256_or_si256(_mm256_and_si256(b, _mm256_set1_epi32((1 << M) - 1)), normal);
  const __m256i pow2 = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_max_epi32(e, _mm256_set1_epi32(1)), _mm256_set1_epi32(127 - ((1 << (E - 1)) - 1) - M)),
      23);
  const __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(mant), _mm256_castsi256_ps(pow2));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
  return _mm256_or_ps(v, _mm256_castsi256_ps(sign));
}
#endif

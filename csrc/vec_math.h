// Vectorized float32 math for the AVX2 and AVX-512 paths of the kernels: e^x for eight or sixteen lanes at
// once. The compilers do not vectorize std::exp here (that needs -ffast-math's libmvec), so a loop calling
// it runs scalar.
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TM_VEC_MATH 1

// Cephes' expf constants, shared by exp8 and exp16 (so their lanes agree): the clamp, log2(e), ln 2 in a
// high and a low part, and the polynomial's coefficients, highest degree first.
namespace vec_math {
constexpr float kExpClamp = 88.3762626647949f, kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpP[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                            4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
}  // namespace vec_math

// e^x for 8 floats (Cephes' expf: x = n ln2 + r, a degree-5 polynomial for e^r; ~1 ulp), x clamped to
// +-88.376 (so e^x stays finite and normal).
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(vec_math::kExpClamp)), _mm256_set1_ps(-vec_math::kExpClamp));
  __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(vec_math::kLog2e), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(vec_math::kLn2Hi), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(vec_math::kLn2Lo), x);
  __m256 y = _mm256_set1_ps(vec_math::kExpP[0]);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(vec_math::kExpP[1]));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(vec_math::kExpP[2]));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(vec_math::kExpP[3]));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(vec_math::kExpP[4]));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(vec_math::kExpP[5]));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(pow2n));
}

#if defined(__AVX512F__)
// exp8 over 16 lanes (the same steps, so the same results lane for lane).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(vec_math::kExpClamp)), _mm512_set1_ps(-vec_math::kExpClamp));
  __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(vec_math::kLog2e), _mm512_set1_ps(0.5f)),
                                  _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(vec_math::kLn2Hi), x);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(vec_math::kLn2Lo), x);
  __m512 y = _mm512_set1_ps(vec_math::kExpP[0]);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(vec_math::kExpP[1]));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(vec_math::kExpP[2]));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(vec_math::kExpP[3]));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(vec_math::kExpP[4]));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(vec_math::kExpP[5]));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.f)));
  const __m512i pow2n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(pow2n));
}
#endif
#endif

#include "block_quant.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <numeric>
#include <type_traits>
#include <utility>
#include <vector>

#include <omp.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TM_SIMD 1
#endif

namespace {

constexpr int64_t kSuper = 256;
constexpr int kE2M1 = -4;  // bits of FP4 e2m1 nibbles (see the module docstring)
constexpr int8_t kE2M1Codes[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};  // 12 + 2 * e2m1

#ifdef TM_SIMD
using Vec = __m256;
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vset1(float a) { return _mm256_set1_ps(a); }
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float hsum(Vec v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

// Per int32 lane, the sum of its four u8 x s8 byte products: VNNI's one instruction (vpdpbusd) where the
// CPU has it (AVX-512 VNNI or AVX-VNNI), else AVX2's maddubs (pairs into saturating int16) + madd.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define TM_VNNI 1
inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
#elif defined(__AVXVNNI__)
#define TM_VNNI 1
inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#endif
inline __m256i dot4(__m256i u, __m256i s) {
#ifdef TM_VNNI
  return dpbusd(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
// dot4(u0, s0) + dot4(u1, s1); AVX2 adds the int16 pair sums before widening them, so the callers keep
// each lane's four pairs within int16 (codes below 64 times |x| <= 127). The same sums on either path.
inline __m256i dot4x2(__m256i u0, __m256i s0, __m256i u1, __m256i s1) {
#ifdef TM_VNNI
  return dpbusd(dpbusd(_mm256_setzero_si256(), u0, s0), u1, s1);
#else
  return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(u0, s0), _mm256_maddubs_epi16(u1, s1)),
                           _mm256_set1_epi16(1));
#endif
}

#endif

// A float16 value as float (F16C's one-instruction conversion where the vector paths are built).
inline float to_float(c10::Half h) {
#ifdef TM_SIMD
  return _cvtsh_ss(h.x);
#else
  return static_cast<float>(h);
#endif
}
inline float to_float(int8_t v) { return static_cast<float>(v); }
inline float to_float(float v) { return v; }

#ifdef TM_SIMD
// Eight stored scales (float32, float16 or int8) as floats.
inline __m256 scale_vec(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 scale_vec(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 scale_vec(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
// The activation scales of blocks b..b+7 (one per 32 values: blocks of 16 share them in pairs).
inline __m256 block_dx(const float* dx, int64_t b, int64_t bs) {
  return bs == 32 ? _mm256_loadu_ps(dx + b)
                  : _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(dx + b / 2)),
                                             _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
}
#endif

// A packed weight (see the Python module's docstring); pointers to row 0.
struct Blocks {
  const uint8_t* codes;
  const uint8_t* high;
  const c10::Half* scales;  // float16 storage, or:
  const c10::Half* offsets;
  const int8_t* scales8;  // int8 storage (K-quant sub-scales and mins: small integers), or:
  const int8_t* offsets8;
  const float* scales32;  // float32 storage (already times any super-block factor)
  const float* offsets32;
  const uint8_t* scales_e8m0;  // E8M0 storage (powers of two, no offsets), or:
  const uint8_t* scales_e4m3;  // float8 e4m3 storage (no offsets), times the row's float32 factor:
  const float* row_scales;     // (`supers` given as float32 [N, 1])
  const c10::Half* supers;
  int64_t N, K, nb, bs, center;
  int64_t code_bytes, high_bytes, supers_per_row;  // per row

  Blocks(const torch::Tensor& c, const c10::optional<torch::Tensor>& h, const torch::Tensor& s,
         const c10::optional<torch::Tensor>& o, const c10::optional<torch::Tensor>& su, int64_t bits, int64_t block,
         int64_t centre)
      : codes(reinterpret_cast<const uint8_t*>(c.data_ptr())),
        high(h ? reinterpret_cast<const uint8_t*>(h->data_ptr()) : nullptr),
        scales(s.scalar_type() == at::kHalf ? s.data_ptr<c10::Half>() : nullptr),
        offsets(o && o->scalar_type() == at::kHalf ? o->data_ptr<c10::Half>() : nullptr),
        scales8(s.scalar_type() == at::kChar ? s.data_ptr<int8_t>() : nullptr),
        offsets8(o && o->scalar_type() == at::kChar ? o->data_ptr<int8_t>() : nullptr),
        scales32(s.scalar_type() == at::kFloat ? s.data_ptr<float>() : nullptr),
        offsets32(o && o->scalar_type() == at::kFloat ? o->data_ptr<float>() : nullptr),
        scales_e8m0(s.scalar_type() == at::kByte ? s.data_ptr<uint8_t>() : nullptr),
        scales_e4m3(s.scalar_type() == at::kFloat8_e4m3fn ? reinterpret_cast<const uint8_t*>(s.data_ptr()) : nullptr),
        row_scales(su && su->scalar_type() == at::kFloat ? su->data_ptr<float>() : nullptr),
        supers(su && su->scalar_type() == at::kHalf ? su->data_ptr<c10::Half>() : nullptr),
        N(c.size(0)),
        K(c.size(1) * (bits == 8 ? 1 : 2)),
        nb(s.size(1)),
        bs(block),
        center(centre),
        code_bytes(c.size(1)),
        high_bytes(h ? h->size(1) : 0),
        supers_per_row(supers ? su->size(1) : 0) {
    TORCH_CHECK(!scales_e4m3 || row_scales, "e4m3 block scales need their float32 factor per row (supers [N, 1])");
  }

  // Row n's scale and offset per block as float32 (stored value times its super-block's). `fold`: the
  // offsets also take -center * scale (for kernels that keep codes unsigned); `dx` (one activation
  // row's scale per 32 values): the scales are then multiplied by it. `xs` (that row's sums per block):
  // instead of writing o, adds the offsets' share (sum of o * xs) to *share. Returns whether there are offsets.
  bool expand(int64_t n, bool fold, const float* dx, const float* xs, float* s, float* o, float* share) const {
    if (scales32) return expand32(n, fold, dx, xs, s, o, share);
    if (scales_e8m0) return expand_bytes<false>(scales_e8m0 + n * nb, 1.f, fold, dx, xs, s, o, share);
    if (scales_e4m3) return expand_bytes<true>(scales_e4m3 + n * nb, row_scales[n], fold, dx, xs, s, o, share);
    if (scales8)
      return expand_as(scales8 + n * nb, offsets8 ? offsets8 + n * nb : nullptr, n, fold, dx, xs, s, o, share);
    return expand_as(scales + n * nb, offsets ? offsets + n * nb : nullptr, n, fold, dx, xs, s, o, share);
  }

  // expand_from compiled for this weight's block size and parts (a decode step runs it once per row
  // of every layer: a generic loop's branches and divisions cost a quarter of a 1-row matmul). A call,
  // not inlined: inlined into the multi-row tiles, they measured 2-5% slower.
  template <typename T>
  __attribute__((noinline)) bool expand_as(const T* sh, const T* oh, int64_t n, bool fold, const float* dx,
                                           const float* xs, float* s, float* o, float* share) const {
    TORCH_CHECK(bs == 16 || bs == 32, "no block kernel for blocks of ", bs);
    switch ((bs == 16) * 8 + !!supers * 4 + !!oh * 2 + !!xs) {
#define TM_EXPAND(BS, SUP, OFF, ROW)             \
  case (BS == 16) * 8 + SUP * 4 + OFF * 2 + ROW: \
    return expand_from<T, BS, SUP, OFF, ROW>(sh, oh, n, fold, dx, xs, s, o, share);
#define TM_EXPAND_ROWS(BS, SUP, OFF) TM_EXPAND(BS, SUP, OFF, true) TM_EXPAND(BS, SUP, OFF, false)
#define TM_EXPAND_OFFS(BS, SUP) TM_EXPAND_ROWS(BS, SUP, true) TM_EXPAND_ROWS(BS, SUP, false)
      TM_EXPAND_OFFS(32, true) TM_EXPAND_OFFS(32, false) TM_EXPAND_OFFS(16, true) TM_EXPAND_OFFS(16, false)
#undef TM_EXPAND_OFFS
#undef TM_EXPAND_ROWS
#undef TM_EXPAND
    }
    return false;  // not reached: every case is above
  }

  // expand from float16 or int8 storage (T), row n's scales sh and offsets oh (OFF: there are some), in
  // blocks of BS, with super-blocks (SUP) or not; ROW: dx and xs are given (see expand).
  template <typename T, int BS, bool SUP, bool OFF, bool ROW>
  bool expand_from(const T* sh, const T* oh, int64_t n, bool fold, const float* dx, const float* xs, float* s, float* o,
                   float* share) const {
    constexpr int64_t per_super = kSuper / BS;  // blocks in a super-block
    const c10::Half* sup = SUP ? supers + n * supers_per_row * 2 : nullptr;
    const bool folded = fold && center, any = OFF || folded;
    const float c = static_cast<float>(center);
    int64_t b = 0;
    float sum = 0.f;
#ifdef TM_SIMD
    __m256 acc = _mm256_setzero_ps();
    const __m256 cv = _mm256_set1_ps(c);
    for (; b + 8 <= nb; b += 8) {  // eight blocks sit in one super-block (K-quants have whole ones)
      __m256 sv = scale_vec(sh + b), ov = _mm256_setzero_ps();
      if (OFF) ov = scale_vec(oh + b);
      if (SUP) {
        const c10::Half* p = sup + (b / per_super) * 2;
        sv = _mm256_mul_ps(sv, _mm256_set1_ps(to_float(p[0])));
        if (OFF) ov = _mm256_mul_ps(ov, _mm256_set1_ps(to_float(p[1])));
      }
      if (folded) ov = _mm256_fnmadd_ps(cv, sv, ov);  // minus center x scale
      if (ROW) {
        sv = _mm256_mul_ps(sv, block_dx(dx, b, BS));
        acc = _mm256_fmadd_ps(ov, _mm256_loadu_ps(xs + b), acc);
      } else if (any) {
        _mm256_storeu_ps(o + b, ov);
      }
      _mm256_storeu_ps(s + b, sv);
    }
    sum = hsum(acc);
#endif
    for (; b < nb; ++b) {
      const c10::Half* p = SUP ? sup + (b / per_super) * 2 : nullptr;
      s[b] = SUP ? to_float(sh[b]) * to_float(p[0]) : to_float(sh[b]);
      float ob = 0.f;
      if (OFF) ob = SUP ? to_float(oh[b]) * to_float(p[1]) : to_float(oh[b]);
      if (folded) ob -= c * s[b];
      if (ROW && any)
        sum += ob * xs[b];
      else if (any)
        o[b] = ob;
      if (ROW) s[b] *= dx[b * BS / 32];
    }
    if (ROW) *share = sum;
    return any;
  }

  // expand for float32 storage (what the exact mode keeps: its kernel then reads the rows in place).
  bool expand32(int64_t n, bool fold, const float* dx, const float* xs, float* s, float* o, float* share) const {
    const float* sr = scales32 + n * nb;
    const float* orow = offsets32 ? offsets32 + n * nb : nullptr;
    const bool folded = fold && center, any = orow || folded;
    float sum = 0.f;
    int64_t b = 0;
#ifdef TM_SIMD
    if (!orow) {  // eight at a time: the folded center's offsets and the activation scales (FP4's float32 scales)
      const __m256 negc = _mm256_set1_ps(-static_cast<float>(center));
      __m256 acc = _mm256_setzero_ps();
      for (; b + 8 <= nb; b += 8) {
        const __m256 sv = _mm256_loadu_ps(sr + b);
        if (folded && xs)
          acc = _mm256_fmadd_ps(_mm256_mul_ps(negc, sv), _mm256_loadu_ps(xs + b), acc);
        else if (folded)
          _mm256_storeu_ps(o + b, _mm256_mul_ps(negc, sv));
        _mm256_storeu_ps(s + b, dx ? _mm256_mul_ps(sv, block_dx(dx, b, bs)) : sv);
      }
      sum = hsum(acc);
    }
#endif
    for (; b < nb; ++b) {
      const float ob = (orow ? orow[b] : 0.f) - (folded ? static_cast<float>(center) * sr[b] : 0.f);
      if (any && xs)
        sum += ob * xs[b];
      else if (any)
        o[b] = ob;
      s[b] = dx ? sr[b] * dx[b * bs / 32] : sr[b];
    }
    if (xs) *share = sum;
    return any;
  }

  // expand for one-byte storage, exactly: E8M0 (s = 2^(byte - 128), built from its float32 bits:
  // exponent field byte - 1; bytes 1 and 0 give the subnormals 2^-127, 2^-128), or E4M3 (an e4m3 value
  // times `factor`: a normal one's bits as a float32's, its exponent rebiased by 120; a subnormal one
  // its mantissa times 2^-9: no float32 subnormals); no offsets but the folded center's.
  template <bool E4M3>
  bool expand_bytes(const uint8_t* e, float factor, bool fold, const float* dx, const float* xs, float* s, float* o,
                    float* share) const {
    const bool folded = fold && center;
    const float c = static_cast<float>(center);
    float sum = 0.f;
    int64_t b = 0;
#ifdef TM_SIMD
    const __m256i one = _mm256_set1_epi32(1);
    __m256 acc = _mm256_setzero_ps();
    for (; b + 8 <= nb; b += 8) {
      const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(e + b)));
      __m256 sv;
      if (E4M3) {
        const __m256i m = _mm256_and_si256(v, _mm256_set1_epi32(0x7F));
        const __m256i normal = _mm256_add_epi32(_mm256_slli_epi32(m, 20), _mm256_set1_epi32(120 << 23));
        const __m256 subnormal = _mm256_mul_ps(_mm256_cvtepi32_ps(m), _mm256_set1_ps(0x1p-9f));
        sv = _mm256_blendv_ps(subnormal, _mm256_castsi256_ps(normal),
                              _mm256_castsi256_ps(_mm256_cmpgt_epi32(m, _mm256_set1_epi32(7))));
        sv = _mm256_mul_ps(sv, _mm256_set1_ps(factor));
      } else {
        const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(v, one), 23);
        const __m256i subnormal = _mm256_sllv_epi32(one, _mm256_add_epi32(v, _mm256_set1_epi32(21)));
        sv = _mm256_castsi256_ps(_mm256_blendv_epi8(subnormal, normal, _mm256_cmpgt_epi32(v, one)));
      }
      if (folded) {
        const __m256 ov = _mm256_mul_ps(_mm256_set1_ps(-c), sv);
        if (xs)
          acc = _mm256_fmadd_ps(ov, _mm256_loadu_ps(xs + b), acc);
        else
          _mm256_storeu_ps(o + b, ov);
      }
      if (dx) sv = _mm256_mul_ps(sv, block_dx(dx, b, bs));
      _mm256_storeu_ps(s + b, sv);
    }
    sum = hsum(acc);
#endif
    for (; b < nb; ++b) {
      const uint32_t m = e[b] & 0x7F;
      const uint32_t bits =
          E4M3 ? (m << 20) + (120u << 23) : (e[b] >= 2 ? static_cast<uint32_t>(e[b] - 1) << 23 : 1u << (21 + e[b]));
      float v;
      std::memcpy(&v, &bits, 4);
      if (E4M3) v = (m > 7 ? v : static_cast<float>(m) * 0x1p-9f) * factor;
      if (folded && xs)
        sum += -c * v * xs[b];
      else if (folded)
        o[b] = -c * v;
      s[b] = dx ? v * dx[b * bs / 32] : v;
    }
    if (xs) *share = sum;
    return folded;
  }

  // Whether row n's stored scales and offsets can be read as they are (no expand needed).
  bool in_place(bool fold, const float* dx) const { return scales32 && !dx && !(fold && center); }
};

// Value i of a row: unsigned for 4-6 bits, signed for 8. The top bits of groups 2p and 2p+1 (L = 0,
// 1) share one record of the high plane, laid out for `unpack_pair`; value 16h + j of group L sits
// in byte 16L + j = 8q + k of the pair's lo (h = 0) or hi (h = 1) vector. 5 bits: 8 bytes, bit
// 8k + 4 + q (lo) or 8k + q (hi); 6 bits: 16 bytes, bits 2L + 4h (two) of byte j.
template <int BITS>
inline int code_at(const uint8_t* codes, const uint8_t* high, int64_t i) {
  if (BITS == 8) return reinterpret_cast<const int8_t*>(codes)[i];
  const int64_t g = i / 32, v = i % 32, L = g % 2, h = v / 16, j = v % 16;
  int u = v < 16 ? (codes[g * 16 + j] & 0x0F) : (codes[g * 16 + j] >> 4);
  if (BITS == kE2M1) return kE2M1Codes[u];
  if (BITS == 5) {
    const int64_t q = (16 * L + j) / 8, k = j % 8, bit = 8 * k + q + (h ? 0 : 4);
    u |= ((high[(g / 2) * 8 + bit / 8] >> (bit % 8)) & 1) << 4;
  }
  if (BITS == 6) u |= ((high[(g / 2) * 16 + j] >> (2 * L + 4 * h)) & 3) << 4;
  return u;
}

// Decode is memory-bound: the row loops ask for the codes (and high bits) kPrefetchBytes of codes
// ahead of group g, one cache line per call; a thread's rows lie back to back, so this runs on into
// the next rows. Spread along the loop, not a row's worth at once: a burst of prefetches at each row
// start fills the core's miss buffers and stalls it on long rows (1.3-1.4x slower at 8,960 columns).
constexpr int64_t kPrefetchBytes = 2048;
template <int BITS>
inline void prefetch_ahead(const uint8_t* codes, const uint8_t* high, int64_t g) {
  constexpr int64_t code_bytes = BITS == 8 ? 32 : 16, high_bytes = BITS > 4 && BITS < 8 ? 4 * (BITS - 4) : 0;
  __builtin_prefetch(codes + g * code_bytes + kPrefetchBytes);
  if (high_bytes) __builtin_prefetch(high + g * high_bytes + kPrefetchBytes * high_bytes / code_bytes);
}

#ifdef TM_SIMD
// kE2M1Codes in both 128-bit lanes, for pshufb.
inline __m256i e2m1_table() {
  return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kE2M1Codes)));
}

// The 32 codes of group g of a row, value j in byte j.
template <int BITS>
inline __m256i unpack32(const uint8_t* codes, const uint8_t* high, int64_t g) {
  if (BITS == 8) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + g * 32));
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + g * 16));
  const __m128i m4 = _mm_set1_epi8(0x0F);
  __m256i v = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m4), _mm_and_si128(raw, m4));
  if (BITS == kE2M1) return _mm256_shuffle_epi8(e2m1_table(), v);
  const int L = static_cast<int>(g % 2);
  if (BITS == 5) {  // 64-bit lanes 0-1 shift right (lo bits), 2-3 left (hi bits); a count of 64 gives 0
    long long word;
    std::memcpy(&word, high + (g / 2) * 8, 8);
    const __m256i w = _mm256_set1_epi64x(word);
    const __m256i top = _mm256_or_si256(_mm256_srlv_epi64(w, _mm256_setr_epi64x(2 * L, 2 * L + 1, 64, 64)),
                                        _mm256_sllv_epi64(w, _mm256_setr_epi64x(64, 64, 4 - 2 * L, 3 - 2 * L)));
    v = _mm256_or_si256(v, _mm256_and_si256(top, _mm256_set1_epi8(0x10)));
  } else if (BITS == 6) {  // values 0-15 from bits 2L, values 16-31 from bits 2L + 4, of the record's bytes
    const __m256i rec =
        _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(high + (g / 2) * 16)));
    const __m256i top = _mm256_srlv_epi32(
        rec, _mm256_setr_epi32(2 * L, 2 * L, 2 * L, 2 * L, 2 * L + 4, 2 * L + 4, 2 * L + 4, 2 * L + 4));
    v = _mm256_or_si256(v, _mm256_slli_epi16(_mm256_and_si256(top, _mm256_set1_epi8(3)), 4));
  }
  return v;
}

// Groups 2p and 2p+1 (4-6 bits) as two vectors: lo holds values 0-15 of group 2p then of group 2p+1,
// hi their values 16-31 (the order `quantize_rows` gives paired activations).
template <int BITS>
inline void unpack_pair(const uint8_t* codes, const uint8_t* high, int64_t p, __m256i& lo, __m256i& hi) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + p * 32));
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  lo = _mm256_and_si256(raw, m4);
  hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
  if (BITS == kE2M1) {
    lo = _mm256_shuffle_epi8(e2m1_table(), lo);
    hi = _mm256_shuffle_epi8(e2m1_table(), hi);
  } else if (BITS == 5) {  // 64-bit lane q: lo takes bits 8k + 4 + q (right by q), hi bits 8k + q (left by 4 - q)
    long long word;
    std::memcpy(&word, high + p * 8, 8);
    const __m256i w = _mm256_set1_epi64x(word);
    const __m256i m = _mm256_set1_epi8(0x10);
    lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_srlv_epi64(w, _mm256_setr_epi64x(0, 1, 2, 3)), m));
    hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_sllv_epi64(w, _mm256_setr_epi64x(4, 3, 2, 1)), m));
  } else if (BITS == 6) {
    // lane L: bits 2L (lo) and 2L + 4 (hi) to bits 4-5; the bits shifted in from a neighbour are masked off
    const __m256i rec = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(high + p * 16)));
    const __m256i m = _mm256_set1_epi8(0x30);
    lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_sllv_epi32(rec, _mm256_setr_epi32(4, 4, 4, 4, 2, 2, 2, 2)), m));
    hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_srlv_epi32(rec, _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2)), m));
  }
}

// The 32 codes of group g minus the center, as four float vectors (values 0-7, 8-15, 16-23, 24-31).
template <int BITS>
inline void decode32(const uint8_t* codes, const uint8_t* high, int64_t g, __m256i center, Vec* f) {
  __m128i lo, hi;
  if (BITS == 4 || BITS == kE2M1) {  // the two nibble halves as they are, no 256-bit round trip
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + g * 16));
    const __m128i m4 = _mm_set1_epi8(0x0F), c = _mm256_castsi256_si128(center);
    lo = _mm_and_si128(raw, m4);
    hi = _mm_and_si128(_mm_srli_epi16(raw, 4), m4);
    if (BITS == kE2M1) {
      const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kE2M1Codes));
      lo = _mm_shuffle_epi8(table, lo);
      hi = _mm_shuffle_epi8(table, hi);
    }
    lo = _mm_sub_epi8(lo, c);
    hi = _mm_sub_epi8(hi, c);
  } else {
    __m256i v = unpack32<BITS>(codes, high, g);
    if (BITS != 8) v = _mm256_sub_epi8(v, center);  // codes below 64, centers up to 32: int8, exactly
    lo = _mm256_castsi256_si128(v);
    hi = _mm256_extracti128_si256(v, 1);
  }
  const __m128i part[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
  for (int i = 0; i < 4; ++i) f[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(part[i]));
}
#endif

// Each row's total plus the offsets' share (offset of block b times that row's sum over block b),
// stored at out[r * out_stride].
template <int ROWS>
inline void store_rows(float* total, const float* offsets, const float* xsum, int64_t nb, float* out,
                       int64_t out_stride) {
  for (int r = 0; r < ROWS; ++r) {
    if (offsets) {
      const float* xs = xsum + r * nb;
      float share = 0.f;
      int64_t b = 0;
#ifdef TM_SIMD
      Vec acc = vzero();  // eight blocks at a time: a scalar chain of adds would be latency-bound
      for (; b + 8 <= nb; b += 8) acc = vfma(vload(offsets + b), vload(xs + b), acc);
      share = hsum(acc);
#endif
      for (; b < nb; ++b) share += offsets[b] * xs[b];
      total[r] += share;
    }
    out[r * out_stride] = total[r];
  }
}

// Up to four activation rows against one weight row: sum over blocks of s * (x . (q - center)), plus
// the offsets' share (xsum holds each row's per-block sums).
template <int BITS, int BS, int ROWS>
inline void rows_dot(const float* x, int64_t K, const uint8_t* codes, const uint8_t* high, const float* s,
                     const float* o, float center, const float* xsum, float* out, int64_t out_stride) {
  const int64_t groups = K / 32, nb = K / BS;
#ifdef TM_SIMD
  const __m256i cv = _mm256_set1_epi8(static_cast<char>(center));
  Vec acc[ROWS], acc2[ROWS];  // two dependency chains, not one: even and odd blocks of 32 (halves of 16)
  for (int r = 0; r < ROWS; ++r) acc[r] = acc2[r] = vzero();
  auto group = [&](int64_t g, Vec* into) {
    Vec f[4];
    decode32<BITS>(codes, high, g, cv, f);
    for (int r = 0; r < ROWS; ++r) {
      const float* xb = x + r * K + g * 32;
      if (BS == 32) {
        Vec d = vmul(vload(xb), f[0]);
        for (int i = 1; i < 4; ++i) d = vfma(vload(xb + i * 8), f[i], d);
        into[r] = vfma(d, vset1(s[g]), into[r]);
      } else {
        const Vec a = vfma(vload(xb + 8), f[1], vmul(vload(xb), f[0]));
        const Vec b = vfma(vload(xb + 24), f[3], vmul(vload(xb + 16), f[2]));
        acc[r] = vfma(a, vset1(s[2 * g]), acc[r]);
        acc2[r] = vfma(b, vset1(s[2 * g + 1]), acc2[r]);
      }
    }
  };
  int64_t g = 0;
  for (; g + 2 <= groups; g += 2) {
    if (BITS == 8 || g % 4 == 0) prefetch_ahead<BITS>(codes, high, g);  // every 64 bytes of codes
    group(g, acc);
    group(g + 1, acc2);
  }
  if (g < groups) group(g, acc);
  float total[ROWS];
  for (int r = 0; r < ROWS; ++r) total[r] = hsum(vadd(acc[r], acc2[r]));
#else
  float total[ROWS] = {};
  for (int64_t b = 0; b < nb; ++b)
    for (int r = 0; r < ROWS; ++r) {
      float d = 0.f;
      for (int64_t j = b * BS; j < (b + 1) * BS; ++j)
        d += x[r * K + j] * (static_cast<float>(code_at<BITS>(codes, high, j)) - center);
      total[r] += s[b] * d;
    }
#endif
  store_rows<ROWS>(total, o, xsum, nb, out, out_stride);
}

// Calls row(n, codes, high, s, o, share) for every weight row n, in parallel, with the rows' scales and
// offsets expanded (`fold`, `dx`, `xs`: see Blocks::expand; o null without offsets or with xs).
template <typename Row>
void for_each_row(const Blocks& w, bool fold, const float* dx, const float* xs, const Row& row) {
  at::parallel_for(0, w.N, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> s(w.nb), o(w.nb);
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* c = w.codes + n * w.code_bytes;
      const uint8_t* h = w.high ? w.high + n * w.high_bytes : nullptr;
      float share = 0.f;
      if (w.in_place(fold, dx) && !xs) {
        row(n, c, h, w.scales32 + n * w.nb, w.offsets32 ? w.offsets32 + n * w.nb : nullptr, share);
        continue;
      }
      const bool has_offsets = w.expand(n, fold, dx, xs, s.data(), o.data(), &share);
      row(n, c, h, s.data(), has_offsets && !xs ? o.data() : nullptr, share);
    }
  });
}

template <int BITS, int BS>
void matmul_impl(const torch::Tensor& x, const Blocks& w, torch::Tensor& out) {
  const int64_t M = x.size(0), K = w.K, N = w.N, nb = w.nb;
  const float* xp = x.data_ptr<float>();
  float* outp = out.data_ptr<float>();
  std::vector<float> xsum(M * nb, 0.f);
  if (w.offsets || w.offsets32)
    for (int64_t i = 0; i < M * nb; ++i)
      for (int64_t j = 0; j < BS; ++j) xsum[i] += xp[i * BS + j];
  const float center = static_cast<float>(w.center);
  auto row_of = [&](int64_t n, const uint8_t* c, const uint8_t* h, const float* s, const float* o, float) {
    int64_t i = 0;
    for (; i + 4 <= M; i += 4)
      rows_dot<BITS, BS, 4>(xp + i * K, K, c, h, s, o, center, xsum.data() + i * nb, outp + i * N + n, N);
    for (; i < M; ++i)
      rows_dot<BITS, BS, 1>(xp + i * K, K, c, h, s, o, center, xsum.data() + i * nb, outp + i * N + n, N);
  };
  for_each_row(w, false, nullptr, nullptr, row_of);
}

// The float32 weight, value by value as gguf computes it: s * (q - center) rounded, then + o.
template <int BITS, int BS>
void dequantize_impl(const Blocks& w, torch::Tensor& out) {
  float* outp = out.data_ptr<float>();
  const float center = static_cast<float>(w.center);
  auto row_of = [&](int64_t n, const uint8_t* c, const uint8_t* h, const float* s, const float* o, float) {
    float* row = outp + n * w.K;
#ifdef TM_SIMD
    const __m256i cv = _mm256_set1_epi8(static_cast<char>(center));
    for (int64_t g = 0; g < w.K / 32; ++g) {
      if (g % (BITS == 8 ? 2 : 4) == 0) prefetch_ahead<BITS>(c, h, g);  // every 64 bytes of codes
      Vec f[4];
      decode32<BITS>(c, h, g, cv, f);
      for (int i = 0; i < 4; ++i) {
        const int64_t b = (g * 32 + i * 8) / BS;
        _mm256_storeu_ps(row + g * 32 + i * 8, vadd(vmul(f[i], vset1(s[b])), vset1(o ? o[b] : 0.f)));
      }
    }
#else
    for (int64_t j = 0; j < w.K; ++j)
      row[j] = (static_cast<float>(code_at<BITS>(c, h, j)) - center) * s[j / BS] + (o ? o[j / BS] : 0.f);
#endif
  };
  for_each_row(w, false, nullptr, nullptr, row_of);
}

// --- int8 activations (llama.cpp's scheme): each 32-value block of an activation row (each 256-value
// super-block, for K-quants: activation_span) becomes int8 codes with one float scale (max |x| / 127),
// and a weight block's dot product is an integer sum
// times both scales; the offsets (and the codes' center) meet the rounded activations too, so the
// result is the rounded activations times the exact weights (what `round_activations` + a float GEMM
// computes). Not exact; several times fewer instructions per weight than decoding it to float.

// x [M, K] -> xq int8 [M, K], dx [M, K/32] (scale per 32 values), xs [M, K/BS] (sums of the rounded
// values) and, where given, xsum [M, K/BS] (those sums as integers: the codes' sums per block). One
// scale, max |x| / 127 over `span` values (32, or 256: a K-quant super-block, as llama.cpp's q8_K),
// written for each of their 32-value groups. The vector path rounds as nearbyint does (half to even).
template <int BS>
void quantize_rows(const float* x, int64_t M, int64_t K, int64_t span, int8_t* xq, float* dx, float* xs,
                   int16_t* xsum) {
  const int64_t per = span / 32;  // groups per scale
  at::parallel_for(0, M * K / span, 64 / per, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      float amax = 0.f;
#ifdef TM_SIMD
      const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
      __m256 vmax = _mm256_setzero_ps();
      for (int64_t j = 0; j < span; j += 8)
        vmax = _mm256_max_ps(vmax, _mm256_and_ps(_mm256_loadu_ps(x + u * span + j), abs_mask));
      __m128 m = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
      m = _mm_max_ps(m, _mm_movehl_ps(m, m));
      amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
#else
      for (int64_t j = 0; j < span; ++j) amax = std::max(amax, std::fabs(x[u * span + j]));
#endif
      const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
      for (int64_t i = u * per; i < (u + 1) * per; ++i) {
        const float* v = x + i * 32;
        int8_t* q = xq + i * 32;
#ifdef TM_SIMD
        __m256i c[4];
        for (int j = 0; j < 4; ++j)
          c[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 8 * j), _mm256_set1_ps(id)));
        // int32 -> int8 (packs work within 128-bit lanes: one permute puts the values back in order)
        const __m256i w16 = _mm256_packs_epi32(c[0], c[1]), w16b = _mm256_packs_epi32(c[2], c[3]);
        const __m256i b8 =
            _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w16, w16b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), b8);
#else
        for (int j = 0; j < 32; ++j) q[j] = static_cast<int8_t>(std::nearbyint(v[j] * id));
#endif
        dx[i] = d;
        for (int h = 0; h < 32 / BS; ++h) {
          int32_t sum = 0;
          for (int j = h * BS; j < (h + 1) * BS; ++j) sum += q[j];
          xs[i * (32 / BS) + h] = d * static_cast<float>(sum);
          if (xsum) xsum[i * (32 / BS) + h] = static_cast<int16_t>(sum);
        }
      }
    }
  });
}

#ifdef TM_SIMD
// Two floats at p as lanes (a, a, a, a, b, b, b, b).
inline __m256 pair_lanes(const float* p) {
  const __m256 two = _mm256_castps128_ps256(_mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(p))));
  return _mm256_permutevar8x32_ps(two, _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
}

// Whether the vector kernel reads the activations of group pairs interleaved (see unpack_pair).
constexpr bool paired(int bits) { return bits < 8; }

// Each full pair of 32-value groups of each row [g0 0-31, g1 0-31] -> [g0 0-15, g1 0-15, g0 16-31, g1 16-31].
void interleave_pairs(int8_t* xq, int64_t M, int64_t K) {
  for (int64_t r = 0; r < M; ++r)
    for (int64_t p = 0; 2 * p + 2 <= K / 32; ++p) {
      int8_t* q = xq + r * K + p * 64;
      int8_t tmp[16];
      std::memcpy(tmp, q + 16, 16);
      std::memcpy(q + 16, q + 32, 16);
      std::memcpy(q + 32, tmp, 16);
    }
}
#else
constexpr bool paired(int) { return false; }
#endif

// One int8 activation row against one weight row whose scales s already hold the row's activation
// scales (see Blocks::expand; the offsets, the codes' center folded in, are the caller's share).
template <int BITS, int BS>
inline float row_dot_q8(const int8_t* xq, int64_t K, const uint8_t* codes, const uint8_t* high, const float* s) {
#ifdef TM_SIMD
  const int64_t groups = K / 32;
  __m256 acc = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps();  // two dependency chains, not one
  auto group = [&](int64_t g, __m256& into) {                    // one group, activations in natural order
    const __m256i w = unpack32<BITS>(codes, high, g);
    // lanes 0-3 hold values 0..15 of the group, lanes 4-7 values 16..31 (a 16-block each for BS 16)
    const __m256 ws =
        BS == 32 ? _mm256_set1_ps(s[g]) : _mm256_set_m128(_mm_set1_ps(s[2 * g + 1]), _mm_set1_ps(s[2 * g]));
    const __m256i wabs = BITS == 8 ? _mm256_sign_epi8(w, w) : w;  // the products are unsigned by signed
    __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + g * 32));
    if (BITS == 8) x = _mm256_sign_epi8(x, w);
    const __m256i sums = dot4(wabs, x);
    into = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), ws, into);
  };
  // two groups at once (paired layouts): lanes 0-3 from group g, 4-7 from g + 1
  auto pair = [&](int64_t g, __m256& into) {
    __m256i lo, hi;
    unpack_pair<BITS>(codes, high, g / 2, lo, hi);
    const __m256i xlo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + g * 32));
    const __m256i xhi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + g * 32 + 32));
    if (BS == 32) {
      const __m256i sums = dot4x2(lo, xlo, hi, xhi);
      into = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), pair_lanes(s + g), into);
    } else {  // blocks of 16: lo and hi have scales of their own
      const __m256 four = _mm256_castps128_ps256(_mm_loadu_ps(s + 2 * g));
      const __m256 wlo = _mm256_permutevar8x32_ps(four, _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2));
      const __m256 whi = _mm256_permutevar8x32_ps(four, _mm256_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3));
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot4(lo, xlo)), wlo, acc);
      acc2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot4(hi, xhi)), whi, acc2);
    }
  };
  int64_t g = 0;
  if (paired(BITS)) {
    for (; g + 4 <= groups; g += 4) {  // 64 bytes of codes
      prefetch_ahead<BITS>(codes, high, g);
      pair(g, acc);
      pair(g + 2, acc2);
    }
    if (g + 2 <= groups) {
      pair(g, acc);
      g += 2;
    }
  } else {
    for (; g + 2 <= groups; g += 2) {  // 64 bytes of 8-bit codes
      prefetch_ahead<BITS>(codes, high, g);
      group(g, acc);
      group(g + 1, acc2);
    }
  }
  if (g < groups) group(g, acc);
  return hsum(_mm256_add_ps(acc, acc2));
#else
  float total = 0.f;
  for (int64_t b = 0; b < K / BS; ++b) {
    int32_t dot = 0;
    for (int64_t j = b * BS; j < (b + 1) * BS; ++j) dot += code_at<BITS>(codes, high, j) * xq[j];
    total += static_cast<float>(dot) * s[b];
  }
  return total;
#endif
}

#ifdef TM_SIMD
// The activation scales as the vector kernels' lanes, one vector per unit of a row: a unit is a pair
// of groups for paired layouts (lanes 0-3 dx[2p], 4-7 dx[2p+1]; an odd last group's scale in all eight),
// else one group (its scale in all eight).
std::vector<__m256> scale_lanes(const float* dx, int64_t M, int64_t groups, bool pairs, int64_t units) {
  std::vector<__m256> lanes(M * units);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t u = 0; u < units; ++u) {
      const float* d = dx + r * groups;
      const int64_t g = pairs ? 2 * u : u;
      lanes[r * units + u] = g + 1 < groups && pairs ? pair_lanes(d + g) : _mm256_set1_ps(d[g]);
    }
  return lanes;
}

constexpr int kTile = 8;  // activation rows per register tile: one float vector across them (sum_lanes8)

// Lane r: the sum of a[r]'s eight lanes (eight horizontal sums in seven adds and two permutes).
inline __m256 sum_lanes8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

// RM int8 activation rows (K apart, ordered as quantize_rows + interleave_pairs leave them) against
// one weight row whose scales s are expanded with the codes' center folded into the offsets, which the
// caller adds: total[r] += sum over the blocks of groups [g, end) of s * dx * (q . x), for all kTile
// entries of total (those past RM add 0). The weight's codes are unpacked once for all RM rows; each
// row keeps one accumulator (RM independent chains).
template <int BITS, int BS, int RM>
inline void tile_q8(const int8_t* xq, const __m256* lanes, int64_t units, int64_t K, const uint8_t* codes,
                    const uint8_t* high, const float* s, int64_t g, int64_t end, float* total) {
  __m256 acc[RM];
  for (int r = 0; r < RM; ++r) acc[r] = _mm256_setzero_ps();
  if (paired(BITS))
    for (; g + 2 <= end; g += 2) {
      __m256i lo, hi;
      unpack_pair<BITS>(codes, high, g / 2, lo, hi);
      if (BS == 32) {
        const __m256 ws = pair_lanes(s + g);
        for (int r = 0; r < RM; ++r) {
          const int8_t* xp = xq + r * K + g * 32;
          const __m256i sums = dot4x2(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp)), hi,
                                      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + 32)));
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(ws, lanes[r * units + g / 2]), acc[r]);
        }
      } else {  // blocks of 16: lo and hi have scales of their own
        const __m256 four = _mm256_castps128_ps256(_mm_loadu_ps(s + 2 * g));
        const __m256 wlo = _mm256_permutevar8x32_ps(four, _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2));
        const __m256 whi = _mm256_permutevar8x32_ps(four, _mm256_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3));
        for (int r = 0; r < RM; ++r) {
          const int8_t* xp = xq + r * K + g * 32;
          const __m256i plo = dot4(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp)));
          const __m256i phi = dot4(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + 32)));
          const __m256 t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(phi), whi, _mm256_mul_ps(_mm256_cvtepi32_ps(plo), wlo));
          acc[r] = _mm256_fmadd_ps(t, lanes[r * units + g / 2], acc[r]);
        }
      }
    }
  for (; g < end; ++g) {  // 8-bit codes (signed: the products take |w| and x with w's sign), or an odd last group
    const __m256i w = unpack32<BITS>(codes, high, g);
    const __m256 ws =
        BS == 32 ? _mm256_set1_ps(s[g]) : _mm256_set_m128(_mm_set1_ps(s[2 * g + 1]), _mm_set1_ps(s[2 * g]));
    const __m256i wabs = BITS == 8 ? _mm256_sign_epi8(w, w) : w;
    for (int r = 0; r < RM; ++r) {
      __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * K + g * 32));
      if (BITS == 8) x = _mm256_sign_epi8(x, w);
      const __m256i sums = dot4(wabs, x);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums),
                               _mm256_mul_ps(ws, lanes[r * units + (paired(BITS) ? g / 2 : g)]), acc[r]);
    }
  }
  __m256 all[kTile];  // the rows past RM add nothing
  for (int r = 0; r < kTile; ++r) all[r] = r < RM ? acc[r] : _mm256_setzero_ps();
  _mm256_storeu_ps(total, _mm256_add_ps(_mm256_loadu_ps(total), sum_lanes8(all)));
}

// tile_q8 for any rows <= kTile (the last, partial tile).
template <int BITS, int BS>
inline void tile_q8_rows(int rows, const int8_t* xq, const __m256* lanes, int64_t units, int64_t K,
                         const uint8_t* codes, const uint8_t* high, const float* s, int64_t g, int64_t end,
                         float* total) {
  switch (rows) {
    case 8:
      return tile_q8<BITS, BS, 8>(xq, lanes, units, K, codes, high, s, g, end, total);
    case 7:
      return tile_q8<BITS, BS, 7>(xq, lanes, units, K, codes, high, s, g, end, total);
    case 6:
      return tile_q8<BITS, BS, 6>(xq, lanes, units, K, codes, high, s, g, end, total);
    case 5:
      return tile_q8<BITS, BS, 5>(xq, lanes, units, K, codes, high, s, g, end, total);
    case 4:
      return tile_q8<BITS, BS, 4>(xq, lanes, units, K, codes, high, s, g, end, total);
    case 3:
      return tile_q8<BITS, BS, 3>(xq, lanes, units, K, codes, high, s, g, end, total);
    case 2:
      return tile_q8<BITS, BS, 2>(xq, lanes, units, K, codes, high, s, g, end, total);
    default:
      return tile_q8<BITS, BS, 1>(xq, lanes, units, K, codes, high, s, g, end, total);
  }
}

// Several activation rows: chunks of weight rows (scales expanded once per chunk) against every tile
// of kTile activation rows, a slab of columns at a time, so that a chunk's codes stay in cache while all
// tiles pass over them and a tile's slab of activations (8 rows of 2,048: 16 KB) stays in L1.
template <int BITS, int BS>
void matmul_q8_tiles(const int8_t* xq, const float* dx, const float* xs, int64_t M, const Blocks& w, float* outp) {
  constexpr int64_t kChunk = 16, kSlab = 64;  // slabs of whole group pairs
  const int64_t K = w.K, N = w.N, nb = w.nb, groups = K / 32;
  constexpr int64_t kRowBlock = 256;  // rows at a time: a block's activations stay in the last-level cache
  if (M > kRowBlock) {
    for (int64_t m = 0; m < M; m += kRowBlock)
      matmul_q8_tiles<BITS, BS>(xq + m * K, dx + m * groups, xs + m * nb, std::min(kRowBlock, M - m), w, outp + m * N);
    return;
  }
  const int64_t units = paired(BITS) ? (groups + 1) / 2 : groups;
  const std::vector<__m256> lanes = scale_lanes(dx, M, groups, paired(BITS), units);
  // the block sums of each tile's rows, transposed: lane r of [t * nb + b] is row t * kTile + r's sum
  // over block b, so that a weight row's offsets' share for the whole tile is nb multiply-adds
  const int64_t tiles = (M + kTile - 1) / kTile;
  std::vector<__m256> xs_tiles(tiles * nb);
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t b = 0; b < nb; ++b) {
      alignas(32) float v[kTile] = {};
      for (int64_t r = 0; r < kTile && t * kTile + r < M; ++r) v[r] = xs[(t * kTile + r) * nb + b];
      xs_tiles[t * nb + b] = _mm256_load_ps(v);
    }
  at::parallel_for(0, N, kChunk, [&](int64_t begin, int64_t end) {
    std::vector<float> s(kChunk * nb), o(kChunk * nb);
    bool offsets = false;
    for (int64_t n0 = begin; n0 < end; n0 += kChunk) {
      const int64_t rows = std::min(kChunk, end - n0);
      for (int64_t j = 0; j < rows; ++j)
        offsets = w.expand(n0 + j, true, nullptr, nullptr, &s[j * nb], &o[j * nb], nullptr);
      for (int64_t m0 = 0; m0 < M; m0 += kTile) {
        const int tile = static_cast<int>(std::min<int64_t>(kTile, M - m0));
        float total[kChunk][kTile] = {};
        for (int64_t g = 0; g < groups; g += kSlab)
          for (int64_t j = 0; j < rows; ++j) {
            const int64_t n = n0 + j;
            tile_q8_rows<BITS, BS>(tile, xq + m0 * K, lanes.data() + m0 * units, units, K, w.codes + n * w.code_bytes,
                                   w.high ? w.high + n * w.high_bytes : nullptr, &s[j * nb], g,
                                   std::min(groups, g + kSlab), total[j]);
          }
        const __m256* xt = xs_tiles.data() + (m0 / kTile) * nb;
        for (int64_t j0 = 0; j0 < rows; j0 += 4) {  // four weight rows at a time, each on two chains
          __m256 v[4][2];
          for (int q = 0; q < 4; ++q) v[q][0] = _mm256_loadu_ps(total[j0 + q]), v[q][1] = _mm256_setzero_ps();
          if (offsets) {  // rows past `rows` read stale offsets and are not stored
            const float* oj = &o[j0 * nb];
            auto block = [&](int64_t b, int c) {
              for (int q = 0; q < 4; ++q) v[q][c] = _mm256_fmadd_ps(_mm256_set1_ps(oj[q * nb + b]), xt[b], v[q][c]);
            };
            int64_t b = 0;
            for (; b + 2 <= nb; b += 2) block(b, 0), block(b + 1, 1);
            if (b < nb) block(b, 0);
          }
          for (int q = 0; q < 4 && j0 + q < rows; ++q) {
            alignas(32) float lane[kTile];
            _mm256_store_ps(lane, _mm256_add_ps(v[q][0], v[q][1]));
            for (int r = 0; r < tile; ++r) outp[(m0 + r) * N + n0 + j0 + q] = lane[r];
          }
        }
      }
    }
  });
}

// One activation row against K-quant rows (int8 sub-block scales, float16 super-block pairs, codes of
// 4-6 bits), the activations rounded with one scale per super-block (quantize_rows' span 256): the
// sub-block scales multiply the integer pair sums inside madd (in place of its ones), so that a
// super-block's sum stays an integer to its end and needs one float multiply-add (its d times the
// activations' scale); a row's scales need no expanding (Blocks::expand, a quarter of a row's time at
// one row). The offsets' share is integer too: the codes' center times the scales, and the mins, each a
// madd against the activations' integer block sums xsum. `masks`: spread_masks<BS>().
template <int BS>
std::vector<__m256i> spread_masks() {  // pshufb masks: int16 element a in the low 128-bit lane, b in the high
  auto mask = [](int a, int b) {
    alignas(32) int8_t m[32];
    for (int i = 0; i < 16; ++i)
      m[i] = static_cast<int8_t>(2 * a + i % 2), m[16 + i] = static_cast<int8_t>(2 * b + i % 2);
    return _mm256_load_si256(reinterpret_cast<const __m256i*>(m));
  };
  std::vector<__m256i> masks;
  for (int k = 0; k < 4; ++k)
    if (BS == 32)
      masks.push_back(mask(2 * k, 2 * k + 1));  // pair k of a super-block: its two groups' scales
    else if (k < 2)
      masks.push_back(mask(4 * k, 4 * k + 2)), masks.push_back(mask(4 * k + 1, 4 * k + 3));  // lo, hi
  return masks;
}

// A super-block's int8 values v (8 or 16 of them, one per block) against the activations' int16 block
// sums: the products summed in pairs, as int32 lanes.
template <int BS>
inline __m256i block_sums_dot(const int8_t* v, const int16_t* sums) {
  if (BS == 16)
    return _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v))),
                             _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sums)));
  return _mm256_zextsi128_si256(_mm_madd_epi16(_mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(v))),
                                               _mm_loadu_si128(reinterpret_cast<const __m128i*>(sums))));
}

template <int BITS, int BS>
inline float row_dot_q8_super(const int8_t* xq, const float* dx, const int16_t* xsum, int64_t K, const Blocks& w,
                              int64_t n, const __m256i* masks) {
  constexpr int64_t kBlocks = kSuper / BS;
  const uint8_t* codes = w.codes + n * w.code_bytes;
  const uint8_t* high = w.high ? w.high + n * w.high_bytes : nullptr;
  const int8_t* scales = w.scales8 + n * w.nb;
  const int8_t* mins = w.offsets8 ? w.offsets8 + n * w.nb : nullptr;
  const c10::Half* sup = w.supers + n * w.supers_per_row * 2;
  const __m256i center = _mm256_set1_epi32(static_cast<int>(w.center));
  __m256 acc = _mm256_setzero_ps(), share = _mm256_setzero_ps();
  for (int64_t q = 0; q < K / kSuper; ++q) {
    const int8_t* sc = scales + q * kBlocks;
    __m256i sv[2];  // the super-block's scales as int16, in both 128-bit lanes
    for (int h = 0; h < kBlocks / 8; ++h)
      sv[h] =
          _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + 8 * h))));
    __m256i isum = _mm256_setzero_si256();
    for (int k = 0; k < 4; ++k) {  // the super-block's four pairs of groups
      const int64_t g = q * 8 + 2 * k;
      if (k % 2 == 0) prefetch_ahead<BITS>(codes, high, g);
      __m256i lo, hi;
      unpack_pair<BITS>(codes, high, g / 2, lo, hi);
      const __m256i xlo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + g * 32));
      const __m256i xhi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + g * 32 + 32));
      __m256i sums;  // codes below 64 times |x| <= 127: the int16 pair sums (and two of them added) fit
      if (BS == 32)
        sums = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo), _mm256_maddubs_epi16(hi, xhi)),
                                 _mm256_shuffle_epi8(sv[0], masks[k]));
      else
        sums = _mm256_add_epi32(
            _mm256_madd_epi16(_mm256_maddubs_epi16(lo, xlo), _mm256_shuffle_epi8(sv[k / 2], masks[2 * (k % 2)])),
            _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xhi), _mm256_shuffle_epi8(sv[k / 2], masks[2 * (k % 2) + 1])));
      isum = _mm256_add_epi32(isum, sums);
    }
    const int16_t* bsum = xsum + q * kBlocks;
    if (w.center) isum = _mm256_sub_epi32(isum, _mm256_mullo_epi32(block_sums_dot<BS>(sc, bsum), center));
    const float d = dx[q * 8];  // the super-block's activation scale (all its groups')
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(d * to_float(sup[2 * q])), acc);
    if (mins)
      share = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_sums_dot<BS>(mins + q * kBlocks, bsum)),
                              _mm256_set1_ps(d * to_float(sup[2 * q + 1])), share);
  }
  return hsum(_mm256_add_ps(acc, share));
}
#endif

#ifdef TM_SIMD
// One activation row against a weight row of 4-, 5- or 8-bit codes (or e2m1 nibbles) with float16 scales,
// and offsets or not, per 32 values and no super-blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, int4 / int8 on
// load): the scales
// are read and multiplied by the activations' eight at a time inside the row loop, and the offsets'
// share (offset minus center times scale, times the activations' block sums xs) taken with them; no
// expand pass over the row first (Blocks::expand: a quarter of the time of a row of 896 columns).
template <int BITS>
inline float row_dot_q8_half(const int8_t* xq, const float* dx, const float* xs, int64_t K, const Blocks& w,
                             int64_t n) {
  const int64_t groups = K / 32;
  const uint8_t* codes = w.codes + n * w.code_bytes;
  const uint8_t* high = w.high ? w.high + n * w.high_bytes : nullptr;
  const c10::Half* sc = w.scales + n * w.nb;
  const c10::Half* of = w.offsets ? w.offsets + n * w.nb : nullptr;
  const __m256 negc = _mm256_set1_ps(-static_cast<float>(w.center));
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), share = _mm256_setzero_ps();
  // the pair of groups g, g + 1 (lanes 0-3, 4-7), i their first's lane in sv
  auto pair = [&](int64_t g, __m256 sv, int i, __m256& into) {
    __m256i lo, hi;
    unpack_pair<BITS>(codes, high, g / 2, lo, hi);
    const int8_t* x = xq + g * 32;
    const __m256i sums = dot4x2(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)), hi,
                                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32)));
    const __m256 lanes = _mm256_permutevar8x32_ps(sv, _mm256_setr_epi32(i, i, i, i, i + 1, i + 1, i + 1, i + 1));
    into = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), lanes, into);
  };
  // one group g, its activations in natural order (8-bit codes, and a paired row's odd last group), i its lane in sv
  auto group = [&](int64_t g, __m256 sv, int i, __m256& into) {
    const __m256i w = unpack32<BITS>(codes, high, g);
    __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + g * 32));
    if (BITS == 8) x = _mm256_sign_epi8(x, w);  // the products are unsigned by signed: |w| times x of w's sign
    const __m256i sums = dot4(BITS == 8 ? _mm256_sign_epi8(w, w) : w, x);
    into = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_permutevar8x32_ps(sv, _mm256_set1_epi32(i)), into);
  };
  // the scales of groups g..g+7 times their activations' (and their offsets' share into `share`)
  auto scales8 = [&](const c10::Half* s8, const c10::Half* o8, const float* d8, const float* x8) {
    const __m256 c = scale_vec(s8);
    share =
        _mm256_fmadd_ps(_mm256_fmadd_ps(negc, c, o8 ? scale_vec(o8) : _mm256_setzero_ps()), _mm256_loadu_ps(x8), share);
    return _mm256_mul_ps(c, _mm256_loadu_ps(d8));
  };
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8) {
    const __m256 sv = scales8(sc + g, of ? of + g : nullptr, dx + g, xs + g);
    for (int i = 0; i < 8; i += 4) {  // 64 bytes of codes a prefetch
      prefetch_ahead<BITS>(codes, high, g + i);
      if (paired(BITS)) {
        pair(g + i, sv, i, acc0);
        pair(g + i + 2, sv, i + 2, acc1);
      } else {
        group(g + i, sv, i, acc0);
        group(g + i + 1, sv, i + 1, acc1);
        prefetch_ahead<BITS>(codes, high, g + i + 2);
        group(g + i + 2, sv, i + 2, acc0);
        group(g + i + 3, sv, i + 3, acc1);
      }
    }
  }
  if (g < groups) {  // the last eight groups' scales (rows have at least eight), those done masked off
    const int64_t base = groups - 8;
    const int off = static_cast<int>(g - base);
    const __m256 keep =
        _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(off - 1)));
    const __m256 c = _mm256_and_ps(scale_vec(sc + base), keep);
    const __m256 o = of ? _mm256_and_ps(scale_vec(of + base), keep) : _mm256_setzero_ps();
    share = _mm256_fmadd_ps(_mm256_fmadd_ps(negc, c, o), _mm256_loadu_ps(xs + base), share);
    const __m256 sv = _mm256_mul_ps(c, _mm256_loadu_ps(dx + base));
    if (paired(BITS))
      for (; g + 2 <= groups; g += 2) pair(g, sv, static_cast<int>(g - base), acc0);
    for (; g < groups; ++g) group(g, sv, static_cast<int>(g - base), acc1);
  }
  return hsum(_mm256_add_ps(_mm256_add_ps(acc0, acc1), share));
}
#endif

// The values that share one activation scale: a K-quant's super-block where the one-row kernel is
// row_dot_q8_super (int8 sub-block scales beside float16 supers), else a 32-value group. Every kernel
// on such a weight rounds the activations alike, so that a token's result does not depend on its batch.
inline int64_t activation_span(const Blocks& w) { return w.scales8 && w.supers ? kSuper : 32; }

template <int BITS, int BS>
void matmul_q8_impl(const torch::Tensor& x, const Blocks& w, torch::Tensor& out) {
  const int64_t M = x.size(0), K = w.K, N = w.N, nw = w.nb, groups = K / 32;
  std::vector<int8_t> xq(M * K);
  std::vector<float> dx(M * groups), xs(M * nw);
  const bool super_rows = paired(BITS) && activation_span(w) == kSuper;  // row_dot_q8_super at one row
  std::vector<int16_t> xsum(super_rows ? M * nw : 0);
  quantize_rows<BS>(x.data_ptr<float>(), M, K, activation_span(w), xq.data(), dx.data(), xs.data(),
                    super_rows ? xsum.data() : nullptr);
#ifdef TM_SIMD
  if (paired(BITS)) interleave_pairs(xq.data(), M, K);
#endif
  float* outp = out.data_ptr<float>();
  // one activation row: its scales go into the weight scales once per weight row
  auto one_row = [&](int64_t i) {
#ifdef TM_SIMD
    if (super_rows) {  // K-quants: no scales to expand (row_dot_q8_super)
      const std::vector<__m256i> masks = spread_masks<BS>();
      return at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
        for (int64_t n = begin; n < end; ++n)
          outp[i * N + n] = row_dot_q8_super<BITS, BS>(xq.data() + i * K, dx.data() + i * groups, xsum.data() + i * nw,
                                                       K, w, n, masks.data());
      });
    }
    if (BS == 32 && w.scales && !w.supers && groups >= 8)  // float16 scales: row_dot_q8_half
      return at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
        for (int64_t n = begin; n < end; ++n)
          outp[i * N + n] =
              row_dot_q8_half<BITS>(xq.data() + i * K, dx.data() + i * groups, xs.data() + i * nw, K, w, n);
      });
#endif
    for_each_row(w, true, dx.data() + i * groups, xs.data() + i * nw,
                 [&](int64_t n, const uint8_t* c, const uint8_t* h, const float* s, const float*, float share) {
                   outp[i * N + n] = row_dot_q8<BITS, BS>(xq.data() + i * K, K, c, h, s) + share;
                 });
  };
#ifdef TM_SIMD
  if (M > 1) return matmul_q8_tiles<BITS, BS>(xq.data(), dx.data(), xs.data(), M, w, outp);
#endif
  for (int64_t i = 0; i < M; ++i) one_row(i);
}

// --- int8 activations against weights repacked into panels at load (llama.cpp's repack, ik_llama.cpp's
// interleaved rows): kPanel weight rows interleaved per 4 values of K, so that one broadcast of 4
// activation bytes meets all of them in one vpdpbusd (or maddubs) and each int32 lane sums one weight
// row's block. A block's integer sums then take their float scales once per block for all eight rows,
// where the row-at-a-time tiles above spend a conversion and two float ops per pair of groups per row;
// and the weights are read as they lie, 32 bytes a load, no per-row strides.
// Panel layout (repack_panels), per panel p of rows 8p..8p+7 (zeros past N) and block b of 32 values:
//   codes  4 bits: uint8 [P, nb, 4, 8, 4], byte (j, r, t) = value 4j + t of row r (low nibble) | value
//          16 + 4j + t (high nibble): one 32-byte load holds values 4j.. and 16 + 4j.. of all eight rows;
//          5 bits: the same 128 bytes of low nibbles, then a plane of their fifth bits, uint8 [8, 4]:
//          bit k of byte (r, t) = the fifth bit of value 4k + t of row r, so that the vector of values
//          4k.. takes its fifth bits from the one plane load with a shift by 4 - k and an and (160 bytes
//          a block: 5 bits a weight, where a byte a code read 8; a one-row step reads all of it a token);
//          8 bits: uint8 [P, nb, 8, 8, 4], byte (j, r, t) = value 4j + t of row r (signed);
//   scales float32 [P, nb, 2, 8]: the rows' block scales, then their offsets with the codes' center
//          folded in (Blocks::expand's fold), so that 4-5-bit codes stay unsigned for vpdpbusd; or
//          [P, nb, 1, 8], the scales alone, where the blocks have no offsets and 4-5-bit codes are
//          centered on panel_center (Q4_0, Q5_0) or 8-bit ones signed (Q8_0): the tiles take the center
//          back as an integer, x's block sum times it (PanelActivations::xc), no float op; float16
//          where every one of them is a float16 value (repack_panels in Python: a sixth fewer bytes a
//          4-bit weight, for the one-row steps that read all of it per token).
constexpr int64_t kPanel = 8;  // weight rows a panel
constexpr int64_t kNibbleBytes = 16 * kPanel;  // a block's low nibbles (4 and 5 bits); 5 bits: the plane next
constexpr int64_t panel_block_bytes(int bits) {
  return bits == 4 ? kNibbleBytes : bits == 5 ? kNibbleBytes + 4 * kPanel : 32 * kPanel;
}
// The center of 4-5-bit codes whose panels have no offsets (Q4_0's and Q5_0's): the tiles take it back
// as an integer (x's sum times it). 8-bit codes are signed: no center.
constexpr int32_t panel_center(int64_t bits) { return bits == 8 ? 0 : 1 << (bits - 1); }
// A block's floats a panel: its rows' scales, then their offsets where the panels have some.
constexpr int64_t panel_scales_per_block(bool offsets) { return (offsets ? 2 : 1) * kPanel; }

// A panel's codes lie block after block, a thread's panels one after another: the tiles ask for the
// lines kPrefetchBytes past the block they start, as the row loops do (the expanded copies stay in L1/L2),
// and a line of the scales' stream a block (their block's 32 or 64 bytes share it or the next's). With
// the weights from memory a 16-row tile runs at a third of its speed in cache (Qwen's gate_up); this
// moved that within the noise of a shared machine (docs/benchmarks/round-3.md, session 7).
inline void prefetch_panel_ahead(const void* block, int64_t bytes) {
  const char* ahead = static_cast<const char*>(block) + kPrefetchBytes;
  for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(ahead + line);
}

#ifdef TM_SIMD
#ifdef __AVX512F__
constexpr int kPanelRows = 8;  // activation rows a tile: 32 vector registers hold 8 integer + 8 float sums
#else
constexpr int kPanelRows = 4;  // 16 registers
#endif
// A row's integer sums over a block, kChains of them (independent chains), and their total as int32.
// vpdpbusd: two int32 chains. maddubs: its int16 pair sums added in int16 while they fit (eight of at
// most 2 x 15 x 127 for 4-bit codes, four of 2 x 31 x 127 for 5-bit ones), then widened; 8-bit
// codes widen each (their pair sums reach 2 x 128 x 127).
template <int BITS>
struct PanelSums {
#ifdef TM_VNNI
  static constexpr int kChains = 2;
  static constexpr bool kBiased8 = true;  // 8 bits: codes + 128 against x, less 128 x's sum (xc) per block
  static constexpr bool kRepayInChain = true;  // a center's repayment: a chain's first value
  static __m256i add(__m256i acc, __m256i u, __m256i s) { return dpbusd(acc, u, s); }
  static __m256i total(const __m256i* sums) { return _mm256_add_epi32(sums[0], sums[1]); }
#else
  static constexpr int kChains = BITS == 5 ? 2 : 1;
  static constexpr bool kBiased8 = false;  // maddubs' int16 pair sums would not hold (code + 128) x
  static constexpr bool kRepayInChain = false;  // nor a center's repayment: taken from the int32 total
  static __m256i add(__m256i acc, __m256i u, __m256i s) {
    const __m256i pairs = _mm256_maddubs_epi16(u, s);
    return BITS == 8 ? _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
                     : _mm256_add_epi16(acc, pairs);
  }
  static __m256i total(const __m256i* sums) {
    if (BITS == 8) return sums[0];
    __m256i t = _mm256_madd_epi16(sums[0], _mm256_set1_epi16(1));
    if (kChains == 2) t = _mm256_add_epi32(t, _mm256_madd_epi16(sums[kChains - 1], _mm256_set1_epi16(1)));
    return t;
  }
#endif
};

// 5 bits: the low nibbles `low` of values 4k.. of the eight rows (k = 0..7) with their fifth bits from
// the block's plane: bit k of each byte to bit 4 (16-bit shifts: the and drops what crossed bytes).
inline __m256i with_fifth_bits(__m256i low, __m256i plane, int k) {
  const __m256i bit = k < 4 ? _mm256_slli_epi16(plane, 4 - k) : _mm256_srli_epi16(plane, k - 4);
  return _mm256_or_si256(low, _mm256_and_si256(bit, _mm256_set1_epi8(0x10)));
}

// `blocks` blocks of 5-bit panels (packed) a byte a code into `bytes` (256 a block: the 8-bit panels'
// layout, the codes unsigned), for tiles that read each block's codes more than once.
inline void expand_panels5(const uint8_t* packed, int64_t blocks, uint8_t* bytes) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  auto load = [](const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); };
  auto store = [](uint8_t* p, __m256i v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); };
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* c = packed + b * panel_block_bytes(5);
    prefetch_panel_ahead(c, panel_block_bytes(5));
    uint8_t* e = bytes + b * panel_block_bytes(8);
    const __m256i plane = load(c + kNibbleBytes);
    for (int j = 0; j < 4; ++j) {
      const __m256i raw = load(c + 32 * j);
      store(e + 32 * j, with_fifth_bits(_mm256_and_si256(raw, m4), plane, j));
      store(e + 32 * (j + 4), with_fifth_bits(_mm256_and_si256(_mm256_srli_epi16(raw, 4), m4), plane, j + 4));
    }
  }
}
#else
constexpr int kPanelRows = 4;
#endif

// Value v (0..31) of panel row c in a block's codes.
template <int BITS>
inline int panel_code(const uint8_t* block, int64_t c, int64_t v) {
  if (BITS != 4 && BITS != 5) {
    const uint8_t byte = block[v / 4 * 32 + c * 4 + v % 4];
    return BITS == 8 ? static_cast<int8_t>(byte) : byte;
  }
  const uint8_t byte = block[(v % 16) / 4 * 32 + c * 4 + v % 4];
  const int low = v < 16 ? byte & 0x0F : byte >> 4;
  return BITS == 5 ? low | ((block[kNibbleBytes + c * 4 + v % 4] >> (v / 4)) & 1) << 4 : low;
}

// RM activation rows (K apart, natural order; dx, xs: their scales and block sums, nb apart) against
// one panel: out[r * ldo + c] for its first `cols` rows c. 5 bits, not PACKED: the codes a byte each
// (expand_panels5), as 8-bit panels hold theirs.
template <int BITS, int RM, bool PACKED, bool OFFSETS, typename S>
inline void panel_tile(const int8_t* xq, const float* dx, const float* xs, const int32_t* xc, int64_t K,
                       const uint8_t* codes, const S* scales, float* out, int64_t ldo, int64_t cols) {
  const int64_t nb = K / 32, bytes = PACKED ? panel_block_bytes(BITS) : panel_block_bytes(8);
  constexpr bool kNibbles = BITS == 4 || (BITS == 5 && PACKED);
  constexpr int64_t per_block = panel_scales_per_block(OFFSETS);
  alignas(32) float total[RM][kPanel];
#ifdef TM_SIMD
  using Sums = PanelSums<BITS>;
  constexpr int kChains = Sums::kChains;
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  constexpr bool kBiased = BITS == 8 && Sums::kBiased8;
  // the codes' center taken back as x's sum times it (xc): 8 bits' + 128 (vpdpbusd), centered 4-5 bits'
  // (where vpdpbusd adds it, from the start of a chain; maddubs' int16 sums take it once widened)
  constexpr bool repay = BITS == 8 ? kBiased : !OFFSETS;
  __m256 acc[RM], off[RM];
  for (int r = 0; r < RM; ++r) acc[r] = off[r] = _mm256_setzero_ps();
  // the offsets' terms as their own sums: a block whose offsets are all zero (Q8_0's) adds +0 to each
  // (the same bits as none): skipped. Few rows add them in the block loop (registers enough; one row's
  // loop of them alone ran latency-bound), more once the integer sums' registers are free: the same bits.
  constexpr bool kOffsetsInLoop = RM <= 2;
  auto add_offsets = [&](int64_t b) {
    if (!OFFSETS) return;
    const __m256 o = scale_vec(scales + b * per_block + kPanel);
    if (_mm256_movemask_ps(_mm256_cmp_ps(o, _mm256_setzero_ps(), _CMP_NEQ_UQ)) == 0) return;
    for (int r = 0; r < RM; ++r) off[r] = _mm256_fmadd_ps(o, _mm256_set1_ps(xs[r * nb + b]), off[r]);
  };
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* c = codes + b * bytes;
    if (PACKED) prefetch_panel_ahead(c, bytes), prefetch_panel_ahead(scales + b * per_block, 1);
    __m256i sums[RM][kChains];  // vpdpbusd, repaying: from less the center times x's sum (xc)
    for (int r = 0; r < RM; ++r)
      for (int h = 0; h < kChains; ++h)
        sums[r][h] = Sums::kRepayInChain && repay && h == 0 ? _mm256_set1_epi32(-xc[r * nb + b]) : _mm256_setzero_si256();
    // weight vector w (values 4j.. of the eight rows) against each row's broadcast x[4j..4j+3], on chain h
    // 8 bits: w + 128 (vpdpbusd), or |w| times x of w's sign (maddubs)
    auto dot = [&](__m256i w, int j, int h) {
      const __m256i u = BITS != 8 ? w : kBiased ? _mm256_xor_si256(w, _mm256_set1_epi8(-128)) : _mm256_sign_epi8(w, w);
      for (int r = 0; r < RM; ++r) {
        int32_t word;
        std::memcpy(&word, xq + r * K + b * 32 + 4 * j, 4);
        __m256i x = _mm256_set1_epi32(word);
        if (BITS == 8 && !kBiased) x = _mm256_sign_epi8(x, w);
        sums[r][h] = Sums::add(sums[r][h], u, x);
      }
    };
    // two weight vectors a step, one per chain (a chain's index must be a constant: sums stay in registers)
    auto load = [&](int j) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32 * j)); };
    const __m256i plane = BITS == 5 && kNibbles ? load(kNibbleBytes / 32) : _mm256_setzero_si256();
    for (int j = 0; j < (kNibbles ? 4 : 8); j += kNibbles ? 1 : 2) {
      if (kNibbles) {
        const __m256i raw = load(j);
        __m256i low = _mm256_and_si256(raw, m4), high = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
        if (BITS == 5) low = with_fifth_bits(low, plane, j), high = with_fifth_bits(high, plane, j + 4);
        dot(low, j, 0);
        dot(high, j + 4, kChains - 1);
      } else {
        dot(load(j), j, 0);
        dot(load(j + 1), j + 1, kChains - 1);
      }
    }
    const __m256 s = scale_vec(scales + b * per_block);
    for (int r = 0; r < RM; ++r) {
      __m256i t = Sums::total(sums[r]);
      if (!Sums::kRepayInChain && repay) t = _mm256_sub_epi32(t, _mm256_set1_epi32(xc[r * nb + b]));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(s, _mm256_set1_ps(dx[r * nb + b])), acc[r]);
    }
    if (kOffsetsInLoop) add_offsets(b);
  }
  if (!kOffsetsInLoop)
    for (int64_t b = 0; b < nb; ++b) add_offsets(b);
  for (int r = 0; r < RM; ++r) _mm256_store_ps(total[r], _mm256_add_ps(acc[r], off[r]));
#else
  for (int r = 0; r < RM; ++r)
    for (int64_t c = 0; c < kPanel; ++c) {
      float sum = 0.f, off = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        int32_t dot = 0;
        for (int64_t v = 0; v < 32; ++v) dot += panel_code<BITS>(codes + b * bytes, c, v) * xq[r * K + b * 32 + v];
        if (BITS != 8 && !OFFSETS) dot -= xc[r * nb + b];  // centered codes
        const S* sc = scales + b * per_block;
        sum += static_cast<float>(dot) * (to_float(sc[c]) * dx[r * nb + b]);
        if (OFFSETS) off += to_float(sc[kPanel + c]) * xs[r * nb + b];
      }
      total[r][c] = sum + off;
    }
#endif
  for (int r = 0; r < RM; ++r) std::memcpy(out + r * ldo, total[r], cols * sizeof(float));
}

template <int BITS, bool PACKED, bool OFFSETS, int RM = kPanelRows, typename S>
inline void panel_tile_rows(int rows, const int8_t* xq, const float* dx, const float* xs, const int32_t* xc,
                            int64_t K, const uint8_t* codes, const S* scales, float* out, int64_t ldo, int64_t cols) {
  if constexpr (RM > 1)
    if (rows < RM)
      return panel_tile_rows<BITS, PACKED, OFFSETS, RM - 1>(rows, xq, dx, xs, xc, K, codes, scales, out, ldo, cols);
  panel_tile<BITS, RM, PACKED, OFFSETS>(xq, dx, xs, xc, K, codes, scales, out, ldo, cols);
}

#if defined(TM_SIMD) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && \
    defined(__AVX512VNNI__)
#define TM_PANEL_PAIRS 1
// Two neighbouring panels (16 weight rows: output columns 8p..8p+15) as one 512-bit vector per step: one broadcast of 4 activation bytes and one vpdpbusd serve 16 weight rows, where
// panel_tile spends one of each on 8, and a block's scales, dx and xs broadcasts are shared the same
// way. Each output lane gets the same integer sums and then the same float operations in the same order
// as panel_tile's, so a row's result is the same bits whichever tile computes it (threads split the
// panels anywhere; an odd one runs panel_tile). kPanelRows rows a tile: 8 integer + 8 float sums.
// Fewer than kPairMinRows rows run panel_tile: with one row a pair's extra shuffle per weight load costs
// more than the shared broadcasts save (Q8_0 / Q5_0 at one row: 0.91x, measured before 8-bit codes took
// +128 in place of a sign op per row). 8-bit codes: w + 128 against x, then x's sum times 128 (xc) taken
// from the block's integer sum: the same integers as |w| against x of w's sign, one op a vector, not a row.
constexpr int kPairMinRows = 4;
// From this many rows a tile's rows give vpdpbusd's latency enough independent chains with one integer
// sum a row (no add of two chains a block); fewer take two.
constexpr int kOneChainRows = 6;
// A wide tile: 2 x kPanelRows rows against a pair, its rows' integer sums kPanelRows at a time (16 float
// + 8 integer sums of the 32 registers), so that a decode batch's 8-bit codes come from memory once a
// block for 16 rows. With one tile after another, the second read them from L1 but the first waited on
// memory for its whole pass: 8-bit codes are twice the bytes of 4-bit ones per product, and their tiles
// wait the longest. From memory (a step's weights), against two 8-row tiles: Q8_0 16-32 rows 1.07-1.23x
// (an LM head, Qwen's qkv); 4-5-bit codes, which a wide tile unpacks again per group, 0.95-1.04x, so they
// keep 8-row tiles. Batches of up to kWideBatch rows (a decode batch); at 64 rows 0.95x.
constexpr int kWideRows = 2 * kPanelRows;
constexpr int64_t kWideBatch = 32;

inline __m512i load_pair(const uint8_t* a, const uint8_t* b) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), 1);
}
inline __m512i with_fifth_bits(__m512i low, __m512i plane, int k) {  // as with_fifth_bits above
  const __m512i bit = k < 4 ? _mm512_slli_epi16(plane, 4 - k) : _mm512_srli_epi16(plane, k - 4);
  return _mm512_ternarylogic_epi32(low, bit, _mm512_set1_epi8(0x10), 0xF8);  // low | (bit & 0x10)
}
inline __m512 scale_pair(const float* a, const float* b) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(a)), _mm256_loadu_ps(b), 1);
}
inline __m512 scale_pair(const c10::Half* a, const c10::Half* b) {
  return _mm512_cvtph_ps(_mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1));
}

// RM activation rows against panels p (codes, scales) and p + 1 (`next_codes`, `next_scales` further):
// out[r * ldo + c] for the pair's first `cols` rows c (9..16); PACKED, OFFSETS as panel_tile's.
template <int BITS, int RM, bool PACKED, bool OFFSETS, typename S>
inline void panel_pair_tile(const int8_t* xq, const float* dx, const float* xs, const int32_t* xc, int64_t K,
                            const uint8_t* codes, int64_t next_codes, const S* scales, int64_t next_scales,
                            float* out, int64_t ldo, int64_t cols) {
  const int64_t nb = K / 32, bytes = PACKED ? panel_block_bytes(BITS) : panel_block_bytes(8);
  constexpr bool kNibbles = BITS == 4 || (BITS == 5 && PACKED);
  constexpr int64_t per_block = panel_scales_per_block(OFFSETS);
  constexpr bool repay = BITS == 8 || !OFFSETS;  // as panel_tile's
  constexpr int kGroup = RM > kPanelRows ? kPanelRows : RM;  // rows whose integer sums are live at once
  constexpr int kChains = kGroup >= kOneChainRows ? 1 : 2;  // a row's independent integer sums
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  __m512 acc[RM];
  for (int r = 0; r < RM; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* c = codes + b * bytes;
    if (PACKED) {
      // the lines kPrefetchBytes ahead in this pair's blocks, or past its last: the next pair's (a pair
      // reads its two panels side by side, so the bytes after panel p are p + 1's, already on their way)
      const int64_t ahead = (b * bytes + kPrefetchBytes < nb * bytes ? 0 : next_codes);
      prefetch_panel_ahead(c + ahead, bytes), prefetch_panel_ahead(c + next_codes + ahead, bytes);
      prefetch_panel_ahead(scales + b * per_block, 1), prefetch_panel_ahead(scales + b * per_block + next_scales, 1);
    }
    const S* sb = scales + b * per_block;
    const __m512 s = scale_pair(sb, sb + next_scales);
    for (int g = 0; g < RM; g += kGroup) {  // a wide tile's groups read the block's codes again, from L1
      __m512i sums[kGroup][kChains];  // repaying: from less the codes' center times x's sum (xc)
      for (int r = 0; r < kGroup; ++r)
        for (int h = 0; h < kChains; ++h)
          sums[r][h] = repay && h == 0 ? _mm512_set1_epi32(-xc[(g + r) * nb + b]) : _mm512_setzero_si512();
      // weight vector w (values 4j.. of the sixteen rows) against each row's broadcast x[4j..4j+3], on chain h
      auto dot = [&](__m512i w, int j, int h) {
        const __m512i u = BITS == 8 ? _mm512_xor_si512(w, _mm512_set1_epi8(-128)) : w;  // 8 bits: w + 128
        for (int r = 0; r < kGroup; ++r) {
          int32_t word;
          std::memcpy(&word, xq + (g + r) * K + b * 32 + 4 * j, 4);
          sums[r][h % kChains] = _mm512_dpbusd_epi32(sums[r][h % kChains], u, _mm512_set1_epi32(word));
        }
      };
      auto load = [&](int j) { return load_pair(c + 32 * j, c + next_codes + 32 * j); };
      const __m512i plane = BITS == 5 && kNibbles ? load(kNibbleBytes / 32) : _mm512_setzero_si512();
      for (int j = 0; j < (kNibbles ? 4 : 8); j += kNibbles ? 1 : 2) {
        if (kNibbles) {
          const __m512i raw = load(j);
          __m512i low = _mm512_and_si512(raw, m4), high = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
          if (BITS == 5) low = with_fifth_bits(low, plane, j), high = with_fifth_bits(high, plane, j + 4);
          dot(low, j, 0);
          dot(high, j + 4, 1);
        } else {
          dot(load(j), j, 0);
          dot(load(j + 1), j + 1, 1);
        }
      }
      for (int r = 0; r < kGroup; ++r) {
        const __m512i total = kChains == 2 ? _mm512_add_epi32(sums[r][0], sums[r][kChains - 1]) : sums[r][0];
        acc[g + r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(s, _mm512_set1_ps(dx[(g + r) * nb + b])),
                                     acc[g + r]);
      }
    }
  }
  // the offsets' terms as panel_tile's
  __m512 off[RM];
  for (int r = 0; r < RM; ++r) off[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < (OFFSETS ? nb : 0); ++b) {
    const S* ob = scales + b * per_block + kPanel;
    const __m512 o = scale_pair(ob, ob + next_scales);
    if (_mm512_cmp_ps_mask(o, _mm512_setzero_ps(), _CMP_NEQ_UQ) == 0) continue;
    for (int r = 0; r < RM; ++r) off[r] = _mm512_fmadd_ps(o, _mm512_set1_ps(xs[r * nb + b]), off[r]);
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << cols) - 1);
  for (int r = 0; r < RM; ++r) _mm512_mask_storeu_ps(out + r * ldo, keep, _mm512_add_ps(acc[r], off[r]));
}

template <int BITS, bool PACKED, bool OFFSETS, int RM = kPanelRows, typename S>
inline void panel_pair_tile_rows(int rows, const int8_t* xq, const float* dx, const float* xs, const int32_t* xc,
                                 int64_t K, const uint8_t* codes, int64_t next_codes, const S* scales,
                                 int64_t next_scales, float* out, int64_t ldo, int64_t cols) {
  if constexpr (RM == kPanelRows)
    if (rows == kWideRows)
      return panel_pair_tile<BITS, kWideRows, PACKED, OFFSETS>(xq, dx, xs, xc, K, codes, next_codes, scales,
                                                              next_scales, out, ldo, cols);
  if constexpr (RM > kPairMinRows)
    if (rows < RM)
      return panel_pair_tile_rows<BITS, PACKED, OFFSETS, RM - 1>(rows, xq, dx, xs, xc, K, codes, next_codes, scales,
                                                                 next_scales, out, ldo, cols);
  panel_pair_tile<BITS, RM, PACKED, OFFSETS>(xq, dx, xs, xc, K, codes, next_codes, scales, next_scales, out, ldo,
                                             cols);
}
#endif

// Every activation row against every panel: per thread, blocks of kRowBlock activation rows (they stay
// in L2: at 256 rows a call ran at half the speed of 64) against chunks of kChunk panels (their codes stay
// in L1) against each tile of kPanelRows activation rows in turn: tile(m0, rows, p, pair) computes rows
// m0.. against panel p, or (pair, AVX-512) panels p and p + 1 at once. Panels [first, last) only.
// prepare(p0, p1, rows) runs on the tile's thread before a chunk's tiles of a row block of `rows` rows.
struct NoPrepare {
  void operator()(int64_t, int64_t, int64_t) const {}
};
// f(begin, end) over [first, last) in pieces of `piece`, which the threads take one at a time as they
// finish the one before (at::parallel_for gives each thread its half at the start: a thread preempted on a
// busy host left its partner waiting at the join for its whole half; here the partner takes what is left).
// Inline inside a parallel region (the compiled decode step's) or with one thread.
template <typename F>
void by_pieces(int64_t first, int64_t last, int64_t piece, const F& f) {
  const int64_t pieces = (last - first + piece - 1) / piece;
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), pieces));
  if (threads <= 1 || omp_in_parallel()) return f(first, last);
  std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(threads)
  for (int64_t k; (k = next.fetch_add(1, std::memory_order_relaxed)) < pieces;)
    f(first + k * piece, std::min(last, first + (k + 1) * piece));
}

// wide: the rows a pair's tile takes where the row block has that many left (kWideRows where the tile
// takes them; single panels take kPanelRows at a time whatever it is).
template <typename Tile, typename Prepare = NoPrepare>
void for_each_panel_tile(int64_t M, int64_t first, int64_t last, const Tile& tile, const Prepare& prepare = {},
                         int64_t wide = kPanelRows) {
  constexpr int64_t kChunk = 4, kRowBlock = 64;
  // pieces of at least 16 panels, about 8 a thread: long enough runs of codes for the prefetchers (a
  // one-row LM head streams 28 MB), enough of them to even out a preempted thread
  const int64_t piece = std::max<int64_t>(4 * kChunk, (last - first) / (8 * at::get_num_threads()) / kChunk * kChunk);
  by_pieces(first, last, piece, [&](int64_t begin, int64_t end) {
    for (int64_t block = 0; block < M; block += kRowBlock)
      for (int64_t p0 = begin; p0 < end; p0 += kChunk) {
        const int64_t p1 = std::min(end, p0 + kChunk), m1 = std::min(M, block + kRowBlock);
        prepare(p0, p1, m1 - block);
        for (int64_t m0 = block, rows; m0 < m1; m0 += rows) {
          rows = m1 - m0 >= wide ? wide : std::min<int64_t>(kPanelRows, m1 - m0);
          int64_t p = p0;
#ifdef TM_PANEL_PAIRS
          for (; p + 1 < p1 && rows >= kPairMinRows; p += 2) tile(m0, static_cast<int>(rows), p, true);
#endif
          for (; p < p1; ++p)
            for (int64_t r0 = 0; r0 < rows; r0 += kPanelRows)
              tile(m0 + r0, static_cast<int>(std::min<int64_t>(kPanelRows, rows - r0)), p, false);
        }
      }
  });
}

template <int BITS, typename S>
void matmul_q8_panels_impl(const PanelActivations& a, const torch::Tensor& codes, const torch::Tensor& scales,
                           torch::Tensor& out, int64_t first, int64_t last) {
  constexpr int64_t bytes = panel_block_bytes(BITS);
  const int64_t M = a.M, K = a.K, nb = K / 32, N = out.size(1), P = codes.size(0);
  TORCH_CHECK(out.size(0) == M && codes.size(1) == nb && codes.size(2) == bytes && P == (N + kPanel - 1) / kPanel,
              "panels do not fit x, out");
  TORCH_CHECK(scales.dim() == 4 && scales.size(1) == nb && (scales.size(2) == 1 || scales.size(2) == 2) &&
                  scales.size(3) == kPanel && static_cast<int64_t>(a.xc.size()) == M * nb,
              "panel scales: [P, K / 32, 1 or 2, 8]; activations with their sums");
  const std::vector<int8_t>& xq = a.xq;
  const std::vector<float>&dx = a.dx, &xs = a.xs;
  const std::vector<int32_t>& xc = a.xc;
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const S* sp = scales.data_ptr<S>();
  float* outp = out.data_ptr<float>();
  // 5 bits: a row block of many tiles meets each block's codes once a tile, so its chunk's codes are
  // expanded to a byte each once first (this thread's `expanded`, from panel `expanded_from`; -1: none).
  // Up to kPackedTiles tiles read the packed codes, each putting the fifth bits back itself: the expand's
  // extra pass over the codes cost more than it saved there (a 16-row decode batch: Qwen2.5-0.5B's Q5_0
  // products 1.08-1.21x, its compiled step 1.07x, two threads), and from about 8 tiles it saves more.
  constexpr int64_t kPackedTiles = 4;
  static thread_local std::vector<uint8_t> expanded;
  static thread_local int64_t expanded_from = -1;
  auto prepare = [&](int64_t p0, int64_t p1, int64_t rows) {
    expanded_from = -1;
#ifdef TM_SIMD
    if (BITS != 5 || rows <= kPackedTiles * kPanelRows) return;
    expanded.resize((p1 - p0) * nb * panel_block_bytes(8));
    expand_panels5(cp + p0 * nb * bytes, (p1 - p0) * nb, expanded.data());
    expanded_from = p0;
#else
    (void)p0, (void)p1, (void)rows;
#endif
  };
  // rows m0.. against panel p (pair: and p + 1), its codes at `c`, a panel's `stride` bytes apart
  auto run = [&](auto packed, auto offsets, int64_t m0, int rows, int64_t p, bool pair, const uint8_t* c,
                 int64_t stride) {
    constexpr bool kPacked = decltype(packed)::value, kOffsets = decltype(offsets)::value;
    constexpr int64_t per_block = panel_scales_per_block(kOffsets);
    const int8_t* xr = xq.data() + m0 * K;
#ifdef TM_PANEL_PAIRS
    if (pair)
      return panel_pair_tile_rows<BITS, kPacked, kOffsets>(
          rows, xr, dx.data() + m0 * nb, xs.data() + m0 * nb, xc.data() + m0 * nb, K, c, stride,
          sp + p * nb * per_block, nb * per_block, outp + m0 * N + p * kPanel, N, std::min(2 * kPanel, N - p * kPanel));
#endif
    (void)pair;
    panel_tile_rows<BITS, kPacked, kOffsets>(rows, xr, dx.data() + m0 * nb, xs.data() + m0 * nb, xc.data() + m0 * nb,
                                             K, c, sp + p * nb * per_block, outp + m0 * N + p * kPanel, N,
                                             std::min(kPanel, N - p * kPanel));
  };
  auto tiles = [&](auto offsets) {
    for_each_panel_tile(
        M, first, last < 0 ? P : last,
        [&](int64_t m0, int rows, int64_t p, bool pair) {
          if constexpr (BITS == 5)
            if (expanded_from >= 0)
              return run(std::false_type(), offsets, m0, rows, p, pair,
                         expanded.data() + (p - expanded_from) * nb * panel_block_bytes(8),
                         nb * panel_block_bytes(8));
          run(std::true_type(), offsets, m0, rows, p, pair, cp + p * nb * bytes, nb * bytes);
        },
#ifdef TM_PANEL_PAIRS
        prepare, BITS == 8 && M <= kWideBatch ? kWideRows : kPanelRows);
#else
        prepare);
#endif
  };
  // a block's scales, and its offsets where there are some (the codes' center otherwise, as integers)
  if (scales.size(2) == 2)
    tiles(std::true_type());
  else
    tiles(std::false_type());
}

// --- Q6_K on panels. The codes lie as the 8-bit panels hold theirs (a byte a value: Q6_K's
// unsigned 0..63, the center 32 not taken, so that vpdpbusd / maddubs take them as they are); in place
// of float scales per 32 values, the file's own integers: per panel and super-block of 256 values,
// kQ6PanelBytes bytes: the 16 sub-block scales (int8, one per 16 values) of the eight rows, sub-block k
// of row r at byte 8k + r, then the rows' super-block scales d as float16 (bytes 128..143). A row's sum
// over a super-block stays an integer to its end, as row_dot_q8_super keeps it: per 16 values, (q . x -
// 32 * sum x) times the sub-block scale, then one float multiply-add of that sum times d times the
// activations' scale (one a super-block: span 256). 8.56 bits a weight, where float32 scales and offsets
// per 16 values would take 12; and per row and 32 values 8 integer dot steps and 6 integer ops, where
// float scales per 16 would take 10 float ops.
constexpr int64_t kQ6Center = 32, kQ6PanelBytes = 16 * kPanel + 2 * kPanel;

#ifdef TM_SIMD
// The vectors of one panel (8 int32 / float lanes: its rows) for q6_panel_tile; next: unused.
struct OnePanel {
  using I = __m256i;
  using F = __m256;
  static I codes(const uint8_t* c, int64_t) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c)); }
  static I words(int32_t w) { return _mm256_set1_epi32(w); }
  // Four weight vectors against four broadcast activation words: per lane, `from` plus its 16 products
  // (codes below 64: dot4x2's int16 pair sums fit).
  static I dot16(I from, const I* w, const I* x) {
    return _mm256_add_epi32(from, _mm256_add_epi32(dot4x2(w[0], x[0], w[1], x[1]), dot4x2(w[2], x[2], w[3], x[3])));
  }
  static I sub_scales(const uint8_t* s, int64_t) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s)));
  }
  static F supers(const uint8_t* s, int64_t) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
  }
  static I izero() { return _mm256_setzero_si256(); }
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static I mullo(I a, I b) { return _mm256_mullo_epi32(a, b); }
  static F fzero() { return _mm256_setzero_ps(); }
  static F set1(float a) { return _mm256_set1_ps(a); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F cvt(I a) { return _mm256_cvtepi32_ps(a); }
  static void store(float* out, F v, int64_t cols) {
    alignas(32) float lane[kPanel];
    _mm256_store_ps(lane, v);
    std::memcpy(out, lane, cols * sizeof(float));
  }
};

#ifdef TM_PANEL_PAIRS
// Two neighbouring panels (the second `next` bytes further) as 16 lanes: the same integer and float
// operations per lane as OnePanel's, so that a row's result is the same bits in either tile.
struct PanelPair {
  using I = __m512i;
  using F = __m512;
  static I codes(const uint8_t* c, int64_t next) { return load_pair(c, c + next); }
  static I words(int32_t w) { return _mm512_set1_epi32(w); }
  static I dot16(I from, const I* w, const I* x) {
    for (int j = 0; j < 4; ++j) from = _mm512_dpbusd_epi32(from, w[j], x[j]);
    return from;
  }
  static I sub_scales(const uint8_t* s, int64_t next) {
    return _mm512_cvtepi8_epi32(_mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s)),
                                                   _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s + next))));
  }
  static F supers(const uint8_t* s, int64_t next) {
    return scale_pair(reinterpret_cast<const c10::Half*>(s), reinterpret_cast<const c10::Half*>(s + next));
  }
  static I izero() { return _mm512_setzero_si512(); }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static I mullo(I a, I b) { return _mm512_mullo_epi32(a, b); }
  static F fzero() { return _mm512_setzero_ps(); }
  static F set1(float a) { return _mm512_set1_ps(a); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F cvt(I a) { return _mm512_cvtepi32_ps(a); }
  static void store(float* out, F v, int64_t cols) {
    _mm512_mask_storeu_ps(out, static_cast<__mmask16>((1u << cols) - 1), v);
  }
};
#endif

// RM activation rows (K apart, natural order; dx their scales per 32 values, nb apart; xc their sums
// times the center per 16 values, K / 16 apart) against one panel (V = OnePanel) or a pair (PanelPair,
// the second panel's codes and scales next_codes, next_scales bytes further): out[r * ldo + c] for the
// first `cols` rows c. The integer sums are exact (per 16 values at most 16 x 32 x 127 in magnitude, times
// a scale of at most 128, 16 of them a super-block: below 2^28).
template <typename V, int RM>
inline void q6_panel_tile(const int8_t* xq, const float* dx, const int32_t* xc, int64_t K, const uint8_t* codes,
                          int64_t next_codes, const uint8_t* scales, int64_t next_scales, float* out, int64_t ldo,
                          int64_t cols) {
  using I = typename V::I;
  const int64_t nb = K / 32, subs = K / 16;
  typename V::F acc[RM];
  for (int r = 0; r < RM; ++r) acc[r] = V::fzero();
  for (int64_t q = 0; q < K / kSuper; ++q) {
    const uint8_t* sq = scales + q * kQ6PanelBytes;
    I isum[RM];
    for (int r = 0; r < RM; ++r) isum[r] = V::izero();
    for (int64_t k = 0; k < kSuper / 16; ++k) {  // the super-block's sub-blocks of 16 values
      const int64_t i = q * (kSuper / 16) + k;
      const uint8_t* c = codes + (i / 2) * panel_block_bytes(8) + (i % 2) * panel_block_bytes(8) / 2;
      I w[4];
      for (int j = 0; j < 4; ++j) w[j] = V::codes(c + 32 * j, next_codes);
      const I sc = V::sub_scales(sq + kPanel * k, next_scales);
      for (int r = 0; r < RM; ++r) {
        I x[4];
        for (int j = 0; j < 4; ++j) {
          int32_t word;
          std::memcpy(&word, xq + r * K + i * 16 + 4 * j, 4);
          x[j] = V::words(word);
        }
        isum[r] = V::add(isum[r], V::mullo(V::dot16(V::words(-xc[r * subs + i]), w, x), sc));
      }
    }
    const typename V::F d = V::supers(sq + 16 * kPanel, next_scales);
    for (int r = 0; r < RM; ++r) acc[r] = V::fma(V::cvt(isum[r]), V::mul(d, V::set1(dx[r * nb + q * 8])), acc[r]);
  }
  for (int r = 0; r < RM; ++r) V::store(out + r * ldo, acc[r], cols);
}

// q6_panel_tile for any rows from kMin to kPanelRows.
template <typename V, int kMin, int RM = kPanelRows>
inline void q6_panel_tile_rows(int rows, const int8_t* xq, const float* dx, const int32_t* xc, int64_t K,
                               const uint8_t* codes, int64_t next_codes, const uint8_t* scales, int64_t next_scales,
                               float* out, int64_t ldo, int64_t cols) {
  if constexpr (RM > kMin)
    if (rows < RM)
      return q6_panel_tile_rows<V, kMin, RM - 1>(rows, xq, dx, xc, K, codes, next_codes, scales, next_scales, out,
                                                 ldo, cols);
  q6_panel_tile<V, RM>(xq, dx, xc, K, codes, next_codes, scales, next_scales, out, ldo, cols);
}
#else
// q6_panel_tile without vectors: the same integer sums, and per row the same float operations in order.
inline void q6_panel_tile_rows(int rows, const int8_t* xq, const float* dx, const int32_t* xc, int64_t K,
                               const uint8_t* codes, const uint8_t* scales, float* out, int64_t ldo, int64_t cols) {
  const int64_t nb = K / 32, subs = K / 16;
  for (int r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      float acc = 0.f;
      for (int64_t q = 0; q < K / kSuper; ++q) {
        const uint8_t* sq = scales + q * kQ6PanelBytes;
        int32_t isum = 0;
        for (int64_t k = 0; k < kSuper / 16; ++k) {
          const int64_t i = q * (kSuper / 16) + k;
          int32_t dot = 0;
          for (int64_t v = 0; v < 16; ++v)
            dot += panel_code<6>(codes + (i / 2) * panel_block_bytes(8), c, (i % 2) * 16 + v) * xq[r * K + i * 16 + v];
          isum += (dot - xc[r * subs + i]) * static_cast<int8_t>(sq[kPanel * k + c]);
        }
        c10::Half d;
        std::memcpy(&d, sq + 16 * kPanel + 2 * c, 2);
        acc = std::fma(static_cast<float>(isum), to_float(d) * dx[r * nb + q * 8], acc);
      }
      out[r * ldo + c] = acc;
    }
}
#endif

// block_quant_matmul_q8_panels on Q6_K's panels (the layout above): the activations rounded per
// super-block (span 256), their integer sums per 16 values times the center subtracted per sub-block.
void matmul_q8_q6_panels(const PanelActivations& a, const torch::Tensor& codes, const torch::Tensor& scales,
                         torch::Tensor& out, int64_t first, int64_t last) {
  const int64_t M = a.M, K = a.K, nb = K / 32, subs = K / 16, N = out.size(1), P = codes.size(0);
  const int64_t bytes = panel_block_bytes(8), supers = K / kSuper;
  TORCH_CHECK(out.size(0) == M && K % kSuper == 0 && codes.size(1) == nb && codes.size(2) == bytes &&
                  P == (N + kPanel - 1) / kPanel && scales.numel() == P * supers * kQ6PanelBytes,
              "Q6_K panels do not fit x, out");
  const std::vector<int8_t>& xq = a.xq;
  const std::vector<float>& dx = a.dx;
  const std::vector<int32_t>& xc = a.xc;
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const uint8_t* sp = scales.data_ptr<uint8_t>();
  float* outp = out.data_ptr<float>();
  const int64_t panel_codes = nb * bytes, panel_scales = supers * kQ6PanelBytes;
  for_each_panel_tile(M, first, last < 0 ? P : last, [&](int64_t m0, int rows, int64_t p, bool pair) {
    const int8_t* xr = xq.data() + m0 * K;
    const float* dr = dx.data() + m0 * nb;
    const int32_t* cr = xc.data() + m0 * subs;
    float* o = outp + m0 * N + p * kPanel;
#ifdef TM_SIMD
#ifdef TM_PANEL_PAIRS
    if (pair)
      return q6_panel_tile_rows<PanelPair, kPairMinRows>(rows, xr, dr, cr, K, cp + p * panel_codes, panel_codes,
                                                         sp + p * panel_scales, panel_scales, o, N,
                                                         std::min(2 * kPanel, N - p * kPanel));
#endif
    (void)pair;
    q6_panel_tile_rows<OnePanel, 1>(rows, xr, dr, cr, K, cp + p * panel_codes, 0, sp + p * panel_scales, 0, o, N,
                                    std::min(kPanel, N - p * kPanel));
#else
    (void)pair;
    q6_panel_tile_rows(rows, xr, dr, cr, K, cp + p * panel_codes, sp + p * panel_scales, o, N,
                       std::min(kPanel, N - p * kPanel));
#endif
  });
}

// Row n's codes into its place r in its panel's blocks `panel` (the layout above matmul_q8_panels_impl;
// 6 bits: a byte a value, as 8).
template <int BITS>
void repack_row_codes(const Blocks& w, int64_t n, int64_t r, uint8_t* panel) {
  constexpr int64_t bytes = panel_block_bytes(BITS == 6 ? 8 : BITS);
  const uint8_t* row = w.codes + n * w.code_bytes;
  const uint8_t* high = w.high ? w.high + n * w.high_bytes : nullptr;
  for (int64_t b = 0; b < w.K / 32; ++b) {
    uint8_t* cb = panel + b * bytes;
    for (int64_t v = 0; v < 32; ++v) {
      const auto code = static_cast<uint8_t>(code_at<BITS>(row, high, b * 32 + v));
      if (BITS != 4 && BITS != 5) {
        cb[v / 4 * 32 + r * 4 + v % 4] = code;
        continue;
      }
      cb[(v % 16) / 4 * 32 + r * 4 + v % 4] |= v < 16 ? code & 0x0F : (code & 0x0F) << 4;
      if (BITS == 5) cb[kNibbleBytes + r * 4 + v % 4] |= (code >> 4) << (v / 4);
    }
  }
}

// The panels of a weight of 4-, 5- or 8-bit codes in blocks of 32 into codes, scales (zeros, shaped as
// the layout above says).
template <int BITS>
void repack_panels_impl(const Blocks& w, torch::Tensor& codes, torch::Tensor& scales) {
  const int64_t P = (w.N + kPanel - 1) / kPanel, nb = w.nb, bytes = panel_block_bytes(BITS);
  TORCH_CHECK(w.bs == 32, "panels hold blocks of 32");
  const int64_t parts = scales.size(2);  // 1: scales only (centered codes), 2: and offsets
  TORCH_CHECK(codes.numel() == P * nb * bytes && scales.numel() == P * nb * parts * kPanel, "panels of other sizes");
  TORCH_CHECK(parts == 2 || (!w.offsets && !w.offsets8 && !w.offsets32 && w.center == panel_center(BITS)),
              "panels without offsets hold codes of the panels' center and no offsets");
  uint8_t* cp = codes.data_ptr<uint8_t>();
  float* sp = scales.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(nb), o(nb);
    for (int64_t p = begin; p < end; ++p)
      for (int64_t r = 0; r < kPanel && p * kPanel + r < w.N; ++r) {
        const int64_t n = p * kPanel + r;
        const bool offsets = w.expand(n, parts == 2, nullptr, nullptr, s.data(), o.data(), nullptr);
        for (int64_t b = 0; b < nb; ++b) {
          float* sb = sp + (p * nb + b) * parts * kPanel;
          sb[r] = s[b];
          if (parts == 2) sb[kPanel + r] = offsets ? o[b] : 0.f;
        }
        repack_row_codes<BITS>(w, n, r, cp + p * nb * bytes);
      }
  });
}

// Q6_K's panels (the layout above q6_panel_tile) into codes, scales (zeros: uint8 [P, K/32, 256] and
// [P, K/256, kQ6PanelBytes]).
void repack_q6_panels(const Blocks& w, torch::Tensor& codes, torch::Tensor& scales) {
  const int64_t P = (w.N + kPanel - 1) / kPanel, nb = w.K / 32, supers = w.K / kSuper;
  TORCH_CHECK(w.bs == 16 && w.scales8 && w.supers && !w.offsets8 && w.center == kQ6Center && w.K % kSuper == 0,
              "6-bit panels hold Q6_K's blocks (int8 sub-block scales per 16, float16 super-block scales, center 32)");
  TORCH_CHECK(codes.numel() == P * nb * panel_block_bytes(8) && scales.numel() == P * supers * kQ6PanelBytes,
              "panels of other sizes");
  uint8_t* cp = codes.data_ptr<uint8_t>();
  uint8_t* sp = scales.data_ptr<uint8_t>();
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t r = 0; r < kPanel && p * kPanel + r < w.N; ++r) {
        const int64_t n = p * kPanel + r;
        for (int64_t q = 0; q < supers; ++q) {
          uint8_t* sq = sp + (p * supers + q) * kQ6PanelBytes;
          for (int64_t k = 0; k < kSuper / 16; ++k)
            sq[kPanel * k + r] = static_cast<uint8_t>(w.scales8[n * w.nb + q * (kSuper / 16) + k]);
          std::memcpy(sq + 16 * kPanel + 2 * r, w.supers + (n * w.supers_per_row + q) * 2, 2);
        }
        repack_row_codes<6>(w, n, r, cp + p * nb * panel_block_bytes(8));
      }
  });
}

// One call per (bits, block) the layouts have: 4, 5 bits in blocks of 32, 6 in blocks of 16, 8 and e2m1 in either.
template <template <int, int> class Op, typename... Args>
void dispatch(int64_t bits, int64_t block, Args&&... args) {
  if (bits == 4 && block == 32)
    Op<4, 32>::run(args...);
  else if (bits == 5 && block == 32)
    Op<5, 32>::run(args...);
  else if (bits == 6 && block == 16)
    Op<6, 16>::run(args...);
  else if (bits == 8 && block == 32)
    Op<8, 32>::run(args...);
  else if (bits == 8 && block == 16)
    Op<8, 16>::run(args...);
  else if (bits == kE2M1 && block == 32)
    Op<kE2M1, 32>::run(args...);
  else if (bits == kE2M1 && block == 16)
    Op<kE2M1, 16>::run(args...);
  else
    TORCH_CHECK(false, "no block kernel for ", bits, "-bit codes in blocks of ", block);
}

template <int B, int S>
struct MatmulOp {
  static void run(const torch::Tensor& x, const Blocks& w, torch::Tensor& o) { matmul_impl<B, S>(x, w, o); }
};
template <int B, int S>
struct MatmulQ8Op {
  static void run(const torch::Tensor& x, const Blocks& w, torch::Tensor& o) { matmul_q8_impl<B, S>(x, w, o); }
};
template <int B, int S>
struct DequantizeOp {
  static void run(const Blocks& w, torch::Tensor& o) { dequantize_impl<B, S>(w, o); }
};

}  // namespace

// x: [M, K] float32; out: [M, N] float32; the weight as `Blocks` lays it out.
void block_quant_matmul(torch::Tensor x, torch::Tensor codes, c10::optional<torch::Tensor> high, torch::Tensor scales,
                        c10::optional<torch::Tensor> offsets, c10::optional<torch::Tensor> supers, int64_t bits,
                        int64_t block, int64_t center, torch::Tensor out) {
  dispatch<MatmulOp>(bits, block, x, Blocks(codes, high, scales, offsets, supers, bits, block, center), out);
}

// The same product with the activations rounded to int8 per 32 values (see matmul_q8_impl).
void block_quant_matmul_q8(torch::Tensor x, torch::Tensor codes, c10::optional<torch::Tensor> high,
                           torch::Tensor scales, c10::optional<torch::Tensor> offsets,
                           c10::optional<torch::Tensor> supers, int64_t bits, int64_t block, int64_t center,
                           torch::Tensor out) {
  dispatch<MatmulQ8Op>(bits, block, x, Blocks(codes, high, scales, offsets, supers, bits, block, center), out);
}

// out: [N, K] float32, the dequantized weight.
void block_quant_dequantize(torch::Tensor codes, c10::optional<torch::Tensor> high, torch::Tensor scales,
                            c10::optional<torch::Tensor> offsets, c10::optional<torch::Tensor> supers, int64_t bits,
                            int64_t block, int64_t center, torch::Tensor out) {
  dispatch<DequantizeOp>(bits, block, Blocks(codes, high, scales, offsets, supers, bits, block, center), out);
}

// A weight's panels for block_quant_matmul_q8_panels, into panel_codes and panel_scales (zeros: uint8
// [P, K/32, 128] for 4-bit codes, [P, K/32, 160] for 5-bit ones, [P, K/32, 256] for 8-bit ones, and
// float32 [P, K/32, 2, 8], P = ceil(N / 8); the layout above matmul_q8_panels_impl; Q6_K: [P, K/32, 256]
// and uint8 [P, K/256, 144], the layout above q6_panel_tile).
void block_quant_repack_panels(torch::Tensor codes, c10::optional<torch::Tensor> high, torch::Tensor scales,
                               c10::optional<torch::Tensor> offsets, c10::optional<torch::Tensor> supers, int64_t bits,
                               int64_t block, int64_t center, torch::Tensor panel_codes, torch::Tensor panel_scales) {
  const Blocks w(codes, high, scales, offsets, supers, bits, block, center);
  if (bits == 4)
    repack_panels_impl<4>(w, panel_codes, panel_scales);
  else if (bits == 5)
    repack_panels_impl<5>(w, panel_codes, panel_scales);
  else if (bits == 8)
    repack_panels_impl<8>(w, panel_codes, panel_scales);
  else if (bits == 6)
    repack_q6_panels(w, panel_codes, panel_scales);
  else
    TORCH_CHECK(false, "panels hold 4-, 5-, 6- or 8-bit codes, not ", bits, "-bit ones");
}

// x [M, K] float32 rounded as the panel products of `bits`-bit codes read it (per `span` values; Q6_K's,
// bits 6: per super-block, with integer sums per 16 values), into `a` (its buffers reused).
void quantize_panel_activations(const torch::Tensor& x, int64_t bits, int64_t span, PanelActivations& a) {
  const int64_t M = x.size(0), K = x.size(1), nb = K / 32;
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && K % span == 0 && (bits != 6 || span == kSuper),
              "panel activations: contiguous float32 rows, whole spans");
  const bool q6 = bits == 6;
  const int64_t sums = q6 ? K / 16 : nb;  // per row: xs, and the integer sums where the codes need them
  a.M = M, a.K = K, a.bits = bits;
  a.xq.resize(M * K);
  a.dx.resize(M * nb);
  a.xs.resize(M * sums);
  std::vector<int16_t> xsum(M * sums);
  if (q6)
    quantize_rows<16>(x.data_ptr<float>(), M, K, kSuper, a.xq.data(), a.dx.data(), a.xs.data(), xsum.data());
  else
    quantize_rows<32>(x.data_ptr<float>(), M, K, span, a.xq.data(), a.dx.data(), a.xs.data(), xsum.data());
  // the sums the tiles repay: x's sum per block times the codes' center: 8 bits, 128 (their codes + 128);
  // 4-5 bits, 8 or 16 (Q4_0's and Q5_0's: panels without offsets); Q6_K, its center
  const int32_t repaid = q6 ? kQ6Center : bits == 8 ? 128 : panel_center(bits);
  a.xc.resize(xsum.size());
  for (size_t i = 0; i < xsum.size(); ++i) a.xc[i] = repaid * xsum[i];
}

// block_quant_matmul_q8 on a weight's panels (x: [M, K] float32, rounded per `span` values; out: [M, N];
// scales float32 or float16; Q6_K's, bits 6: uint8).
void block_quant_matmul_q8_panels(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, int64_t bits,
                                  int64_t span, torch::Tensor out) {
  PanelActivations a;
  quantize_panel_activations(x, bits, span, a);
  block_quant_matmul_q8_panels_range(a, codes, scales, out, 0, -1);
}

// Its output columns of panels [first, last) only (8 first .. 8 last; last < 0: to the end), on activations
// rounded once (quantize_panel_activations) for callers that split a product over threads of their own
// (the compiled decode step): inside a parallel region it runs on the calling thread.
void block_quant_matmul_q8_panels_range(const PanelActivations& a, const torch::Tensor& codes,
                                        const torch::Tensor& scales, torch::Tensor& out, int64_t first, int64_t last) {
  if (a.bits == 6) {  // Q6_K's: its integer sub-block scales and float16 super-block scales as bytes
    TORCH_CHECK(scales.scalar_type() == at::kByte, "Q6_K panel scales: uint8");
    return matmul_q8_q6_panels(a, codes, scales, out, first, last);
  }
  TORCH_CHECK(scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf,
              "panel scales: float32 or float16");
  auto run = [&](auto scale) {
    using S = decltype(scale);
    if (a.bits == 4)
      matmul_q8_panels_impl<4, S>(a, codes, scales, out, first, last);
    else if (a.bits == 5)
      matmul_q8_panels_impl<5, S>(a, codes, scales, out, first, last);
    else if (a.bits == 8)
      matmul_q8_panels_impl<8, S>(a, codes, scales, out, first, last);
    else
      TORCH_CHECK(false, "panels hold 4-, 5- or 8-bit codes, not ", a.bits, "-bit ones");
  };
  if (scales.scalar_type() == at::kHalf)
    run(c10::Half());
  else
    run(float());
}

// --- This machine's int8 peak: kPeakChains independent sums on the instruction the tiles multiply with
// (vpdpbusd on 512- or 256-bit vectors, else AVX2's maddubs), so that `tokenmill plan` sets prefill and
// batches against the hardware's rate rather than a kernel's. Each of the torch threads runs `iterations`
// passes at once; returns the multiply-adds of all of them.
namespace {
constexpr int kPeakChains = 12;  // more than any of these instructions' latency x throughput

template <typename V, typename Step>
int32_t peak_chains(int64_t iterations, V ones, const Step& step) {
  V acc[kPeakChains];  // each from its own start: equal sums would be computed once
  for (int c = 0; c < kPeakChains; ++c) {
    int32_t start[sizeof(V) / 4];
    std::fill(start, start + sizeof(V) / 4, c);
    std::memcpy(static_cast<void*>(&acc[c]), start, sizeof(V));
  }
  for (int64_t i = 0; i < iterations; ++i) {
    for (auto& a : acc) a = step(a, ones);
#if defined(__AVX512F__)
    asm volatile("" : "+v"(ones));  // opaque: the passes may not be folded into fewer
#else
    asm volatile("" : "+x"(ones));
#endif
  }
  int32_t sum = 0, lanes[sizeof(V) / 4];
  for (const auto& a : acc) {
    std::memcpy(lanes, &a, sizeof(V));
    for (int32_t lane : lanes) sum += lane;
  }
  return sum;
}

// one thread's passes: (multiply-adds, a checksum)
std::pair<int64_t, int32_t> peak_passes(int64_t iterations) {
  const int64_t steps = iterations * kPeakChains;
#if defined(TM_PANEL_PAIRS)
  auto step = [](__m512i a, __m512i b) { return _mm512_dpbusd_epi32(a, b, b); };
  return {steps * 64, peak_chains(iterations, _mm512_set1_epi8(1), step)};
#elif defined(TM_VNNI)
  auto step = [](__m256i a, __m256i b) { return dpbusd(a, b, b); };
  return {steps * 32, peak_chains(iterations, _mm256_set1_epi8(1), step)};
#elif defined(TM_SIMD)
  auto step = [](__m256i a, __m256i b) { return _mm256_add_epi16(a, _mm256_maddubs_epi16(b, b)); };
  return {steps * 32, peak_chains(iterations, _mm256_set1_epi8(1), step)};
#else
  int32_t acc[kPeakChains] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}, one = 1;
  for (int64_t i = 0; i < iterations; ++i) {
    for (auto& a : acc) a += one * one;
    asm volatile("" : "+r"(one));
  }
  return {steps, std::accumulate(acc, acc + kPeakChains, 0)};
#endif
}
}  // namespace

int64_t block_quant_int8_peak(int64_t iterations) {
  const int64_t threads = at::get_num_threads();
  std::atomic<int64_t> macs{0};
  std::atomic<int32_t> checksum{0};
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const auto [done, sum] = peak_passes(iterations);
      macs += done;
      checksum += sum;
    }
  });
  TORCH_CHECK(checksum.load() != 1, "unreachable");  // reads the sums: they are computed
  return macs.load();
}

"""Matmul on block-quantized weights with float32 activations, on CPU: w = scale * code + offset per
block of 16 or 32 values, the layout `tokenmill.quantization.gguf` builds from a GGUF file's own
blocks (Q4_0/Q4_1/Q8_0, Q5_0/Q5_1 and the K-quants Q4_K/Q5_K/Q6_K). The weights stay packed (4 or
8 bits a code plus a float32 scale, and offset, per block, instead of 32 bits a weight) and are
dequantized inside the matmul, so a decode step reads 3-7x fewer weight bytes while computing on
the very float32 weights that `gguf.dequantize` gives (the scale * code products are exact in
float32: a float16 scale times a 6-bit sub-scale times a code of at most 8 bits fits 24 bits; the
kernels are built with -ffp-contract=off so nothing else is fused).

Layout:
  4 bits (block 32): codes uint8 [N, K/2]; in each 16-byte block, byte j holds value j (low nibble)
          and value j+16 (high nibble), as in GGUF; scales, offsets float32 [N, K/32].
  8 bits (block 32 or 16): codes int8 [N, K]; scales float32 [N, K/block]; offsets optional.
`matmul` handles few rows of activations (decode) by dequantizing each weight row in registers;
`dequantize` writes the float32 weight for large batches, which then go to torch's GEMM.
"""

from __future__ import annotations

import torch

from tokenmill.kernels import cpu_kernels

BLOCK = 32

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TM_SIMD 1
#endif

namespace {

constexpr int64_t kPrefetchRows = 8;

#ifdef TM_SIMD
using Vec = __m256;  // AVX2: a block of 32 values is four vectors, of 16 two
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
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

// The BS codes of one block as floats (q, not yet scaled); 4-bit blocks are always 32 values.
template <int BITS, int BS>
inline void decode_block(const uint8_t* codes, Vec* f) {
  __m128i a, b;
  if (BS == 16) {
    a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
    f[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a));
    f[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(a, 8)));
  } else if (BITS == 4) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
    const __m128i mask = _mm_set1_epi8(0x0F);
    a = _mm_and_si128(raw, mask);                     // values 0..15
    b = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);  // values 16..31
    f[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(a));
    f[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(a, 8)));
    f[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
    f[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)));
  } else {
    a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
    b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16));
    f[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a));
    f[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(a, 8)));
    f[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    f[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
  }
}
#endif

template <int BITS>
inline float code_at(const uint8_t* block, int j) {
  if (BITS == 4) return static_cast<float>(j < 16 ? (block[j] & 0x0F) : (block[j - 16] >> 4));
  return static_cast<float>(reinterpret_cast<const int8_t*>(block)[j]);
}

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

// Up to four activation rows against one weight row: sum over blocks of d * (x . q), plus the
// offsets' share m * sum(x) (xsum holds each row's per-block sums).
template <int BITS, int BS, int ROWS>
inline void rows_dot(const float* x, int64_t K, const uint8_t* codes, const float* scales, const float* offsets,
                     const float* xsum, float* out, int64_t out_stride) {
  const int64_t nb = K / BS, bytes = BITS * BS / 8;
#ifdef TM_SIMD
  constexpr int kParts = BS / 8, lanes = 8;
  Vec acc[ROWS], acc2[ROWS];  // even and odd blocks accumulate apart: two dependency chains, not one
  for (int r = 0; r < ROWS; ++r) acc[r] = acc2[r] = vzero();
  auto block = [&](int64_t g, Vec* into) {
    Vec f[kParts];
    decode_block<BITS, BS>(codes + g * bytes, f);
    const Vec d = vset1(scales[g]);
    for (int r = 0; r < ROWS; ++r) {
      const float* xb = x + r * K + g * BS;
      Vec s = vmul(vload(xb), f[0]);
      for (int i = 1; i < kParts; ++i) s = vfma(vload(xb + i * lanes), f[i], s);
      into[r] = vfma(s, d, into[r]);
    }
  };
  int64_t g = 0;
  for (; g + 2 <= nb; g += 2) {
    block(g, acc);
    block(g + 1, acc2);
  }
  if (g < nb) block(g, acc);
  float total[ROWS];
  for (int r = 0; r < ROWS; ++r) total[r] = hsum(vadd(acc[r], acc2[r]));
#else
  float total[ROWS] = {};
  for (int64_t g = 0; g < nb; ++g)
    for (int r = 0; r < ROWS; ++r) {
      float s = 0.f;
      for (int j = 0; j < BS; ++j) s += x[r * K + g * BS + j] * code_at<BITS>(codes + g * bytes, j);
      total[r] += scales[g] * s;
    }
#endif
  store_rows<ROWS>(total, offsets, xsum, nb, out, out_stride);
}

template <int BITS, int BS>
void matmul_impl(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                 const c10::optional<torch::Tensor>& offsets, torch::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0), nb = K / BS;
  const float* xp = x.data_ptr<float>();
  const uint8_t* cp = reinterpret_cast<const uint8_t*>(codes.data_ptr());
  const float* sp = scales.data_ptr<float>();
  const float* op = offsets ? offsets->data_ptr<float>() : nullptr;
  float* outp = out.data_ptr<float>();
  const int64_t row_bytes = K * BITS / 8;
  std::vector<float> xsum(M * nb, 0.f);
  if (op)
    for (int64_t i = 0; i < M * nb; ++i)
      for (int64_t j = 0; j < BS; ++j) xsum[i] += xp[i * BS + j];
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* c = cp + n * row_bytes;
      const float *s = sp + n * nb, *o = op ? op + n * nb : nullptr;
      if (n + kPrefetchRows < end) {  // decode is memory-bound: ask for rows ahead of time
        for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(c + kPrefetchRows * row_bytes + b);
        for (int64_t b = 0; b < nb; b += 16) {
          __builtin_prefetch(s + kPrefetchRows * nb + b);
          if (o) __builtin_prefetch(o + kPrefetchRows * nb + b);
        }
      }
      int64_t i = 0;
      for (; i + 4 <= M; i += 4)
        rows_dot<BITS, BS, 4>(xp + i * K, K, c, s, o, xsum.data() + i * nb, outp + i * N + n, N);
      for (; i < M; ++i)
        rows_dot<BITS, BS, 1>(xp + i * K, K, c, s, o, xsum.data() + i * nb, outp + i * N + n, N);
    }
  });
}

// The float32 weight, value by value as gguf computes it: d * q rounded, then + m.
template <int BITS, int BS>
void dequantize_impl(const torch::Tensor& codes, const torch::Tensor& scales,
                     const c10::optional<torch::Tensor>& offsets, torch::Tensor& out) {
  const int64_t N = out.size(0), K = out.size(1), nb = K / BS, bytes = BITS * BS / 8;
  const uint8_t* cp = reinterpret_cast<const uint8_t*>(codes.data_ptr());
  const float* sp = scales.data_ptr<float>();
  const float* op = offsets ? offsets->data_ptr<float>() : nullptr;
  float* outp = out.data_ptr<float>();
  at::parallel_for(0, N * nb, 256, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const uint8_t* block = cp + b * bytes;
      const float d = sp[b], m = op ? op[b] : 0.f;
      float* w = outp + b * BS;
#ifdef TM_SIMD
      Vec f[BS / 8];
      decode_block<BITS, BS>(block, f);
      for (int i = 0; i < BS / 8; ++i) vstore(w + i * 8, vadd(vmul(f[i], vset1(d)), vset1(m)));
#else
      for (int j = 0; j < BS; ++j) w[j] = code_at<BITS>(block, j) * d + m;
#endif
    }
  });
  (void)N;
}

// --- int8 activations (llama.cpp's scheme): each 32-value block of an activation row becomes int8
// codes with one float scale (max |x| / 127), and a weight block's dot product is an integer sum
// times both scales; the offsets meet the rounded activations too, so the result is the rounded
// activations times the exact weights (what `round_activations` + a float GEMM computes). Not exact;
// several times fewer instructions per weight than decoding it to float.

// x [M, K] -> xq int8 [M, K], dx [M, K/32] (scale per 32 values), xs [M, K/BS] (sums of the rounded values).
template <int BS>
void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* xq, float* dx, float* xs) {
  for (int64_t i = 0; i < M * K / 32; ++i) {
    const float* v = x + i * 32;
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(v[j]));
    const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
    dx[i] = d;
    for (int j = 0; j < 32; ++j) xq[i * 32 + j] = static_cast<int8_t>(std::nearbyint(v[j] * id));
  }
  for (int64_t i = 0; i < M * K / BS; ++i) {
    int32_t sum = 0;
    for (int j = 0; j < BS; ++j) sum += xq[i * BS + j];
    xs[i] = dx[i * BS / 32] * static_cast<float>(sum);
  }
}

// Up to four int8 activation rows against one weight row.
template <int BITS, int BS, int ROWS>
inline void rows_dot_q8(const int8_t* xq, const float* dx, int64_t K, const uint8_t* codes, const float* scales,
                        const float* offsets, const float* xsum, float* out, int64_t out_stride) {
  const int64_t nb = K / 32, nw = K / BS;
  float total[ROWS];
#ifdef TM_SIMD
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[ROWS], acc2[ROWS];  // even and odd blocks accumulate apart: two dependency chains, not one
  for (int r = 0; r < ROWS; ++r) acc[r] = acc2[r] = _mm256_setzero_ps();
  auto block = [&](int64_t g, __m256* into) {
    __m256i w;
    if (BITS == 4) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + g * 16));
      const __m128i mask = _mm_set1_epi8(0x0F);
      w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), _mm_and_si128(raw, mask));
    } else {
      w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + g * 32));
    }
    // lanes 0-3 hold values 0..15 of the block, lanes 4-7 values 16..31 (a 16-block each for BS 16)
    const __m256 ws = BS == 32 ? _mm256_set1_ps(scales[g])
                               : _mm256_set_m128(_mm_set1_ps(scales[2 * g + 1]), _mm_set1_ps(scales[2 * g]));
    const __m256i wabs = BITS == 4 ? w : _mm256_sign_epi8(w, w);  // maddubs multiplies unsigned by signed
    for (int r = 0; r < ROWS; ++r) {
      __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * K + g * 32));
      if (BITS == 8) x = _mm256_sign_epi8(x, w);
      const __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, x), ones);
      into[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(ws, _mm256_set1_ps(dx[r * nb + g])), into[r]);
    }
  };
  int64_t g = 0;
  for (; g + 2 <= nb; g += 2) {
    block(g, acc);
    block(g + 1, acc2);
  }
  if (g < nb) block(g, acc);
  for (int r = 0; r < ROWS; ++r) total[r] = hsum(_mm256_add_ps(acc[r], acc2[r]));
#else
  for (int r = 0; r < ROWS; ++r) {
    total[r] = 0.f;
    for (int64_t b = 0; b < nw; ++b) {
      const uint8_t* block = codes + (b * BS / 32) * (32 * BITS / 8);  // the 32-value block holding it
      const int first = static_cast<int>(b * BS % 32);
      int32_t dot = 0;
      for (int j = 0; j < BS; ++j)
        dot += static_cast<int32_t>(code_at<BITS>(block, first + j)) * xq[r * K + b * BS + j];
      total[r] += static_cast<float>(dot) * scales[b] * dx[r * nb + b * BS / 32];
    }
  }
#endif
  store_rows<ROWS>(total, offsets, xsum, nw, out, out_stride);
}

template <int BITS, int BS>
void matmul_q8_impl(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                    const c10::optional<torch::Tensor>& offsets, torch::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0), nw = K / BS;
  std::vector<int8_t> xq(M * K);
  std::vector<float> dx(M * K / 32), xs(M * nw);
  quantize_rows<BS>(x.data_ptr<float>(), M, K, xq.data(), dx.data(), xs.data());
  const uint8_t* cp = reinterpret_cast<const uint8_t*>(codes.data_ptr());
  const float* sp = scales.data_ptr<float>();
  const float* op = offsets ? offsets->data_ptr<float>() : nullptr;
  float* outp = out.data_ptr<float>();
  const int64_t row_bytes = K * BITS / 8, nb = K / 32;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* c = cp + n * row_bytes;
      const float *s = sp + n * nw, *o = op ? op + n * nw : nullptr;
      if (n + kPrefetchRows < end)
        for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(c + kPrefetchRows * row_bytes + b);
      int64_t i = 0;
      for (; i + 4 <= M; i += 4)
        rows_dot_q8<BITS, BS, 4>(xq.data() + i * K, dx.data() + i * nb, K, c, s, o, xs.data() + i * nw,
                                 outp + i * N + n, N);
      for (; i < M; ++i)
        rows_dot_q8<BITS, BS, 1>(xq.data() + i * K, dx.data() + i * nb, K, c, s, o, xs.data() + i * nw,
                                 outp + i * N + n, N);
    }
  });
}

}  // namespace

// x: [M, K] float32; out: [M, N] float32. (bits, block): (4, 32), (8, 32) or (8, 16).
void block_quant_matmul(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                        c10::optional<torch::Tensor> offsets, int64_t bits, int64_t block, torch::Tensor out) {
  if (bits == 4) matmul_impl<4, 32>(x, codes, scales, offsets, out);
  else if (block == 32) matmul_impl<8, 32>(x, codes, scales, offsets, out);
  else matmul_impl<8, 16>(x, codes, scales, offsets, out);
}

// The same product with the activations rounded to int8 per 32 values (see matmul_q8_impl).
void block_quant_matmul_q8(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                           c10::optional<torch::Tensor> offsets, int64_t bits, int64_t block, torch::Tensor out) {
  if (bits == 4) matmul_q8_impl<4, 32>(x, codes, scales, offsets, out);
  else if (block == 32) matmul_q8_impl<8, 32>(x, codes, scales, offsets, out);
  else matmul_q8_impl<8, 16>(x, codes, scales, offsets, out);
}

// out: [N, K] float32, the dequantized weight.
void block_quant_dequantize(torch::Tensor codes, torch::Tensor scales, c10::optional<torch::Tensor> offsets,
                            int64_t bits, int64_t block, torch::Tensor out) {
  if (bits == 4) dequantize_impl<4, 32>(codes, scales, offsets, out);
  else if (block == 32) dequantize_impl<8, 32>(codes, scales, offsets, out);
  else dequantize_impl<8, 16>(codes, scales, offsets, out);
}
"""


FUNCTIONS = ["block_quant_matmul", "block_quant_matmul_q8", "block_quant_dequantize"]


def load():
    """The compiled extension, or None when it cannot be built here."""
    return cpu_kernels()


def block_size(codes: torch.Tensor, scales: torch.Tensor, bits: int) -> int:
    return codes.shape[1] * 8 // bits // scales.shape[1]


def matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
           bits: int) -> torch.Tensor:
    """x [M, K] float32 (contiguous) @ dequantized weight [N, K].T -> [M, N]."""
    out = torch.empty(x.shape[0], codes.shape[0], dtype=torch.float32)
    load().block_quant_matmul(x, codes, scales, offsets, bits, block_size(codes, scales, bits), out)
    return out


def round_activations(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] rounded as `matmul_q8` rounds it: to int8 codes per 32 values, scale max|x| / 127
    (half to even), returned as floats."""
    blocks = x.view(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (torch.round(blocks * inverse) * d).view(x.shape)


def matmul_q8(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
              bits: int) -> torch.Tensor:
    """`matmul` of `round_activations(x)` with integer dot products (close to `matmul`, not exact)."""
    out = torch.empty(x.shape[0], codes.shape[0], dtype=torch.float32)
    load().block_quant_matmul_q8(x, codes, scales, offsets, bits, block_size(codes, scales, bits), out)
    return out


_workspace = torch.empty(0)


def workspace(rows: int, cols: int) -> torch.Tensor:
    """A float32 [rows, cols] scratch buffer shared by all layers (one dequantized weight at a time)."""
    global _workspace
    if _workspace.numel() < rows * cols:
        _workspace = torch.empty(rows * cols)
    return _workspace[: rows * cols].view(rows, cols)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, bits: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 weight [N, K] (into `out` when given)."""
    if out is None:
        out = torch.empty(codes.shape[0], codes.shape[1] * 8 // bits, dtype=torch.float32)
    load().block_quant_dequantize(codes, scales, offsets, bits, block_size(codes, scales, bits), out)
    return out

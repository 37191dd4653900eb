"""Matmul on GGUF block-quantized weights (Q4_0, Q4_1, Q8_0) with float32 activations, on CPU.

A GGUF file stores each weight row in blocks of 32 values with a float16 scale `d` (and, for
Q4_1, a float16 offset `m`): w = d * q + m. We keep exactly those blocks (4 or 8 bits a weight
instead of 32) and dequantize inside the matmul, so a decode step reads 4-7x fewer weight bytes
while computing on the very float32 weights that `gguf.dequantize` gives: d * q is rounded, then
m is added, in the same order (the kernel is built with -ffp-contract=off so that is not fused).

Layout (ours, built by `tokenmill.quantization.gguf.BlockQuantLinearMethod`):
  4 bits: codes uint8 [N, K/2]; in each 16-byte block, byte j holds value j (low nibble) and
          value j+16 (high nibble), as in GGUF; scales, offsets float32 [N, K/32]
          (Q4_0 becomes offsets = -8 d, which is exactly its d * (q - 8)).
  8 bits: codes int8 [N, K]; scales float32 [N, K/32]; no offsets.
`matmul` handles few rows of activations (decode) by dequantizing each weight row in registers;
`dequantize` writes the float32 weight for large batches, which then go to torch's GEMM.
"""

from __future__ import annotations

import torch

from tokenmill.kernels import build

BLOCK = 32

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TM_SIMD 1
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kPrefetchRows = 8;

#ifdef TM_SIMD
using Vec = __m256;  // AVX2: one block of 32 values is four vectors
constexpr int kParts = 4;
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

// The 32 codes of one block as floats (q, not yet scaled).
template <int BITS>
inline void decode_block(const uint8_t* codes, Vec f[kParts]) {
  __m128i a, b;
  if (BITS == 4) {
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

// Up to four activation rows against one weight row: sum over blocks of d * (x . q), plus the
// offsets' share m * sum(x) (xsum holds each row's per-block sums).
template <int BITS, int ROWS>
inline void rows_dot(const float* x, int64_t K, const uint8_t* codes, const float* scales, const float* offsets,
                     const float* xsum, float* out, int64_t out_stride) {
  const int64_t nb = K / kBlock, bytes = BITS * 4;
#ifdef TM_SIMD
  constexpr int lanes = kBlock / kParts;
  Vec acc[ROWS], acc2[ROWS];  // even and odd blocks accumulate apart: two dependency chains, not one
  for (int r = 0; r < ROWS; ++r) acc[r] = acc2[r] = vzero();
  auto block = [&](int64_t g, Vec* into) {
    Vec f[kParts];
    decode_block<BITS>(codes + g * bytes, f);
    const Vec d = vset1(scales[g]);
    for (int r = 0; r < ROWS; ++r) {
      const float* xb = x + r * K + g * kBlock;
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
      for (int j = 0; j < kBlock; ++j) s += x[r * K + g * kBlock + j] * code_at<BITS>(codes + g * bytes, j);
      total[r] += scales[g] * s;
    }
#endif
  for (int r = 0; r < ROWS; ++r) {
    if (offsets)
      for (int64_t g = 0; g < nb; ++g) total[r] += offsets[g] * xsum[r * nb + g];
    out[r * out_stride] = total[r];
  }
}

template <int BITS>
void matmul_impl(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                 const c10::optional<torch::Tensor>& offsets, torch::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0), nb = K / kBlock;
  const float* xp = x.data_ptr<float>();
  const uint8_t* cp = reinterpret_cast<const uint8_t*>(codes.data_ptr());
  const float* sp = scales.data_ptr<float>();
  const float* op = offsets ? offsets->data_ptr<float>() : nullptr;
  float* outp = out.data_ptr<float>();
  const int64_t row_bytes = K * BITS / 8;
  std::vector<float> xsum(M * nb, 0.f);
  if (op)
    for (int64_t i = 0; i < M * nb; ++i)
      for (int64_t j = 0; j < kBlock; ++j) xsum[i] += xp[i * kBlock + j];
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
        rows_dot<BITS, 4>(xp + i * K, K, c, s, o, xsum.data() + i * nb, outp + i * N + n, N);
      for (; i < M; ++i)
        rows_dot<BITS, 1>(xp + i * K, K, c, s, o, xsum.data() + i * nb, outp + i * N + n, N);
    }
  });
}

// The float32 weight, value by value as gguf computes it: d * q rounded, then + m.
template <int BITS>
void dequantize_impl(const torch::Tensor& codes, const torch::Tensor& scales,
                     const c10::optional<torch::Tensor>& offsets, torch::Tensor& out) {
  const int64_t N = out.size(0), K = out.size(1), nb = K / kBlock, bytes = BITS * 4;
  const uint8_t* cp = reinterpret_cast<const uint8_t*>(codes.data_ptr());
  const float* sp = scales.data_ptr<float>();
  const float* op = offsets ? offsets->data_ptr<float>() : nullptr;
  float* outp = out.data_ptr<float>();
  at::parallel_for(0, N * nb, 256, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const uint8_t* block = cp + b * bytes;
      const float d = sp[b], m = op ? op[b] : 0.f;
      float* w = outp + b * kBlock;
#ifdef TM_SIMD
      Vec f[kParts];
      decode_block<BITS>(block, f);
      for (int i = 0; i < kParts; ++i) vstore(w + i * (kBlock / kParts), vadd(vmul(f[i], vset1(d)), vset1(m)));
#else
      for (int j = 0; j < kBlock; ++j) w[j] = code_at<BITS>(block, j) * d + m;
#endif
    }
  });
  (void)N;
}

}  // namespace

// x: [M, K] float32; out: [M, N] float32. bits: 4 or 8.
void block_quant_matmul(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                        c10::optional<torch::Tensor> offsets, int64_t bits, torch::Tensor out) {
  if (bits == 4) matmul_impl<4>(x, codes, scales, offsets, out);
  else matmul_impl<8>(x, codes, scales, offsets, out);
}

// out: [N, K] float32, the dequantized weight.
void block_quant_dequantize(torch::Tensor codes, torch::Tensor scales, c10::optional<torch::Tensor> offsets,
                            int64_t bits, torch::Tensor out) {
  if (bits == 4) dequantize_impl<4>(codes, scales, offsets, out);
  else dequantize_impl<8>(codes, scales, offsets, out);
}
"""


def load():
    """The compiled extension, or None when it cannot be built here."""
    return build("block_quant", _SOURCE, ["block_quant_matmul", "block_quant_dequantize"],
                 extra_cflags=["-ffp-contract=off"])


def matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
           bits: int) -> torch.Tensor:
    """x [M, K] float32 (contiguous) @ dequantized weight [N, K].T -> [M, N]."""
    out = torch.empty(x.shape[0], codes.shape[0], dtype=torch.float32)
    load().block_quant_matmul(x, codes, scales, offsets, bits, out)
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
        out = torch.empty(codes.shape[0], scales.shape[1] * BLOCK, dtype=torch.float32)
    load().block_quant_dequantize(codes, scales, offsets, bits, out)
    return out

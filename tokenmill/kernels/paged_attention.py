"""A C++ paged-attention kernel for decode on CPU, compiled on first use (see `tokenmill.kernels`).

Decode attention reads each sequence's K/V straight from its cache blocks through the block table:
no gather copy, no padding to the longest sequence. One (sequence, kv head) pair per task, OpenMP
across tasks, the head-dim loops left to the compiler's vectoriser. If the build fails (no
compiler, no OpenMP), `load()` returns None and the torch backend's gather + SDPA path is used.
"""

from __future__ import annotations

import torch

from tokenmill.kernels import build

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

// k, v: [T, KVH, D] with a contiguous last dim (views into the fused qkv output);
// k_cache, v_cache: [num_blocks, block_size, KVH, D] contiguous; slots: [T] int64 (block * block_size + offset).
void write_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots) {
  const int64_t T = k.size(0), KVH = k.size(1), D = k.size(2);
  const int64_t* sp = slots.data_ptr<int64_t>();
  const float *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  float *kc = k_cache.data_ptr<float>(), *vc = v_cache.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < KVH; ++h) {
      std::memcpy(kc + (sp[t] * KVH + h) * D, kp + t * k.stride(0) + h * k.stride(1), D * sizeof(float));
      std::memcpy(vc + (sp[t] * KVH + h) * D, vp + t * v.stride(0) + h * v.stride(1), D * sizeof(float));
    }
}

// q: [B, H, D]; k_cache, v_cache: [num_blocks, block_size, KVH, D]; block_tables: [B, max_blocks] int64;
// context_lens: [B] int64; out: [B, H, D]. All float32 and contiguous.
void paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor block_tables, torch::Tensor context_lens, double scale,
                            torch::Tensor out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2), G = H / KVH;
  const int64_t max_blocks = block_tables.size(1);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(G * D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / KVH, kvh = task % KVH;
      const int64_t L = lens[b];
      const int64_t* table = tables + b * max_blocks;
      const float* qb = qp + (b * H + kvh * G) * D;
      scores.assign(G * L, 0.f);
      for (int64_t t = 0; t < L; ++t) {
        const float* k = kp + ((table[t / BS] * BS + t % BS) * KVH + kvh) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qb + g * D;
          float dot = 0.f;
          #pragma omp simd reduction(+:dot)
          for (int64_t d = 0; d < D; ++d) dot += qg[d] * k[d];
          scores[g * L + t] = dot * fscale;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* s = scores.data() + g * L;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < L; ++t) m = std::max(m, s[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < L; ++t) { s[t] = std::exp(s[t] - m); sum += s[t]; }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < L; ++t) s[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < L; ++t) {
        const float* v = vp + ((table[t / BS] * BS + t % BS) * KVH + kvh) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float w = scores[g * L + t];
          float* a = acc.data() + g * D;
          #pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] += w * v[d];
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* o = op + (b * H + kvh * G + g) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = acc[g * D + d];
      }
    }
  });
}
"""


def load():
    """The compiled extension, or None when it cannot be built here."""
    return build("cpu_attention", _SOURCE, ["paged_decode_attention", "write_kv"])


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store the step's new keys and values at their cache slots, in one call for both."""
    load().write_kv(k, v, k_cache, v_cache, slot_mapping)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    out = torch.empty_like(q)
    load().paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, out)
    return out

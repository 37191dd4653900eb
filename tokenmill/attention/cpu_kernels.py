"""A C++ paged-attention kernel for decode on CPU, compiled on first use with the system compiler.

Decode attention reads each sequence's K/V straight from its cache blocks through the block table:
no gather copy, no padding to the longest sequence. One (sequence, kv head) pair per task, OpenMP
across tasks, the head-dim loops left to the compiler's vectoriser. If the build fails (no
compiler, no OpenMP), `load()` returns None and the torch backend's gather + SDPA path is used.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys

import torch

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>
#include <vector>

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

_module = None
_tried = False


def load():
    """The compiled extension, or None when it cannot be built here (logged once)."""
    global _module, _tried
    if _tried:
        return _module
    _tried = True
    if os.environ.get("TOKENMILL_DISABLE_CPU_KERNELS"):
        return None
    # the build runs `ninja` from PATH; the one pip installed sits next to this Python
    bin_dir = os.path.dirname(sys.executable)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    try:
        from torch.utils.cpp_extension import load_inline

        _module = load_inline(
            name=f"tokenmill_cpu_attention_{_cpu_tag()}",  # -march=native: one build per CPU kind
            cpp_sources=_SOURCE,
            functions=["paged_decode_attention"],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # no compiler, no ninja, no OpenMP: fall back to torch ops
        logger.warning("CPU paged-attention kernel unavailable (%s); using the torch gather path", e)
        _module = None
    return _module


def _cpu_tag() -> str:
    """A short tag of this CPU's instruction sets, so a build cached for one CPU is never loaded on another."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return hashlib.sha256(f"{platform.machine()} {flags}".encode()).hexdigest()[:10]


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    out = torch.empty_like(q)
    _module.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, out)
    return out

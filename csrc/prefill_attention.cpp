#include "prefill_attention.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include "attention_vec.h"

// Flash-style: a task is a tile of kQueryTile queries for the G query heads of one kv head (its rows, G per
// query); it walks the keys a tile of kKeyTile at a time, each tile's keys and values converted to float32
// once for all the rows, and keeps each row's running softmax (largest score m, sum l of e^(score - m), the
// weighted values o, rescaled when m grows): no score matrix beyond one tile's. The lanes of the score
// vectors are rows (the queries transposed once per task, each key feature broadcast), so the softmax is
// lane-wise with no horizontal sums, and every row's arithmetic is its own: the same whatever rows share
// its task. Key tiles sit at fixed positions of the sequence ([32 t, 32 t + 32)), a row runs the tiles
// its task walks, and a tile it cannot see changes nothing (its e^ are exactly 0, its rescale exactly 1),
// so a row's result depends neither on how the prompt was cut into chunks nor on the thread count.
constexpr int64_t kQueryTile = 16;
constexpr int64_t kKeyTile = 32;
constexpr float kInf = std::numeric_limits<float>::infinity();

// The portable build's vector: one lane, a multiply-add as a multiply and an add (x86-64 has no FMA).
struct Scalar {
  using V = float;
  static constexpr int kLanes = 1;
  static V zero() { return 0.f; }
  static V set1(float x) { return x; }
  static V mul(V a, V b) { return a * b; }
  static V fma(V a, V b, V c) { return a * b + c; }
  static void store(float* p, V a) { *p = a; }
  template <typename T>
  static V load(const T* p) {
    return to_f32(*p);
  }
};

// Lane-wise add and max, and e^x with e^-inf exactly 0 (exp8 clamps x at -88.4: a masked key would weigh
// ~1e-38, and a row's result would depend on which keys its tile held).
inline float add_lanes(float a, float b) { return a + b; }
inline float max_lanes(float a, float b) { return std::max(a, b); }
inline float exp_or_zero(float x) { return x == -kInf ? 0.f : std::exp(x); }
#ifdef TM_ATTN_SIMD
inline __m256 add_lanes(__m256 a, __m256 b) { return _mm256_add_ps(a, b); }
inline __m256 max_lanes(__m256 a, __m256 b) { return _mm256_max_ps(a, b); }
inline __m256 exp_or_zero(__m256 x) {
  return _mm256_andnot_ps(_mm256_cmp_ps(x, _mm256_set1_ps(-kInf), _CMP_EQ_OQ), exp8(x));
}
#endif
#ifdef TM_ATTN_AVX512
inline __m512 add_lanes(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }
inline __m512 max_lanes(__m512 a, __m512 b) { return _mm512_max_ps(a, b); }
inline __m512 exp_or_zero(__m512 x) {
  const __m512 e = _mm512_insertf32x8(_mm512_castps256_ps512(exp8(_mm512_castps512_ps256(x))),
                                      exp8(_mm512_extractf32x8_ps(x, 1)), 1);
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-kInf), _CMP_NEQ_OQ), e);
}
#endif

// Register blocks (as many accumulators as the registers hold beside their operands): scores kScoreKeys keys
// x kScoreVectors vectors of rows, weighted values kWeighRows rows x kWeighVectors vectors of features.
template <typename Vec>
struct Blocks {  // 16 registers
  static constexpr int kScoreKeys = 4, kScoreVectors = 2, kWeighRows = 2, kWeighVectors = 4;
};
#ifdef TM_ATTN_AVX512
template <>
struct Blocks<Zmm> {  // 32 registers
  static constexpr int kScoreKeys = 8, kScoreVectors = 3, kWeighRows = 6, kWeighVectors = 4;
};
using Lanes = Zmm;
#elif defined(TM_ATTN_SIMD)
using Lanes = Ymm;
#else
using Lanes = Scalar;
#endif

// s[j][rows] = the dot products of JB keys (k: rows of D floats) with NC vectors of rows' queries (qt: [D]
// rows of `stride` floats, the queries transposed); s rows `stride` floats apart. Each a sum over d in order.
template <typename Vec, int JB, int NC>
inline void score_block(const float* k, int64_t D, const float* qt, int64_t stride, float* s) {
  constexpr int W = Vec::kLanes;
  typename Vec::V acc[JB][NC];
  for (int j = 0; j < JB; ++j)
    for (int c = 0; c < NC; ++c) acc[j][c] = Vec::zero();
  for (int64_t d = 0; d < D; ++d) {
    typename Vec::V q[NC];
    for (int c = 0; c < NC; ++c) q[c] = Vec::load(qt + d * stride + c * W);
    for (int j = 0; j < JB; ++j) {
      const auto kd = Vec::set1(k[j * D + d]);
      for (int c = 0; c < NC; ++c) acc[j][c] = Vec::fma(kd, q[c], acc[j][c]);
    }
  }
  for (int j = 0; j < JB; ++j)
    for (int c = 0; c < NC; ++c) Vec::store(s + j * stride + c * W, acc[j][c]);
}

template <typename Vec, int JB, int NC>
void score_rows(const float* k, int64_t D, const float* qt, int64_t stride, int64_t vectors, float* s) {
  constexpr int W = Vec::kLanes;
  int64_t c = 0;
  for (; c + NC <= vectors; c += NC) score_block<Vec, JB, NC>(k, D, qt + c * W, stride, s + c * W);
  if constexpr (NC > 1)
    if (c < vectors) score_rows<Vec, JB, NC - 1>(k, D, qt + c * W, stride, vectors - c, s + c * W);
}

// o[r] (RB rows `width` floats apart, NV vectors of them) = o[r] alpha[r] + the sum over the tile's first
// `keys` keys j of p[j][r] v[j] (p rows `stride` floats apart, v rows `width`): each a sum over j in order.
template <typename Vec, int RB, int NV>
inline void weigh_block(const float* p, int64_t stride, const float* v, int64_t width, const float* alpha,
                        int64_t keys, float* o) {
  constexpr int W = Vec::kLanes;
  typename Vec::V acc[RB][NV];
  for (int r = 0; r < RB; ++r) {
    const auto a = Vec::set1(alpha[r]);
    for (int c = 0; c < NV; ++c) acc[r][c] = Vec::mul(Vec::load(o + r * width + c * W), a);
  }
  for (int64_t j = 0; j < keys; ++j) {
    typename Vec::V x[NV];
    for (int c = 0; c < NV; ++c) x[c] = Vec::load(v + j * width + c * W);
    for (int r = 0; r < RB; ++r) {
      const auto w = Vec::set1(p[j * stride + r]);
      for (int c = 0; c < NV; ++c) acc[r][c] = Vec::fma(w, x[c], acc[r][c]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < NV; ++c) Vec::store(o + r * width + c * W, acc[r][c]);
}

template <typename Vec, int RB, int NV>
void weigh_vectors(const float* p, int64_t stride, const float* v, int64_t width, const float* alpha, int64_t keys,
                   int64_t vectors, float* o) {
  constexpr int W = Vec::kLanes;
  int64_t c = 0;
  for (; c + NV <= vectors; c += NV) weigh_block<Vec, RB, NV>(p, stride, v + c * W, width, alpha, keys, o + c * W);
  if constexpr (NV > 1)
    if (c < vectors) weigh_vectors<Vec, RB, NV - 1>(p, stride, v + c * W, width, alpha, keys, vectors - c, o + c * W);
}

template <typename Vec, int RB, int NV>  // rows (1 .. RB) rows
void weigh_rows(int64_t rows, const float* p, int64_t stride, const float* v, int64_t width, const float* alpha,
                int64_t keys, int64_t vectors, float* o) {
  if constexpr (RB > 1)
    if (rows < RB) return weigh_rows<Vec, RB - 1, NV>(rows, p, stride, v, width, alpha, keys, vectors, o);
  weigh_vectors<Vec, RB, NV>(p, stride, v, width, alpha, keys, vectors, o);
}

// dst = a cache row (len elements) as float32 times its scale (1 unless quantized: exact).
template <typename Vec, typename T>
inline void convert_row(const T* src, int64_t len, float scale, float* dst) {
  constexpr int W = Vec::kLanes;
  int64_t d = 0;
  for (; d + W <= len; d += W) Vec::store(dst + d, Vec::mul(Vec::load(src + d), Vec::set1(scale)));
  for (; d < len; ++d) dst[d] = to_f32(src[d]) * scale;
}

// A task's scratch (one per thread): qt [D][R] its queries transposed (times the softmax scale), k [kKeyTile][D]
// and v [kKeyTile][DVp] a tile's keys and values as float32, s [kKeyTile][R] their scores, then weights; o
// [R][DVp] the rows' weighted values, m, l, alpha [R] their running max, sum and the tile's rescale.
struct Scratch {
  std::vector<float> qt, k, v, s, o, m, l, alpha;
  Scratch(int64_t R, int64_t D, int64_t DVp)
      : qt(D * R), k(kKeyTile * D), v(kKeyTile * DVp, 0.f), s(kKeyTile * R), o(R * DVp), m(R), l(R), alpha(R) {}
};

// The optional inputs: a quantized cache's row scales, the heads' sinks, and the chunk's own keys and values
// as computed (read in place of the cache's rows at positions from `start` on).
struct Extras {
  const c10::BFloat16 *k_scales = nullptr, *v_scales = nullptr;
  const float* sinks = nullptr;
  const float *k_new = nullptr, *v_new = nullptr;
  int64_t k_new_row = 0, k_new_head = 0, v_new_row = 0, v_new_head = 0;
};

template <typename Vec, typename T>
struct PrefillTasks {
  static constexpr int W = Vec::kLanes;
  using B = Blocks<Vec>;
  const int64_t n, H, D, DV, BS, KVH, G, start, window, q_row, q_head, k_row, k_head, v_row, v_head, R, DVp;
  const float scale, cap;
  const float* qp;
  const T *kp, *vp;
  const int64_t* table;
  float* op;
  const Extras e;

  PrefillTasks(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
               const torch::Tensor& block_table, int64_t start_, double scale_, int64_t window_, double cap_,
               torch::Tensor& out, const Extras& extras)
      : n(q.size(0)), H(q.size(1)), D(q.size(2)), DV(v_cache.size(3)), BS(k_cache.size(1)), KVH(k_cache.size(2)),
        G(H / KVH), start(start_), window(window_), q_row(q.stride(0)), q_head(q.stride(1)), k_row(k_cache.stride(1)),
        k_head(k_cache.stride(2)), v_row(v_cache.stride(1)), v_head(v_cache.stride(2)),
        R((kQueryTile * G + W - 1) / W * W), DVp((DV + W - 1) / W * W), scale(static_cast<float>(scale_)),
        cap(static_cast<float>(cap_)), qp(q.data_ptr<float>()), kp(k_cache.data_ptr<T>()), vp(v_cache.data_ptr<T>()),
        table(block_table.data_ptr<int64_t>()), op(out.data_ptr<float>()), e(extras) {}

  int64_t tasks() const { return (n + kQueryTile - 1) / kQueryTile * KVH; }

  // task: the last query tiles first (they see the most keys), so that threads taking tasks in turn
  // finish together.
  void run(int64_t task, Scratch& x) const {
    const int64_t tile = (n + kQueryTile - 1) / kQueryTile - 1 - task / KVH, kvh = task % KVH;
    const int64_t i0 = tile * kQueryTile, queries = std::min(kQueryTile, n - i0), rows = queries * G;
    const int64_t first = start + i0, last = first + queries - 1;  // positions of its first and last queries
    auto pos = [&](int64_t r) { return first + std::min(r / G, queries - 1); };  // padding rows: the last's
    auto begin = [&](int64_t p) { return window > 0 ? std::max<int64_t>(0, p - window + 1) : 0; };
    for (int64_t r = 0; r < R; ++r) {  // padding rows: zeros (their results are not stored)
      const float* qr = r < rows ? qp + (i0 + r / G) * q_row + (kvh * G + r % G) * q_head : nullptr;
      for (int64_t d = 0; d < D; ++d) x.qt[d * R + r] = qr ? qr[d] * scale : 0.f;
      x.m[r] = e.sinks && qr ? e.sinks[kvh * G + r % G] : -std::numeric_limits<float>::max();
      x.l[r] = e.sinks && qr ? 1.f : 0.f;
    }
    std::fill(x.o.begin(), x.o.end(), 0.f);
    const int64_t lo = begin(first), vectors = (rows + W - 1) / W;
    for (int64_t k0 = lo / kKeyTile * kKeyTile; k0 <= last; k0 += kKeyTile) {
      const int64_t from = std::max(k0, lo), to = std::min(k0 + kKeyTile, last + 1);  // the keys read
      for (int64_t j = 0; j < kKeyTile; ++j) {
        float *kj = x.k.data() + j * D, *vj = x.v.data() + j * DVp;
        if (k0 + j < from || k0 + j >= to) {  // seen by no row: zeros, never the slot's bytes (maybe not finite)
          std::fill(kj, kj + D, 0.f);
          std::fill(vj, vj + DV, 0.f);
          continue;
        }
        if (e.k_new && k0 + j >= start) {
          const int64_t i = k0 + j - start;
          convert_row<Vec>(e.k_new + i * e.k_new_row + kvh * e.k_new_head, D, 1.f, kj);
          convert_row<Vec>(e.v_new + i * e.v_new_row + kvh * e.v_new_head, DV, 1.f, vj);
          continue;
        }
        const int64_t slot = table[(k0 + j) / BS] * BS + (k0 + j) % BS, at = slot * KVH + kvh;
        convert_row<Vec>(kp + slot * k_row + kvh * k_head, D, e.k_scales ? float(e.k_scales[at]) : 1.f, kj);
        convert_row<Vec>(vp + slot * v_row + kvh * v_head, DV, e.v_scales ? float(e.v_scales[at]) : 1.f, vj);
        const int64_t ahead = k0 + j + kKeyTile;  // the next tile's row, asked into cache
        if (ahead <= last) {
          const int64_t next = table[ahead / BS] * BS + ahead % BS;
          for (int64_t d = 0; d < D; d += 64 / sizeof(T)) __builtin_prefetch(kp + next * k_row + kvh * k_head + d);
          for (int64_t d = 0; d < DV; d += 64 / sizeof(T)) __builtin_prefetch(vp + next * v_row + kvh * v_head + d);
        }
      }
      // The rows that see a key of this tile, in whole vectors: rows before r0 see only earlier keys, rows
      // from r1 on (a window) only later ones; the tile leaves theirs as they are.
      const int64_t r0 = std::min(rows, G * std::max<int64_t>(0, k0 - first)) / W;
      const int64_t seeing = G * std::max<int64_t>(0, k0 + kKeyTile + window - 1 - first);  // rows, window > 0
      const int64_t r1 = window > 0 ? std::min(vectors, (seeing + W - 1) / W) : vectors;
      if (r0 >= r1) continue;
      float* s = x.s.data() + r0 * W;
      constexpr int JB = B::kScoreKeys;
      for (int64_t j = (from - k0) / JB * JB; j < to - k0; j += JB)
        score_rows<Vec, JB, B::kScoreVectors>(x.k.data() + j * D, D, x.qt.data() + r0 * W, R, r1 - r0, s + j * R);
      if (cap > 0.f)
        for (int64_t j = 0; j < kKeyTile; ++j)
          for (int64_t r = r0 * W; r < r1 * W; ++r) x.s[j * R + r] = cap * std::tanh(x.s[j * R + r] / cap);
      if (k0 + kKeyTile - 1 > first || (window > 0 && k0 < begin(last)))  // some row does not see some key
        for (int64_t r = r0 * W; r < r1 * W; ++r) {  // its keys before its window's, and after its own position
          const int64_t p = pos(r), seen_from = std::max<int64_t>(0, begin(p) - k0);
          for (int64_t j = 0; j < std::min(seen_from, kKeyTile); ++j) x.s[j * R + r] = -kInf;
          for (int64_t j = std::max<int64_t>(0, p + 1 - k0); j < kKeyTile; ++j) x.s[j * R + r] = -kInf;
        }
      for (int64_t c = r0; c < r1; ++c) {  // the online softmax, a vector of rows at a time
        const auto m_old = Vec::load(x.m.data() + c * W);
        auto m = m_old;
        for (int64_t j = 0; j < kKeyTile; ++j) m = max_lanes(m, Vec::load(x.s.data() + j * R + c * W));
        auto sum = Vec::zero();
        for (int64_t j = 0; j < kKeyTile; ++j) {
          float* sj = x.s.data() + j * R + c * W;
          const auto weight = exp_or_zero(Vec::load(sj) - m);
          Vec::store(sj, weight);
          sum = add_lanes(sum, weight);
        }
        const auto alpha = exp_or_zero(m_old - m);
        Vec::store(x.alpha.data() + c * W, alpha);
        Vec::store(x.m.data() + c * W, m);
        Vec::store(x.l.data() + c * W, Vec::fma(Vec::load(x.l.data() + c * W), alpha, sum));
      }
      constexpr int RB = B::kWeighRows;
      const int64_t end = std::min(rows, r1 * W);
      for (int64_t r = r0 * W; r < end; r += RB) {  // keys past a block's last row weigh 0: not read
        const int64_t block = std::min<int64_t>(RB, end - r), keys = std::min(to, pos(r + block - 1) + 1) - k0;
        weigh_rows<Vec, RB, B::kWeighVectors>(block, x.s.data() + r, R, x.v.data(), DVp, x.alpha.data() + r,
                                               std::max<int64_t>(0, keys), DVp / W, x.o.data() + r * DVp);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      float* out = op + ((i0 + r / G) * H + kvh * G + r % G) * DV;
      const float* o = x.o.data() + r * DVp;
      const float inv = 1.f / x.l[r];
      for (int64_t d = 0; d < DV; ++d) out[d] = o[d] * inv;
    }
  }
};

// The chunk's tasks over a cache of element T, for PrefillAttention.
template <typename T>
struct PrefillWork : PrefillAttention::Work {
  const PrefillTasks<Lanes, T> work;
  PrefillWork(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
              const torch::Tensor& block_table, int64_t start, double scale, int64_t window, double cap,
              torch::Tensor& out, const Extras& extras)
      : work(q, k_cache, v_cache, block_table, start, scale, window, cap, out, extras) {
    tasks = work.tasks();
  }
  void run_tasks(int64_t begin, int64_t end) override {
    Scratch scratch(work.R, work.D, work.DVp);
    for (int64_t task = begin; task < end; ++task) work.run(task, scratch);
  }
};

PrefillAttention::PrefillAttention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                                   const torch::Tensor& block_table, int64_t start, double scale, int64_t window,
                                   double soft_cap_value, torch::Tensor& out,
                                   const c10::optional<torch::Tensor>& k_scales,
                                   const c10::optional<torch::Tensor>& v_scales,
                                   const c10::optional<torch::Tensor>& sinks,
                                   const c10::optional<torch::Tensor>& k_new,
                                   const c10::optional<torch::Tensor>& v_new) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 3 && q.stride(2) == 1, "q: [n, H, D] float32");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous(), "out: contiguous float32");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1 && k_cache.size(3) == q.size(2),
              "caches: [blocks, block_size, KVH, D] with contiguous rows");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads: a multiple of the kv heads");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.is_contiguous() &&
                  block_table.numel() * k_cache.size(1) >= start + q.size(0),
              "block_table: contiguous int64, blocks for every position of the chunk");
  Extras extras;
  const bool quantized = k_cache.element_size() == 1;
  TORCH_CHECK(quantized == (k_scales.has_value() && v_scales.has_value()), "scales come with int8 / fp8 caches only");
  if (quantized) {
    TORCH_CHECK(k_scales->scalar_type() == at::kBFloat16 && k_scales->is_contiguous() && v_scales->is_contiguous(),
                "scales: contiguous bfloat16");
    extras.k_scales = k_scales->data_ptr<c10::BFloat16>(), extras.v_scales = v_scales->data_ptr<c10::BFloat16>();
  }
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() && sinks->numel() == q.size(1),
                "sinks: contiguous float32, one per query head");
    extras.sinks = sinks->data_ptr<float>();
  }
  TORCH_CHECK(k_new.has_value() == v_new.has_value(), "k_new and v_new come together");
  if (k_new.has_value()) {
    for (const auto& x : {*k_new, *v_new})
      TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 3 && x.size(0) == q.size(0) &&
                      x.size(1) == k_cache.size(2) && x.stride(2) == 1,
                  "k_new, v_new: [n, KVH, D] float32 with contiguous rows");
    TORCH_CHECK(k_new->size(2) == k_cache.size(3) && v_new->size(2) == v_cache.size(3),
                "k_new, v_new: the caches' widths");
    extras.k_new = k_new->data_ptr<float>(), extras.v_new = v_new->data_ptr<float>();
    extras.k_new_row = k_new->stride(0), extras.k_new_head = k_new->stride(1);
    extras.v_new_row = v_new->stride(0), extras.v_new_head = v_new->stride(1);
  }
  auto make = [&](auto element) -> std::unique_ptr<Work> {
    return std::make_unique<PrefillWork<decltype(element)>>(q, k_cache, v_cache, block_table, start, scale, window,
                                                             soft_cap_value, out, extras);
  };
  work_ = with_cache_element(k_cache.scalar_type(), "paged_prefill_attention", make);
}

void paged_prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_table,
                             int64_t start, double scale, int64_t window, double soft_cap_value, torch::Tensor out,
                             c10::optional<torch::Tensor> k_scales, c10::optional<torch::Tensor> v_scales,
                             c10::optional<torch::Tensor> sinks, c10::optional<torch::Tensor> k_new,
                             c10::optional<torch::Tensor> v_new) {
  PrefillAttention attention(q, k_cache, v_cache, block_table, start, scale, window, soft_cap_value, out, k_scales,
                             v_scales, sinks, k_new, v_new);
  // each thread takes the next task until none is left (tasks differ in cost: a fixed split would not balance)
  const int64_t tasks = attention.tasks();
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(tasks, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    for (int64_t task; (task = next.fetch_add(1)) < tasks;) attention.run_tasks(task, task + 1);
  });
}

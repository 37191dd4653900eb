#include "paged_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "attention_vec.h"
#include "fp8.h"
#include "vec_math.h"

// k, v: [T, KVH, D] float32 with a contiguous last dim (views into the fused qkv output);
// k_cache, v_cache: [num_blocks, block_size, KVH, D] contiguous, float32 (copied) or float16 / bfloat16
// (rounded to nearest even, as torch's .to() does); slots: [T] int64 (block * block_size + offset).
template <typename T>
void write_kv_impl(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& k_cache, torch::Tensor& v_cache,
                   const torch::Tensor& slots) {
  const int64_t n = k.size(0), KVH = k.size(1), D = k.size(2);
  const int64_t* sp = slots.data_ptr<int64_t>();
  const float *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  T *kc = k_cache.data_ptr<T>(), *vc = v_cache.data_ptr<T>();
  for (int64_t t = 0; t < n; ++t)
    for (int64_t h = 0; h < KVH; ++h) {
      const float *ks = kp + t * k.stride(0) + h * k.stride(1), *vs = vp + t * v.stride(0) + h * v.stride(1);
      T *kd = kc + (sp[t] * KVH + h) * D, *vd = vc + (sp[t] * KVH + h) * D;
      if (std::is_same<T, float>::value) {
        std::memcpy(kd, ks, D * sizeof(float));
        std::memcpy(vd, vs, D * sizeof(float));
      } else {
        for (int64_t d = 0; d < D; ++d) kd[d] = static_cast<T>(ks[d]);
        for (int64_t d = 0; d < D; ++d) vd[d] = static_cast<T>(vs[d]);
      }
    }
}

void write_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots) {
  switch (k_cache.scalar_type()) {
    case at::kHalf:
      return write_kv_impl<c10::Half>(k, v, k_cache, v_cache, slots);
    case at::kBFloat16:
      return write_kv_impl<c10::BFloat16>(k, v, k_cache, v_cache, slots);
    default:
      TORCH_CHECK(k_cache.scalar_type() == at::kFloat, "write_kv: a float32, float16 or bfloat16 cache");
      return write_kv_impl<float>(k, v, k_cache, v_cache, slots);
  }
}

// k or v rows [T, KVH, D] (float32, contiguous last dim) into an int8 / fp8 cache [blocks, bs, KVH, D]
// with one bfloat16 scale per row in scales [blocks, bs, KVH], exactly as `kv_quant.quantize` (torch)
// computes them: s = bf16(max(max|x| / qmax, 2^-100)); x / s clamped to +-qmax, then rounded half to
// even (int8) or converted to the fp8 grid (c10's rounding, as torch's .to()).
template <typename T>
void write_quantized_rows(const torch::Tensor& x, torch::Tensor& cache, torch::Tensor& scales,
                          const torch::Tensor& slots, float qmax) {
  const int64_t n = x.size(0), KVH = x.size(1), D = x.size(2);
  const int64_t* sp = slots.data_ptr<int64_t>();
  const float* xp = x.data_ptr<float>();
  T* cp = reinterpret_cast<T*>(cache.data_ptr());
  c10::BFloat16* scp = scales.data_ptr<c10::BFloat16>();
  for (int64_t t = 0; t < n; ++t)
    for (int64_t h = 0; h < KVH; ++h) {
      const float* row = xp + t * x.stride(0) + h * x.stride(1);
      float amax = 0.f;
      for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(row[d]));
      const c10::BFloat16 stored(std::max(amax / qmax, 0x1p-100f));
      const float s = static_cast<float>(stored);
      scp[sp[t] * KVH + h] = stored;
      T* dst = cp + (sp[t] * KVH + h) * D;
      for (int64_t d = 0; d < D; ++d) {
        const float y = std::min(std::max(row[d] / s, -qmax), qmax);
        if constexpr (std::is_same<T, int8_t>::value)
          dst[d] = static_cast<int8_t>(std::nearbyint(y));
        else
          dst[d] = T(y);
      }
    }
}

void write_kv_quantized(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                        torch::Tensor k_scales, torch::Tensor v_scales, torch::Tensor slots) {
  TORCH_CHECK(k_scales.scalar_type() == at::kBFloat16 && k_scales.is_contiguous() && v_scales.is_contiguous(),
              "write_kv_quantized: contiguous bfloat16 scales");
  auto both = [&](auto element, float qmax) {
    using T = decltype(element);
    write_quantized_rows<T>(k, k_cache, k_scales, slots, qmax);
    write_quantized_rows<T>(v, v_cache, v_scales, slots, qmax);
  };
  switch (k_cache.scalar_type()) {
    case at::kChar:
      return both(int8_t(), 127.f);
    case at::ScalarType::Float8_e4m3fn:
      return both(c10::Float8_e4m3fn(), 448.f);
    case at::ScalarType::Float8_e5m2:
      return both(c10::Float8_e5m2(), 57344.f);
    default:
      TORCH_CHECK(false, "write_kv_quantized: an int8, fp8_e4m3 or fp8_e5m2 cache");
  }
}

// Key rows asked for ahead of their reads: about a memory latency of the score loop's work.
constexpr int64_t kAhead = 32;

#ifdef TM_ATTN_SIMD
// The scores of a span's n tokens for HG query heads (q: [HG, D]) into s ([HG, stride], stride >= n
// rounded up to 8): score * scale * key scale, 8 tokens a tile. Each key row's dims are read and converted
// to float32 once for the HG heads, whose 8 x HG sums stay in registers (HG * 8 of them: kHeads to fill
// the registers), with no float32 copy of the tile (staging it cost a store and a load per element).
// A short last tile's other lanes are left over (the caller pads them). ask: this pass asks for the rows
// (the first one over them): the key rows kAhead tokens on (the first kAhead were asked for as they were
// found) and the tile's value rows, into L2. Asking for all of a span's rows at once, as they are found,
// cost as much as the walk itself when they were already cached.
template <typename Vec, int HG, typename Row>
void group_scores(const float* q, int64_t D, int64_t DV, int64_t n, float scale, Row key, Row value, bool ask,
                  const float* key_scales, int64_t stride, float* s) {
  using T = std::remove_const_t<std::remove_pointer_t<decltype(key(0))>>;
  for (int64_t t0 = 0; t0 < n; t0 += 8) {
    const int64_t tokens = std::min<int64_t>(8, n - t0);
    if (ask) {
      for (int64_t j = t0; j < t0 + tokens; ++j)
        for (int64_t i = 0; i < DV; i += 64 / sizeof(T)) __builtin_prefetch(value(j) + i, 0, 2);
      for (int64_t j = t0 + kAhead; j < std::min<int64_t>(n, t0 + kAhead + 8); ++j)
        for (int64_t i = 0; i < D; i += 64 / sizeof(T)) __builtin_prefetch(key(j) + i, 0, 2);
    }
    const T* k[8];
    for (int64_t j = 0; j < 8; ++j) k[j] = key(t0 + (j < tokens ? j : tokens - 1));  // (min(): a slow gather)
    typename Vec::V acc[HG][8];
    for (int h = 0; h < HG; ++h)
      for (int j = 0; j < 8; ++j) acc[h][j] = Vec::zero();
    for (int64_t d = 0; d < D; d += Vec::kLanes)
      for (int j = 0; j < 8; ++j) {
        const auto kv = Vec::load(k[j] + d);
        for (int h = 0; h < HG; ++h) acc[h][j] = Vec::fma(Vec::load(q + h * D + d), kv, acc[h][j]);
      }
    for (int h = 0; h < HG; ++h) {
      __m256 scores = _mm256_mul_ps(Vec::sums8(acc[h]), _mm256_set1_ps(scale));
      if (key_scales) scores = _mm256_mul_ps(scores, _mm256_loadu_ps(key_scales + t0));
      _mm256_storeu_ps(s + h * stride + t0, scores);
    }
  }
}

// group_scores for G heads, kHeads at a time.
template <typename Vec, int HG = Vec::kHeads, typename Row>
void span_scores(const float* q, int64_t G, int64_t D, int64_t DV, int64_t n, float scale, Row key, Row value,
                 bool ask, const float* key_scales, int64_t stride, float* s) {
  for (int64_t g = 0; g < G; g += HG) {
    if constexpr (HG > 1)
      if (G - g < HG)
        return span_scores<Vec, HG - 1>(q + g * D, G - g, D, DV, n, scale, key, value, ask && g == 0, key_scales,
                                        stride, s + g * stride);
    group_scores<Vec, HG>(q + g * D, D, DV, n, scale, key, value, ask && g == 0, key_scales, stride, s + g * stride);
  }
}

// o[h] dims [d0, d0 + NV kLanes) = the sum over t < n of w[h stride + t] value(t) for HG heads (o: [HG, DV]):
// each value row's dims are read and converted once for all HG heads, whose sums stay in registers (HG and
// NV constants). The rows were asked for during the scores (`group_scores`).
template <typename Vec, int HG, int NV, typename Row>
inline void weigh_values(const float* w, int64_t n, int64_t stride, Row value, int64_t d0, int64_t DV, float* o) {
  constexpr int W = Vec::kLanes;
  typename Vec::V acc[HG][NV];
  for (int h = 0; h < HG; ++h)
    for (int c = 0; c < NV; ++c) acc[h][c] = Vec::zero();
  for (int64_t t = 0; t < n; ++t) {
    typename Vec::V x[NV];
    for (int c = 0; c < NV; ++c) x[c] = Vec::load(value(t) + d0 + c * W);
    for (int h = 0; h < HG; ++h) {
      const auto wt = Vec::set1(w[h * stride + t]);
      for (int c = 0; c < NV; ++c) acc[h][c] = Vec::fma(wt, x[c], acc[h][c]);
    }
  }
  for (int h = 0; h < HG; ++h)
    for (int c = 0; c < NV; ++c) Vec::store(o + h * DV + d0 + c * W, acc[h][c]);
}

// The weighted values of `heads` (1 .. 8) heads, DV / kLanes vectors each: as many vectors a pass as the
// registers hold (HG heads' sums, the row's NV vectors and a weight).
template <typename Vec, int HG = 8, typename Row>
inline void weigh_heads(int64_t heads, const float* w, int64_t n, int64_t stride, Row value, int64_t DV,
                        float* o) {
  if constexpr (HG > 1)
    if (heads < HG) return weigh_heads<Vec, HG - 1>(heads, w, n, stride, value, DV, o);
  constexpr int kRegisters = Vec::kLanes == 16 ? 31 : 15;
  constexpr int NV = std::max(1, std::min(4, kRegisters / (HG + 1)));
  const int64_t chunks = DV / Vec::kLanes;
  int64_t c = 0;
  for (; c + NV <= chunks; c += NV)
    weigh_values<Vec, HG, NV>(w, n, stride, value, c * Vec::kLanes, DV, o);
  for (; c < chunks; ++c) weigh_values<Vec, HG, 1>(w, n, stride, value, c * Vec::kLanes, DV, o);
}

// attend_span's vector path: D and DV multiples of kLanes; s: [G, n rounded up to kLanes] scratch.
template <typename Vec, typename Row>
void attend_span_simd(const float* q, int64_t G, int64_t D, int64_t DV, int64_t n, float scale, float cap, Row key,
                      Row value, const float* key_scales, const float* value_scales, float* s, float* m, float* l,
                      float* o) {
  constexpr int W = Vec::kLanes;
  const int64_t stride = (n + W - 1) / W * W;
  span_scores<Vec>(q, G, D, DV, n, scale, key, value, true, key_scales, stride, s);
  soft_cap(s, G * stride, cap);
  for (int64_t g = 0; g < G; ++g) {  // e^(score - max), a vector exp; the padding lanes' e^-inf are 0
    float* sg = s + g * stride;
    std::fill(sg + n, sg + stride, -std::numeric_limits<float>::infinity());
    auto big = Vec::load(sg);
    for (int64_t t = W; t < stride; t += W) big = Vec::max(big, Vec::load(sg + t));
    m[g] = Vec::reduce_max(big);
    const auto top = Vec::set1(m[g]);
    auto total = Vec::zero();
    for (int64_t t = 0; t < stride; t += W) {
      const auto e = Vec::exp(Vec::sub(Vec::load(sg + t), top));
      Vec::store(sg + t, e);
      total = Vec::add(total, e);
    }
    l[g] = Vec::reduce_add(total);
    if (value_scales)  // the weights of the values, once (not once a pass)
      for (int64_t t = 0; t < stride; t += W)
        Vec::store(sg + t, Vec::mul(Vec::load(sg + t), Vec::load(value_scales + t)));
  }
  for (int64_t g0 = 0; g0 < G; g0 += 8)  // weighted values, eight heads at a time
    weigh_heads<Vec>(std::min<int64_t>(8, G - g0), s + g0 * stride, n, stride, value, DV, o + g0 * DV);
}
#endif

// One span of n cached tokens for the G query heads (q: [G, D]) of a kv head: the span's share of their
// softmax, unnormalised (merged across spans by `merge_spans`): m[g] the largest score, l[g] the sum of
// e^(score - m[g]), o[g] (DV) the sum of e^(score - m[g]) value. key(t), value(t) point at token t's key
// row (D features) and value row (DV); key_scales, value_scales: the rows' scales ([n rounded up to 16]),
// null unless quantized; s: [G, n rounded up to 16] scratch.
template <typename Row>
void attend_span(const float* q, int64_t G, int64_t D, int64_t DV, int64_t n, float scale, float cap, Row key,
                 Row value, const float* key_scales, const float* value_scales, float* s, float* m, float* l,
                 float* o) {
#ifdef TM_ATTN_AVX512
  if (D % 16 == 0 && DV % 16 == 0)
    return attend_span_simd<Zmm>(q, G, D, DV, n, scale, cap, key, value, key_scales, value_scales, s, m, l, o);
#endif
#ifdef TM_ATTN_SIMD
  if (D % 8 == 0 && DV % 8 == 0)
    return attend_span_simd<Ymm>(q, G, D, DV, n, scale, cap, key, value, key_scales, value_scales, s, m, l, o);
#endif
  for (int64_t t = 0; t < n; ++t)
    for (int64_t g = 0; g < G; ++g) {
      const auto* k = key(t);
      float dot = 0.f;
      for (int64_t d = 0; d < D; ++d) dot += q[g * D + d] * to_f32(k[d]);
      s[g * n + t] = dot * scale * (key_scales ? key_scales[t] : 1.f);
    }
  soft_cap(s, G * n, cap);
  for (int64_t g = 0; g < G; ++g) {
    float* sg = s + g * n;
    m[g] = *std::max_element(sg, sg + n);
    l[g] = 0.f;
    for (int64_t t = 0; t < n; ++t) {
      sg[t] = std::exp(sg[t] - m[g]);
      l[g] += sg[t];
    }
  }
  std::fill(o, o + G * DV, 0.f);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t g = 0; g < G; ++g) {
      const float w = s[g * n + t] * (value_scales ? value_scales[t] : 1.f);
      for (int64_t d = 0; d < DV; ++d) o[g * DV + d] += w * to_f32(value(t)[d]);
    }
}

// A task's share of a sequence's context: one span of this many tokens for all the query heads of one
// kv head. Fixed, so that the spans (and so the result) depend only on the sequence's own length, not
// on its batch nor on the thread count; short enough that a long context makes tasks for every thread
// (SmolLM2 at 550 tokens: 5 spans x 3 kv heads) and that a span's 16-bit V rows (16 KB at 64 dims) stay
// in L1 while the value passes (`weigh_heads`) read them again.
constexpr int64_t kSpanTokens = 128;

// Per span c, (m, l, o) of `attend_span` in `part` ([G, DV] o, then G m, then G l; `stride` floats per
// span) into the G heads' attention out [G, DV], spans in order: with M the largest m (or sink),
// out = sum_c e^(m_c - M) o_c / (sum_c e^(m_c - M) l_c + e^(sink - M)). sinks: the heads' extra softmax
// logits (no value), or null.
inline void merge_spans(const float* part, int64_t spans, int64_t stride, int64_t G, int64_t DV, const float* sinks,
                        float* out) {
  for (int64_t g = 0; g < G; ++g) {
    float big = sinks ? sinks[g] : -std::numeric_limits<float>::infinity();
    for (int64_t c = 0; c < spans; ++c) big = std::max(big, part[c * stride + G * DV + g]);
    float sum = sinks ? std::exp(sinks[g] - big) : 0.f;
    float* og = out + g * DV;
    std::fill(og, og + DV, 0.f);
    for (int64_t c = 0; c < spans; ++c) {
      const float* p = part + c * stride;
      const float w = std::exp(p[G * DV + g] - big);
      sum += w * p[G * DV + G + g];
      for (int64_t d = 0; d < DV; ++d) og[d] += w * p[g * DV + d];
    }
    const float inv = sum > 0.f ? 1.f / sum : 0.f;  // no token and no sink (an empty context): zeros
    for (int64_t d = 0; d < DV; ++d) og[d] *= inv;
  }
}

// q: [B, H, D]; k_cache: [num_blocks, block_size, KVH, D], v_cache: [num_blocks, block_size, KVH, DV] (rows
// may be strided: a view into the key rows); block_tables: [B, max_blocks] int64; context_lens: [B] int64;
// out: [B, H, DV]. q and out float32; the caches float32, float16, bfloat16, int8 or fp8 (both alike); last
// dims contiguous; k_scales, v_scales (int8 / fp8): [num_blocks, block_size, KVH] bfloat16, else null.
// window > 0: only the last `window` tokens are attended; soft_cap > 0: scores are soft-capped; sinks:
// [H] float32 logits that join each head's softmax without a value, or null.
// The work as tasks (a span of one kv head for some of its query heads), then merges (one per sequence and
// kv head, its spans in order): the parts of `DecodeAttention`.
template <typename T>
struct DecodeTasks final : DecodeAttention::Work {
  const int64_t B, H, D, DV, BS, KVH, G, max_blocks, k_row, k_head, v_row, v_head;  // (k_row: a slot's stride)
  const float scale, cap;
  const float* qp;
  const T *kp, *vp;
  const int64_t *tables, *lens;
  float* op;
  const c10::BFloat16 *k_scales, *v_scales;
  const float* sinks;
  std::vector<int64_t> begins, first;  // per sequence b: its first token, its spans first[b] .. first[b + 1]
  int64_t stride, splits, per;
  std::vector<float> parts;

  DecodeTasks(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
              const torch::Tensor& block_tables, const torch::Tensor& context_lens, double scale_, int64_t window,
              double soft_cap_value, torch::Tensor& out, const c10::BFloat16* k_scales_,
              const c10::BFloat16* v_scales_, const float* sinks_, int64_t threads)
      : B(q.size(0)), H(q.size(1)), D(q.size(2)), DV(v_cache.size(3)), BS(k_cache.size(1)), KVH(k_cache.size(2)),
        G(H / KVH), max_blocks(block_tables.size(1)), k_row(k_cache.stride(1)), k_head(k_cache.stride(2)),
        v_row(v_cache.stride(1)), v_head(v_cache.stride(2)), scale(static_cast<float>(scale_)),
        cap(static_cast<float>(soft_cap_value)), qp(q.data_ptr<float>()), kp(k_cache.data_ptr<T>()),
        vp(v_cache.data_ptr<T>()), tables(block_tables.data_ptr<int64_t>()),
        lens(context_lens.data_ptr<int64_t>()), op(out.data_ptr<float>()), k_scales(k_scales_),
        v_scales(v_scales_), sinks(sinks_), begins(B), first(B + 1, 0) {
    for (int64_t b = 0; b < B; ++b) {
      begins[b] = window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0;
      first[b + 1] = first[b] + KVH * ((lens[b] - begins[b] + kSpanTokens - 1) / kSpanTokens);
    }
    stride = G * DV + 2 * G;  // a span's (o, m, l)
    parts.resize(first[B] * stride);
    // Few spans for the threads (one short sequence; a latent cache's single kv head): each span's query
    // heads are split so that there are at least two tasks per thread to balance (a head's result is the
    // same whichever task computes it).
    splits = std::min<int64_t>(
        G, std::max<int64_t>(1, (2 * threads + first[B] - 1) / std::max<int64_t>(1, first[B])));
    per = (G + splits - 1) / splits;
    tasks = first[B] * splits;
    merges = B * KVH;
    merge_floats = G * DV;
  }

  // A span's n key rows from token `from` into rows[0, n), its value rows into rows[kSpanTokens, ...) (and
  // their scales into scales, likewise, if quantized). Locals, not members, in the loop: its stores
  // through `rows` could alias a member, and reloading them cost more than the walk itself.
  void find_rows(const int64_t* table, int64_t from, int64_t n, int64_t kvh, const T** rows, float* scales) const {
    const T *keys = kp + kvh * k_head, *values = vp + kvh * v_head;
    const int64_t bs = BS, kr = k_row, vr = v_row, kv_heads = KVH;
    for (int64_t t = 0, block = from / bs, offset = from % bs; t < n; ++block, offset = 0) {
      const int64_t slot0 = table[block] * bs, end = std::min(n, t + bs - offset);
      for (int64_t slot = slot0 + offset; t < end; ++t, ++slot) {
        const T *k = keys + slot * kr, *v = values + slot * vr;
        rows[t] = k, rows[kSpanTokens + t] = v;
        if (t < kAhead)  // the first key rows: `group_scores` asks for the others
          for (int64_t i = 0; i < D; i += 64 / sizeof(T)) __builtin_prefetch(k + i, 0, 2);
        if (scales) {
          scales[t] = static_cast<float>(k_scales[slot * kv_heads + kvh]);
          scales[kSpanTokens + t] = static_cast<float>(v_scales[slot * kv_heads + kvh]);
        }
      }
    }
  }

  void run_tasks(int64_t begin, int64_t end) override {
    if (begin >= end) return;
    std::vector<float> scores(per * kSpanTokens), row_scales(k_scales ? 2 * kSpanTokens : 0, 1.f);
    std::vector<const T*> rows(2 * kSpanTokens);
    int64_t b = std::upper_bound(first.begin(), first.end(), begin / splits) - first.begin() - 1;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t span = task / splits, g0 = task % splits * per, heads = std::min(per, G - g0);
      if (heads <= 0) continue;
      while (span >= first[b + 1]) ++b;
      const int64_t spans = (first[b + 1] - first[b]) / KVH, kvh = (span - first[b]) / spans;
      const int64_t from = begins[b] + (span - first[b]) % spans * kSpanTokens;
      const int64_t n = std::min(kSpanTokens, lens[b] - from);
      const int64_t* table = tables + b * max_blocks;
      // the span's key and value rows (and scales), found once: the loops below read each row once per
      // query head, and finding a slot's block per read (a division by the block size) cost about as much
      // as the products
      find_rows(table, from, n, kvh, rows.data(), k_scales ? row_scales.data() : nullptr);
      auto row = [](const T* const* p) { return [=](int64_t t) { return p[t]; }; };
      const float* sk = k_scales ? row_scales.data() : nullptr;
      float* part = parts.data() + span * stride;
      attend_span(qp + (b * H + kvh * G + g0) * D, heads, D, DV, n, scale, cap, row(rows.data()),
                  row(rows.data() + kSpanTokens), sk, sk ? sk + kSpanTokens : nullptr, scores.data(),
                  part + G * DV + g0, part + G * DV + G + g0, part + g0 * DV);
    }
  }

  void run_merges(int64_t begin, int64_t end) override {
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t b = pair / KVH, kvh = pair % KVH, spans = (first[b + 1] - first[b]) / KVH;
      merge_spans(parts.data() + (first[b] + kvh * spans) * stride, spans, stride, G, DV,
                  sinks ? sinks + kvh * G : nullptr, op + (b * H + kvh * G) * DV);
    }
  }
};

DecodeAttention::DecodeAttention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                                 const torch::Tensor& block_tables, const torch::Tensor& context_lens, double scale,
                                 int64_t window, double soft_cap_value, torch::Tensor& out,
                                 const c10::optional<torch::Tensor>& k_scales,
                                 const c10::optional<torch::Tensor>& v_scales,
                                 const c10::optional<torch::Tensor>& sinks, int64_t threads) {
  const bool quantized = k_cache.element_size() == 1;
  TORCH_CHECK(quantized == (k_scales.has_value() && v_scales.has_value()), "scales come with int8 / fp8 caches only");
  const c10::BFloat16* ks = nullptr;
  const c10::BFloat16* vs = nullptr;
  if (quantized) {
    TORCH_CHECK(k_scales->scalar_type() == at::kBFloat16 && k_scales->is_contiguous() && v_scales->is_contiguous(),
                "scales: contiguous bfloat16");
    ks = k_scales->data_ptr<c10::BFloat16>(), vs = v_scales->data_ptr<c10::BFloat16>();
  }
  if (sinks.has_value())
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() && sinks->numel() == q.size(1),
                "sinks: contiguous float32, one per query head");
  const float* sp = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
  auto make = [&](auto element) -> std::unique_ptr<Work> {
    return std::make_unique<DecodeTasks<decltype(element)>>(q, k_cache, v_cache, block_tables, context_lens, scale,
                                                             window, soft_cap_value, out, ks, vs, sp, threads);
  };
  work_ = with_cache_element(k_cache.scalar_type(), "paged_decode_attention", make);
}

void paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                            torch::Tensor context_lens, double scale, int64_t window, double soft_cap_value,
                            torch::Tensor out, c10::optional<torch::Tensor> k_scales,
                            c10::optional<torch::Tensor> v_scales, c10::optional<torch::Tensor> sinks) {
  DecodeAttention attention(q, k_cache, v_cache, block_tables, context_lens, scale, window, soft_cap_value, out,
                            k_scales, v_scales, sinks, at::get_num_threads());
  at::parallel_for(0, attention.tasks(), 1, [&](int64_t begin, int64_t end) { attention.run_tasks(begin, end); });
  // the merges: inline for a few sequences (a fork would cost more than they do), else across threads
  at::parallel_for(0, attention.merges(), std::max<int64_t>(1, 16384 / attention.merge_floats()),
                   [&](int64_t begin, int64_t end) { attention.run_merges(begin, end); });
}

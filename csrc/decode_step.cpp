#include "decode_step.h"

#include <algorithm>
#include <atomic>
#include <exception>
#include <memory>

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/rms_norm.h>
#include <omp.h>

#include "block_quant.h"
#include "fused_ops.h"
#include "lora.h"
#include "paged_attention.h"
#include "prefill_attention.h"
#include "step_experts.h"
#include "step_phases.h"

namespace decode_step {

inline c10::optional<torch::Tensor> present(const torch::Tensor& t) {
  return t.numel() ? c10::optional<torch::Tensor>(t) : c10::nullopt;
}

// As the Python path: F.linear for dense weights; the block kernel, then `out += bias`; then the
// adapters' deltas (LoRAWeights.add_to).
torch::Tensor linear(const Linear& l, const torch::Tensor& x, const torch::Tensor* segments) {
  torch::Tensor out;
  if (l.kind == 0) {
    out = at::linear(x, l.w, present(l.bias));
  } else {
    out = torch::empty({x.size(0), l.w.size(0)}, x.options());
    const int64_t block = l.w.size(1) * (l.bits == 8 ? 1 : 2) / l.scales.size(1);
    if (l.kind == 2 && l.panel_codes.numel()) {  // as BlockQuantLinearMethod.apply
      block_quant_matmul_q8_panels(x, l.panel_codes, l.panel_scales, l.bits, activation_span(l), out);
    } else {
      auto kernel = l.kind == 1 ? block_quant_matmul : block_quant_matmul_q8;
      kernel(x, l.w, present(l.high), l.scales, present(l.offsets), present(l.supers), l.bits, block, l.center, out);
    }
    if (l.bias.numel()) out += l.bias;
  }
  if (l.lora) lora_add(x.contiguous(), l.lora[0], l.lora[1], l.lora[2], segments[0], segments[1], segments[2], out);
  return out;
}

inline Linear make_linear(const torch::Tensor* t, const int64_t* k) {  // 8 tensors, (kind, bits, center)
  return Linear{t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7], k[0], k[1], k[2], nullptr};
}

// Whether the parallel region below runs this layer: int8 activations on panels, no adapter.
inline bool splits_by_panels(const Linear& l) {
  return l.kind == 2 && l.panel_codes.numel() && !l.lora && (!l.bias.numel() || l.bias.scalar_type() == at::kFloat);
}

void linear_panels(const Linear& l, const PanelActivations& a, torch::Tensor& out, int64_t first, int64_t last) {
  block_quant_matmul_q8_panels_range(a, l.panel_codes, l.panel_scales, out, first, last);
  if (!l.bias.numel()) return;
  const int64_t N = out.size(1), end = std::min(N, 8 * last);
  const float* b = l.bias.data_ptr<float>();
  for (int64_t r = 0; r < out.size(0); ++r) {
    float* row = out.data_ptr<float>() + r * N;
    for (int64_t c = 8 * first; c < end; ++c) row[c] += b[c];
  }
}

// The scales and codes of panels [first, last) of `l` into `ahead` (the lines a thread asks for while it
// waits before the op that reads them).
void ask_ahead(LinesAhead& ahead, const Linear& l, int64_t first, int64_t last) {
  for (const torch::Tensor* p : {&l.panel_scales, &l.panel_codes}) {
    const int64_t row = p->stride(0) * p->element_size();
    ahead.add(static_cast<const char*>(p->data_ptr()) + first * row, (last - first) * row);
  }
}

// The layers in one OpenMP parallel region: a step pays one fork and join, not one per kernel (about 150
// a token for SmolLM2's 30 layers). Each layer is nine phases (step_phases.h): the products by panels and
// the attention by its span tasks and merges, split over the threads (a thread does what a late partner
// has not started), and the small ops (norms, rotary, the KV write) as one unit each. A product's input is
// rounded to int8 once, by the op before it (or the thread that finishes the phase before it); SiLU or
// GELU-tanh times up is applied by each thread to the columns whose gate and up it computed (whole vectors
// of 8: the same bits as a whole row's). Gemma's parts run in the phases their ops follow: the q and k
// norms before the rotation, the attention's output norm before the post-attention one, the MLP's output
// norm as the down projection's phase ends; each layer's attention reads its KV cache group (`Group`) and
// rotary table. The same kernels on the same inputs as the op-by-op loop, so the same bits. Buffers are
// made once a step: the residual stream alternates between the MLP's output (the input first: `hidden`,
// then `down` or its norm) and the attention's (`o` or its norm).
std::vector<torch::Tensor> layers_in_one_region(torch::Tensor hidden, c10::optional<torch::Tensor> residual,
                                                const torch::Tensor& positions, const std::vector<Group>& groups,
                                                const std::vector<torch::Tensor>& rope_tables,
                                                const std::vector<Linear>& linears, const std::vector<LayerKind>& kinds,
                                                const std::vector<torch::Tensor>& tensors, int64_t H, int64_t KVH,
                                                int64_t D, double eps, double scale, const Chunks& chunks,
                                                const std::vector<Experts>& experts_of, bool count_experts) {
  constexpr size_t kTensors = DecodeStep::kTensors;
  constexpr int64_t kPhases = 9, kChunk = 4;  // phases a layer; panels a product's shares are whole multiples of
  const size_t layers = linears.size() / 4;
  const int64_t T = hidden.size(0);
  auto make = [&](int64_t width) { return torch::empty({T, width}, hidden.options()); };
  torch::Tensor normed = make(hidden.size(1)), qkv = make(linears[0].w.size(0)), q = make(H * D), attn = make(H * D),
                o = make(hidden.size(1)), down = make(hidden.size(1));
  torch::Tensor gate_up, act;  // a dense MLP's, made for its width (gate_up: 2I outputs, G = I / 8 panels each)
  // the attention's and the MLP's outputs normed before they join the stream (Gemma's), where layers have them
  auto any_has = [&](size_t j) {
    for (size_t i = 0; i < layers; ++i)
      if (tensors[kTensors * i + j].numel()) return true;
    return false;
  };
  const torch::Tensor o_normed = any_has(kTensors - 2) ? make(hidden.size(1)) : torch::Tensor(),
                      down_normed = any_has(kTensors - 1) ? make(hidden.size(1)) : torch::Tensor();
  // the views the layers take of the buffers, made once a step too (each costs a tensor's construction)
  const torch::Tensor heads = qkv.view({T, H + 2 * KVH, D}), rotated = heads.narrow(1, 0, H + KVH),
                      keys = heads.narrow(1, H, KVH), values = heads.narrow(1, H + KVH, KVH),
                      queries = heads.narrow(1, 0, H), q_heads = q.view({T, H, D});
  // one token's queries are contiguous where they are (the attention reads them in place), more decodes'
  // are copied out; the chunks' queries are read where they are
  const bool queries_in_place = queries.is_contiguous();
  const int64_t decodes = T - chunks.tokens();
  torch::Tensor attn_heads = attn.view({T, H, D}), decode_out = attn_heads.narrow(0, 0, decodes),
                decode_queries = queries_in_place ? queries : q_heads.narrow(0, 0, decodes);
  std::vector<std::unique_ptr<PrefillAttention>> prompt_attention(chunks.size());
  std::vector<torch::Tensor> prompt_out(chunks.size());
  for (size_t c = 0; c < chunks.size(); ++c) prompt_out[c] = attn_heads.narrow(0, chunks.start(c), chunks.length(c));
  int64_t decode_tasks = 0;  // the attention's tasks: the decodes', then each chunk's
  torch::Tensor res = residual ? *residual : torch::Tensor(), x = hidden;
  std::unique_ptr<DecodeAttention> attention;
  PanelActivations rounded;  // the next product's input, rounded to int8
  RegionExperts experts;      // a MoE layer's MLP
  const int threads = at::get_num_threads();
  // An exception must not leave the parallel region (that ends the process): the first one is kept, every
  // thread skips the work after it but still counts its units done, and it is rethrown once the region ends.
  std::exception_ptr error;
  std::atomic<bool> failed{false};
  auto guard = [&](auto&& work) {
    if (failed.load()) return;
    try {
      work();
    } catch (...) {
#pragma omp critical(decode_step_error)
      if (!error) error = std::current_exception();
      failed.store(true);
    }
  };
  auto round_input = [&](const torch::Tensor& in, const Linear& l) {
    quantize_panel_activations(in, l.bits, activation_span(l), rounded);
  };
  const at::ThreadLocalState torch_state;  // grad and inference mode: every thread may make the torch calls
  std::unique_ptr<StepPhases> phases;
#pragma omp parallel num_threads(threads)
  {
    const at::ThreadLocalStateGuard torch_state_guard(torch_state);
    const int t = omp_get_thread_num(), n = omp_get_num_threads();
#pragma omp master
    {
      phases = std::make_unique<StepPhases>(kPhases * static_cast<int64_t>(layers), n);
      phases->open_one_op(0);
    }
#pragma omp barrier
    StepPhases& step = *phases;
    // a product's phase over its panels (gate_up: over its gate's panels, each with the up panel G on), taken
    // a sixteenth of a share at a time (whole chunks): a thread done with its share takes pieces that short
    // off its partner's back, so the phase ends with one waiting at most that long (a quarter of a share: a
    // serving A/B 7 % slower, the threads' waits at a product's end 4-5 % of the core's time)
    auto open_product = [&](int64_t p, int64_t panels) {
      const int64_t share = panels / n, piece = std::max(kChunk, (share / 16 + kChunk - 1) / kChunk * kChunk);
      step.open(p, panels, piece, kChunk);
    };
    auto open_tasks = [&](int64_t p, int64_t tasks) { step.open(p, tasks, std::max<int64_t>(1, tasks / (4 * n))); };
    // this thread's share of a product's panels, asked for while it waits before the product
    LinesAhead ahead;
    auto next_share = [&](const Linear& l, int64_t panels, int64_t offset = 0) {
      const auto [first, last] = StepPhases::share(panels, t, n, kChunk);
      ask_ahead(ahead, l, offset + first, offset + last);
    };
    auto panels = [](const Linear& l) { return l.panel_codes.size(0); };
    next_share(linears[0], panels(linears[0]));
    for (size_t i = 0; i < layers; ++i) {
      const torch::Tensor* w = tensors.data() + kTensors * i;
      const torch::Tensor &q_norm = w[kTensors - 4], &k_norm = w[kTensors - 3], &attn_out_norm = w[kTensors - 2],
                          &mlp_out_norm = w[kTensors - 1], &sinks = w[DecodeStep::kSinks];
      const Linear* l = linears.data() + 4 * i;
      const LayerKind& kind = kinds[i];
      const Group& g = groups[kind.group];
      const int64_t p = kPhases * static_cast<int64_t>(i), G = l[2].kind < 0 ? 0 : l[2].w.size(0) / 16;
      const bool routed = kind.experts >= 0;
      step.run(p, t, [&](int64_t, int64_t) {
        guard([&] {
          add_rms_norm(x, res.defined() ? c10::optional<torch::Tensor>(res) : c10::nullopt, w[0], eps, normed);
          res = x;
          round_input(normed, l[0]);
        });
      }, [&] { open_product(p + 1, panels(l[0])); }, &ahead);
      ahead = LinesAhead();
      next_share(l[1], panels(l[1]));
      step.run(p + 1, t, [&](int64_t a, int64_t b) { guard([&] { linear_panels(l[0], rounded, qkv, a, b); }); },
               [&] { step.open_one_op(p + 2); }, &ahead);
      step.run(p + 2, t, [&](int64_t, int64_t) {
        guard([&] {
          if (q_norm.numel()) {  // each head's q and k normed in place, as the layers norm them (torch's rms_norm)
            queries.copy_(at::rms_norm(queries, {D}, q_norm, eps));
            keys.copy_(at::rms_norm(keys, {D}, k_norm, eps));
          }
          rotary_inplace(rotated, positions, rope_tables[kind.rope]);
          if (w[4].numel())
            write_kv_quantized(keys, values, w[2], w[3], w[4], w[5], g.slots);
          else
            write_kv(keys, values, w[2], w[3], g.slots);
          attention.reset();
          if (decodes) {
            if (!queries_in_place) decode_queries.copy_(queries.narrow(0, 0, decodes));
            attention = std::make_unique<DecodeAttention>(decode_queries, w[2], w[3], g.block_tables, g.context_lens,
                                                          scale, kind.window, kind.soft_cap, decode_out, present(w[4]),
                                                          present(w[5]), present(sinks), n);
          }
          decode_tasks = attention ? attention->tasks() : 0;
          for (size_t c = 0; c < chunks.size(); ++c)
            prompt_attention[c] = std::make_unique<PrefillAttention>(
                queries.narrow(0, chunks.start(c), chunks.length(c)), w[2], w[3], g.chunk_tables[c], chunks.cached(c),
                scale, kind.window, kind.soft_cap, prompt_out[c], present(w[4]), present(w[5]), present(sinks),
                c10::nullopt, c10::nullopt);
        });
      }, [&] {
        int64_t tasks = decode_tasks;
        for (const auto& a : prompt_attention) tasks += a ? a->tasks() : 0;
        open_tasks(p + 3, failed.load() ? 0 : tasks);
      }, &ahead);
      step.run(p + 3, t, [&](int64_t a, int64_t b) {
        guard([&] {  // tasks [a, b) of the decodes' and then the chunks' in turn
          int64_t first = 0;
          auto share = [&](int64_t count, auto&& run) {
            const int64_t lo = std::max(a, first), hi = std::min(b, first + count);
            if (lo < hi) run(lo - first, hi - first);
            first += count;
          };
          share(decode_tasks, [&](int64_t x, int64_t y) { attention->run_tasks(x, y); });
          for (auto& c : prompt_attention) share(c->tasks(), [&](int64_t x, int64_t y) { c->run_tasks(x, y); });
        });
      }, [&] { open_tasks(p + 4, failed.load() || !attention ? 0 : attention->merges()); }, &ahead);
      step.run(p + 4, t, [&](int64_t a, int64_t b) { guard([&] { attention->run_merges(a, b); }); },
               [&] {
                 guard([&] { round_input(attn, l[1]); });
                 open_product(p + 5, panels(l[1]));
               }, &ahead);
      ahead = LinesAhead();
      if (!routed) {  // a MoE layer's experts are known once routed
        next_share(l[2], G);
        next_share(l[2], G, G);
      }
      step.run(p + 5, t, [&](int64_t a, int64_t b) { guard([&] { linear_panels(l[1], rounded, o, a, b); }); },
               [&] { step.open_one_op(p + 6); }, &ahead);
      step.run(p + 6, t, [&](int64_t, int64_t) {
        guard([&] {
          if (attn_out_norm.numel()) add_rms_norm(o, c10::nullopt, attn_out_norm, eps, o_normed);
          const torch::Tensor& joined = attn_out_norm.numel() ? o_normed : o;
          add_rms_norm(joined, res, w[1], eps, normed);
          res = joined;
          if (routed) {
            experts.start(experts_of[kind.experts], l[2], l[3], normed, count_experts);
            return;
          }
          if (!act.defined() || act.size(1) != 8 * G) {
            gate_up = make(16 * G);
            act = make(8 * G);
          }
          round_input(normed, l[2]);
        });
      }, [&] { open_product(p + 7, failed.load() ? 0 : routed ? experts.gate_up_panels() : G); }, &ahead);
      ahead = LinesAhead();
      if (!routed) next_share(l[3], panels(l[3]));
      // gate and up over the same columns of act, then act * up on those
      step.run(p + 7, t, [&](int64_t a, int64_t b) {
        guard([&] {
          if (routed) return experts.gate_up(a, b);
          linear_panels(l[2], rounded, gate_up, a, b);
          linear_panels(l[2], rounded, gate_up, G + a, G + b);
          (kind.activation ? gelu_tanh_and_mul_columns : silu_and_mul_columns)(gate_up, act, 8 * a, 8 * b);
        });
      }, [&] {
        guard([&] { routed ? experts.round_act() : round_input(act, l[3]); });
        open_product(p + 8, failed.load() ? 0 : routed ? experts.down_panels() : panels(l[3]));
      }, &ahead);
      ahead = LinesAhead();
      if (i + 1 < layers) next_share(l[4], panels(l[4]));
      step.run(p + 8, t, [&](int64_t a, int64_t b) {
        guard([&] { routed ? experts.down(a, b) : linear_panels(l[3], rounded, down, a, b); });
      }, [&] {
                 guard([&] {
                   const torch::Tensor out = routed ? experts.finish(normed) : down;
                   if (mlp_out_norm.numel()) add_rms_norm(out, c10::nullopt, mlp_out_norm, eps, down_normed);
                   x = mlp_out_norm.numel() ? down_normed : out;
                 });
                 if (i + 1 < layers) step.open_one_op(p + kPhases);
               }, &ahead);
    }
  }
  if (error) std::rethrow_exception(error);
  return {x, res};
}

}  // namespace decode_step

// Per layer, `tensors` holds input norm, post-attention norm, k cache, v cache, k scales, v scales (empty
// unless the cache is int8 / fp8), then (w, high, scales, offsets, supers, panel codes, panel scales, bias)
// of qkv, o, gate_up, down, then the attention's sinks (empty: none), the norms of each head's q and of each
// head's k, and the norms of the
// attention's and of the MLP's output before they join the stream (Gemma 3's; all four empty where the
// layer has none); `ints` holds (kind, bits, center) of those four linears, then the layer's
// `LayerKind` (activation, window, group, rope, experts); `soft_caps` the layers' `LayerKind::soft_cap`.
// `lora`: empty, or per layer the LoRA factors (a, b, shard_offsets) of qkv, o, gate_up, down. A layer with
// routed experts has its shared expert (or none: kind -1, empty tensors) as gate_up and down, and its
// `Experts` in `expert_ints`: (E, top_k, renormalize), then (kind, bits, center) of the router, the shared
// expert's gate and each expert's gate_up and down in turn; in `expert_tensors` the 8 tensors of each of
// those linears, in the same order, then the expert counters, the experts' gate_up and down biases (empty:
// none) and their clamped SwiGLU's (alpha, limit) in float64 (empty: SiLU).
DecodeStep::DecodeStep(std::vector<torch::Tensor> tensors, std::vector<int64_t> ints, int64_t num_heads,
                       int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
                       std::vector<double> soft_caps, std::vector<torch::Tensor> lora,
                       std::vector<torch::Tensor> expert_tensors, std::vector<int64_t> expert_ints)
    : tensors_(std::move(tensors)),
      lora_(std::move(lora)),
      expert_tensors_(std::move(expert_tensors)),
      H_(num_heads),
      KVH_(num_kv_heads),
      D_(head_dim),
      eps_(eps),
      scale_(scale) {
  using decode_step::Linear;
  constexpr size_t kInts = 4 * 3 + 5, kLoRA = 4 * 3;
  TORCH_CHECK(tensors_.size() % kTensors == 0, "DecodeStep: ", kTensors, " tensors per layer");
  const size_t layers = tensors_.size() / kTensors;
  TORCH_CHECK(ints.size() == kInts * layers, "DecodeStep: 17 ints per layer");
  TORCH_CHECK(lora_.empty() || lora_.size() == kLoRA * layers, "DecodeStep: 12 LoRA tensors per layer, or none");
  TORCH_CHECK(soft_caps.size() == layers, "DecodeStep: a soft cap per layer");
  for (size_t i = 0; i < layers; ++i)
    for (int j = 0; j < 4; ++j) {
      const torch::Tensor* l = tensors_.data() + kTensors * i + 6 + 8 * j;
      const int64_t* k = ints.data() + kInts * i + 3 * j;
      plain_.push_back(decode_step::make_linear(l, k));
      if (!lora_.empty()) {
        adapted_.push_back(plain_.back());
        adapted_.back().lora = lora_.data() + kLoRA * i + 3 * j;
      }
    }
  for (size_t i = 0; i < layers; ++i) {
    const int64_t* k = ints.data() + kInts * i + 12;
    kinds_.push_back(decode_step::LayerKind{k[0], k[1], k[2], k[3], soft_caps[i], k[4]});
  }
  // the layers' experts, in layer order (each layer's `LayerKind::experts` names its own)
  const torch::Tensor* et = expert_tensors_.data();
  const int64_t* ei = expert_ints.data();
  const int64_t* ints_end = ei + expert_ints.size();
  for (const auto& kind : kinds_) {
    if (kind.experts < 0) continue;
    TORCH_CHECK(kind.experts == static_cast<int64_t>(experts_.size()) && ints_end - ei >= 3,
                "DecodeStep: a layer's experts out of order");
    const int64_t E = ei[0], linears = 2 + 2 * E;
    const int64_t tensors_left = expert_tensors_.data() + expert_tensors_.size() - et;
    TORCH_CHECK(ints_end - ei >= 3 + 3 * linears && tensors_left >= 8 * linears + 4,
                "DecodeStep: (E, top_k, renormalize), then 3 ints and 8 tensors for each of 2 + 2E linears");
    const torch::Tensor* extra = et + 8 * linears;  // counters, gate_up and down biases, SwiGLU's (alpha, limit)
    auto bias = [](const torch::Tensor& b) { return b.numel() ? b : torch::Tensor(); };
    TORCH_CHECK(!extra[3].numel() || (extra[3].numel() == 2 && extra[3].scalar_type() == at::kDouble),
                "DecodeStep: SwiGLU's (alpha, limit) as float64, or none");
    const double* swiglu = extra[3].numel() ? extra[3].data_ptr<double>() : nullptr;
    decode_step::Experts m{decode_step::make_linear(et, ei + 3),
                           decode_step::make_linear(et + 8, ei + 6),
                           {},
                           {},
                           ei[1],
                           ei[2] != 0,
                           extra[0],
                           bias(extra[1]),
                           bias(extra[2]),
                           swiglu ? std::vector<double>{swiglu[0], swiglu[1]} : std::vector<double>{}};
    for (int64_t e = 0; e < E; ++e) {
      m.gate_up.push_back(decode_step::make_linear(et + 8 * (2 + e), ei + 3 + 3 * (2 + e)));
      m.down.push_back(decode_step::make_linear(et + 8 * (2 + E + e), ei + 3 + 3 * (2 + E + e)));
    }
    TORCH_CHECK(m.counts.numel() == E && m.counts.scalar_type() == at::kLong, "DecodeStep: a counter an expert");
    experts_.push_back(std::move(m));
    et += 8 * linears + 4;
    ei += 3 + 3 * linears;
  }
  TORCH_CHECK(ei == ints_end && et == expert_tensors_.data() + expert_tensors_.size(),
              "DecodeStep: experts left over");
  TORCH_CHECK(lora_.empty() || experts_.empty(), "DecodeStep: adapters beside MoE layers run on the layers");
  // every product on panels (a MoE layer's router and shared expert gate excepted: one unit each, on any
  // weights), 8 | I; SiLU experts without biases
  auto gate_up_on_panels = [](const decode_step::Linear& l) {
    return decode_step::splits_by_panels(l) && (l.w.size(0) / 2) % 8 == 0;
  };
  one_region_ = true;
  for (size_t i = 0; i < layers; ++i) {
    const decode_step::Linear* l = plain_.data() + 4 * i;
    const bool routed = kinds_[i].experts >= 0;
    one_region_ = one_region_ && decode_step::splits_by_panels(l[0]) && decode_step::splits_by_panels(l[1]) &&
                  (routed && l[2].kind < 0 ? true : gate_up_on_panels(l[2]) && decode_step::splits_by_panels(l[3]));
    if (routed) {
      const decode_step::Experts& m = experts_[kinds_[i].experts];
      one_region_ = one_region_ && m.swiglu.empty() && !m.gate_up_bias.defined() && !m.down_bias.defined() &&
                    std::all_of(m.gate_up.begin(), m.gate_up.end(), gate_up_on_panels) &&
                    std::all_of(m.down.begin(), m.down.end(), decode_step::splits_by_panels);
    }
  }
}

// hidden: [T, hidden], its decodes first, then (chunk_spans: decode_step::Chunks) the prompt chunks of a mixed
// step, which only the one parallel region runs; residual: the stream so far (absent before the first layer).
// `lora_segments`: empty, or the step's (seg_starts, seg_slots, seg_scales) (tokenmill/kernels/lora.py), which
// run the adapters. slots, block_tables, context_lens, chunk_tables (a block table a chunk): KV cache group
// 0's (the layers' of `LayerKind::group` 0); other_groups: the first three of group 1, 2, ... in turn, and
// other_chunk_tables their chunk tables. cos_sin: rotary table 0; other_tables: tables 1, 2, ...
// count_experts: add the step's tokens to the expert counters. Returns {hidden, residual} after the last
// layer (the final norm is the caller's).
std::vector<torch::Tensor> DecodeStep::run(torch::Tensor hidden, c10::optional<torch::Tensor> residual,
                                           const torch::Tensor& positions, const torch::Tensor& slots,
                                           const torch::Tensor& block_tables, const torch::Tensor& context_lens,
                                           const torch::Tensor& cos_sin,
                                           const std::vector<torch::Tensor>& lora_segments,
                                           std::vector<int64_t> chunk_spans, std::vector<torch::Tensor> chunk_tables,
                                           const std::vector<torch::Tensor>& other_groups,
                                           const std::vector<torch::Tensor>& other_chunk_tables,
                                           const std::vector<torch::Tensor>& other_tables, bool count_experts) const {
  TORCH_CHECK(lora_segments.empty() || lora_segments.size() == 3, "DecodeStep: 3 LoRA segment tensors, or none");
  const bool adapters = !lora_.empty() && !lora_segments.empty();
  const torch::Tensor* segments = adapters ? lora_segments.data() : nullptr;
  const std::vector<decode_step::Linear>& linears = adapters ? adapted_ : plain_;
  const int64_t T = hidden.size(0), H = H_, KVH = KVH_, D = D_;
  const decode_step::Chunks chunks{std::move(chunk_spans)};
  TORCH_CHECK(chunks.spans.size() % 3 == 0 && chunk_tables.size() == chunks.size(),
              "DecodeStep: (start, end, cached) and a block table for each chunk");
  TORCH_CHECK(chunks.tokens() <= T, "DecodeStep: more chunk tokens than the step's");
  for (size_t c = 0; c < chunks.size(); ++c)
    TORCH_CHECK(chunks.length(c) > 0 && chunks.cached(c) >= 0 &&
                    chunks.start(c) == (c ? chunks.start(c - 1) + chunks.length(c - 1) : T - chunks.tokens()),
                "DecodeStep: chunks follow the decodes and each other to the step's end");
  TORCH_CHECK(other_groups.size() % 3 == 0 && other_chunk_tables.size() == other_groups.size() / 3 * chunks.size(),
              "DecodeStep: (slots, block tables, context lens) and a block table a chunk for each other group");
  std::vector<decode_step::Group> groups{{slots, block_tables, context_lens, std::move(chunk_tables)}};
  for (size_t k = 0; k < other_groups.size(); k += 3) {
    const auto first = other_chunk_tables.begin() + static_cast<int64_t>(k / 3 * chunks.size());
    groups.push_back({other_groups[k], other_groups[k + 1], other_groups[k + 2],
                      std::vector<torch::Tensor>(first, first + static_cast<int64_t>(chunks.size()))});
  }
  std::vector<torch::Tensor> rope_tables{cos_sin};
  rope_tables.insert(rope_tables.end(), other_tables.begin(), other_tables.end());
  for (const auto& k : kinds_)
    TORCH_CHECK(k.group < static_cast<int64_t>(groups.size()) && k.rope < static_cast<int64_t>(rope_tables.size()),
                "DecodeStep: a layer's KV cache group or rotary table was not passed");
  if (one_region_ && !adapters)
    return decode_step::layers_in_one_region(hidden, residual, positions, groups, rope_tables, linears, kinds_,
                                             tensors_, H, KVH, D, eps_, scale_, chunks, experts_, count_experts);
  TORCH_CHECK(!chunks.size(), "DecodeStep: prompt chunks run only with every product on int8 panels, no adapter");
  torch::Tensor res = residual ? *residual : torch::Tensor();
  for (size_t i = 0; i < linears.size() / 4; ++i) {
    const torch::Tensor* t = tensors_.data() + kTensors * i;
    const decode_step::Linear &qkv_proj = linears[4 * i], &o_proj = linears[4 * i + 1],
                              &gate_up_proj = linears[4 * i + 2], &down_proj = linears[4 * i + 3];

    const decode_step::LayerKind& kind = kinds_[i];
    const decode_step::Group& group = groups[kind.group];
    const torch::Tensor &q_norm = t[kTensors - 4], &k_norm = t[kTensors - 3], &attn_out_norm = t[kTensors - 2],
                        &mlp_out_norm = t[kTensors - 1];
    // a norm with no residual, as RMSNorm(x) alone runs it (the fused kernel)
    auto norm_alone = [&](const torch::Tensor& x, const torch::Tensor& w) {
      auto out = torch::empty_like(x);
      add_rms_norm(x, c10::nullopt, w, eps_, out);
      return out;
    };

    auto normed = torch::empty_like(hidden);
    add_rms_norm(hidden, res.defined() ? c10::optional<torch::Tensor>(res) : c10::nullopt, t[0], eps_, normed);
    res = hidden;
    auto qkv = decode_step::linear(qkv_proj, normed, segments).view({T, H + 2 * KVH, D});
    auto qk = qkv.narrow(1, 0, H + KVH);
    if (q_norm.numel())  // each head's q and k normed (torch's rms_norm, as LlamaAttention), into a new tensor
      qk = at::cat({at::rms_norm(qkv.narrow(1, 0, H), {D}, q_norm, eps_),
                    at::rms_norm(qkv.narrow(1, H, KVH), {D}, k_norm, eps_)},
                   1);
    rotary_inplace(qk, positions, rope_tables[kind.rope]);
    const auto keys = qk.narrow(1, H, KVH), values = qkv.narrow(1, H + KVH, KVH);
    const bool quantized = t[4].numel() > 0;
    if (quantized)
      write_kv_quantized(keys, values, t[2], t[3], t[4], t[5], group.slots);
    else
      write_kv(keys, values, t[2], t[3], group.slots);
    auto attn = torch::empty({T, H, D}, hidden.options());
    paged_decode_attention(qk.narrow(1, 0, H).contiguous(), t[2], t[3], group.block_tables, group.context_lens, scale_,
                           kind.window, kind.soft_cap, attn, decode_step::present(t[4]), decode_step::present(t[5]),
                           decode_step::present(t[kSinks]));
    auto o = decode_step::linear(o_proj, attn.view({T, H * D}), segments);
    if (attn_out_norm.numel()) o = norm_alone(o, attn_out_norm);

    normed = torch::empty_like(o);
    add_rms_norm(o, res, t[1], eps_, normed);
    res = o;
    if (kind.experts >= 0) {
      hidden = decode_step::experts_mlp(experts_[kind.experts], gate_up_proj, down_proj, normed, count_experts);
      continue;
    }
    auto gate_up = decode_step::linear(gate_up_proj, normed, segments);
    auto act = torch::empty({T, gate_up.size(1) / 2}, hidden.options());
    (kind.activation ? gelu_tanh_and_mul : silu_and_mul)(gate_up, act);
    hidden = decode_step::linear(down_proj, act, segments);
    if (mlp_out_norm.numel()) hidden = norm_alone(hidden, mlp_out_norm);
  }
  return {hidden, res};
}

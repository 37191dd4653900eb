#include "step_experts.h"

#include <ATen/ops/add.h>
#include <ATen/ops/clamp.h>
#include <ATen/ops/div.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/topk.h>
#include <ATen/ops/zeros_like.h>

#include "fused_ops.h"

namespace decode_step {

Routing route(const Experts& m, const torch::Tensor& x, bool count) {
  // select_experts: softmax scores (float32 logits), the top_k, their scores as weights (renormalised)
  const torch::Tensor scores = at::softmax(linear(m.router, x, nullptr), -1);
  const torch::Tensor ids = std::get<1>(at::topk(scores, m.top_k, -1)).contiguous();
  torch::Tensor weights = scores.gather(1, ids);
  if (m.renormalize) weights = at::div(weights, weights.sum(-1, true));
  weights = weights.contiguous();
  // grouped_experts: the (token, expert) pairs in expert order, stable (a counting sort: its argsort's order)
  const int64_t pairs = ids.numel(), E = static_cast<int64_t>(m.gate_up.size());
  const int64_t* id = ids.data_ptr<int64_t>();
  const float* w = weights.data_ptr<float>();
  Routing r{std::vector<int64_t>(pairs), std::vector<int64_t>(E, 0), std::vector<float>(pairs)};
  for (int64_t i = 0; i < pairs; ++i) ++r.rows[id[i]];
  std::vector<int64_t> next(E, 0);
  for (int64_t e = 1; e < E; ++e) next[e] = next[e - 1] + r.rows[e - 1];
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t row = next[id[i]]++;
    r.token_of[row] = i / m.top_k;
    r.weights[row] = w[i];
  }
  if (count) {
    int64_t* counts = m.counts.data_ptr<int64_t>();
    for (int64_t e = 0; e < E; ++e) counts[e] += r.rows[e];
  }
  return r;
}

void sized(torch::Tensor& t, int64_t rows, int64_t columns, const torch::Tensor& like) {
  if (!t.defined() || t.size(0) != rows || t.size(1) != columns) t = torch::empty({rows, columns}, like.options());
}

void Routing::gather(const torch::Tensor& x, torch::Tensor& rows) const {
  const int64_t n = static_cast<int64_t>(token_of.size()), H = x.size(1);
  sized(rows, n, H, x);
  const float* src = x.data_ptr<float>();
  float* dst = rows.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) std::copy_n(src + token_of[i] * x.stride(0), H, dst + i * H);
}

torch::Tensor combine(const Routing& r, const torch::Tensor& rows_out, const torch::Tensor& x) {
  const int64_t H = x.size(1);
  torch::Tensor out = at::zeros_like(x);
  float* o = out.data_ptr<float>();
  const float* rows = rows_out.data_ptr<float>();
  for (size_t i = 0; i < r.token_of.size(); ++i) {
    float* dst = o + r.token_of[i] * H;
    const float* src = rows + static_cast<int64_t>(i) * H;
    const float weight = r.weights[i];
    for (int64_t c = 0; c < H; ++c) {
      const float weighed = src[c] * weight;  // rounded, then added (the build does not contract to an FMA)
      dst[c] += weighed;
    }
  }
  return out;
}

void expert_activation(const Experts& m, size_t e, torch::Tensor& g, torch::Tensor& act) {
  if (m.gate_up_bias.defined()) g.add_(m.gate_up_bias[static_cast<int64_t>(e)]);
  if (m.swiglu.empty()) return silu_and_mul(g, act);
  // clamped_swiglu: gate clamped above at the limit, up to [-limit, limit], gate * sigmoid(alpha gate) * (up + 1)
  const double alpha = m.swiglu[0], limit = m.swiglu[1];
  const int64_t I = act.size(1);
  const torch::Tensor gate = at::clamp(g.narrow(1, 0, I), c10::nullopt, limit),
                      up = at::clamp(g.narrow(1, I, I), -limit, limit);
  act.copy_(at::mul(at::mul(gate, at::sigmoid(at::mul(gate, alpha))), at::add(up, 1)));
}

namespace {

torch::Tensor silu_mlp(const Linear& gate_up, const Linear& down, const torch::Tensor& x) {
  const torch::Tensor g = linear(gate_up, x, nullptr);
  torch::Tensor act = torch::empty({x.size(0), g.size(1) / 2}, x.options());
  silu_and_mul(g, act);
  return linear(down, act, nullptr);
}

}  // namespace

torch::Tensor experts_mlp(const Experts& m, const Linear& shared_gate_up, const Linear& shared_down,
                          const torch::Tensor& x, bool count) {
  const Routing r = route(m, x, count);
  torch::Tensor rows;
  r.gather(x, rows);
  torch::Tensor out = at::empty_like(rows);
  int64_t start = 0;
  for (size_t e = 0; e < r.rows.size(); start += r.rows[e++]) {
    if (!r.rows[e]) continue;
    torch::Tensor g = linear(m.gate_up[e], rows.narrow(0, start, r.rows[e]), nullptr);
    torch::Tensor act = torch::empty({r.rows[e], g.size(1) / 2}, x.options());
    expert_activation(m, e, g, act);
    torch::Tensor part = out.narrow(0, start, r.rows[e]);
    part.copy_(linear(m.down[e], act, nullptr));
    if (m.down_bias.defined()) part.add_(m.down_bias[static_cast<int64_t>(e)]);
  }
  torch::Tensor routed = combine(r, out, x);
  if (shared_gate_up.kind < 0) return routed;
  const torch::Tensor always = silu_mlp(shared_gate_up, shared_down, x);
  return at::add(routed, at::mul(at::sigmoid(linear(m.shared_gate, x, nullptr)), always));
}

void RegionExperts::start(const Experts& m, const Linear& shared_gate_up, const Linear& shared_down,
                          const torch::Tensor& x, bool count) {
  routing_ = route(m, x, count);
  routing_.gather(x, rows_);
  sized(rows_out_, rows_.size(0), rows_.size(1), x);
  shared_ = shared_gate_up.kind >= 0;
  used_ = 0;  // the segments and their buffers are kept from layer to layer (made anew where a size changes)
  auto add = [&](const Linear& gate_up, const Linear& down, const torch::Tensor& in, torch::Tensor out) {
    if (used_ == segments_.size()) segments_.emplace_back();
    Segment& s = segments_[used_++];
    const int64_t I = gate_up.w.size(0) / 2;
    s.gate_up = &gate_up;
    s.down = &down;
    sized(s.gate_up_out, in.size(0), 2 * I, in);
    sized(s.act, in.size(0), I, in);
    s.out = std::move(out);
    s.G = I / 8;
    s.panels = down.panel_codes.size(0);
    round_for(gate_up, in, s.in);
  };
  int64_t start = 0;
  for (size_t e = 0; e < routing_.rows.size(); start += routing_.rows[e++])
    if (routing_.rows[e])
      add(m.gate_up[e], m.down[e], rows_.narrow(0, start, routing_.rows[e]),
          rows_out_.narrow(0, start, routing_.rows[e]));
  if (shared_) {
    add(shared_gate_up, shared_down, x, at::empty_like(x));
    shared_scale_ = at::sigmoid(linear(m.shared_gate, x, nullptr));
  }
}

void RegionExperts::gate_up(int64_t a, int64_t b) {
  over(a, b, &Segment::G, [](Segment& s, int64_t lo, int64_t hi) {
    linear_panels(*s.gate_up, s.in, s.gate_up_out, lo, hi);
    linear_panels(*s.gate_up, s.in, s.gate_up_out, s.G + lo, s.G + hi);
    silu_and_mul_columns(s.gate_up_out, s.act, 8 * lo, 8 * hi);
  });
}

void RegionExperts::round_act() {
  for (size_t i = 0; i < used_; ++i) round_for(*segments_[i].down, segments_[i].act, segments_[i].mid);
}

void RegionExperts::down(int64_t a, int64_t b) {
  over(a, b, &Segment::panels,
       [](Segment& s, int64_t lo, int64_t hi) { linear_panels(*s.down, s.mid, s.out, lo, hi); });
}

torch::Tensor RegionExperts::finish(const torch::Tensor& x) {
  torch::Tensor routed = combine(routing_, rows_out_, x);
  return shared_ ? at::add(routed, at::mul(shared_scale_, segments_[used_ - 1].out)) : routed;
}

}  // namespace decode_step

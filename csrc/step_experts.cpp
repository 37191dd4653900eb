#include "step_experts.h"

#include <ATen/ops/add.h>
#include <ATen/ops/argsort.h>
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
  const torch::Tensor ids = std::get<1>(at::topk(scores, m.top_k, -1));
  torch::Tensor weights = scores.gather(1, ids);
  if (m.renormalize) weights = at::div(weights, weights.sum(-1, true));
  // grouped_experts: the (token, expert) pairs in expert order, stable
  const torch::Tensor flat = ids.flatten(), order = at::argsort(flat, /*stable=*/true, 0, false);
  Routing r{at::div(order, m.top_k, "floor"), weights.flatten().index_select(0, order),
            std::vector<int64_t>(m.gate_up.size(), 0)};
  const int64_t* id = flat.data_ptr<int64_t>();
  for (int64_t i = 0; i < flat.numel(); ++i) ++r.rows[id[i]];
  if (count) {
    int64_t* counts = m.counts.data_ptr<int64_t>();
    for (size_t e = 0; e < r.rows.size(); ++e) counts[e] += r.rows[e];
  }
  return r;
}

torch::Tensor combine(const Routing& r, torch::Tensor rows_out, const torch::Tensor& x) {
  rows_out.mul_(r.weights.unsqueeze(1));
  return at::zeros_like(x).index_add_(0, r.token_of, rows_out);
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
  const torch::Tensor rows = x.index_select(0, r.token_of);
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
  const torch::Tensor rows = x.index_select(0, routing_.token_of);
  rows_out_ = at::empty_like(rows);
  shared_ = shared_gate_up.kind >= 0;
  segments_.clear();
  auto add = [&](const Linear& gate_up, const Linear& down, const torch::Tensor& in, torch::Tensor out) {
    const int64_t I = gate_up.w.size(0) / 2;
    segments_.push_back({&gate_up, &down, {}, {}, torch::empty({in.size(0), 2 * I}, in.options()),
                         torch::empty({in.size(0), I}, in.options()), std::move(out), I / 8,
                         down.panel_codes.size(0)});
    round_for(gate_up, in, segments_.back().in);
  };
  int64_t start = 0;
  for (size_t e = 0; e < routing_.rows.size(); start += routing_.rows[e++])
    if (routing_.rows[e])
      add(m.gate_up[e], m.down[e], rows.narrow(0, start, routing_.rows[e]),
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
  for (Segment& s : segments_) round_for(*s.down, s.act, s.mid);
}

void RegionExperts::down(int64_t a, int64_t b) {
  over(a, b, &Segment::panels,
       [](Segment& s, int64_t lo, int64_t hi) { linear_panels(*s.down, s.mid, s.out, lo, hi); });
}

torch::Tensor RegionExperts::finish(const torch::Tensor& x) {
  torch::Tensor routed = combine(routing_, rows_out_, x);
  return shared_ ? at::add(routed, at::mul(shared_scale_, segments_.back().out)) : routed;
}

}  // namespace decode_step

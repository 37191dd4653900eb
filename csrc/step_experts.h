// A mixture-of-experts MLP in the compiled step (decode_step::Experts): the routing of a step's tokens, and
// the layer's output, as tokenmill/layers/fused_moe.py computes them (`select_experts`, `grouped_experts`,
// `FusedMoE.run_experts`), op for op, so with the same bits.
#pragma once

#include <algorithm>
#include <vector>

#include "decode_step.h"

namespace decode_step {

// A step's tokens routed to their experts: each token's top_k (token, expert) pairs as rows grouped by
// expert (stable: by token within an expert, as `grouped_experts`' stable argsort orders them), the token of
// each row, the routing weight of each row, and how many rows each expert has.
struct Routing {
  std::vector<int64_t> token_of, rows;
  std::vector<float> weights;

  void gather(const torch::Tensor& x, torch::Tensor& rows) const;  // x's row of each row's token (index_select)
};

// `t` as a [rows, columns] tensor of `like`'s type: made anew only where its shape differs.
void sized(torch::Tensor& t, int64_t rows, int64_t columns, const torch::Tensor& like);

// Routes the normed hidden states `x` [T, hidden]; `count`: adds each expert's rows to its counters.
Routing route(const Experts& m, const torch::Tensor& x, bool count);

// The routed experts' output: every row's expert output `rows_out` times its weight, summed per token in
// row order (as `rows_out.mul_(weights)` and `zeros.index_add_(0, token_of, rows_out)`: one rounding each).
torch::Tensor combine(const Routing& r, const torch::Tensor& rows_out, const torch::Tensor& x);

// Expert e's activation of its gate_up output `g` [n, 2I] into `act` [n, I] (its gate_up bias added to `g`
// first, where it has one), as `FusedMoE.run_experts` applies it.
void expert_activation(const Experts& m, size_t e, torch::Tensor& g, torch::Tensor& act);

// The whole MLP op by op: the routed experts' output, plus the shared expert's (gate_up, down: kind -1 where
// the layer has none) scaled by sigmoid(m.shared_gate(x)).
torch::Tensor experts_mlp(const Experts& m, const Linear& shared_gate_up, const Linear& shared_down,
                          const torch::Tensor& x, bool count);

// A MoE layer's MLP in the compiled step's one parallel region (its phases after the post-attention norm;
// SiLU experts without biases):
// `start` (one unit) routes the tokens and rounds each active expert's rows; the experts' gate_up panels,
// then their down panels, are two products whose panels run the active experts' in turn (the shared
// expert's last); `finish` (one unit) weighs and sums the experts' outputs. The same kernels on the same
// inputs as `experts_mlp`, so the same bits.
class RegionExperts {
 public:
  void start(const Experts& m, const Linear& shared_gate_up, const Linear& shared_down, const torch::Tensor& x,
             bool count);
  int64_t gate_up_panels() const { return total(&Segment::G); }  // gate's: each with the up panel G on
  // panels [a, b) of the gate_up product, and SiLU * up on their columns
  void gate_up(int64_t a, int64_t b);
  void round_act();  // each expert's SiLU * up rounded for its down projection (one unit)
  int64_t down_panels() const { return total(&Segment::panels); }
  void down(int64_t a, int64_t b);
  torch::Tensor finish(const torch::Tensor& x);

 private:
  struct Segment {  // an active expert (rows: its tokens' rows), or the shared expert (every token)
    const Linear *gate_up = nullptr, *down = nullptr;
    PanelActivations in, mid;
    torch::Tensor gate_up_out, act, out;
    int64_t G = 0, panels = 0;  // gate panels, down panels
  };
  template <typename F>
  void over(int64_t a, int64_t b, int64_t Segment::*count, const F& f) {
    int64_t first = 0;
    for (size_t i = 0; i < used_; ++i) {
      Segment& s = segments_[i];
      const int64_t lo = std::max(a, first), hi = std::min(b, first + s.*count);
      if (lo < hi) f(s, lo - first, hi - first);
      first += s.*count;
    }
  }
  int64_t total(int64_t Segment::*count) const {
    int64_t n = 0;
    for (size_t i = 0; i < used_; ++i) n += segments_[i].*count;
    return n;
  }

  std::vector<Segment> segments_;  // the first used_ are this layer's
  size_t used_ = 0;
  Routing routing_;
  torch::Tensor rows_, rows_out_, shared_scale_;
  bool shared_ = false;
};

}  // namespace decode_step

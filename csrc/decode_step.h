// The decode step of a stack of pre-norm decoder layers (see tokenmill/kernels/decode_step.py), made of the
// very kernels the Python path calls: built once from the layers' weights, then run once a step.
#pragma once

#include <vector>

#include "block_quant.h"
#include "prelude.h"

namespace decode_step {

// A linear layer: kind 0 dense (w [N, K]), 1 blocks with float activations, 2 blocks with int8 activations
// (w: codes, then the rest of `block_quant.Blocks`, then the weight's panels where it has them:
// `block_quant.Panels`), -1 none (a part a layer lacks); absent tensors are empty. `lora`: its LoRA factors
// (a, b, shard_offsets), or null when the step runs no adapter.
struct Linear {
  torch::Tensor w, high, scales, offsets, supers, panel_codes, panel_scales, bias;
  int64_t kind, bits, center;
  const torch::Tensor* lora;
};

inline int64_t activation_span(const Linear& l) {  // block_quant.cpp's activation_span
  return l.scales.scalar_type() == at::kChar && l.supers.numel() ? 256 : 32;
}

// Rounds `x` to int8 as `l`'s panels read it.
inline void round_for(const Linear& l, const torch::Tensor& x, PanelActivations& a) {
  quantize_panel_activations(x, l.bits, activation_span(l), a);
}

// The layer's product on `x` [T, K] as the Python path computes it (`segments`: the step's LoRA segments, or
// null).
torch::Tensor linear(const Linear& l, const torch::Tensor& x, const torch::Tensor* segments);

// The output columns of panels [first, last) of `l` (int8 activations on panels) on its rounded input `a`,
// and the bias added to them as `out += bias` adds it.
void linear_panels(const Linear& l, const PanelActivations& a, torch::Tensor& out, int64_t first, int64_t last);

// A mixed step's prompt chunks, after its decodes: chunk c's tokens [start, end) of the step, the first at
// position `cached` of its sequence (spans: start, end, cached a chunk).
struct Chunks {
  std::vector<int64_t> spans;
  size_t size() const { return spans.size() / 3; }
  int64_t start(size_t c) const { return spans[3 * c]; }
  int64_t length(size_t c) const { return spans[3 * c + 1] - spans[3 * c]; }
  int64_t cached(size_t c) const { return spans[3 * c + 2]; }
  int64_t tokens() const {
    int64_t n = 0;
    for (size_t c = 0; c < size(); ++c) n += length(c);
    return n;
  }
};

// A KV cache group's part of a step: the slots its tokens' K/V go to, its decodes' block tables and context
// lengths (empty without decodes), and each prompt chunk's block table.
struct Group {
  torch::Tensor slots, block_tables, context_lens;
  std::vector<torch::Tensor> chunk_tables;
};

// A mixture-of-experts MLP (tokenmill/layers/fused_moe.py): a softmax router choosing each token's top_k
// experts (their weights renormalised to sum to 1 where `renormalize`), each expert's gate_up and down
// projections, with their biases where the layer has them ([E, 2I], [E, hidden]; GPT-OSS's), and SiLU * up
// between them, or GPT-OSS's clamped SwiGLU where `swiglu` holds its (alpha, limit); a shared expert's
// output scaled by sigmoid(shared_gate(x)) where the layer has one (its gate_up and down are the layer's
// own, kind -1 where it has none); and the expert's token counters (`FusedMoE.expert_tokens`).
struct Experts {
  Linear router, shared_gate;
  std::vector<Linear> gate_up, down;
  int64_t top_k;
  bool renormalize;
  torch::Tensor counts, gate_up_bias, down_bias;
  std::vector<double> swiglu;
};

// What a layer has beyond the plain pre-norm one (Gemma's): its activation (0: SiLU, 1: GELU-tanh), its
// attention's sliding window (0: none), the KV cache group its cache and metadata come from, the rotary
// table it turns q and k with (an index into the step's tables), its attention scores' soft cap
// (Gemma 2's; 0: none), and its routed experts (an index into the step's `Experts`; -1: a dense MLP).
struct LayerKind {
  int64_t activation, window, group, rope;
  double soft_cap;
  int64_t experts;
};

}  // namespace decode_step

// The layers' weights, KV caches and shapes, held from the model's load (or the KV cache's binding) on: a
// step passes only its own tensors, so it converts no weight list from Python and rebuilds no `Linear`
// (about 1,100 tensor arguments a token for SmolLM2's 30 layers).
class DecodeStep {
 public:
  static constexpr size_t kTensors = 6 + 4 * 8 + 1 + 4;  // per layer (see the constructor)
  static constexpr size_t kSinks = 6 + 4 * 8;          // the attention's sinks among them
  DecodeStep(std::vector<torch::Tensor> tensors, std::vector<int64_t> ints, int64_t num_heads, int64_t num_kv_heads,
             int64_t head_dim, double eps, double scale, std::vector<double> soft_caps,
             std::vector<torch::Tensor> lora, std::vector<torch::Tensor> expert_tensors,
             std::vector<int64_t> expert_ints);
  DecodeStep(const DecodeStep&) = delete;  // `adapted_` points into `lora_`
  DecodeStep& operator=(const DecodeStep&) = delete;
  std::vector<torch::Tensor> run(torch::Tensor hidden, c10::optional<torch::Tensor> residual,
                                 const torch::Tensor& positions, const torch::Tensor& slots,
                                 const torch::Tensor& block_tables, const torch::Tensor& context_lens,
                                 const torch::Tensor& cos_sin, const std::vector<torch::Tensor>& lora_segments,
                                 std::vector<int64_t> chunk_spans, std::vector<torch::Tensor> chunk_tables,
                                 const std::vector<torch::Tensor>& other_groups,
                                 const std::vector<torch::Tensor>& other_chunk_tables,
                                 const std::vector<torch::Tensor>& other_tables, bool count_experts) const;
  // whether mixed steps (prompt chunks after the decodes) can run: every product on panels, no adapter
  bool runs_chunks() const { return one_region_ && lora_.empty(); }

 private:
  std::vector<torch::Tensor> tensors_, lora_, expert_tensors_;
  std::vector<decode_step::Linear> plain_, adapted_;  // adapted_: with the LoRA factors, when there are some
  std::vector<decode_step::LayerKind> kinds_;
  std::vector<decode_step::Experts> experts_;
  int64_t H_, KVH_, D_;
  double eps_, scale_;
  bool one_region_;  // every product on panels with int8 activations: the layers in one parallel region
};

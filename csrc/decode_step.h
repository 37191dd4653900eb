// The decode step of a stack of pre-norm decoder layers (see tokenmill/kernels/decode_step.py), made of the
// very kernels the Python path calls: built once from the layers' weights, then run once a step.
#pragma once

#include <vector>

#include "prelude.h"

namespace decode_step {

// A linear layer: kind 0 dense (w [N, K]), 1 blocks with float activations, 2 blocks with int8
// activations (w: codes, then the rest of `block_quant.Blocks`, then the weight's panels where it has
// them: `block_quant.Panels`); absent tensors are empty. `lora`: its LoRA factors (a, b, shard_offsets),
// or null when the step runs no adapter.
struct Linear {
  torch::Tensor w, high, scales, offsets, supers, panel_codes, panel_scales, bias;
  int64_t kind, bits, center;
  const torch::Tensor* lora;
};

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

// What a layer has beyond the plain pre-norm one (Gemma's): its activation (0: SiLU, 1: GELU-tanh), its
// attention's sliding window (0: none), the KV cache group its cache and metadata come from, the rotary
// table it turns q and k with (an index into the step's tables), and its attention scores' soft cap
// (Gemma 2's; 0: none).
struct LayerKind {
  int64_t activation, window, group, rope;
  double soft_cap;
};

}  // namespace decode_step

// The layers' weights, KV caches and shapes, held from the model's load (or the KV cache's binding) on: a
// step passes only its own tensors, so it converts no weight list from Python and rebuilds no `Linear`
// (about 1,100 tensor arguments a token for SmolLM2's 30 layers).
class DecodeStep {
 public:
  static constexpr size_t kTensors = 6 + 4 * 8 + 4;  // per layer (see the constructor)
  DecodeStep(std::vector<torch::Tensor> tensors, std::vector<int64_t> ints, int64_t num_heads, int64_t num_kv_heads,
             int64_t head_dim, double eps, double scale, std::vector<double> soft_caps,
             std::vector<torch::Tensor> lora);
  DecodeStep(const DecodeStep&) = delete;  // `adapted_` points into `lora_`
  DecodeStep& operator=(const DecodeStep&) = delete;
  std::vector<torch::Tensor> run(torch::Tensor hidden, c10::optional<torch::Tensor> residual,
                                 const torch::Tensor& positions, const torch::Tensor& slots,
                                 const torch::Tensor& block_tables, const torch::Tensor& context_lens,
                                 const torch::Tensor& cos_sin, const std::vector<torch::Tensor>& lora_segments,
                                 std::vector<int64_t> chunk_spans, std::vector<torch::Tensor> chunk_tables,
                                 const std::vector<torch::Tensor>& other_groups,
                                 const std::vector<torch::Tensor>& other_chunk_tables,
                                 const std::vector<torch::Tensor>& other_tables) const;
  // whether mixed steps (prompt chunks after the decodes) can run: every product on panels, no adapter
  bool runs_chunks() const { return one_region_ && lora_.empty(); }

 private:
  std::vector<torch::Tensor> tensors_, lora_;
  std::vector<decode_step::Linear> plain_, adapted_;  // adapted_: with the LoRA factors, when there are some
  std::vector<decode_step::LayerKind> kinds_;
  int64_t H_, KVH_, D_;
  double eps_, scale_;
  bool one_region_;  // every product on panels with int8 activations: the layers in one parallel region
};

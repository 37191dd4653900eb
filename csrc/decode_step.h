// The decode step of a stack of plain pre-norm decoder layers in one call (see
// tokenmill/kernels/decode_step.py), made of the very kernels the Python path calls.
#pragma once

#include <vector>

#include "prelude.h"

std::vector<torch::Tensor> decode_layers(torch::Tensor hidden, c10::optional<torch::Tensor> residual,
                                         torch::Tensor positions, torch::Tensor slots, torch::Tensor block_tables,
                                         torch::Tensor context_lens, torch::Tensor cos_sin,
                                         std::vector<torch::Tensor> tensors, std::vector<int64_t> ints,
                                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
                                         double scale, std::vector<torch::Tensor> lora,
                                         std::vector<torch::Tensor> lora_segments);

// Fused elementwise kernels for CPU float32: add + RMSNorm, rotary embedding in place, SiLU * mul and
// GELU-tanh * mul, and each row's argmax (the greedy sampler).
#pragma once

#include "prelude.h"

void add_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight, double eps,
                  torch::Tensor out);
void rotary_inplace(torch::Tensor x, torch::Tensor positions, torch::Tensor cos_sin);
void silu_and_mul(torch::Tensor gate_up, torch::Tensor out);
void silu_and_mul_columns(const torch::Tensor& gate_up, torch::Tensor& out, int64_t first, int64_t last);
void gelu_tanh_and_mul(torch::Tensor gate_up, torch::Tensor out);
void gelu_tanh_and_mul_columns(const torch::Tensor& gate_up, torch::Tensor& out, int64_t first, int64_t last);
void row_argmax(torch::Tensor x, torch::Tensor out);

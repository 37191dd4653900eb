// Matmul on float8 e4m3 weights with float32 scales per row and group of columns (see
// tokenmill/kernels/fp8_matmul.py).
#pragma once

#include "prelude.h"

void fp8_matmul(torch::Tensor x, torch::Tensor weight, torch::Tensor scales, int64_t group, torch::Tensor out);
void fp8_dequantize(torch::Tensor weight, torch::Tensor scales, int64_t group, torch::Tensor out);

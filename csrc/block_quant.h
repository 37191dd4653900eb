// Matmuls on block-quantized (GGUF-style) weights, float or int8 activations; the layout is described in
// tokenmill/kernels/block_quant.py.
#pragma once

#include "prelude.h"

void block_quant_matmul(torch::Tensor x, torch::Tensor codes, c10::optional<torch::Tensor> high, torch::Tensor scales,
                        c10::optional<torch::Tensor> offsets, c10::optional<torch::Tensor> supers, int64_t bits,
                        int64_t block, int64_t center, torch::Tensor out);
void block_quant_matmul_q8(torch::Tensor x, torch::Tensor codes, c10::optional<torch::Tensor> high,
                           torch::Tensor scales, c10::optional<torch::Tensor> offsets,
                           c10::optional<torch::Tensor> supers, int64_t bits, int64_t block, int64_t center,
                           torch::Tensor out);
void block_quant_dequantize(torch::Tensor codes, c10::optional<torch::Tensor> high, torch::Tensor scales,
                            c10::optional<torch::Tensor> offsets, c10::optional<torch::Tensor> supers, int64_t bits,
                            int64_t block, int64_t center, torch::Tensor out);
void block_quant_repack_panels(torch::Tensor codes, c10::optional<torch::Tensor> high, torch::Tensor scales,
                               c10::optional<torch::Tensor> offsets, c10::optional<torch::Tensor> supers, int64_t bits,
                               int64_t block, int64_t center, torch::Tensor panel_codes, torch::Tensor panel_scales);
void block_quant_matmul_q8_panels(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, int64_t bits,
                                  int64_t span, torch::Tensor out);
void block_quant_matmul_q8_panels_range(const torch::Tensor& x, const torch::Tensor& codes,
                                        const torch::Tensor& scales, int64_t bits, int64_t span, torch::Tensor& out,
                                        int64_t first, int64_t last);

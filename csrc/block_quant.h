// Matmuls on block-quantized (GGUF-style) weights, float or int8 activations; the layout is described in
// tokenmill/kernels/block_quant.py.
#pragma once

#include <vector>

#include "prelude.h"

// Activation rows rounded to int8 as the panel products read them (quantize_panel_activations): made once
// for a product that several calls of block_quant_matmul_q8_panels_range split between them.
struct PanelActivations {
  std::vector<int8_t> xq;              // [M, K] codes
  std::vector<float> dx, xs;           // per row: the scale of each 32 values; the rounded values' sums
  std::vector<int32_t> xc;             // per block, x's integer sum times the codes' center (the tiles repay it)
  int64_t M = 0, K = 0, bits = 0;      // the panels' bits these were rounded for
};

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
void quantize_panel_activations(const torch::Tensor& x, int64_t bits, int64_t span, PanelActivations& a);
int64_t block_quant_int8_peak(int64_t iterations);
void block_quant_matmul_q8_panels_range(const PanelActivations& a, const torch::Tensor& codes,
                                        const torch::Tensor& scales, torch::Tensor& out, int64_t first, int64_t last);

// Paged decode attention on CPU, and the writes of a step's keys and values into their cache slots.
#pragma once

#include "prelude.h"

void write_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots);
void write_kv_quantized(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                        torch::Tensor k_scales, torch::Tensor v_scales, torch::Tensor slots);
// k_scales, v_scales: for int8 / fp8 caches only; sinks: optional (see paged_attention.cpp).
void paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                            torch::Tensor context_lens, double scale, int64_t window, double soft_cap_value,
                            torch::Tensor out, c10::optional<torch::Tensor> k_scales = c10::nullopt,
                            c10::optional<torch::Tensor> v_scales = c10::nullopt,
                            c10::optional<torch::Tensor> sinks = c10::nullopt);

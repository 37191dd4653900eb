// LoRA adapters' low-rank products for a flat batch grouped by adapter (see tokenmill/kernels/lora.py).
#pragma once

#include "prelude.h"

void lora_add(torch::Tensor x, torch::Tensor a, torch::Tensor b, torch::Tensor shard_offsets, torch::Tensor seg_starts,
              torch::Tensor seg_slots, torch::Tensor seg_scales, torch::Tensor out);

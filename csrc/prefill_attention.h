// Paged attention of a prompt chunk on CPU: its queries over the sequence's cache blocks, causal.
#pragma once

#include <memory>

#include "prelude.h"

// q: [n, H, D] float32 (last dim contiguous), the chunk's queries, its first at position `start`; k_cache:
// [num_blocks, block_size, KVH, D], v_cache: [num_blocks, block_size, KVH, DV] (rows may be strided: a
// latent cache's values are a view of its key rows), float32, float16, bfloat16, int8 or fp8 (both alike;
// the chunk's own keys and values already written); block_table: [blocks] int64, the sequence's; out:
// [n, H, DV] float32. k_scales, v_scales (int8 / fp8 only): [num_blocks, block_size, KVH] bfloat16. window
// > 0: a query sees only the last `window` positions; soft_cap > 0: scores soft-capped; sinks: [H] float32
// logits that join each head's softmax without a value, or null. k_new, v_new: [n, KVH, D(V)] float32, the
// chunk's own keys and values as computed, read instead of the cache's rows at positions from `start` on (a
// quantized cache's first chunk attends them unquantized, as the torch path does), or null.
void paged_prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_table,
                             int64_t start, double scale, int64_t window, double soft_cap_value, torch::Tensor out,
                             c10::optional<torch::Tensor> k_scales = c10::nullopt,
                             c10::optional<torch::Tensor> v_scales = c10::nullopt,
                             c10::optional<torch::Tensor> sinks = c10::nullopt,
                             c10::optional<torch::Tensor> k_new = c10::nullopt,
                             c10::optional<torch::Tensor> v_new = c10::nullopt);

// paged_prefill_attention's work (its arguments checked alike) as tasks that callers with threads of their own
// run (the compiled step's phases): run_tasks(begin, end), any split over any threads, gives the same bits.
class PrefillAttention {
 public:
  struct Work {  // the kernel for one cache element type (prefill_attention.cpp)
    virtual ~Work() = default;
    virtual void run_tasks(int64_t begin, int64_t end) = 0;
    int64_t tasks = 0;
  };
  PrefillAttention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                   const torch::Tensor& block_table, int64_t start, double scale, int64_t window,
                   double soft_cap_value, torch::Tensor& out, const c10::optional<torch::Tensor>& k_scales,
                   const c10::optional<torch::Tensor>& v_scales, const c10::optional<torch::Tensor>& sinks,
                   const c10::optional<torch::Tensor>& k_new, const c10::optional<torch::Tensor>& v_new);
  int64_t tasks() const { return work_->tasks; }
  void run_tasks(int64_t begin, int64_t end) { work_->run_tasks(begin, end); }

 private:
  std::unique_ptr<Work> work_;
};

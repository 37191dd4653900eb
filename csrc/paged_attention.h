// Paged decode attention on CPU, and the writes of a step's keys and values into their cache slots.
#pragma once

#include <memory>

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

// paged_decode_attention in two phases for a caller that runs its own threads (the compiled decode step's
// parallel region): its threads split [0, tasks()) among them for run_tasks, then, once every task is
// done, [0, merges()) for run_merges. Any split gives the same result (each span's result is merged in
// order); `threads` only sets how finely the work is cut. Arguments as paged_decode_attention's; their data
// must outlive the last merge.
class DecodeAttention {
 public:
  struct Work {  // the kernel for one cache element type (paged_attention.cpp)
    virtual ~Work() = default;
    virtual void run_tasks(int64_t begin, int64_t end) = 0;
    virtual void run_merges(int64_t begin, int64_t end) = 0;
    int64_t tasks = 0, merges = 0, merge_floats = 0;
  };
  DecodeAttention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                  const torch::Tensor& block_tables, const torch::Tensor& context_lens, double scale, int64_t window,
                  double soft_cap_value, torch::Tensor& out, const c10::optional<torch::Tensor>& k_scales,
                  const c10::optional<torch::Tensor>& v_scales, const c10::optional<torch::Tensor>& sinks,
                  int64_t threads);
  int64_t tasks() const { return work_->tasks; }
  int64_t merges() const { return work_->merges; }
  int64_t merge_floats() const { return work_->merge_floats; }  // the output floats of one merge
  void run_tasks(int64_t begin, int64_t end) { work_->run_tasks(begin, end); }
  void run_merges(int64_t begin, int64_t end) { work_->run_merges(begin, end); }

 private:
  std::unique_ptr<Work> work_;
};

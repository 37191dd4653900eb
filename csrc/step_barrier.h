// A barrier for the threads of one parallel region that spins for a short while, then sleeps (a futex,
// through std::atomic::wait) until the last thread arrives; while it spins, a thread may ask for the memory
// its next op reads (`LinesAhead`).
//
// Why not `#pragma omp barrier`: libgomp spins there for up to ~300,000 iterations (milliseconds) before it
// sleeps. On a machine with as many busy threads as cores (a 2-core host serving its own HTTP clients), a
// thread of the region is often preempted for a scheduler slice; its partner then spins at the next
// barrier for that whole slice, holding the core the preempted thread could have run on: both cores are
// lost to the region, not one. Sleeping after a bounded spin frees the core, so the preempted thread is
// run there and the region goes on at one core's speed instead of none. The spin covers what a step's
// phases normally differ by (a few to some tens of microseconds), so on a quiet machine no thread sleeps
// and no wake-up latency is paid.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <chrono>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define TM_SPIN_PAUSE() _mm_pause()
#else
#define TM_SPIN_PAUSE() ((void)0)
#endif

// Byte ranges a thread reads next, asked for (into L2) a few lines at a time from the barrier's spin loop:
// time a thread would only wait becomes time its next op's data is on the way (a one-token step reads its
// weights from memory, and each op otherwise starts with its first lines cold). At most kBudget bytes.
class LinesAhead {
 public:
  static constexpr int64_t kBudget = 256 << 10;  // a quarter of a Zen 4 core's L2

  void add(const void* begin, int64_t bytes) {
    bytes = std::min(bytes, kBudget - total_);
    if (bytes <= 0 || count_ == kRanges) return;
    const char* p = static_cast<const char*>(begin);
    ranges_[count_++] = {p, p + bytes};
    total_ += bytes;
  }
  // asks for the next few lines; false once all are asked for
  bool step() {
    while (current_ < count_ && ranges_[current_].next >= ranges_[current_].end) ++current_;
    if (current_ == count_) return false;
    Range& r = ranges_[current_];
    for (int k = 0; k < 8 && r.next < r.end; ++k, r.next += 64) __builtin_prefetch(r.next, 0, 2);
    return true;
  }

 private:
  static constexpr int kRanges = 4;
  struct Range {
    const char *next, *end;
  };
  Range ranges_[kRanges] = {};
  int count_ = 0, current_ = 0;
  int64_t total_ = 0;
};

class StepBarrier {
 public:
  static constexpr std::chrono::microseconds kSpin{50};  // then sleep

  // the team's size: set before the first wait, by one thread, with a barrier of the team's own after it
  void set_threads(int threads) { threads_ = threads; }

  // ahead: lines to ask for while spinning (all of them are, if the wait is long enough), or null
  void wait(LinesAhead* ahead = nullptr) {
    const unsigned generation = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == threads_ - 1) {  // the last one releases the others
      arrived_.store(0, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_release);
      generation_.notify_all();
      return;
    }
    const auto until = std::chrono::steady_clock::now() + kSpin;
    for (int i = 1; generation_.load(std::memory_order_acquire) == generation; ++i) {
      if (!ahead || !ahead->step()) TM_SPIN_PAUSE();
      if (i % 64 == 0 && std::chrono::steady_clock::now() > until) {
        while (generation_.load(std::memory_order_acquire) == generation) generation_.wait(generation);
        return;
      }
    }
  }

 private:
  int threads_ = 1;
  std::atomic<int> arrived_{0};
  std::atomic<unsigned> generation_{0};
};

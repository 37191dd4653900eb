// The phases of one compiled step, run by the threads of one parallel region: a phase is `units` of work
// (a product's panels, the attention's span tasks or merges, or one small op), and every unit of a phase
// is done before any unit of the next one starts. Each thread has its share of a phase's units, which it
// takes from the front a piece at a time; once its share is gone it takes what is left of the others'
// shares from their back. The thread that finishes a phase's last unit runs the phase's `finish` (which
// opens the next phase) and lets the others on.
//
// Why not a barrier between the ops: on a machine with as many busy threads as cores (a 2-core host
// serving its own HTTP clients), a thread of the region is often preempted for a scheduler slice. At a
// barrier its partner then waits for it, once per op; here the partner does the preempted thread's part of
// each phase and goes on, and the late thread, when it runs again, finds its phases done and catches up.
// Which thread computes a unit never changes its result (each unit is the same code on the same inputs),
// so the bits do not depend on the split.
//
// A thread waiting for a phase to end spins for a short while, asking for the memory its next op reads
// (`LinesAhead`), then sleeps on a futex until the phase's last unit is done.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <memory>
#include <utility>

#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define TM_SPIN_PAUSE() _mm_pause()
#else
#define TM_SPIN_PAUSE() ((void)0)
#endif

// Byte ranges a thread reads next, asked for (into L2) a few lines at a time while it waits: time a thread
// would only wait becomes time its next op's data is on the way (a one-token step reads its weights from
// memory, and each op otherwise starts with its first lines cold). At most kBudget bytes.
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

class StepPhases {
 public:
  static constexpr std::chrono::microseconds kSpin{50};  // a waiting thread's spin, then it sleeps

  // `phases` phases for a team of `threads`
  StepPhases(int64_t phases, int threads)
      : threads_(threads),
        shares_(new std::atomic<uint64_t>[phases * threads]),
        left_(new std::atomic<int64_t>[phases]),
        pieces_(new int64_t[phases]) {}

  // Thread t's share of `units` (of n threads): [units t / n, units (t + 1) / n), its inner ends rounded
  // down to a multiple of `align` (products: whole chunks of panels)
  static std::pair<int64_t, int64_t> share(int64_t units, int t, int n, int64_t align = 1) {
    return {t == 0 ? 0 : units * t / n / align * align, t + 1 == n ? units : units * (t + 1) / n / align * align};
  }

  // Phase p: units [0, units), each thread's `share` taken `piece` units at a time; one_op: one unit, the
  // first thread's (the one that makes the step's torch calls, unless it is late). No units: the phase
  // is done by whichever thread comes first, with no work. Phase 0 is opened before the threads run,
  // phase p + 1 by phase p's `finish`.
  void open(int64_t p, int64_t units, int64_t piece, int64_t align = 1, bool one_op = false) {
    const bool empty = units == 0;
    for (int t = 0; t < threads_; ++t) {
      auto [lo, hi] = one_op || empty ? std::pair<int64_t, int64_t>(0, t == 0 ? 1 : 0) : share(units, t, threads_, align);
      shares_[p * threads_ + t].store(static_cast<uint64_t>(lo) | static_cast<uint64_t>(hi) << 32,
                                      std::memory_order_relaxed);
    }
    pieces_[p] = empty ? 0 : std::max<int64_t>(1, piece);  // 0: take the one unit, do nothing
    left_[p].store(empty ? 1 : units, std::memory_order_relaxed);
  }
  void open_one_op(int64_t p) { open(p, 1, 1, 1, true); }

  // Thread t's part of phase p: work(begin, end) on the units it takes, then (the thread that finishes the
  // phase) finish(), and a wait until the phase is done; `ahead`: lines to ask for while waiting, or null.
  // work and finish must not throw (the caller keeps the first exception and skips the work after it).
  template <typename Work, typename Finish>
  void run(int64_t p, int t, const Work& work, const Finish& finish, LinesAhead* ahead = nullptr) {
    if (done_.load(std::memory_order_acquire) > p) return;  // a late thread: others did this phase
    const int64_t piece = std::max<int64_t>(1, pieces_[p]);
    const bool empty = pieces_[p] == 0;
    auto take_all = [&](int s, bool front) {
      int64_t begin, end;
      while (take(shares_[p * threads_ + s], piece, front, begin, end)) {
        if (!empty) work(begin, end);
        if (left_[p].fetch_sub(end - begin, std::memory_order_acq_rel) == end - begin) {
          finish();
          done_.store(static_cast<unsigned>(p + 1), std::memory_order_seq_cst);
          if (sleepers_.load(std::memory_order_seq_cst)) wake_all();
          return;
        }
      }
    };
    take_all(t, true);
    for (int k = 1; k < threads_; ++k) take_all((t + k) % threads_, false);
    wait_past(p, ahead);
  }

 private:
  // up to `piece` units off the front (or the back) of a share: [begin, end), or false when it is empty
  static bool take(std::atomic<uint64_t>& share, int64_t piece, bool front, int64_t& begin, int64_t& end) {
    uint64_t v = share.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t lo = static_cast<int64_t>(v & 0xFFFFFFFFu), hi = static_cast<int64_t>(v >> 32);
      if (lo >= hi) return false;
      const int64_t k = std::min(piece, hi - lo);
      begin = front ? lo : hi - k;
      end = front ? lo + k : hi;
      const uint64_t next = front ? static_cast<uint64_t>(lo + k) | (v & ~0xFFFFFFFFull)
                                  : (v & 0xFFFFFFFFull) | static_cast<uint64_t>(hi - k) << 32;
      if (share.compare_exchange_weak(v, next, std::memory_order_acq_rel, std::memory_order_relaxed)) return true;
    }
  }

  void wait_past(int64_t p, LinesAhead* ahead) {
    const auto until = std::chrono::steady_clock::now() + kSpin;
    for (int i = 1; done_.load(std::memory_order_acquire) <= p; ++i) {
      if (!ahead || !ahead->step()) TM_SPIN_PAUSE();
      if (i % 64 == 0 && std::chrono::steady_clock::now() > until) return sleep_past(p);
    }
  }

  // Sleeps until phase p is done. On Linux a futex, called directly: libstdc++'s std::atomic::wait first
  // calls sched_yield a few times, and on a core shared with another busy process (the server's HTTP front
  // end, its clients) a yield hands that process the rest of its slice, so the thread ran again long after
  // it could have (py-spy of the serving core: 14 % of the main thread's samples in that sched_yield). A
  // thread woken from a futex is run promptly. `sleepers_` spares the finishing thread the wake-up call
  // when no one sleeps (the usual case): a sleeper counts itself before it reads `done_`, the finisher
  // stores `done_` before it reads the count (all sequentially consistent), so one of them sees the other.
  void sleep_past(int64_t p) {
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    for (unsigned d; (d = done_.load(std::memory_order_seq_cst)) <= p;) {
#ifdef __linux__
      static_assert(sizeof(done_) == sizeof(int), "a futex word is 32 bits");
      syscall(SYS_futex, reinterpret_cast<unsigned*>(&done_), FUTEX_WAIT_PRIVATE, d, nullptr, nullptr, 0);
#else
      done_.wait(d);
#endif
    }
    sleepers_.fetch_sub(1, std::memory_order_relaxed);
  }
  void wake_all() {
#ifdef __linux__
    syscall(SYS_futex, reinterpret_cast<unsigned*>(&done_), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
#else
    done_.notify_all();
#endif
  }

  const int threads_;
  std::unique_ptr<std::atomic<uint64_t>[]> shares_;  // per phase and thread: [lo, hi) as lo | hi << 32
  std::unique_ptr<std::atomic<int64_t>[]> left_;     // per phase: units not yet done
  std::unique_ptr<int64_t[]> pieces_;
  std::atomic<unsigned> done_{0};  // phases done (a futex word)
  std::atomic<int> sleepers_{0};
};

// The kernels' work pool (declared in work_pool.h).

#include "work_pool.h"

#include <c10/util/Exception.h>
#include <pthread.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <new>
#include <thread>
#include <vector>

namespace tailserve_cpu {

// A single-sequence decode step makes ~150 short parallel calls (each linear and attention of
// every layer, 20-300 us apiece). Through OpenMP each one wakes the pool's sleeping threads
// (with OMP_WAIT_POLICY=PASSIVE, the setting for shared hosts), measured at 20-28 us per call
// on this VM. These kernels use their own workers instead, which after a job spin for a short
// while (TAILSERVE_KERNEL_SPIN_US, default 200 us; 0 never spins) before they sleep, so calls
// inside one forward find them awake and an idle engine still costs no CPU.

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

class WorkPool {
 public:
  static WorkPool& get() {
    // Never destroyed: detached workers may outlive static destruction at exit.
    static WorkPool* pool = [] {
      WorkPool* p = new WorkPool();
      // A forked child has none of the parent's threads: it starts from an empty pool.
      pthread_atfork(nullptr, nullptr, [] { new (&WorkPool::get()) WorkPool(); });
      return p;
    }();
    return *pool;
  }

  // Runs fn(item) for item in [0, n) on the calling thread plus up to threads - 1 workers,
  // items taken one at a time (contexts within one step differ by 10x). One job at a time:
  // a concurrent or nested call runs serially on its own thread instead of waiting.
  //
  // The caller never waits for a worker that has not joined: once its own share is done it
  // closes the job, and a worker that wakes later (descheduled on a shared host, or still
  // leaving its sleep) finds it closed and takes nothing. Only workers that joined before the
  // close are waited for, and they are inside an item. Waiting for every worker instead made
  // each parallel call as slow as the OS's next time slice for a preempted worker whenever
  // other processes share the cores (benchmarks/notes/, "Prefill on one pool").
  void run(int64_t n, int64_t threads, const std::function<void(int64_t)>& fn) {
    std::unique_lock<std::mutex> busy(run_mu_, std::try_to_lock);
    if (!busy.owns_lock()) {
      for (int64_t i = 0; i < n; ++i) fn(i);
      return;
    }
    ensure_workers(threads - 1);
    const int64_t helpers = std::min<int64_t>(threads - 1, static_cast<int64_t>(workers_.size()));
    next_.store(0, std::memory_order_relaxed);
    total_ = n;
    fn_ = &fn;
    wanted_ = helpers;
    uint64_t gen;
    {
      std::lock_guard<std::mutex> lock(mu_);
      gen = generation_.load(std::memory_order_relaxed) + 1;
      // Open for joining: this job's generation, no worker in it, not closed.
      state_.store((gen & kGenMask) << kGenShift, std::memory_order_release);
      generation_.store(gen, std::memory_order_release);
    }
    if (sleeping_.load(std::memory_order_acquire) > 0) cv_.notify_all();
    work();
    uint64_t s = state_.fetch_or(kClosed, std::memory_order_acq_rel) | kClosed;
    while ((s & kCountMask) != 0) {
      cpu_relax();
      s = state_.load(std::memory_order_acquire);
    }
    fn_ = nullptr;
  }

  void set_spin_us(int64_t us) { spin_ns_.store(us * 1000, std::memory_order_relaxed); }

 private:
  WorkPool() {
    const char* env = std::getenv("TAILSERVE_KERNEL_SPIN_US");
    spin_ns_.store((env ? std::atoll(env) : 200) * 1000, std::memory_order_relaxed);
  }

  void work() {
    for (int64_t i = next_.fetch_add(1); i < total_; i = next_.fetch_add(1)) (*fn_)(i);
  }

  void ensure_workers(int64_t count) {
    while (static_cast<int64_t>(workers_.size()) < count) {
      const int64_t index = static_cast<int64_t>(workers_.size());
      // The generation before this job's bump: a worker that starts late still takes the job.
      const uint64_t seen = generation_.load(std::memory_order_acquire);
      workers_.emplace_back([this, index, seen] { loop(index, seen); });
      workers_.back().detach();
    }
  }

  void loop(int64_t index, uint64_t seen) {
    for (;;) {
      const auto spin = std::chrono::nanoseconds(spin_ns_.load(std::memory_order_relaxed));
      const auto spin_until = std::chrono::steady_clock::now() + spin;
      uint64_t gen = generation_.load(std::memory_order_acquire);
      // The generation is looked at after every pause, the clock every kPausesPerClock: a
      // pause takes ~26 ns on Zen 4, and a worker that looked only every 64 pauses joined
      // a job 1.0 us after it was published on average, against 0.5 us looking after each
      // (a one-sequence decode step opens ~145 jobs; benchmarks/notes/).
      while (gen == seen && std::chrono::steady_clock::now() < spin_until) {
        for (int k = 0; k < kPausesPerClock && gen == seen; ++k) {
          cpu_relax();
          gen = generation_.load(std::memory_order_acquire);
        }
      }
      if (gen == seen) {
        std::unique_lock<std::mutex> lock(mu_);
        sleeping_.fetch_add(1, std::memory_order_acq_rel);
        cv_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
        sleeping_.fetch_sub(1, std::memory_order_acq_rel);
        gen = generation_.load(std::memory_order_acquire);
      }
      seen = gen;
      if (index < wanted_ && join(gen)) {
        work();
        state_.fetch_sub(1, std::memory_order_acq_rel);
      }
    }
  }

  // Enter job `gen` unless it is closed or already over (a newer job's state, or an older
  // one's: this worker woke late). The caller waits only for workers that got in here.
  bool join(uint64_t gen) {
    uint64_t s = state_.load(std::memory_order_acquire);
    for (;;) {
      if ((s >> kGenShift) != (gen & kGenMask) || (s & kClosed)) return false;
      if (state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel)) return true;
    }
  }

  static constexpr int kPausesPerClock = 64;
  // state_: the job's generation (high bits), closed (one bit), workers inside it (low bits).
  static constexpr int kGenShift = 24;
  static constexpr uint64_t kClosed = uint64_t(1) << 23;
  static constexpr uint64_t kCountMask = kClosed - 1;
  static constexpr uint64_t kGenMask = (uint64_t(1) << (64 - kGenShift)) - 1;

  std::atomic<int64_t> spin_ns_{0};
  std::vector<std::thread> workers_;
  std::mutex run_mu_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int64_t> sleeping_{0};
  std::atomic<int64_t> next_{0};
  std::atomic<uint64_t> state_{0};
  int64_t total_ = 0;
  int64_t wanted_ = 0;
  const std::function<void(int64_t)>* fn_ = nullptr;
};

void set_kernel_spin_us(int64_t us) {
  TORCH_CHECK(us >= 0, "set_kernel_spin_us: microseconds must be >= 0, got ", us);
  WorkPool::get().set_spin_us(us);
}

void run_on_work_pool(int64_t n, int64_t threads, const std::function<void(int64_t)>& fn) {
  WorkPool::get().run(n, threads, fn);
}

}  // namespace tailserve_cpu

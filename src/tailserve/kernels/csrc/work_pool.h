// The kernels' own work pool: parallel_dynamic hands items out one at a time to the calling
// thread and the pool's workers (see work_pool.cpp for why not OpenMP).

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <functional>

namespace tailserve_cpu {

// Runs fn(item) for item in [0, n) on the calling thread plus up to threads - 1 pool workers.
void run_on_work_pool(int64_t n, int64_t threads, const std::function<void(int64_t)>& fn);

// torch.ops.tailserve.set_kernel_spin_us: how long idle workers spin before they sleep.
void set_kernel_spin_us(int64_t us);

// Hand-outs per thread for a product's runs of consecutive weight rows. With a few rows of x
// (a decode step) the product streams its weight once and is memory-bound: two long runs per
// thread keep each thread's reads one sequential, prefetched stream, where every new run
// restarts it (30 layers' one-row Q4_1 products, best of 40 passes: 29-37 GB/s at eight runs
// per thread, 38-47 at one or two; benchmarks/notes/, "Decode products in long runs").
// With many rows each run is compute, and more hand-outs even out the threads.
inline int64_t runs_per_thread(bool streamed) { return streamed ? 2 : 8; }

// Runs fn(item) for item in [0, n), in parallel over as many threads as torch uses.
template <typename F>
void parallel_dynamic(int64_t n, const F& fn) {
  if (n <= 0) return;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  const std::function<void(int64_t)> job = [&fn](int64_t i) { fn(i); };
  run_on_work_pool(n, threads, job);
}

}  // namespace tailserve_cpu

// tailserve CPU kernels, registered as torch.ops.tailserve.*.
//
//   paged_decode_attention  one query token per sequence against its K/V blocks, read in place
//                           from the paged pool (no gather into a workspace), the query heads
//                           of a GQA group sharing every K/V row they read; one pass with an
//                           online softmax.
//   panel_linear            y = x W^T (+ b) for decode batches (1-128 rows) on a panel copy of
//                           W; MKL and oneDNN are 1.3-3x slower at these row counts on AVX2.
//   skinny_linear           the same for a few rows on W as stored (weights whose output count
//                           is not a multiple of 16, so they have no panel copy).
//   rms_norm, fused_add_rms_norm, silu_and_mul, rope_
//                           one pass each instead of several torch ops.
//
// decode_layers.cpp chains these into whole decode-only steps (torch.ops.tailserve.decode_layers).
//
// Parallel work runs on the kernels' own WorkPool (below), handed out dynamically through an
// atomic counter because decode contexts differ in length by 10x within one step.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_ops.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <new>
#include <thread>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TS_AVX2 1
#endif

namespace tailserve_cpu {

template <typename T>
inline float to_f(T v) {
  return static_cast<float>(v);
}

// ------------------------------------------------------------------ work pool
//
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
    active_.store(helpers, std::memory_order_relaxed);
    wanted_ = helpers;
    {
      std::lock_guard<std::mutex> lock(mu_);
      generation_.fetch_add(1, std::memory_order_release);
    }
    if (sleeping_.load(std::memory_order_acquire) > 0) cv_.notify_all();
    work();
    while (active_.load(std::memory_order_acquire) > 0) cpu_relax();
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
      while (gen == seen && std::chrono::steady_clock::now() < spin_until) {
        for (int k = 0; k < 64; ++k) cpu_relax();
        gen = generation_.load(std::memory_order_acquire);
      }
      if (gen == seen) {
        std::unique_lock<std::mutex> lock(mu_);
        sleeping_.fetch_add(1, std::memory_order_acq_rel);
        cv_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
        sleeping_.fetch_sub(1, std::memory_order_acq_rel);
        gen = generation_.load(std::memory_order_acquire);
      }
      seen = gen;
      if (index < wanted_) {
        work();
        active_.fetch_sub(1, std::memory_order_acq_rel);
      }
    }
  }

  std::atomic<int64_t> spin_ns_{0};
  std::vector<std::thread> workers_;
  std::mutex run_mu_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int64_t> sleeping_{0};
  std::atomic<int64_t> next_{0};
  std::atomic<int64_t> active_{0};
  int64_t total_ = 0;
  int64_t wanted_ = 0;
  const std::function<void(int64_t)>* fn_ = nullptr;
};

void set_kernel_spin_us(int64_t us) {
  TORCH_CHECK(us >= 0, "set_kernel_spin_us: microseconds must be >= 0, got ", us);
  WorkPool::get().set_spin_us(us);
}

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
  WorkPool::get().run(n, threads, job);
}

// ------------------------------------------------------------------ dot products (float)

inline float dot_f32(const float* a, const float* b, int64_t n) {
#ifdef TS_AVX2
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  __m256 s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    s2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), s2);
    s3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24), s3);
  }
  for (; i + 8 <= n; i += 8) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
  }
  __m256 s = _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3));
  __m128 lo = _mm256_castps256_ps128(s), hi = _mm256_extractf128_ps(s, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_hadd_ps(lo, lo);
  lo = _mm_hadd_ps(lo, lo);
  float r = _mm_cvtss_f32(lo);
  for (; i < n; ++i) r += a[i] * b[i];
  return r;
#else
  float r = 0.f;
  for (int64_t i = 0; i < n; ++i) r += a[i] * b[i];
  return r;
#endif
}

// q (already float) against a K row of any storage type.
template <typename T>
inline float dot_q(const float* q, const T* k, int64_t n) {
  float r = 0.f;
  for (int64_t i = 0; i < n; ++i) r += q[i] * to_f(k[i]);
  return r;
}
template <>
inline float dot_q<float>(const float* q, const float* k, int64_t n) {
  return dot_f32(q, k, n);
}

// acc[0..n) += w * v[0..n)
template <typename T>
inline void axpy(float* acc, float w, const T* v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += w * to_f(v[i]);
}
template <>
inline void axpy<float>(float* acc, float w, const float* v, int64_t n) {
#ifdef TS_AVX2
  const __m256 wv = _mm256_set1_ps(w);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(wv, _mm256_loadu_ps(v + i), _mm256_loadu_ps(acc + i)));
  }
  for (; i < n; ++i) acc[i] += w * v[i];
#else
  for (int64_t i = 0; i < n; ++i) acc[i] += w * v[i];
#endif
}

// ------------------------------------------------------------------ paged decode attention

// Pointer to token t's row for KV head g: blocks are [block_size, H_kv, D].
struct PagedRows {
  const int64_t* table;
  int64_t block_size, blk_stride, tok_stride, head_off;
  template <typename T>
  inline const T* row(const T* base, int64_t t) const {
    return base + table[t / block_size] * blk_stride + (t % block_size) * tok_stride + head_off;
  }
};

// Generic path (any dtype, any head_dim): scores, softmax, weighted sum of V.
template <typename T>
void decode_one_generic(const T* qp, int64_t q_s1, T* op, int64_t o_s1, const T* kp,
                        const T* vp, const PagedRows& rows, int64_t len, int64_t group,
                        int64_t head_dim, float scale) {
  std::vector<float> buf(group * (len + 2 * head_dim));
  float* scores = buf.data();
  float* qf = scores + group * len;
  float* acc = qf + group * head_dim;
  for (int64_t h = 0; h < group; ++h) {
    for (int64_t d = 0; d < head_dim; ++d) qf[h * head_dim + d] = to_f(qp[h * q_s1 + d]) * scale;
  }
  for (int64_t t = 0; t < len; ++t) {
    const T* krow = rows.row(kp, t);
    for (int64_t h = 0; h < group; ++h) scores[h * len + t] = dot_q<T>(qf + h * head_dim, krow, head_dim);
  }
  std::fill(acc, acc + group * head_dim, 0.f);
  for (int64_t h = 0; h < group; ++h) {
    float* row = scores + h * len;
    const float mx = *std::max_element(row, row + len);
    float sum = 0.f;
    for (int64_t t = 0; t < len; ++t) {
      row[t] = std::exp(row[t] - mx);
      sum += row[t];
    }
    for (int64_t t = 0; t < len; ++t) axpy<T>(acc + h * head_dim, row[t] / sum, rows.row(vp, t), head_dim);
    for (int64_t d = 0; d < head_dim; ++d) op[h * o_s1 + d] = static_cast<T>(acc[h * head_dim + d]);
  }
}

#ifdef TS_AVX2
// Horizontal sums of eight vectors, as one vector [sum(v0), ..., sum(v7)].
inline __m256 hsum8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(v[0], v[1]), b = _mm256_hadd_ps(v[2], v[3]);
  const __m256 c = _mm256_hadd_ps(v[4], v[5]), d = _mm256_hadd_ps(v[6], v[7]);
  const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

// exp(x) for x <= 0 (scores minus their max): 2^n * p(r), r in [-ln2/2, ln2/2], relative
// error ~2e-7; inputs below -87 flush to 0 as expf would underflow there anyway.
inline __m256 exp_neg(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
  __m256 p = _mm256_set1_ps(1.f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// float32, head_dim = 8 * NV, KV heads [g0, g0 + num_g) of one sequence (their query heads
// are num_g * group consecutive heads of q). One pass over the context with an online softmax,
// eight tokens of one block at a time: the chunk's K rows give the scores of every query head
// of their group, the running max and sum are updated, then its V rows are added in while
// they are still in L1.
//
// Why one pass and spread-out prefetches: reading K/V from DRAM, one thread reached only
// ~4 GB/s with a K pass then a V pass, where a plain walk of the same blocks reads ~10 GB/s.
// A DRAM line takes ~100 ns and a core has few misses in flight, so the loads of a chunk
// must already be on their way while the previous chunk computes. Each chunk therefore
// prefetches into L1 the K rows (during its score loop) and V rows (during its V loop) of the
// chunk kPrefetchTokens ahead, a few lines at a time, and into L2 the rows kFarTokens ahead:
// +25-40% GB/s on 32-64 sequences x 300-1000 tokens for the near prefetches (bursts of whole
// chunks gained nothing), +3-14% more for the far ones (96 tokens: no steadier gain).
constexpr int64_t kMaxItemHeads = 32;
constexpr int64_t kPrefetchTokens = 16;
constexpr int64_t kFarTokens = 48;

// K and V row pointers of tokens [t, t + count), one table lookup per block they fall in.
inline void chunk_rows(const PagedRows& rows, const float* kp, const float* vp, int64_t t,
                       int64_t count, const float** pk, const float** pv) {
  for (int64_t j = 0; j < count;) {
    const int64_t stop = std::min(count, j + rows.block_size - (t + j) % rows.block_size);
    const float* kb = rows.row(kp, t + j);
    const float* vb = rows.row(vp, t + j);
    for (int64_t i = 0; j < stop; ++j, ++i) {
      pk[j] = kb + i * rows.tok_stride;
      pv[j] = vb + i * rows.tok_stride;
    }
  }
}

// Prefetch `floats` floats from p: Hint _MM_HINT_T0 into L1, _MM_HINT_T1 into L2.
template <int Hint>
inline void prefetch_span(const float* p, int64_t floats) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < floats * 4; b += 64) _mm_prefetch(c + b, static_cast<_mm_hint>(Hint));
}

template <int NV>
void decode_heads_avx2(const float* qp, int64_t q_s1, float* op, int64_t o_s1, const float* kp,
                       const float* vp, const PagedRows& rows, int64_t len, int64_t num_g,
                       int64_t group, float scale) {
  constexpr int64_t D = 8 * NV;
  const int64_t heads = num_g * group;
  const int64_t span = num_g * D;  // floats of one token this item reads, K or V
  alignas(32) float qs[kMaxItemHeads * D];
  alignas(32) float acc[kMaxItemHeads * D];
  alignas(32) float p[kMaxItemHeads][8];
  __m256 part[kMaxItemHeads][8];
  float m[kMaxItemHeads], l[kMaxItemHeads];
  const __m256 vscale = _mm256_set1_ps(scale);
  for (int64_t h = 0; h < heads; ++h) {
    for (int v = 0; v < NV; ++v) {
      _mm256_store_ps(qs + h * D + 8 * v, _mm256_mul_ps(_mm256_loadu_ps(qp + h * q_s1 + 8 * v), vscale));
    }
    m[h] = -std::numeric_limits<float>::infinity();
    l[h] = 0.f;
  }
  std::fill(acc, acc + heads * D, 0.f);
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const float* pk[8];  // rows kPrefetchTokens ahead
  const float* pv[8];
  const float* fk[8];  // rows kFarTokens ahead
  const float* fv[8];
  for (int64_t t0 = 0; t0 < len;) {
    // A chunk never crosses a block: its rows are tok_stride apart.
    const int64_t n = std::min<int64_t>({8, rows.block_size - t0 % rows.block_size, len - t0});
    const float* k0 = rows.row(kp, t0);
    const float* v0 = rows.row(vp, t0);
    const int64_t ahead = std::max<int64_t>(0, std::min<int64_t>(8, len - t0 - kPrefetchTokens));
    const int64_t far = std::max<int64_t>(0, std::min<int64_t>(8, len - t0 - kFarTokens));
    chunk_rows(rows, kp, vp, t0 + kPrefetchTokens, ahead, pk, pv);
    chunk_rows(rows, kp, vp, t0 + kFarTokens, far, fk, fv);
    // Scores, token by token so the chunk's rows are read in address order.
    for (int64_t j = 0; j < 8; ++j) {
      if (j < ahead) prefetch_span<_MM_HINT_T0>(pk[j], span);
      if (j < far) {
        prefetch_span<_MM_HINT_T1>(fk[j], span);
        prefetch_span<_MM_HINT_T1>(fv[j], span);
      }
      const float* kr = k0 + std::min(j, n - 1) * rows.tok_stride;  // lanes >= n are masked
      for (int64_t g = 0; g < num_g; ++g) {
        const float* k = kr + g * D;
        for (int64_t hg = 0; hg < group; ++hg) {
          const int64_t h = g * group + hg;
          const float* qh = qs + h * D;
          __m256 a = _mm256_mul_ps(_mm256_load_ps(qh), _mm256_loadu_ps(k));
          for (int v = 1; v < NV; ++v) a = _mm256_fmadd_ps(_mm256_load_ps(qh + 8 * v), _mm256_loadu_ps(k + 8 * v), a);
          part[h][j] = a;
        }
      }
    }
    const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(int(n)), lane));
    for (int64_t h = 0; h < heads; ++h) {
      const __m256 s = _mm256_blendv_ps(ninf, hsum8(part[h]), valid);
      __m256 mx = _mm256_max_ps(s, _mm256_permute2f128_ps(s, s, 1));
      mx = _mm256_max_ps(mx, _mm256_shuffle_ps(mx, mx, 0x4e));
      mx = _mm256_max_ps(mx, _mm256_shuffle_ps(mx, mx, 0xb1));
      const float m_new = std::max(m[h], _mm256_cvtss_f32(mx));
      const __m256 e = exp_neg(_mm256_sub_ps(s, _mm256_set1_ps(m_new)));
      _mm256_store_ps(p[h], e);
      __m256 sum = _mm256_add_ps(e, _mm256_permute2f128_ps(e, e, 1));
      sum = _mm256_add_ps(sum, _mm256_shuffle_ps(sum, sum, 0x4e));
      sum = _mm256_add_ps(sum, _mm256_shuffle_ps(sum, sum, 0xb1));
      if (m_new > m[h]) {  // rescale what was summed against the old max (exp(-inf) = 0)
        const float c = std::exp(m[h] - m_new);
        l[h] *= c;
        const __m256 cv = _mm256_set1_ps(c);
        float* a = acc + h * D;
        for (int v = 0; v < NV; ++v) _mm256_store_ps(a + 8 * v, _mm256_mul_ps(cv, _mm256_load_ps(a + 8 * v)));
        m[h] = m_new;
      }
      l[h] += _mm256_cvtss_f32(sum);
    }
    // Weighted V rows, head by head; the chunk's V rows stay in L1 across the heads.
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t j = h * 8 / heads; j < (h + 1) * 8 / heads; ++j) {
        if (j < ahead) prefetch_span<_MM_HINT_T0>(pv[j], span);
      }
      const float* vr = v0 + (h / group) * D;
      float* a = acc + h * D;
      __m256 av[NV];
      for (int v = 0; v < NV; ++v) av[v] = _mm256_load_ps(a + 8 * v);
      for (int64_t j = 0; j < n; ++j) {
        const __m256 w = _mm256_set1_ps(p[h][j]);
        const float* r = vr + j * rows.tok_stride;
        for (int v = 0; v < NV; ++v) av[v] = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 8 * v), av[v]);
      }
      for (int v = 0; v < NV; ++v) _mm256_store_ps(a + 8 * v, av[v]);
    }
    t0 += n;
  }
  for (int64_t h = 0; h < heads; ++h) {
    const __m256 inv = _mm256_set1_ps(1.f / l[h]);
    for (int v = 0; v < NV; ++v) {
      _mm256_storeu_ps(op + h * o_s1 + 8 * v, _mm256_mul_ps(_mm256_load_ps(acc + h * D + 8 * v), inv));
    }
  }
}
#endif

template <typename T>
void decode_attention_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, double scale) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t q_s0 = q.stride(0), q_s1 = q.stride(1);
  const int64_t o_s0 = out.stride(0), o_s1 = out.stride(1);
  const int64_t bt_s0 = block_tables.stride(0);
  // K/V rows of one token for one KV head are head_dim apart inside a token's slot.
  const int64_t tok_stride = num_kv_heads * head_dim;
  const int64_t blk_stride = block_size * tok_stride;
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale);
  // Checked here: an exception must not leave a parallel region.
  for (int64_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK(lens[s] > 0 && (lens[s] + block_size - 1) / block_size <= block_tables.size(1),
                "paged_decode_attention: sequence ", s, " has context ", lens[s],
                " for a block table of ", block_tables.size(1), " blocks");
  }

  // Work items: whole sequences when there are enough of them for every thread (reads of a
  // block are then sequential), else (sequence, KV head) pairs so one long sequence still
  // spreads over the threads.
  const bool whole = num_seqs >= 2 * at::get_num_threads() && num_heads <= kMaxItemHeads;
  const int64_t per_item = whole ? num_kv_heads : 1;
  parallel_dynamic(num_seqs * (num_kv_heads / per_item), [&](int64_t item) {
    const int64_t s = item / (num_kv_heads / per_item);
    const int64_t g = (item % (num_kv_heads / per_item)) * per_item;
    const int64_t len = lens[s];
    const PagedRows rows{bt + s * bt_s0, block_size, blk_stride, tok_stride, g * head_dim};
    const T* qs = qp + s * q_s0 + g * group * q_s1;
    T* os = op + s * o_s0 + g * group * o_s1;
#ifdef TS_AVX2
    if constexpr (std::is_same_v<T, float>) {
      if (per_item * group <= kMaxItemHeads && head_dim == 64) {
        decode_heads_avx2<8>(qs, q_s1, os, o_s1, kp, vp, rows, len, per_item, group, fscale);
        return;
      }
      if (per_item * group <= kMaxItemHeads && head_dim == 128) {
        decode_heads_avx2<16>(qs, q_s1, os, o_s1, kp, vp, rows, len, per_item, group, fscale);
        return;
      }
    }
#endif
    for (int64_t gi = 0; gi < per_item; ++gi) {
      const PagedRows rg{rows.table, block_size, blk_stride, tok_stride, (g + gi) * head_dim};
      decode_one_generic<T>(qs + gi * group * q_s1, q_s1, os + gi * group * o_s1, o_s1, kp, vp,
                            rg, len, group, head_dim, fscale);
    }
  });
}

// out [n, H, D] (last dim contiguous) = attention of q [n, H, D] over each sequence's first
// seq_lens[i] cached tokens. kv_cache: [2, num_blocks, block_size, H_kv, D], contiguous.
void paged_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& kv_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            double scale) {
  TORCH_CHECK(q.device().is_cpu(), "paged_decode_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3, "q and out must be [n, H, D]");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous(), "kv_cache must be contiguous 5-D");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "head_dim must be contiguous");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type() && out.scalar_type() == q.scalar_type(),
              "q, out and kv_cache must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "block_tables and seq_lens must be int64");
  TORCH_CHECK(block_tables.stride(1) == 1, "block_tables rows must be contiguous");
  TORCH_CHECK(seq_lens.is_contiguous() && seq_lens.size(0) >= q.size(0), "seq_lens too short");
  TORCH_CHECK(block_tables.size(0) >= q.size(0), "block_tables has too few rows");
  TORCH_CHECK(q.size(1) % kv_cache.size(3) == 0, "num_heads must be a multiple of num_kv_heads");
  const at::Tensor k_cache = kv_cache.select(0, 0), v_cache = kv_cache.select(0, 1);
  switch (q.scalar_type()) {
    case at::kFloat:
      decode_attention_impl<float>(out, q, k_cache, v_cache, block_tables, seq_lens, scale);
      break;
    case at::kBFloat16:
      decode_attention_impl<c10::BFloat16>(out, q, k_cache, v_cache, block_tables, seq_lens, scale);
      break;
    case at::kHalf:
      decode_attention_impl<c10::Half>(out, q, k_cache, v_cache, block_tables, seq_lens, scale);
      break;
    default:
      TORCH_CHECK(false, "paged_decode_attention: unsupported dtype ", q.scalar_type());
  }
}

// ------------------------------------------------------------------ skinny linear (float)

// y [M, N] = x [M, K] @ w[N, K]^T (+ bias [N]); x and w contiguous float32.
at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& w,
                         const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat,
              "skinny_linear: float32 CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "shape mismatch");
  TORCH_CHECK(w.is_contiguous(), "weight must be contiguous");
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::Tensor bc;  // keeps a contiguous copy of the bias alive while the kernel reads it
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N, "bad bias");
    bc = bias->contiguous();
    bp = bc.data_ptr<float>();
  }
  // Chunks of output rows: big enough to amortise the hand-out, small enough to balance.
  constexpr int64_t kRows = 64;
  const int64_t chunks = (N + kRows - 1) / kRows;
  parallel_dynamic(chunks, [&](int64_t c) {
    const int64_t n0 = c * kRows, n1 = std::min(N, n0 + kRows);
    int64_t n = n0;
#ifdef TS_AVX2
    // Tiles of 4 weight rows x 2 input rows: each loaded weight vector feeds two FMAs and each
    // input vector four, eight accumulators reduced together by hsum8.
    const int64_t K8 = K & ~int64_t(7);
    if (M == 1 && K8 == K) {
      // One input row: 8 weight rows per tile, one accumulator each. Measured 14 GB/s over
      // a layer's four weights vs 11 GB/s for the 4x2 tile, whose second column is wasted here.
      for (; n + 8 <= n1; n += 8) {
        const float* w0 = wp + n * K;
        __m256 acc[8];
        for (auto& a : acc) a = _mm256_setzero_ps();
        for (int64_t k = 0; k < K; k += 8) {
          const __m256 xv = _mm256_loadu_ps(xp + k);
          for (int r = 0; r < 8; ++r) {
            acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + r * K + k), xv, acc[r]);
          }
        }
        __m256 y8 = hsum8(acc);
        if (bp) y8 = _mm256_add_ps(y8, _mm256_loadu_ps(bp + n));
        _mm256_storeu_ps(yp + n, y8);
      }
    }
    for (; n + 4 <= n1; n += 4) {
      const float* w0 = wp + n * K;
      for (int64_t m = 0; m < M; m += 2) {
        const float* x0 = xp + m * K;
        const float* x1 = m + 1 < M ? x0 + K : x0;
        __m256 acc[8];
        for (auto& a : acc) a = _mm256_setzero_ps();
        for (int64_t k = 0; k < K8; k += 8) {
          const __m256 a0 = _mm256_loadu_ps(x0 + k), a1 = _mm256_loadu_ps(x1 + k);
          for (int r = 0; r < 4; ++r) {
            const __m256 wv = _mm256_loadu_ps(w0 + r * K + k);
            acc[2 * r] = _mm256_fmadd_ps(wv, a0, acc[2 * r]);
            acc[2 * r + 1] = _mm256_fmadd_ps(wv, a1, acc[2 * r + 1]);
          }
        }
        alignas(32) float sums[8];
        _mm256_store_ps(sums, hsum8(acc));
        for (int64_t k = K8; k < K; ++k) {
          for (int r = 0; r < 4; ++r) {
            sums[2 * r] += w0[r * K + k] * x0[k];
            sums[2 * r + 1] += w0[r * K + k] * x1[k];
          }
        }
        for (int r = 0; r < 4; ++r) {
          const float b = bp ? bp[n + r] : 0.f;
          yp[m * N + n + r] = sums[2 * r] + b;
          if (m + 1 < M) yp[(m + 1) * N + n + r] = sums[2 * r + 1] + b;
        }
      }
    }
#endif
    for (; n < n1; ++n) {
      const float* wrow = wp + n * K;
      const float b = bp ? bp[n] : 0.f;
      for (int64_t m = 0; m < M; ++m) yp[m * N + n] = dot_f32(xp + m * K, wrow, K) + b;
    }
  });
  return y;
}

// y [M, N] = x [M, K] @ W^T (+ bias) with W stored in panels, wp [N/16, K, 16]: for each group
// of 16 output columns, the K rows of 16 weights are one contiguous stream. The inner step
// broadcasts one x element per row, loads 16 weights and does two FMAs per row (no
// horizontal sums); each panel is streamed from memory once and reused from L1/L2 for every
// chunk of up to six rows. One kernel for every decode batch: at M = 1 it reads the weights
// at ~15-19 GB/s, at M = 9-64 it does 1.3-1.55x the GFLOPS of oneDNN's prepacked sgemm on
// this AVX2 machine.
//
// Every output is (bias + the sum over k < K/2) + (the sum over k >= K/2), each half summed in
// k order, whatever M is: a row's result does not depend on its batch mates. At M = 1 the two
// halves are read as two interleaved streams, which the hardware prefetchers keep further
// ahead than one (+7-10% GB/s over the model's weights, RESULTS.md); at M > 1 the kernel is
// arithmetic-bound and sums the halves one after the other.
#ifdef TS_AVX2
// Rows [0, MR) of x (row stride ldx) against k in [0, kn) of one panel. Accumulators start
// at the bias (or zero); with Accumulate they are added to y, else stored.
template <int MR, bool Accumulate>
inline void panel_rows(const float* x, int64_t ldx, const float* w, int64_t kn, float* y,
                       int64_t N, const float* bias) {
  // Named accumulators, not arrays: GCC 12 kept __m256 arrays on the stack here and stored
  // all twelve every step, which halved the speed.
  __m256 c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51;
  c00 = c10 = c20 = c30 = c40 = c50 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  c01 = c11 = c21 = c31 = c41 = c51 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
  const float* x0 = x;
  for (int64_t k = 0; k < kn; ++k, ++x0, w += 16) {
    const __m256 w0 = _mm256_load_ps(w), w1 = _mm256_load_ps(w + 8);
#define TS_PANEL_ROW(r)                                          \
  if constexpr (MR > r) {                                        \
    const __m256 a = _mm256_broadcast_ss(x0 + r * ldx);          \
    c##r##0 = _mm256_fmadd_ps(a, w0, c##r##0);                   \
    c##r##1 = _mm256_fmadd_ps(a, w1, c##r##1);                   \
  }
    TS_PANEL_ROW(0)
    TS_PANEL_ROW(1)
    TS_PANEL_ROW(2)
    TS_PANEL_ROW(3)
    TS_PANEL_ROW(4)
    TS_PANEL_ROW(5)
#undef TS_PANEL_ROW
  }
#define TS_PANEL_STORE(r)                                                        \
  if constexpr (MR > r) {                                                        \
    if constexpr (Accumulate) {                                                  \
      c##r##0 = _mm256_add_ps(_mm256_loadu_ps(y + r * N), c##r##0);              \
      c##r##1 = _mm256_add_ps(_mm256_loadu_ps(y + r * N + 8), c##r##1);          \
    }                                                                            \
    _mm256_storeu_ps(y + r * N, c##r##0);                                        \
    _mm256_storeu_ps(y + r * N + 8, c##r##1);                                    \
  }
  TS_PANEL_STORE(0)
  TS_PANEL_STORE(1)
  TS_PANEL_STORE(2)
  TS_PANEL_STORE(3)
  TS_PANEL_STORE(4)
  TS_PANEL_STORE(5)
#undef TS_PANEL_STORE
}

// One row, both halves at once: k and h + k advance together, two streams through the panel.
inline void panel_row_two_streams(const float* x, int64_t K, const float* w, float* y,
                                  const float* bias) {
  const int64_t h = K / 2;
  __m256 a0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  __m256 a1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
  __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
  const float* wb = w + h * 16;
  for (int64_t k = 0; k < h; ++k, w += 16, wb += 16) {
    const __m256 xa = _mm256_broadcast_ss(x + k), xb = _mm256_broadcast_ss(x + h + k);
    a0 = _mm256_fmadd_ps(xa, _mm256_load_ps(w), a0);
    a1 = _mm256_fmadd_ps(xa, _mm256_load_ps(w + 8), a1);
    b0 = _mm256_fmadd_ps(xb, _mm256_load_ps(wb), b0);
    b1 = _mm256_fmadd_ps(xb, _mm256_load_ps(wb + 8), b1);
  }
  if (K - h > h) {  // odd K: the second half has one more k
    const __m256 xb = _mm256_broadcast_ss(x + K - 1);
    b0 = _mm256_fmadd_ps(xb, _mm256_load_ps(wb), b0);
    b1 = _mm256_fmadd_ps(xb, _mm256_load_ps(wb + 8), b1);
  }
  _mm256_storeu_ps(y, _mm256_add_ps(a0, b0));
  _mm256_storeu_ps(y + 8, _mm256_add_ps(a1, b1));
}

template <int MR>
inline void panel_rows_halves(const float* x, int64_t K, const float* w, float* y, int64_t N,
                              const float* bias) {
  const int64_t h = K / 2;
  panel_rows<MR, false>(x, K, w, h, y, N, bias);
  panel_rows<MR, true>(x + h, K, w + h * 16, K - h, y, N, nullptr);
}
#endif

// Rows [0, rows) of x (rows <= 6) against one panel.
inline void panel_chunk(int64_t rows, const float* x, int64_t K, const float* w, float* y,
                        int64_t N, const float* bias) {
#ifdef TS_AVX2
  switch (rows) {
    case 6: return panel_rows_halves<6>(x, K, w, y, N, bias);
    case 5: return panel_rows_halves<5>(x, K, w, y, N, bias);
    case 4: return panel_rows_halves<4>(x, K, w, y, N, bias);
    case 3: return panel_rows_halves<3>(x, K, w, y, N, bias);
    case 2: return panel_rows_halves<2>(x, K, w, y, N, bias);
    default: return panel_row_two_streams(x, K, w, y, bias);
  }
#else
  const int64_t h = K / 2;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < 16; ++c) {
      float lo = bias ? bias[c] : 0.f, hi = 0.f;
      for (int64_t k = 0; k < h; ++k) lo += x[r * K + k] * w[k * 16 + c];
      for (int64_t k = h; k < K; ++k) hi += x[r * K + k] * w[k * 16 + c];
      y[r * N + c] = lo + hi;
    }
  }
#endif
}

// Six rows keep 12 accumulators + 2 weight vectors + 1 broadcast in the 16 AVX2 registers.
constexpr int64_t kPanelRows = 6;

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& wp,
                        const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && wp.scalar_type() == at::kFloat,
              "panel_linear: float32 CPU tensors only");
  TORCH_CHECK(wp.dim() == 3 && wp.size(2) == 16 && wp.is_contiguous(),
              "panel_linear: weight must be panels [N/16, K, 16], contiguous");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == wp.size(1), "panel_linear: x is ", x.sizes(),
              " for panels of K = ", wp.size(1));
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), P = wp.size(0), N = P * 16;
  at::Tensor y = at::empty({M, N}, x.options());
  at::Tensor bc;
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N, "panel_linear: bad bias");
    bc = bias->contiguous();
    bp = bc.data_ptr<float>();
  }
  if (M == 0) return y;
  const float* xp = xc.data_ptr<float>();
  const float* w = wp.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Consecutive panels per hand-out: a thread's reads stay one sequential stream, and there
  // are still ~8 hand-outs per thread to even out the threads' speeds.
  const int64_t per_item = std::max<int64_t>(1, P / (8 * at::get_num_threads()));
  parallel_dynamic((P + per_item - 1) / per_item, [&](int64_t item) {
    const int64_t p1 = std::min(P, (item + 1) * per_item);
    for (int64_t p = item * per_item; p < p1; ++p) {
      const float* panel = w + p * K * 16;
      const float* b = bp ? bp + p * 16 : nullptr;
      for (int64_t m = 0; m < M; m += kPanelRows) {
        panel_chunk(std::min(kPanelRows, M - m), xp + m * K, K, panel, yp + m * N + p * 16, N, b);
      }
    }
  });
  return y;
}

// ------------------------------------------------------------------ fused elementwise ops
//
// A decode step of one sequence runs ~300 small elementwise ops; in torch each costs a
// dispatch plus, for some, a wake-up of the thread pool. These do the whole thing in one pass,
// serially for few rows (no fork/join) and over rows in parallel for many.

template <typename F>
void for_rows(int64_t rows, int64_t row_elems, const F& fn) {
  if (rows * row_elems < (1 << 16)) {
    for (int64_t r = 0; r < rows; ++r) fn(r);
  } else {
    at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) fn(r);
    });
  }
}

inline void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, ": float32 CPU only");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, ": expected [rows, n] with contiguous rows");
}

inline void rms_row(float* out, const float* in, const float* w, int64_t n, float eps) {
  float ss = 0.f;
  for (int64_t i = 0; i < n; ++i) ss += in[i] * in[i];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = in[i] * inv * w[i];
}

// out = rms_norm(x) * weight
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(weight.numel() == n && weight.is_contiguous(), "rms_norm: weight size");
  at::Tensor out = at::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0);
  for_rows(rows, n, [&](int64_t r) { rms_row(op + r * n, xp + r * xs, wp, n, float(eps)); });
  return out;
}

// residual += x, then x = rms_norm(residual) * weight; both in place (vLLM's fused form).
void fused_add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps) {
  check_rows(x, "fused_add_rms_norm");
  check_rows(residual, "fused_add_rms_norm");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(residual.size(0) == rows && residual.size(1) == n, "fused_add_rms_norm: shapes");
  TORCH_CHECK(weight.numel() == n && weight.is_contiguous(), "fused_add_rms_norm: weight size");
  float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const int64_t xs = x.stride(0), rs = residual.stride(0);
  for_rows(rows, n, [&](int64_t r) {
    float* xr = xp + r * xs;
    float* rr = rp + r * rs;
    for (int64_t i = 0; i < n; ++i) rr[i] += xr[i];
    rms_row(xr, rr, wp, n, float(eps));
  });
}

// [rows, 2 * I] -> [rows, I]: silu(gate) * up, gate the first half of each row.
at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "silu_and_mul");
  const int64_t rows = x.size(0), half = x.size(1) / 2;
  at::Tensor out = at::empty({rows, half}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0);
  for_rows(rows, half, [&](int64_t r) {
    const float* g = xp + r * xs;
    const float* u = g + half;
    float* o = op + r * half;
    int64_t i = 0;
#ifdef TS_AVX2
    // silu(g) = g / (1 + exp(-g)); exp of -|g| keeps exp_neg in its domain:
    // for g >= 0 that is exp(-g); for g < 0, g / (1 + 1/e) = g * e / (1 + e) with e = exp(g).
    const __m256 one = _mm256_set1_ps(1.f);
    for (; i + 8 <= half; i += 8) {
      const __m256 gv = _mm256_loadu_ps(g + i);
      const __m256 e = exp_neg(_mm256_min_ps(gv, _mm256_sub_ps(_mm256_setzero_ps(), gv)));
      const __m256 pos = _mm256_div_ps(gv, _mm256_add_ps(one, e));
      const __m256 neg = _mm256_div_ps(_mm256_mul_ps(gv, e), _mm256_add_ps(one, e));
      const __m256 silu = _mm256_blendv_ps(pos, neg, gv);  // sign bit of g selects
      _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < half; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
  });
  return out;
}

// Rotate-half rope, in place, on x [tokens, heads, head_dim] (head_dim contiguous);
// cos, sin [tokens, head_dim / 2] float32.
void rope_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 3 &&
                  x.stride(2) == 1, "rope_: float32 CPU [tokens, heads, head_dim]");
  const int64_t tokens = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat, "rope_: float32 tables");
  TORCH_CHECK(cos.numel() == tokens * half && sin.numel() == tokens * half && cos.is_contiguous() &&
                  sin.is_contiguous(), "rope_: cos/sin must be [tokens, head_dim / 2]");
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  for_rows(tokens, heads * half * 2, [&](int64_t t) {
    const float* c = cp + t * half;
    const float* sn = sp + t * half;
    for (int64_t h = 0; h < heads; ++h) {
      float* a = xp + t * s0 + h * s1;
      float* b = a + half;
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = a[i], x2 = b[i];
        a[i] = x1 * c[i] - x2 * sn[i];
        b[i] = x2 * c[i] + x1 * sn[i];
      }
    }
  });
}

}  // namespace tailserve_cpu

TORCH_LIBRARY(tailserve, m) {
  m.def("paged_decode_attention(Tensor(a!) out, Tensor q, Tensor kv_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale) -> ()");
  m.def("set_kernel_spin_us(int us) -> ()");
  m.def("skinny_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("panel_linear(Tensor x, Tensor wp, Tensor? bias) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
}

// No tensor arguments: registered for every backend.
TORCH_LIBRARY_IMPL(tailserve, CompositeExplicitAutograd, m) {
  m.impl("set_kernel_spin_us", &tailserve_cpu::set_kernel_spin_us);
}

TORCH_LIBRARY_IMPL(tailserve, CPU, m) {
  m.impl("paged_decode_attention", &tailserve_cpu::paged_decode_attention);
  m.impl("skinny_linear", &tailserve_cpu::skinny_linear);
  m.impl("panel_linear", &tailserve_cpu::panel_linear);
  m.impl("rms_norm", &tailserve_cpu::rms_norm);
  m.impl("fused_add_rms_norm", &tailserve_cpu::fused_add_rms_norm);
  m.impl("silu_and_mul", &tailserve_cpu::silu_and_mul);
  m.impl("rope_", &tailserve_cpu::rope_);
}

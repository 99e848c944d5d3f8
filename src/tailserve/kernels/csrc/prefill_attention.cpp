// torch.ops.tailserve.write_kv_cache and paged_prefill_attention: a step's K/V into their
// slots, and causal attention of prefill chunks over their sequences' cached K/V, read in
// place from the paged pool.
//
// Why not SDPA: it runs on OpenMP's threads while every product of the step runs on the
// kernels' work pool (work_pool.h). On a 2-core host the two pools spin against each other
// after each call (OpenMP spins by default) and the prefill lost a third of its speed
// (benchmarks/RESULTS.md, "Prefill on one pool"). A chunk with earlier context also needed a
// gather of its K/V into a workspace, a mask tensor, and a copy of the output.
//
// One work item is (sequence, KV head, 32 query tokens): the query heads of the GQA group
// share every K/V chunk the item stages. A chunk of 16 keys is staged as float32 (K
// transposed to [D][16], V as [16][D]; a 16-bit pool is widened here), so a query row's
// scores are D broadcast FMAs over 16 lanes and its output D / 16 vectors per key; softmax is
// online (running max and sum per row). Items run longest first, handed out dynamically.

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_ops.h"
#include "simd.h"
#include "simd16.h"
#include "work_pool.h"

namespace tailserve_cpu {
namespace {

constexpr int64_t kQueryBlock = 32;  // query tokens per item
constexpr int64_t kKeys = 16;        // keys per staged chunk: one 16-lane vector of scores
constexpr int64_t kRows = 4;         // query rows (token x head) computed together

// 16 float lanes: one AVX512 register, two AVX2 ones, or a plain array. The kernel is written
// once over this and instantiated per ISA (chosen at run time: quant_isa()).
struct VecScalar {
  float v[16];
  static VecScalar load(const float* p) { VecScalar r; for (int i = 0; i < 16; ++i) r.v[i] = p[i]; return r; }
  static VecScalar set1(float x) { VecScalar r; for (float& e : r.v) e = x; return r; }
  void store(float* p) const { for (int i = 0; i < 16; ++i) p[i] = v[i]; }
  static VecScalar fma(VecScalar a, VecScalar b, VecScalar c) {
    for (int i = 0; i < 16; ++i) c.v[i] += a.v[i] * b.v[i];
    return c;
  }
  static VecScalar mul(VecScalar a, VecScalar b) { for (int i = 0; i < 16; ++i) a.v[i] *= b.v[i]; return a; }
  // exp(x - m) for lanes < valid, 0 for the rest; returns the sum of the kept lanes.
  // The largest of lanes < valid (valid >= 1).
  float max_of(int64_t valid) const {
    float mx = v[0];
    for (int64_t i = 1; i < valid; ++i) mx = std::max(mx, v[i]);
    return mx;
  }
  float exp_sub(float m, int64_t valid, float* out) const {
    float s = 0.f;
    for (int i = 0; i < 16; ++i) {
      out[i] = i < valid ? std::exp(v[i] - m) : 0.f;
      s += out[i];
    }
    return s;
  }
};

#ifdef TS_AVX2
struct VecAvx2 {
  __m256 lo, hi;
  static VecAvx2 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static VecAvx2 set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
  void store(float* p) const { _mm256_storeu_ps(p, lo); _mm256_storeu_ps(p + 8, hi); }
  static VecAvx2 fma(VecAvx2 a, VecAvx2 b, VecAvx2 c) {
    return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
  }
  static VecAvx2 mul(VecAvx2 a, VecAvx2 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
  // The largest of lanes < valid (valid >= 1): the others set to -inf, then a tree.
  float max_of(int64_t valid) const {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i n = _mm256_set1_epi32(static_cast<int>(valid));
    const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    const __m256 keep_lo = _mm256_castsi256_ps(_mm256_cmpgt_epi32(n, lane));
    const __m256 keep_hi = _mm256_castsi256_ps(
        _mm256_cmpgt_epi32(n, _mm256_add_epi32(lane, _mm256_set1_epi32(8))));
    const __m256 m8 = _mm256_max_ps(_mm256_blendv_ps(ninf, lo, keep_lo),
                                    _mm256_blendv_ps(ninf, hi, keep_hi));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    return _mm_cvtss_f32(m4);
  }
  float exp_sub(float m, int64_t valid, float* out) const {
    const __m256 mv = _mm256_set1_ps(m);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i n = _mm256_set1_epi32(static_cast<int>(valid));
    const __m256 keep_lo = _mm256_castsi256_ps(_mm256_cmpgt_epi32(n, lane));
    const __m256 keep_hi = _mm256_castsi256_ps(
        _mm256_cmpgt_epi32(n, _mm256_add_epi32(lane, _mm256_set1_epi32(8))));
    const __m256 e_lo = _mm256_and_ps(keep_lo, exp_neg(_mm256_sub_ps(lo, mv)));
    const __m256 e_hi = _mm256_and_ps(keep_hi, exp_neg(_mm256_sub_ps(hi, mv)));
    _mm256_storeu_ps(out, e_lo);
    _mm256_storeu_ps(out + 8, e_hi);
    return hsum_ps(_mm256_add_ps(e_lo, e_hi));
  }
  static float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
};
#endif

#if defined(__AVX512F__)
// exp(x) for x <= 0, the AVX512 twin of exp_neg (simd.h): same polynomial, same flush.
inline __m512 exp_neg512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  const __m512i e = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

struct Vec512 {
  __m512 a;
  static Vec512 load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vec512 set1(float x) { return {_mm512_set1_ps(x)}; }
  void store(float* p) const { _mm512_storeu_ps(p, a); }
  static Vec512 fma(Vec512 x, Vec512 y, Vec512 z) { return {_mm512_fmadd_ps(x.a, y.a, z.a)}; }
  static Vec512 mul(Vec512 x, Vec512 y) { return {_mm512_mul_ps(x.a, y.a)}; }
  // The largest of lanes < valid (valid >= 1).
  float max_of(int64_t valid) const {
    return _mm512_mask_reduce_max_ps(static_cast<__mmask16>((1u << valid) - 1), a);
  }
  float exp_sub(float m, int64_t valid, float* out) const {
    const __mmask16 keep = static_cast<__mmask16>((1u << valid) - 1);
    const __m512 e = _mm512_maskz_mov_ps(keep, exp_neg512(_mm512_sub_ps(a, _mm512_set1_ps(m))));
    _mm512_storeu_ps(out, e);
    return _mm512_reduce_add_ps(e);
  }
};
#endif

// One item's buffers, per thread, grown to the largest item seen.
struct ItemBuffers {
  std::vector<float> q, acc, m, l, kt, vf;
};

struct Item {
  int64_t seq, kv_head, j0, j1;  // query tokens [j0, j1) of the sequence's chunk
};

template <typename V, typename T>
void prefill_item(const Item& it, const float* qp, int64_t q_s0, int64_t q_s1, float* op,
                  int64_t o_s0, int64_t o_s1, const T* kp, const T* vp, const int64_t* table,
                  int64_t block_size, int64_t tok_stride, int64_t blk_stride, int64_t q_begin,
                  int64_t ctx, int64_t chunk_len, int64_t group, int64_t D, float scale,
                  ItemBuffers& b) {
  const int64_t n = it.j1 - it.j0, rows = n * group, nv = D / 16;
  const int64_t pos0 = ctx - chunk_len + it.j0;  // position of the item's first query
  const int64_t keys = pos0 + n;
  b.q.resize(rows * D);
  b.acc.assign(rows * D, 0.f);
  b.m.assign(rows, -std::numeric_limits<float>::infinity());
  b.l.assign(rows, 0.f);
  b.kt.resize(D * kKeys);
  b.vf.resize(kKeys * D);
  // Row r = token jq * group + hg: query head kv_head * group + hg of token j0 + jq.
  for (int64_t jq = 0; jq < n; ++jq) {
    for (int64_t hg = 0; hg < group; ++hg) {
      const float* src = qp + (q_begin + it.j0 + jq) * q_s0 + (it.kv_head * group + hg) * q_s1;
      float* dst = b.q.data() + (jq * group + hg) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * scale;
    }
  }
  const int64_t head_off = it.kv_head * D;
  alignas(64) float p[kRows][kKeys];
  for (int64_t t0 = 0; t0 < keys; t0 += kKeys) {
    const int64_t c = std::min(kKeys, keys - t0);
    // Stage the chunk; lanes past its end are zero. A float32 pool's V rows are read where
    // they are (only K needs its transpose).
    const float* vrows[kKeys];
    for (int64_t j = 0; j < kKeys; ++j) {
      float* vrow = b.vf.data() + j * D;
      vrows[j] = vrow;
      if (j < c) {
        const int64_t t = t0 + j;
        const int64_t off = table[t / block_size] * blk_stride + (t % block_size) * tok_stride + head_off;
        const T* kr = kp + off;
        const T* vr = vp + off;
        for (int64_t d = 0; d < D; ++d) b.kt[d * kKeys + j] = to_f(kr[d]);
        if constexpr (std::is_same_v<T, float>) {
          vrows[j] = vr;
        } else {
          for (int64_t d = 0; d < D; ++d) vrow[d] = to_f(vr[d]);
        }
      } else {
        for (int64_t d = 0; d < D; ++d) b.kt[d * kKeys + j] = 0.f;
      }
    }
    // Query token jq sees keys 0 .. pos0 + jq: none of this chunk before jq = t0 - pos0.
    // Rows go four at a time, so each staged K column and V row feeds four FMAs.
    for (int64_t r0 = std::max<int64_t>(0, t0 - pos0) * group; r0 < rows; r0 += kRows) {
      int64_t valid[kRows];
      int64_t most = 0;
      const float* qr[kRows];
      for (int64_t i = 0; i < kRows; ++i) {
        const int64_t r = std::min(r0 + i, rows - 1);  // past the end: repeat, then dropped
        valid[i] = r0 + i < rows ? std::max<int64_t>(0, std::min(c, pos0 + r / group - t0 + 1)) : 0;
        most = std::max(most, valid[i]);
        qr[i] = b.q.data() + r * D;
      }
      V sc[kRows];
      for (int64_t i = 0; i < kRows; ++i) sc[i] = V::set1(0.f);
      for (int64_t d = 0; d < D; ++d) {
        const V kt = V::load(b.kt.data() + d * kKeys);
        for (int64_t i = 0; i < kRows; ++i) sc[i] = V::fma(V::set1(qr[i][d]), kt, sc[i]);
      }
      V alpha[kRows];
      for (int64_t i = 0; i < kRows; ++i) {
        alpha[i] = V::set1(1.f);
        if (valid[i] == 0) {  // nothing of this chunk is visible to the row (or no row)
          std::fill(p[i], p[i] + kKeys, 0.f);
          continue;
        }
        const int64_t r = r0 + i;
        // In registers: a scalar pass over the stored lanes was a chain of dependent maxes
        // per row and chunk, as long as the chunk's FMAs.
        const float mx = sc[i].max_of(valid[i]);
        const float m_old = b.m[r];
        const float m_new = std::max(m_old, mx);
        const float sum = sc[i].exp_sub(m_new, valid[i], p[i]);
        if (m_new > m_old) {  // rescale what was summed against the old max (exp(-inf) = 0)
          const float a = std::exp(m_old - m_new);
          b.l[r] *= a;
          alpha[i] = V::set1(a);
          b.m[r] = m_new;
        }
        b.l[r] += sum;
      }
      float* ar[kRows];
      for (int64_t i = 0; i < kRows; ++i) ar[i] = b.acc.data() + std::min(r0 + i, rows - 1) * D;
      for (int64_t v = 0; v < nv; ++v) {
        V a[kRows];
        for (int64_t i = 0; i < kRows; ++i) a[i] = V::mul(alpha[i], V::load(ar[i] + 16 * v));
        for (int64_t j = 0; j < most; ++j) {
          const V vv = V::load(vrows[j] + 16 * v);
          for (int64_t i = 0; i < kRows; ++i) a[i] = V::fma(V::set1(p[i][j]), vv, a[i]);
        }
        // Rows past the end (repeats of the last one) are dropped.
        for (int64_t i = kRows - 1; i >= 0; --i) {
          if (r0 + i < rows) a[i].store(ar[i] + 16 * v);
        }
      }
    }
  }
  for (int64_t jq = 0; jq < n; ++jq) {
    for (int64_t hg = 0; hg < group; ++hg) {
      const int64_t r = jq * group + hg;
      const float inv = 1.f / b.l[r];
      float* dst = op + (q_begin + it.j0 + jq) * o_s0 + (it.kv_head * group + hg) * o_s1;
      const float* ar = b.acc.data() + r * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = ar[d] * inv;
    }
  }
}

template <typename V, typename T>
void prefill_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_cache,
                  const at::Tensor& block_tables, const int64_t* lens, const int64_t* qsl,
                  int64_t first_seq, int64_t num_seqs, float scale) {
  const int64_t num_heads = q.size(1), D = q.size(2);
  const int64_t block_size = kv_cache.size(2), num_kv_heads = kv_cache.size(3);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t tok_stride = num_kv_heads * D, blk_stride = block_size * tok_stride;
  const T* kp = kv_cache.data_ptr<T>();
  const T* vp = kp + kv_cache.size(1) * blk_stride;
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t bt_s0 = block_tables.stride(0);
  std::vector<Item> items;
  for (int64_t s = first_seq; s < num_seqs; ++s) {
    const int64_t len = qsl[s + 1] - qsl[s];
    // Last query blocks first: they attend to the most keys (longest items first).
    for (int64_t j0 = (len - 1) / kQueryBlock * kQueryBlock; j0 >= 0 && len > 0; j0 -= kQueryBlock) {
      for (int64_t g = 0; g < num_kv_heads; ++g) {
        items.push_back({s, g, j0, std::min(len, j0 + kQueryBlock)});
      }
    }
  }
  std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) {
    return lens[a.seq] - (qsl[a.seq + 1] - qsl[a.seq]) + a.j1 >
           lens[b.seq] - (qsl[b.seq + 1] - qsl[b.seq]) + b.j1;
  });
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  parallel_dynamic(static_cast<int64_t>(items.size()), [&](int64_t i) {
    thread_local ItemBuffers buffers;
    const Item& it = items[i];
    prefill_item<V, T>(it, qp, q.stride(0), q.stride(1), op, out.stride(0), out.stride(1), kp,
                       vp, bt + it.seq * bt_s0, block_size, tok_stride, blk_stride, qsl[it.seq],
                       lens[it.seq], qsl[it.seq + 1] - qsl[it.seq], group, D, scale, buffers);
  });
}

template <typename T>
void prefill_dispatch(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_cache,
                      const at::Tensor& block_tables, const int64_t* lens, const int64_t* qsl,
                      int64_t first_seq, int64_t num_seqs, float scale) {
  const int isa = quant_isa();
#if defined(__AVX512F__)
  if (isa >= 2) {
    return prefill_impl<Vec512, T>(out, q, kv_cache, block_tables, lens, qsl, first_seq,
                                   num_seqs, scale);
  }
#endif
#ifdef TS_AVX2
  if (isa >= 1) {
    return prefill_impl<VecAvx2, T>(out, q, kv_cache, block_tables, lens, qsl, first_seq,
                                    num_seqs, scale);
  }
#endif
  (void)isa;
  prefill_impl<VecScalar, T>(out, q, kv_cache, block_tables, lens, qsl, first_seq, num_seqs,
                             scale);
}

template <typename T>
void write_kv_as(at::Tensor& kv_cache, const at::Tensor& k, const at::Tensor& v,
                 const int64_t* slots) {
  const int64_t T_ = k.size(0), H = k.size(1), D = k.size(2);
  T* k_pool = kv_cache.data_ptr<T>();
  T* v_pool = k_pool + kv_cache.size(1) * kv_cache.size(2) * H * D;
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  for (int64_t t = 0; t < T_; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      store_from_f32(k_pool + (slots[t] * H + h) * D, kp + t * k.stride(0) + h * k.stride(1), D);
      store_from_f32(v_pool + (slots[t] * H + h) * D, vp + t * v.stride(0) + h * v.stride(1), D);
    }
  }
}

void check_pool(const at::Tensor& kv_cache, const char* op) {
  const auto dt = kv_cache.scalar_type();
  TORCH_CHECK(kv_cache.device().is_cpu() && kv_cache.dim() == 5 && kv_cache.size(0) == 2 &&
                  kv_cache.is_contiguous() &&
                  (dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf),
              op, ": kv_cache must be a contiguous float32 / bfloat16 / float16 CPU tensor "
              "[2, num_blocks, block_size, H_kv, D], got ", dt, " ", kv_cache.sizes());
}

}  // namespace

// kv_cache[:, slot_mapping[t]] = k[t], v[t] (rounded to nearest even for a 16-bit pool, the
// bits torch's .to() writes). k, v: float32 [T, H_kv, D], head_dim contiguous.
void write_kv_cache(at::Tensor kv_cache, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& slot_mapping) {
  check_pool(kv_cache, "write_kv_cache");
  for (const at::Tensor* t : {&k, &v}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 3 &&
                    t->stride(2) == 1 && t->size(1) == kv_cache.size(3) &&
                    t->size(2) == kv_cache.size(4) && t->size(0) == k.size(0),
                "write_kv_cache: k and v must be float32 [T, ", kv_cache.size(3), ", ",
                kv_cache.size(4), "] with contiguous head_dim, got ", t->scalar_type(), " ",
                t->sizes());
  }
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == k.size(0),
              "write_kv_cache: slot_mapping must be int64 [", k.size(0), "]");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  for (int64_t t = 0; t < k.size(0); ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "write_kv_cache: slot ", slots[t],
                " outside the pool's ", num_slots);
  }
  switch (kv_cache.scalar_type()) {
    case at::kBFloat16: return write_kv_as<c10::BFloat16>(kv_cache, k, v, slots);
    case at::kHalf: return write_kv_as<c10::Half>(kv_cache, k, v, slots);
    default: return write_kv_as<float>(kv_cache, k, v, slots);
  }
}

// out[t] for the tokens of sequences [first_seq, num_seqs): causal attention of each
// sequence's chunk (tokens query_start_loc[i] .. query_start_loc[i + 1]) over its first
// seq_lens[i] cached tokens (this chunk's K/V already written). q, out: float32 [T, H, D],
// head_dim contiguous; kv_cache [2, num_blocks, block_size, H_kv, D] in float32 / bf16 / fp16.
void paged_prefill_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& kv_cache,
                             const at::Tensor& block_tables, const at::Tensor& seq_lens,
                             const at::Tensor& query_start_loc, int64_t first_seq,
                             double scale) {
  check_pool(kv_cache, "paged_prefill_attention");
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat &&
                  q.dim() == 3 && out.sizes() == q.sizes() && q.stride(2) == 1 && out.stride(2) == 1,
              "paged_prefill_attention: q and out must be float32 [T, H, D] with contiguous "
              "head_dim, got ", q.scalar_type(), " ", q.sizes(), " and ", out.scalar_type(), " ",
              out.sizes());
  TORCH_CHECK(q.size(2) == kv_cache.size(4) && q.size(2) % 16 == 0 && q.size(1) % kv_cache.size(3) == 0,
              "paged_prefill_attention: ", q.size(1), " heads of ", q.size(2), " over ",
              kv_cache.size(3), " KV heads of ", kv_cache.size(4), " (head_dim a multiple of 16)");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 &&
                  block_tables.stride(1) == 1 && seq_lens.scalar_type() == at::kLong &&
                  seq_lens.is_contiguous() && query_start_loc.scalar_type() == at::kLong &&
                  query_start_loc.is_contiguous() && query_start_loc.dim() == 1,
              "paged_prefill_attention: block_tables, seq_lens and query_start_loc must be int64");
  const int64_t num_seqs = query_start_loc.numel() - 1;
  TORCH_CHECK(num_seqs >= 0 && 0 <= first_seq && first_seq <= num_seqs &&
                  seq_lens.numel() >= num_seqs && block_tables.size(0) >= num_seqs,
              "paged_prefill_attention: first_seq ", first_seq, " of ", num_seqs, " sequences (",
              seq_lens.numel(), " lengths, ", block_tables.size(0), " block tables)");
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  const int64_t block_size = kv_cache.size(2);
  TORCH_CHECK(qsl[num_seqs] <= q.size(0), "paged_prefill_attention: query_start_loc ends at ",
              qsl[num_seqs], ", q has ", q.size(0), " tokens");
  for (int64_t s = first_seq; s < num_seqs; ++s) {
    const int64_t n = qsl[s + 1] - qsl[s];
    TORCH_CHECK(n >= 0 && n <= lens[s] && (lens[s] + block_size - 1) / block_size <= block_tables.size(1),
                "paged_prefill_attention: sequence ", s, " has ", n, " new tokens, context ",
                lens[s], ", a block table of ", block_tables.size(1), " blocks");
  }
  const float fscale = static_cast<float>(scale);
  switch (kv_cache.scalar_type()) {
    case at::kBFloat16:
      return prefill_dispatch<c10::BFloat16>(out, q, kv_cache, block_tables, lens, qsl,
                                             first_seq, num_seqs, fscale);
    case at::kHalf:
      return prefill_dispatch<c10::Half>(out, q, kv_cache, block_tables, lens, qsl, first_seq,
                                         num_seqs, fscale);
    default:
      return prefill_dispatch<float>(out, q, kv_cache, block_tables, lens, qsl, first_seq,
                                     num_seqs, fscale);
  }
}

}  // namespace tailserve_cpu

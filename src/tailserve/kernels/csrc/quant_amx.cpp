// quant_linear on tiled GGUF blocks (quant_tiled.h's layout) with AMX int8 tiles, for prompt
// chunks and wide batches: 16 rows of x at a time.
//
// Per block of 32 values the integer dot of every (row of x, output row) pair is one tile
// product of a 16 x 32-byte tile of x (signed) against an 8 x 64-byte tile of the weight, a
// 16 x 16 int32 result: TDPBSSD where the weight's values are signed (Q8_0 as stored; Q4_0 /
// Q5_0 unpacked as q - zero), TDPBSUD where they are not (Q4_1 / Q5_1's unsigned q, offset
// by m in the epilogue). The tiled layout already holds the weight in AMX's B order: chunk j's
// 64 bytes are, per output row, the four bytes of values 4j..4j+3 (low nibbles) and 16+4j..
// (high nibbles), so splitting the nibbles gives B's rows j and 4 + j, and Q8_0's chunks are B
// as stored. The integer sums are the VNNI path's exactly (VNNI sums x * q and takes zero *
// sum(x) off; the tile sums x * (q - zero), the same integer), and the float epilogue is
// VNNI's per lane, in the same block order, with the same operations — so the outputs are bit
// for bit quant_tiled.cpp's (tests/test_amx.py).
//
// What limits it: the per-block scales. Each 16 x 16 x 32 block product (one tile
// instruction, 16 cycles) needs its int32 tile stored and 16 rows of convert + scale + FMA,
// ~50-80 vector operations, where VNNI spent ~130 dpbusd on it plus the same epilogue.
// Measured (benchmarks/notes/cpu_kernels.md): 1.2-1.7x VNNI at 512 rows; without the epilogue
// the tile loads and the 1 KiB store alone take ~45 cycles a block. Signed weights took the
// zero point's subtraction and broadcast out of every row of the epilogue (Q4_0 at the 1B's
// shapes 1.25-1.3x); x regrouped per 16 rows (pack_groups) took the strided tile loads and
// scattered broadcasts out (Q4_1 1.1-1.25x); four result tiles in flight instead of two were
// no faster. The opt-in
// bf16 tiles (quant_amx_bf16.cpp) drop the per-block epilogue, and VNNI's answers with it.

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <vector>

#include "amx_tiles.h"
#include "isa.h"
#include "quant_tiled.h"
#include "scratch.h"
#include "work_pool.h"

namespace tailserve_cpu {

#ifdef TS_AMX
namespace {

template <int TS>
using AmxLayout = TiledLayout<TS>;

// Palette 1: tmm0 / tmm1 the int32 results, tmm2 / tmm3 x's 16 x 32 bytes, tmm4 / tmm5 the
// weight's B.
void load_tile_config() {
  amx::TileConfig cfg{};
  for (int t : {0, 1}) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
  for (int t : {2, 3}) { cfg.rows[t] = 16; cfg.colsb[t] = 32; }
  for (int t : {4, 5}) { cfg.rows[t] = 8; cfg.colsb[t] = 64; }
  amx::load_config(cfg);
}

// x's quantization regrouped per 16 rows: the bytes of block g of the group's rows as one
// 512-byte A tile ([group][block][row][32]), dx and xs32 as [group][block][row]. The tile load
// then reads 8 whole lines instead of a 32-byte run from each of 16 rows (K bytes apart), and
// each block's 16 epilogue broadcasts come from one line instead of 16 (Q4_1 at 576 x 1,536
// and 128 rows 1.25x; notes: cpu_kernels.md). The same numbers, so the same sums.
void pack_groups(const int8_t* xq, const float* dx, const float* xs32, int64_t groups, int64_t K,
                 int8_t* xg, float* dxg, float* xsg) {
  const int64_t nb = K / 32;
  parallel_dynamic(groups, [&](int64_t m) {
    for (int64_t i = 0; i < 16; ++i) {
      const int64_t r = 16 * m + i;
      for (int64_t g = 0; g < nb; ++g) {
        std::memcpy(xg + (m * nb + g) * 512 + i * 32, xq + r * K + g * 32, 32);
        dxg[(m * nb + g) * 16 + i] = dx[r * nb + g];
        xsg[(m * nb + g) * 16 + i] = xs32[r * nb + g];
      }
    }
  });
}

// The weight's B tiles of one output tile, every block: 8 rows of 64 bytes each, q - zero as
// signed bytes for Q4_0 / Q5_0 (Q8_0 reads its blocks in place and never calls this).
template <int TS>
void unpack_tile(const uint8_t* tile, int64_t nb, uint8_t* b) {
  using L = AmxLayout<TS>;
  for (int64_t g = 0; g < nb; ++g) {
    const uint8_t* blk = tile + g * L::kBytes;
    uint8_t* out = b + g * 512;
    for (int j = 0; j < 4; ++j) {
      __m512i lo, hi;
      split_chunk512<TS>(blk, j, lo, hi);
      if constexpr (L::kZero != 0) {  // q - zero, signed: the sums need no correction
        lo = _mm512_sub_epi8(lo, _mm512_set1_epi8(L::kZero));
        hi = _mm512_sub_epi8(hi, _mm512_set1_epi8(L::kZero));
      }
      _mm512_store_si512(out + 64 * j, lo);
      _mm512_store_si512(out + 64 * (4 + j), hi);
    }
  }
}

// VNNI's epilogue (quant_tiled.cpp tile_vnni), lane for lane: acc[r] += C[r] * (d * dx)
// (+ m * xs32) for the 16 rows of x of this group, block g (C already net of the zero point).
// Inlined and unrolled so acc[] stays in 16 registers (as a loop over a stack array GCC kept
// it in memory: a load and a store around every FMA, half this kernel's speed).
template <int TS>
__attribute__((always_inline)) inline void epilogue(const int32_t* c, const uint8_t* blk, int64_t g,
                                                    const float* dx, const float* xs32,
                                                    __m512* acc) {
  using L = AmxLayout<TS>;
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
  __m512 mv = _mm512_setzero_ps();
  if constexpr (L::kMin) {
    mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32)));
  }
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) {
    const __m512i a = _mm512_load_si512(c + 16 * r);
    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a),
                             _mm512_mul_ps(d, _mm512_set1_ps(dx[g * 16 + r])), acc[r]);
    if constexpr (L::kMin) acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs32[g * 16 + r]), acc[r]);
  }
}

// One output tile (16 rows of W) against 16 rows of x: y[r][0..15].
template <int TS>
void tile_group(const uint8_t* tile, const uint8_t* b, int64_t nb, const int8_t* xq,
                const float* dx, const float* xs32, float* y, int64_t N, const float* bias) {
  using L = AmxLayout<TS>;
  alignas(64) int32_t c[2][2][256];  // [set][block of the pair]
  __m512 acc[16];
  const __m512 b0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) acc[r] = b0;
  // B of block g: Q8_0's stored chunks (signed), else the unpacked nibbles.
  auto bptr = [&](int64_t g) -> const void* {
    if constexpr (L::kQ8) return tile + g * L::kBytes + L::kQs;
    return b + g * 512;
  };
  // Blocks g, g + 1 into c[set]: the tile products of the next pair run while the epilogue
  // reads the pair stored one round before (tile registers are not renamed, and a vector load
  // of a line a tile store just wrote waits for it: computing and reading the same pair in one
  // round serialized the two units, 1/3 of this pipelined speed).
  auto products = [&](int64_t g, int set) {
    _tile_zero(0);
    _tile_loadd(2, xq + g * 512, 32);
    _tile_loadd(4, bptr(g), 64);
    if constexpr (L::kMin) {
      _tile_dpbsud(0, 2, 4);
    } else {
      _tile_dpbssd(0, 2, 4);
    }
    _tile_stored(0, c[set][0], 64);
    if (g + 1 < nb) {
      _tile_zero(1);
      _tile_loadd(3, xq + (g + 1) * 512, 32);
      _tile_loadd(5, bptr(g + 1), 64);
      if constexpr (L::kMin) {
        _tile_dpbsud(1, 3, 5);
      } else {
        _tile_dpbssd(1, 3, 5);
      }
      _tile_stored(1, c[set][1], 64);
    }
  };
  products(0, 0);
  for (int64_t g = 0, set = 0; g < nb; g += 2, set ^= 1) {
    if (g + 2 < nb) products(g + 2, set ^ 1);
    epilogue<TS>(c[set][0], tile + g * L::kBytes, g, dx, xs32, acc);
    if (g + 1 < nb) {
      epilogue<TS>(c[set][1], tile + (g + 1) * L::kBytes, g + 1, dx, xs32, acc);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) _mm512_storeu_ps(y + r * N, acc[r]);
}

template <int TS>
void linear_amx_as(const uint8_t* w, int64_t N, int64_t K, int64_t groups, const int8_t* xq,
                   const float* dx, const float* xs32, float* y, const float* bias) {
  using L = AmxLayout<TS>;
  const int64_t nb = K / 32, tiles = N / 16;
  const int64_t tile_bytes = nb * L::kBytes;
  const int64_t per_item = std::max<int64_t>(
      1, tiles / (runs_per_thread(false) * at::get_num_threads()));
  parallel_dynamic((tiles + per_item - 1) / per_item, [&](int64_t item) {
    load_tile_config();  // per thread state; cheap beside an item's work
    thread_local Scratch<uint8_t> storage;  // the unpacked B tiles (scratch.h)
    uint8_t* b = L::kQ8 ? nullptr : storage.get(nb * 512);
    const int64_t t1 = std::min(tiles, (item + 1) * per_item);
    for (int64_t t = item * per_item; t < t1; ++t) {
      const uint8_t* tile = w + t * tile_bytes;
      if constexpr (!L::kQ8) unpack_tile<TS>(tile, nb, b);
      for (int64_t m = 0; m < groups; ++m) {
        tile_group<TS>(tile, b, nb, xq + 16 * m * K, dx + 16 * m * nb, xs32 + 16 * m * nb,
                       y + 16 * m * N + t * 16, N, bias ? bias + t * 16 : nullptr);
      }
    }
    _tile_release();
  });
}

// Tile instructions back to back on registers (no memory operand in the loop): the peak the
// tile unit gives one thread. Four independent accumulators hide the instruction's latency.
double tile_peak_loop(bool bf16, int64_t iterations) {
  amx::load_full_config();
  alignas(64) uint8_t zeros[1024] = {};
  _tile_loadd(4, zeros, 64);  // tile numbers are immediates: one statement each
  _tile_loadd(5, zeros, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t i = 0; i < iterations; ++i) {
    if (bf16) {
      _tile_dpbf16ps(0, 4, 5);
      _tile_dpbf16ps(1, 4, 5);
      _tile_dpbf16ps(2, 4, 5);
      _tile_dpbf16ps(3, 4, 5);
    } else {
      _tile_dpbssd(0, 4, 5);
      _tile_dpbssd(1, 4, 5);
      _tile_dpbssd(2, 4, 5);
      _tile_dpbssd(3, 4, 5);
    }
  }
  alignas(64) int32_t sink[256];
  _tile_stored(0, sink, 64);
  _tile_release();
  // One instruction: 16 x 16 outputs, each a dot of 64 int8 (or 32 bf16) pairs; 2 ops a pair.
  return 4.0 * static_cast<double>(iterations) * 16 * 16 * (bf16 ? 32 : 64) * 2 + sink[0] * 0.0;
}

}  // namespace
#endif

double amx_peak(bool bf16, int64_t iterations) {
#ifdef TS_AMX
  TORCH_CHECK(isa::amx_status().permitted, "amx_peak: ", isa::amx_status().reason);
  const int64_t threads = at::get_num_threads();
  std::vector<double> ops(threads, 0.0);
  const auto t0 = std::chrono::steady_clock::now();
  parallel_dynamic(threads, [&](int64_t item) { ops[item] = tile_peak_loop(bf16, iterations); });
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  double total = 0.0;
  for (double o : ops) total += o;
  return total / s;
#else
  (void)bf16, (void)iterations;
  TORCH_CHECK(false, "amx_peak: this build has no AMX tile kernels");
  return 0.0;
#endif
}

int64_t tiled_linear_amx(int64_t type_size, const uint8_t* w, int64_t N, int64_t K, int64_t M,
                         const int8_t* xq, const float* dx, const float* xs32,
                         const int32_t* xi32, float* y, const float* bias) {
#ifdef TS_AMX
  (void)xi32;  // VNNI's zero-point sums: the tiles' sums come net of the zero point
  const int64_t groups = M / 16;
  if (groups == 0 || !isa::amx_status().permitted) return 0;
  const int64_t nb = K / 32;
  // Kept between calls (scratch.h: pack_groups writes every element it reads).
  thread_local Scratch<int8_t> xg_buf;
  thread_local Scratch<float> dxg_buf, xsg_buf;
  int8_t* xg = xg_buf.get(groups * 16 * K);
  float* dxg = dxg_buf.get(groups * 16 * nb);
  float* xsg = xsg_buf.get(groups * 16 * nb);
  pack_groups(xq, dx, xs32, groups, K, xg, dxg, xsg);
  switch (type_size) {
    case 18: linear_amx_as<18>(w, N, K, groups, xg, dxg, xsg, y, bias); break;
    case 20: linear_amx_as<20>(w, N, K, groups, xg, dxg, xsg, y, bias); break;
    case 22: linear_amx_as<22>(w, N, K, groups, xg, dxg, xsg, y, bias); break;
    case 24: linear_amx_as<24>(w, N, K, groups, xg, dxg, xsg, y, bias); break;
    default: linear_amx_as<34>(w, N, K, groups, xg, dxg, xsg, y, bias); break;
  }
  return 16 * groups;
#else
  (void)type_size, (void)w, (void)N, (void)K, (void)M, (void)xq, (void)dx, (void)xs32,
      (void)xi32, (void)y, (void)bias;
  return 0;
#endif
}

namespace isa {
bool amx_kernels_built() {
#ifdef TS_AMX
  return true;
#else
  return false;
#endif
}
}  // namespace isa

}  // namespace tailserve_cpu

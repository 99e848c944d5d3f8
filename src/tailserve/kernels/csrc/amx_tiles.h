// AMX tile configuration shared by the tile kernels (quant_amx.cpp, quant_amx_bf16.cpp).
// TS_AMX is defined where the compiler targets AMX-TILE, AMX-INT8, AMX-BF16 and the AVX512
// subsets their epilogues use (-march=native on such a CPU).

#pragma once

#include <cstdint>

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AMX_BF16__) && \
    defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define TS_AMX 1

namespace tailserve_cpu {
namespace amx {

// Palette 1's 64-byte configuration: tile t has rows[t] rows of colsb[t] bytes.
struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Loads `cfg` into this thread's tile state. GCC 12 does not see ldtilecfg read the struct
// and dropped the stores that filled it (found here: it wrote the palette byte alone and
// ldtilecfg faulted): the barrier makes them land.
inline void load_config(TileConfig& cfg) {
  cfg.palette_id = 1;
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// Every tile 16 rows of 64 bytes: the bf16 kernels' and the peak loop's one shape.
inline void load_full_config() {
  TileConfig cfg{};
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  load_config(cfg);
}

}  // namespace amx
}  // namespace tailserve_cpu
#endif

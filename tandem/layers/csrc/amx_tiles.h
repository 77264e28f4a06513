// AMX tile helpers shared by cpu_ops.cpp (bf16 GEMM) and quant_ops.cpp (int8 blocks).
#pragma once

#include <cstdint>

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__AMX_TILE__)
#include <immintrin.h>
#endif

namespace tandem_amx {

// Linux hands out the 8 KiB tile state only to a process that asks (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA);
// asked once per process
inline bool permitted() {
  static const bool ok = [] {
#if defined(__linux__) && defined(__AMX_TILE__)
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
#else
    return false;
#endif
  }();
  return ok;
}

#if defined(__AMX_TILE__)
struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// The layout both kernels use: C tiles 0-3 (row half h, column tile j -> tile 2h + j; rows_h x 64 bytes), A tiles 4-5
// (rows_h x a_colsb bytes), B tiles 6-7 (b_rows x 64 bytes). A half with 0 rows is left unconfigured (not used).
inline void configure(int rows0, int rows1, int a_colsb, int b_rows) {
  TileConfig cfg{};
  cfg.palette_id = 1;
  const int rows[2] = {rows0, rows1};
  for (int h = 0; h < 2; ++h) {
    if (rows[h] == 0) continue;
    for (int j = 0; j < 2; ++j) {
      cfg.rows[h * 2 + j] = static_cast<uint8_t>(rows[h]);
      cfg.colsb[h * 2 + j] = 64;
    }
    cfg.rows[4 + h] = static_cast<uint8_t>(rows[h]);
    cfg.colsb[4 + h] = static_cast<uint16_t>(a_colsb);
  }
  for (int j = 0; j < 2; ++j) {
    cfg.rows[6 + j] = static_cast<uint8_t>(b_rows);
    cfg.colsb[6 + j] = 64;
  }
  _tile_loadconfig(&cfg);
}
#endif

}  // namespace tandem_amx

// What every AMX kernel here needs before its first tile instruction: whether the build
// targets AMX, Linux's permission for tile data (once per process) and the user's switch
// (CADENCE_AMX=0 turns every AMX kernel off).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <string>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define CADENCE_AMX 1
#endif

namespace cadence {

#ifdef CADENCE_AMX
// Tile data needs the kernel's permission once per process (Linux 5.16+).
inline bool amx_permitted() {
  constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  static const bool ok = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  return ok;
}

// Palette 1, 8 tiles of 64-byte rows, tile t with rows[t] rows: the configuration every
// kernel here loads. The barrier keeps the compiler from dropping or sinking the stores that
// build it: ldtilecfg reads memory the compiler does not see it read (without the barrier, the
// attention kernel's configuration, moved here from attention_amx.cpp, faulted in
// test_listed_attention: ldtilecfg got an invalid one).
// ``colsb``: bytes per row of each tile (64 unless given).
inline void load_tile_rows(const uint8_t (&rows)[8], const uint8_t (&colsb)[8] = {64, 64, 64, 64, 64, 64, 64, 64}) {
  struct alignas(64) Config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  } cfg{};
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = colsb[t], cfg.rows[t] = rows[t];
  asm volatile("" : : "r"(&cfg) : "memory");  // the stores above happen before ldtilecfg reads them
  _tile_loadconfig(&cfg);
}
#else
inline bool amx_permitted() { return false; }
#endif

// CADENCE_AMX unset or anything but 0/false/off/no
inline bool amx_env_allows() {
  const char* e = std::getenv("CADENCE_AMX");
  if (e == nullptr) return true;
  const std::string s(e);
  return !(s == "0" || s == "false" || s == "off" || s == "no");
}

}  // namespace cadence

// What every AMX kernel here needs before its first tile instruction: whether the build
// targets AMX, Linux's permission for tile data (once per process) and the user's switch
// (CADENCE_AMX=0 turns every AMX kernel off).
#pragma once

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

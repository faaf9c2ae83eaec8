// AMX tile plumbing shared by the AMX extensions (attention_amx.cpp, quant_gguf_amx.cpp):
// the Linux permission request, the tile configuration record and a scope that loads a
// configuration and releases the tiles.  Compiled only with -mamx-tile.
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace pagedserve_amx {

constexpr long kArchReqXcompPerm = 0x1023;
constexpr long kXfeatureXtiledata = 18;

// Linux grants the AMX tile state only on request, once per process (every thread,
// also those started later, inherits it).
inline bool request_amx_permission() {
  static const bool ok = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return ok;
}

// The 64-byte record _tile_loadconfig reads (palette 1: eight tiles).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Loads ``cfg`` for this thread's share of a call and releases the tiles after it:
// other AMX users on the same threads (oneDNN) configure tiles their own way.
struct TileScope {
  explicit TileScope(const TileConfig& cfg) { _tile_loadconfig(&cfg); }
  ~TileScope() { _tile_release(); }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};

}  // namespace pagedserve_amx

// GroupedConv1d's AMX kernels (grouped_conv1d_amx_impl.h) on tiles emulated in C++,
// plain C++ compiled with the baseline flags: the tile kernels' logic (packing, windows,
// passes of packed sequences, the grad-weight transposes, rounding) runs and is tested on
// any CPU, so a change to it cannot land untested on the machines without AMX where most
// work is done. GROUPBERT_AMX=emulate selects it (cpu_capability.h); it is for tests and
// about 35x slower than the vector kernels (docs/custom_ops.md).
//
// Each thread has its own tile state, as a core does. The instructions follow the Intel
// SDM's pseudocode (LDTILECFG, TILELOADD, TILESTORED, TILEZERO, TDPBF16PS, TILERELEASE)
// and refuse what the hardware refuses with a fault: a configuration with a palette other
// than 0 or 1, reserved bytes set, more than 16 rows or 64 bytes per row, or entries
// for tiles 8-15; a tile instruction before LDTILECFG or on a tile with 0 rows or 0 bytes
// per row (the crash of issue 51); TDPBF16PS on tiles whose shapes do not chain. A fault
// is a C++ exception here (a RuntimeError in Python), SIGILL or SIGSEGV on the hardware.
//
// What the emulation cannot show is how the compiler treats the asm of the hardware
// instructions (issue 51 was GCC deleting the stores of a configuration whose asm operand
// declared 8 of its 64 bytes): the configuration is a constant for that reason, and
// tests/test_grouped_conv1d.py checks in the built library that every LDTILECFG reads it.
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "grouped_conv1d_amx.h"

namespace groupbert::conv::amx_emulated {
namespace {

constexpr int kTiles = 8, kMaxRows = 16, kMaxBytes = 64;

// One core's tile registers and the configuration in force (palette 0: none, as at
// start and after TILERELEASE).
struct TileUnit {
  amx::TileConfig config{};
  alignas(64) uint8_t tile[kTiles][kMaxRows][kMaxBytes] = {};
};
thread_local TileUnit unit;

[[noreturn]] void fault(const std::string& what) {
  throw std::runtime_error("AMX emulation (GROUPBERT_AMX=emulate): " + what +
                           "; on AMX hardware this instruction faults (SIGILL or SIGSEGV)");
}

int rows_of(int t) { return unit.config.rows[t]; }
int bytes_of(int t) { return unit.config.bytes_per_row[t]; }

// A tile instruction's check of its tile: configured, with rows and bytes per row.
void check_tile(const char* instruction, int t) {
  if (unit.config.palette == 0) fault(std::string(instruction) + " before LDTILECFG configured the tiles");
  if (rows_of(t) == 0 || bytes_of(t) == 0)
    fault(std::string(instruction) + " on tile " + std::to_string(t) + ", which the configuration gives " +
          std::to_string(rows_of(t)) + " rows of " + std::to_string(bytes_of(t)) + " bytes");
}

void load_config(const amx::TileConfig& config) {
  if (config.palette > 1) fault("LDTILECFG with palette " + std::to_string(config.palette) + " (only 0 and 1 exist)");
  if (config.palette == 0) {  // palette 0: back to the initial state
    unit = TileUnit{};
    return;
  }
  if (config.start_row != 0) fault("LDTILECFG with start_row " + std::to_string(config.start_row));
  for (uint8_t byte : config.reserved)
    if (byte != 0) fault("LDTILECFG with reserved bytes set");
  for (int t = 0; t < 16; ++t) {
    const bool exists = t < kTiles;
    if (config.rows[t] > (exists ? kMaxRows : 0) || config.bytes_per_row[t] > (exists ? kMaxBytes : 0))
      fault("LDTILECFG giving tile " + std::to_string(t) + " " + std::to_string(config.rows[t]) + " rows of " +
            std::to_string(config.bytes_per_row[t]) + " bytes (palette 1 has 8 tiles of at most 16 x 64)");
  }
  unit = TileUnit{};
  unit.config = config;
}

// bf16 and fp32 as TDPBF16PS reads them: denormals as zero (DAZ).
float bf16_value(uint16_t bits) {
  uint32_t word = static_cast<uint32_t>(bits) << 16;
  if ((word & 0x7F800000u) == 0) word &= 0x80000000u;
  float f;
  std::memcpy(&f, &word, sizeof(f));
  return f;
}
float flush_denormal(float f) {
  uint32_t word;
  std::memcpy(&word, &f, sizeof(word));
  if ((word & 0x7F800000u) == 0) word &= 0x80000000u;
  std::memcpy(&f, &word, sizeof(f));
  return f;
}

// TDPBF16PS acc, a, b (SDM pseudocode): for each row m of acc and fp32 lane n,
// acc[m][n] += a[m].bf16[2k] * b[k].bf16[2n], then += a[m].bf16[2k + 1] * b[k].bf16[2n + 1],
// for k over a's pairs; each product exact in fp32, each sum rounded to nearest even,
// denormal inputs read as zero, denormal results written as zero.
void dot_bf16(int acc, int a, int b) {
  for (int t : {acc, a, b}) check_tile("TDPBF16PS", t);
  const int M = rows_of(acc), N = bytes_of(acc) / 4, K = bytes_of(a) / 4;
  if (bytes_of(acc) % 4 != 0 || bytes_of(a) % 4 != 0 || rows_of(a) != M || rows_of(b) != K ||
      bytes_of(b) != bytes_of(acc))
    fault("TDPBF16PS on tiles of " + std::to_string(M) + "x" + std::to_string(bytes_of(acc)) + ", " +
          std::to_string(rows_of(a)) + "x" + std::to_string(bytes_of(a)) + " and " + std::to_string(rows_of(b)) +
          "x" + std::to_string(bytes_of(b)) + " bytes, whose shapes do not chain");
  for (int m = 0; m < M; ++m) {
    float row[kMaxBytes / 4];
    std::memcpy(row, unit.tile[acc][m], N * sizeof(float));
    for (int n = 0; n < N; ++n) row[n] = flush_denormal(row[n]);
    for (int k = 0; k < K; ++k) {
      uint16_t pair_a[2], pair_b[2];
      std::memcpy(pair_a, &unit.tile[a][m][4 * k], sizeof(pair_a));
      for (int n = 0; n < N; ++n) {
        std::memcpy(pair_b, &unit.tile[b][k][4 * n], sizeof(pair_b));
        row[n] = flush_denormal(row[n] + bf16_value(pair_a[0]) * bf16_value(pair_b[0]));
        row[n] = flush_denormal(row[n] + bf16_value(pair_a[1]) * bf16_value(pair_b[1]));
      }
    }
    std::memcpy(unit.tile[acc][m], row, N * sizeof(float));
  }
}

struct Tiles {
  static void configure(const amx::TileConfig& config) { load_config(config); }
  template <int T>
  static void zero() {
    check_tile("TILEZERO", T);
    std::memset(unit.tile[T], 0, sizeof(unit.tile[T]));
  }
  // Rows beyond the configured ones, and bytes beyond a row's, are zeroed, as the hardware does.
  template <int T>
  static void load(const void* base, int64_t stride) {
    check_tile("TILELOADD", T);
    std::memset(unit.tile[T], 0, sizeof(unit.tile[T]));
    for (int r = 0; r < rows_of(T); ++r)
      std::memcpy(unit.tile[T][r], static_cast<const uint8_t*>(base) + r * stride, bytes_of(T));
  }
  template <int T>
  static void store(void* base, int64_t stride) {
    check_tile("TILESTORED", T);
    for (int r = 0; r < rows_of(T); ++r)
      std::memcpy(static_cast<uint8_t*>(base) + r * stride, unit.tile[T][r], bytes_of(T));
  }
  template <int Acc, int A, int B>
  static void dot() {
    dot_bf16(Acc, A, B);
  }
  static void release() { unit = TileUnit{}; }
};

}  // namespace
}  // namespace groupbert::conv::amx_emulated

#include "grouped_conv1d_amx_impl.h"

namespace groupbert::conv::amx_emulated {

const amx::TileKernels& kernels() { return AmxKernels<Tiles>::table(); }

}  // namespace groupbert::conv::amx_emulated

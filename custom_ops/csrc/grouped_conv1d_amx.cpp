// GroupedConv1d on the hardware AMX tiles (grouped_conv1d_amx.h; the kernels in
// grouped_conv1d_amx_impl.h), compiled with the AVX-512 flags: the code around the tiles
// is AVX-512, and it runs only where cpu::amx_tiles() found AMX-BF16, Linux granted the
// tile state and the tiles passed their known-answer run (kernel_check.cpp).
//
// The tile instructions are inline assembly rather than GCC's <immintrin.h> macros, which
// tell the compiler less than the instructions do: _tile_loadconfig declares an 8-byte
// read of the 64-byte configuration (the stores of the rest of a local configuration were
// deleted, issue 51), and _tile_loadd / _tile_stored name no memory at all (nothing kept
// the compiler from moving a window's stores past the tile load that reads them). Here
// LDTILECFG takes the whole configuration as its operand, and the loads and stores
// clobber memory. The assembler knows the AMX mnemonics whatever -m flags GCC got, so no
// target attribute is needed and every wrapper inlines.
#include <cstdint>

#include "grouped_conv1d_amx.h"

namespace groupbert::conv::amx {
namespace {

struct Tiles {
  template <int T>
  static void zero() {
    __asm__ volatile("tilezero %%tmm%c0" : : "n"(T));
  }
  template <int T>
  static void load(const void* base, int64_t stride) {
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm%c2" : : "r"(base), "r"(stride), "n"(T) : "memory");
  }
  template <int T>
  static void store(void* base, int64_t stride) {
    __asm__ volatile("tilestored %%tmm%c2, (%0,%1,1)" : : "r"(base), "r"(stride), "n"(T) : "memory");
  }
  // Tile Acc += tile A . tile B (AT&T order: B, A, Acc).
  template <int Acc, int A, int B>
  static void dot() {
    __asm__ volatile("tdpbf16ps %%tmm%c2, %%tmm%c1, %%tmm%c0" : : "n"(Acc), "n"(A), "n"(B));
  }
  static void release() { __asm__ volatile("tilerelease"); }
  static void configure(const TileConfig& config) {
    __asm__ volatile("ldtilecfg %0" : : "m"(config));  // all 64 bytes of the operand are read
  }
};

}  // namespace
}  // namespace groupbert::conv::amx

#include "grouped_conv1d_amx_impl.h"

namespace groupbert::conv::amx {

const TileKernels& kernels() { return AmxKernels<Tiles>::table(); }

}  // namespace groupbert::conv::amx

// GroupedConv1d on AMX tiles, for bf16 activations with 16 channels per group (the
// GroupBERT shape): the forward pass, grad-input and grad-weight, written once in
// grouped_conv1d_amx_impl.h on a tile backend and compiled twice:
//
//   amx::kernels()           the hardware tiles (grouped_conv1d_amx.cpp, AVX-512 flags; the
//                            tile instructions by inline assembly)
//   amx_emulated::kernels()  the tile instructions emulated in C++ as the Intel SDM states
//                            them (grouped_conv1d_amx_emulated.cpp, baseline flags): the
//                            same kernels on any CPU, for tests (GROUPBERT_AMX=emulate)
//
// grouped_conv1d.cpp calls one of them when cpu::amx_tiles() says so and shares the work
// items out; otherwise the level's vector kernels run.
#pragma once

#include <cstddef>
#include <cstdint>

#include "grouped_conv1d_cpu.h"

namespace groupbert::conv::amx {

// Channels per group the AMX kernels take: one 16 x 16 output tile per group.
constexpr int64_t kChannels = 16;
// Sequence positions per work item: 16 for the convolution (tile rows), 32 for
// grad-weight (one TDPBF16PS contracts 32 positions).
constexpr int64_t kConvTileRows = 16;
constexpr int64_t kGradWeightTileRows = 32;

// Elements of the packed weights (bf16 bits) for G groups of kernel width K.
constexpr size_t packed_weight_elements(int64_t G, int64_t K) {
  return static_cast<size_t>(G * ((K + 1) / 2) * 2 * kConvTileRows * kChannels);
}

// The tile configuration LDTILECFG reads (Intel SDM, "TILECFG"): 64 bytes, palette 1.
struct alignas(64) TileConfig {
  uint8_t palette = 0;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64, "LDTILECFG reads exactly 64 bytes");

// Palette 1: tile 0 accumulates (16 rows of 16 fp32), tile 1 holds A, tile 2 holds B;
// tiles 3 to 7 unused (0 rows). A constant in the library's read-only data, not a local
// filled at run time: GCC 12's _tile_loadconfig declares an 8-byte operand, so the
// optimizer deleted the stores of rows and bytes_per_row into the local it was given;
// every tile had 0 rows and the first TILEZERO raised SIGILL (issue 51). With no stores
// there is nothing to delete, and tests/test_grouped_conv1d.py reads these 64 bytes
// back out of the built library.
constexpr TileConfig make_tile_config() {
  TileConfig config;
  config.palette = 1;
  for (int tile = 0; tile < 3; ++tile) {
    config.bytes_per_row[tile] = 64;
    config.rows[tile] = 16;
  }
  return config;
}
constexpr TileConfig kTileConfig = make_tile_config();

struct TileKernels {
  // The B tiles of every (group, tap pair) in the VNNI layout: from conv1d's (H, 16, K)
  // weight, or with `transposed` its grad-input form w(g, j, c, k) = weight[g*16 + c][j][K-1-k].
  void (*pack_weights)(const uint16_t* weight, bool transposed, int64_t G, int64_t K, uint16_t* packed);
  // Bytes of scratch each worker passes to the kernels below.
  size_t (*scratch_bytes)(int64_t K);
  // As Kernels::conv (grouped_conv1d_cpu.h), bf16 only, call.weights from pack_weights,
  // items of kConvTileRows positions. Products in bf16, sums in fp32, the result rounded
  // to nearest even.
  void (*conv_items)(const ConvCall& call, int64_t begin, int64_t end, void* scratch);
  // As Kernels::grad_weight, bf16 only, items of kGradWeightTileRows positions, fp32
  // partials (workers, G, K, 16, 16) holding [j][c] (the transpose of the other kernels').
  void (*grad_weight_items)(const GradWeightCall& call, int64_t worker, int64_t begin, int64_t end, void* scratch);
};

const TileKernels& kernels();

}  // namespace groupbert::conv::amx

namespace groupbert::conv::amx_emulated {

const amx::TileKernels& kernels();

}  // namespace groupbert::conv::amx_emulated

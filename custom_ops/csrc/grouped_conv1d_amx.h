// GroupedConv1d on AMX tiles, for bf16 activations with 16 channels per group (the
// GroupBERT shape): the forward pass, grad-input and grad-weight, in
// grouped_conv1d_amx.cpp (compiled with the AVX-512 flags; the tile code takes
// amx-tile/amx-bf16 by target attributes). grouped_conv1d.cpp calls these when
// cpu::amx_usable() and shares the work items out; otherwise the AVX-512 kernels run.
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
size_t packed_weight_elements(int64_t G, int64_t K);
// The B tiles of every (group, tap pair) in the VNNI layout: from conv1d's (H, 16, K)
// weight, or with `transposed` its grad-input form w(g, j, c, k) = weight[g*16 + c][j][K-1-k].
void pack_weights(const uint16_t* weight, bool transposed, int64_t G, int64_t K, uint16_t* packed);

// Bytes of scratch each worker passes to the kernels below.
size_t scratch_bytes(int64_t K);

// As Kernels::conv (grouped_conv1d_cpu.h), bf16 only, call.weights from pack_weights,
// items of kConvTileRows positions. Products in bf16, sums in fp32, the result rounded
// to nearest even.
void conv_items(const ConvCall& call, int64_t begin, int64_t end, void* scratch);

// As Kernels::grad_weight, bf16 only, items of kGradWeightTileRows positions, fp32
// partials (workers, G, K, 16, 16) holding [j][c] (the transpose of the other kernels').
void grad_weight_items(const GradWeightCall& call, int64_t worker, int64_t begin, int64_t end, void* scratch);

}  // namespace groupbert::conv::amx

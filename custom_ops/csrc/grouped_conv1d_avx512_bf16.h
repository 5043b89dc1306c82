// GroupedConv1d in bf16 on AVX512-BF16 dot products (vdpbf16ps: Cooper Lake, Sapphire
// Rapids, Zen 4 and later): the forward pass, grad-input and grad-weight, in
// grouped_conv1d_avx512_bf16.cpp (compiled with the AVX-512 flags plus -mavx512bf16).
// grouped_conv1d.cpp calls these for bf16 at the avx512_bf16 level where the AMX tiles
// do not run, and shares the work items out; fp32, fp16 and float64 take the AVX-512
// kernels at that level.
//
// Letters as in grouped_conv1d_cpu.h; CP = lanes_for(C).
#pragma once

#include <cstddef>
#include <cstdint>

#include "grouped_conv1d_cpu.h"

namespace groupbert::conv::avx512_bf16 {

// Sequence positions per work item: 16 for the convolution (one accumulator register
// per position). Grad-weight contracts pairs of positions, its accumulators added to
// the worker's partial once per item: 32 positions, 64 at C > 32, whose partial
// (G*K*64*64 fp32: 1.4 MB at H = 768) does not stay in L2 (TW 64 against 32: 3.9
// against 4.3 ms at B = 8, S = 128, H = 768, one Zen 4 core).
constexpr int64_t kConvTileRows = 16;
constexpr int64_t grad_weight_tile_rows(int64_t C) { return lanes_for(C) > 32 ? 64 : 32; }

// Bytes of scratch each worker passes to the kernels below.
size_t scratch_bytes(const Shape& shape);

// As Kernels::conv (grouped_conv1d_cpu.h), bf16 only, items of kConvTileRows positions.
// call.weights are bf16 pairs, (G, K, CP / 2, CP, 2): [g][k][i][l][e] is the weight from
// reduction index 2i + e (input channel c forward, output channel j for grad-input) to
// lane l at tap k, zero past C (grouped_conv1d.cpp packs them). Products exact, sums in
// fp32, the result rounded to nearest even.
void conv_items(const ConvCall& call, int64_t begin, int64_t end, void* scratch);

// As Kernels::grad_weight, bf16 only, items of grad_weight_tile_rows(C) positions, fp32
// partials (workers, G, K, CP, CP) holding [c][j] as the other vector kernels do.
void grad_weight_items(const GradWeightCall& call, int64_t worker, int64_t begin, int64_t end, void* scratch);

}  // namespace groupbert::conv::avx512_bf16

// The raw-pointer interface between the softmax cross-entropy ops (softmax_xent.cpp:
// checks, threads, registration) and their CPU kernel variants, one file per instruction
// set, each the same portable loops (softmax_xent_cpu_impl.h) compiled with its own
// target flags (custom_ops/CMakeLists.txt), which the compiler vectorises for it:
//
//   softmax_xent_generic.cpp  the target's baseline: any CPU
//   softmax_xent_avx2.cpp     AVX2 + FMA: 8 lanes
//   softmax_xent_avx512.cpp   AVX-512 F/BW/VL/DQ: 16 lanes
//
// Each kernel works on rows [b, e) of a row-major (N, C) array of scores. No torch header
// here or in the variants (see grouped_conv1d_cpu.h).
#pragma once

#include <cstdint>

namespace groupbert::xent {

struct RowKernels {
  // stats[r] = [m, log Σ_c exp(x[r, c] − m)] with m the row's maximum (0 where it is not
  // finite), so that log softmax(x[r])[c] = (x[r, c] − m) − stats[r][1], as ATen computes it.
  void (*row_stats_f32)(const float* x, int64_t columns, int64_t b, int64_t e, float* stats);
  void (*row_stats_bf16)(const uint16_t* x, int64_t columns, int64_t b, int64_t e, float* stats);
  // dx[r, c] = (exp((x[r, c] − m) − log_sum) − [c == target[r]]) · scale[r], computed in
  // fp32 and rounded once to the scores' dtype (bf16: to nearest even). A target outside
  // [0, columns) (an ignored row) subtracts nothing.
  void (*grad_f32)(const float* x, const float* stats, const int64_t* target, const float* scale, int64_t columns,
                   int64_t b, int64_t e, float* dx);
  void (*grad_bf16)(const uint16_t* x, const float* stats, const int64_t* target, const float* scale, int64_t columns,
                    int64_t b, int64_t e, uint16_t* dx);
};

namespace generic {
const RowKernels& kernels();
}
#ifdef GROUPBERT_X86_KERNELS
namespace avx2 {
const RowKernels& kernels();
}
namespace avx512 {
const RowKernels& kernels();
}
#endif

}  // namespace groupbert::xent

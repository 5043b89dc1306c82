// The raw-pointer interface between the fused LAMB ops (fused_lamb.cpp: checks, chunk
// traversal, threads, registration) and their CPU kernel variants, one file per
// instruction set, each compiled with its own target flags (custom_ops/CMakeLists.txt):
//
//   fused_lamb_generic.cpp  portable loops (fused_lamb_cpu_impl.h): any CPU
//   fused_lamb_avx2.cpp     AVX2 + FMA: stage 1 and the sums of squares in intrinsics
//   fused_lamb_avx512.cpp   AVX-512 F/BW/VL/DQ: the same, 16 lanes with masked tails
//
// Each kernel works on one piece [b, e) of the flat buffers (a chunk's part of one
// segment). No torch header here or in the variants (see grouped_conv1d_cpu.h).
#pragma once

#include <cstdint>

namespace groupbert::lamb {

// Stage-1 scalars, rounded to fp32 once per call. 1 - beta is rounded from double
// (1.0f - 0.999f is off by 1.3e-5 relative); bias_correction{1,2} are the reciprocals
// 1 / (1 - beta^step).
struct Stage1Scalars {
  float beta1, beta2, one_minus_beta1, one_minus_beta2, bias_correction1, bias_correction2, eps, grad_scale;
};

struct PieceKernels {
  // Sum of x[i]^2 over [b, e), accumulated in double.
  double (*sum_squares_f32)(const float* x, int64_t b, int64_t e);
  double (*sum_squares_bf16)(const uint16_t* x, int64_t b, int64_t e);
  // g <- grad * scale; m <- beta1 m + (1 - beta1) g; v <- beta2 v + (1 - beta2) g^2;
  // u = m bc1 / (sqrt(v bc2) + eps) + wd p written into grad; sums = [sum p^2, sum u^2].
  void (*stage1_f32)(const float* p, float* g, float* m, float* v, int64_t b, int64_t e, float wd,
                     const Stage1Scalars& k, double* sums);
  void (*stage1_bf16)(const uint16_t* p, float* g, float* m, float* v, int64_t b, int64_t e, float wd,
                      const Stage1Scalars& k, double* sums);
  // p <- p - a u; bf16 p rounds stochastically with the bits of (key, element index).
  void (*stage2_f32)(float* p, const float* u, int64_t b, int64_t e, float a);
  void (*stage2_bf16)(uint16_t* p, const float* u, int64_t b, int64_t e, float a, uint32_t key);
};

namespace generic {
const PieceKernels& kernels();
}
#ifdef GROUPBERT_X86_KERNELS
namespace avx2 {
const PieceKernels& kernels();
}
namespace avx512 {
const PieceKernels& kernels();
}
#endif

}  // namespace groupbert::lamb

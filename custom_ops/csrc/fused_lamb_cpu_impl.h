// The portable CPU loops of the fused LAMB step, compiled into every variant
// (fused_lamb_{generic,avx2,avx512}.cpp): the generic variant uses all of them, the x86
// ones replace stage 1 and the sums of squares with intrinsics and keep stage 2, which
// the compiler vectorises for their target. Internal linkage (anonymous namespace), as
// in grouped_conv1d_cpu_impl.h. GCC does not vectorise std::sqrt without
// -fno-math-errno (errno on negative input), which left stage 1 compute-bound at 1.35x
// the 40 B/param floor on a Zen 3 CPU: the generic file is compiled with it (1.76x ->
// 0.57x the floor on this project's Zen 4 at the generic level), the x86 variants use
// intrinsics.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "fused_lamb_cpu.h"
#include "fused_lamb_cuda.h"

namespace groupbert::lamb {
namespace {

// bf16 <-> fp32 by bit moves (what c10::BFloat16 does), written so the loops vectorise.
inline float bf16_to_float(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint32_t float_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) { return bf16_to_float(p[i]); }

// The loops as static members of a class templated on the variant's `struct Isa`, so
// every symbol compiled here names the variant it was compiled for (the objdump test
// in tests/test_grouped_conv1d.py reads the names).
template <class Isa>
struct PortableLoops {
  template <typename T>
  static double sum_squares(const T* x, int64_t b, int64_t e) {
    double acc = 0.0;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = b; i < e; ++i) {
      const float xi = load(x, i);
      acc += static_cast<double>(xi) * xi;
    }
    return acc;
  }

  template <typename P>
  static void stage1(const P* p, float* g, float* m, float* v, int64_t b, int64_t e, float wd, const Stage1Scalars& k,
                     double* sums) {
    const float b1 = k.beta1, b2 = k.beta2, omb1 = k.one_minus_beta1, omb2 = k.one_minus_beta2;
    const float bc1 = k.bias_correction1, bc2 = k.bias_correction2, eps = k.eps, scale = k.grad_scale;
    double sp = 0.0, su = 0.0;
#pragma omp simd reduction(+ : sp, su)
    for (int64_t i = b; i < e; ++i) {
      const float pi = load(p, i);
      const float gi = g[i] * scale;
      const float mi = b1 * m[i] + omb1 * gi;
      const float vi = b2 * v[i] + omb2 * gi * gi;
      m[i] = mi;
      v[i] = vi;
      const float u = (mi * bc1) / (std::sqrt(vi * bc2) + eps) + wd * pi;
      g[i] = u;
      sp += static_cast<double>(pi) * pi;
      su += static_cast<double>(u) * u;
    }
    sums[0] = sp;
    sums[1] = su;
  }

  static void stage2_f32(float* p, const float* u, int64_t b, int64_t e, float a) {
#pragma omp simd
    for (int64_t i = b; i < e; ++i) p[i] -= a * u[i];
  }

  static void stage2_bf16(uint16_t* p, const float* u, int64_t b, int64_t e, float a, uint32_t key) {
#pragma omp simd
    for (int64_t i = b; i < e; ++i) {
      const float updated = bf16_to_float(p[i]) - a * u[i];
      p[i] = bf16_bits_stochastic(float_bits(updated), rounding_bits(key, static_cast<uint32_t>(i)));
    }
  }
};

}  // namespace
}  // namespace groupbert::lamb

// GroupedConv1d CPU kernels in portable C++ (grouped_conv1d_cpu_impl.h with 16-byte GCC
// vectors, no intrinsics), compiled with the target's baseline flags: the variant for
// CPUs without AVX2 and for other architectures (aarch64: NEON), and the reference the
// faster variants are tested against (GROUPBERT_CPU_CAPABILITY=generic).
#include <cstdint>

#include "grouped_conv1d_cpu.h"

namespace groupbert::conv::generic {
namespace {

struct Isa {
  static constexpr int kVectorBytes = 16;   // SSE2 / NEON
  static constexpr int kRegisters = 16;
  static constexpr int kAccumulators = 8;   // of 16 registers (SSE2 has 16, NEON 32)
  static constexpr bool kInputStationary = false;
  static void half_to_float(const uint16_t* src, float* dst, int64_t n);
  static void float_to_half(const float* src, uint16_t* dst, int64_t n);
  template <typename Vec>
  static void store_half(const Vec& v, uint16_t* dst);
};

}  // namespace
}  // namespace groupbert::conv::generic

#include "grouped_conv1d_cpu_impl.h"

namespace groupbert::conv::generic {
namespace {

void Isa::half_to_float(const uint16_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = portable_half_to_float(src[i]);
}

void Isa::float_to_half(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = portable_float_to_half(src[i]);
}

template <typename Vec>
void Isa::store_half(const Vec& v, uint16_t* dst) {
  for (int i = 0; i < static_cast<int>(sizeof(Vec) / sizeof(float)); ++i) dst[i] = portable_float_to_half(v[i]);
}

}  // namespace

const Kernels& kernels() {
  static const Kernels k = make_kernels<Isa>();
  return k;
}

}  // namespace groupbert::conv::generic

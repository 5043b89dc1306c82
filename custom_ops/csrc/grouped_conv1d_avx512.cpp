// GroupedConv1d CPU kernels for x86-64 with AVX-512 F/BW/VL/DQ, compiled with those
// flags only (custom_ops/CMakeLists.txt) and called only when the CPU has them
// (cpu_capability.h). 32 zmm registers: at C = 16 one output row is one register, a
// micro-tile holds 16 rows, and K = 7 runs input-stationary (16 accumulators, the 7
// weight vectors of one input channel and a broadcast). The code the AVX-512 Xeon
// measured at 1.85x torch, which one build with -march=native used to produce.
// bf16 and fp16 are stored as such and converted to fp32 in registers.
#include <immintrin.h>

#include <cstdint>

#include "f16c_convert.h"
#include "grouped_conv1d_cpu.h"

namespace groupbert::conv::avx512 {
namespace {

// fp16 conversions 16 lanes at a time, masked loads and stores taking the tail; the
// maskz_ forms because GCC 12 warns inside the unmasked ones (_mm512_undefined_*, GCC
// bug 105593). Narrower vectors go through F16C.
struct Isa : F16cConversions<Isa> {
  static constexpr int kVectorBytes = 64;
  static constexpr int kRegisters = 32;
  static constexpr int kAccumulators = 16;
  static constexpr bool kInputStationary = true;

  static __mmask16 tail(int64_t n) { return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1u); }

  static void half_to_float(const uint16_t* src, float* dst, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 m = tail(n - i);
      _mm512_mask_storeu_ps(dst + i, m, _mm512_maskz_cvtph_ps(m, _mm256_maskz_loadu_epi16(m, src + i)));
    }
  }

  static void float_to_half(const float* src, uint16_t* dst, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 m = tail(n - i);
      _mm256_mask_storeu_epi16(dst + i, m, _mm512_maskz_cvtps_ph(m, _mm512_maskz_loadu_ps(m, src + i), kRound));
    }
  }

  template <typename Vec>
  static void store_half(const Vec& v, uint16_t* dst) {
    if constexpr (sizeof(Vec) == 64) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                          _mm512_maskz_cvtps_ph(0xffff, reinterpret_cast<const __m512&>(v), kRound));
    } else {
      F16cConversions<Isa>::store_half(v, dst);
    }
  }
};

}  // namespace
}  // namespace groupbert::conv::avx512

#include "grouped_conv1d_cpu_impl.h"

namespace groupbert::conv::avx512 {

const Kernels& kernels() {
  static const Kernels k = make_kernels<Isa>();
  return k;
}

}  // namespace groupbert::conv::avx512

// fp16 <-> fp32 with F16C (vcvtph2ps / vcvtps2ph, round to nearest even), for the x86
// GroupedConv1d variants (grouped_conv1d_avx2.cpp, grouped_conv1d_avx512.cpp), which
// derive their `struct Isa` from F16cConversions<Isa>: a template on the variant, with
// internal linkage, so each variant keeps the copy compiled with its own flags and its
// symbols name the variant (the objdump test reads them).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace groupbert::conv {
namespace {

template <class Isa>
struct F16cConversions {
  static constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

  static void half_to_float(const uint16_t* src, float* dst, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
    for (; i < n; ++i) dst[i] = _cvtsh_ss(src[i]);
  }

  static void float_to_half(const float* src, uint16_t* dst, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), kRound));
    for (; i < n; ++i) dst[i] = _cvtss_sh(src[i], kRound);
  }

  // A GCC vector of 8 or 4 floats rounded to fp16 and stored, from its register.
  template <typename Vec>
  static void store_half(const Vec& v, uint16_t* dst) {
    if constexpr (sizeof(Vec) == 32) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm256_cvtps_ph(reinterpret_cast<const __m256&>(v), kRound));
    } else {
      static_assert(sizeof(Vec) == 16, "4 or 8 floats");
      _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), _mm_cvtps_ph(reinterpret_cast<const __m128&>(v), kRound));
    }
  }
};

}  // namespace
}  // namespace groupbert::conv

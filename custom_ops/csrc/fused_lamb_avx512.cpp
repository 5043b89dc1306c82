// Fused LAMB CPU kernels for x86-64 with AVX-512 F/BW/VL/DQ, compiled with those flags
// only (custom_ops/CMakeLists.txt) and called only when the CPU has them
// (cpu_capability.h). Stage 1 and the sums of squares in intrinsics (16 lanes, masked
// tail); stage 2 is the portable loop, which the compiler vectorises for AVX-512.
#include <immintrin.h>

#include "fused_lamb_cpu_impl.h"

namespace groupbert::lamb::avx512 {
namespace {

struct Isa {};
using Loops = PortableLoops<Isa>;

// 16 lanes per step; the tail is a masked load/store (masked-off lanes read 0 and
// add 0 to the sums). Squares accumulate in two double vectors (lanes 0-7, 8-15).
// The maskz_ forms with all-ones masks: GCC 12 warns inside the unmasked
// intrinsics (_mm512_undefined_*, GCC bug 105593).
constexpr __mmask8 kAll8 = 0xff;
inline __mmask16 tail_mask(int64_t left) { return left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1u); }
inline __m512 load16(const float* p, __mmask16 k) { return _mm512_maskz_loadu_ps(k, p); }
inline __m512 load16(const uint16_t* p, __mmask16 k) {
  return _mm512_castsi512_ps(
      _mm512_maskz_slli_epi32(k, _mm512_maskz_cvtepu16_epi32(k, _mm256_maskz_loadu_epi16(k, p)), 16));
}
inline void add_squares(__m512 x, __m512d& lo, __m512d& hi) {
  const __m512d a = _mm512_maskz_cvtps_pd(kAll8, _mm512_maskz_extractf32x8_ps(kAll8, x, 0));
  const __m512d b = _mm512_maskz_cvtps_pd(kAll8, _mm512_maskz_extractf32x8_ps(kAll8, x, 1));
  lo = _mm512_fmadd_pd(a, a, lo);
  hi = _mm512_fmadd_pd(b, b, hi);
}
inline double horizontal_sum(__m512d lo, __m512d hi) {
  alignas(64) double lanes[8];
  _mm512_store_pd(lanes, _mm512_add_pd(lo, hi));
  return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

template <typename T>
double sum_squares(const T* x, int64_t b, int64_t e) {
  __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
  for (int64_t i = b; i < e; i += 16) add_squares(load16(x + i, tail_mask(e - i)), lo, hi);
  return horizontal_sum(lo, hi);
}

template <typename P>
void stage1(const P* p, float* g, float* m, float* v, int64_t b, int64_t e, float wd, const Stage1Scalars& k,
            double* sums) {
  const float b1 = k.beta1, b2 = k.beta2, omb1 = k.one_minus_beta1, omb2 = k.one_minus_beta2;
  const float bc1 = k.bias_correction1, bc2 = k.bias_correction2, eps = k.eps, scale = k.grad_scale;
  const __m512 vb1 = _mm512_set1_ps(b1), vb2 = _mm512_set1_ps(b2), vomb1 = _mm512_set1_ps(omb1),
               vomb2 = _mm512_set1_ps(omb2), vbc1 = _mm512_set1_ps(bc1), vbc2 = _mm512_set1_ps(bc2),
               veps = _mm512_set1_ps(eps), vscale = _mm512_set1_ps(scale), vwd = _mm512_set1_ps(wd);
  __m512d p_lo = _mm512_setzero_pd(), p_hi = _mm512_setzero_pd(), u_lo = _mm512_setzero_pd(),
          u_hi = _mm512_setzero_pd();
  for (int64_t i = b; i < e; i += 16) {
    const __mmask16 mask = tail_mask(e - i);
    const __m512 pi = load16(p + i, mask);
    const __m512 gi = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, g + i), vscale);
    const __m512 mi = _mm512_fmadd_ps(vb1, _mm512_maskz_loadu_ps(mask, m + i), _mm512_mul_ps(vomb1, gi));
    const __m512 vi =
        _mm512_fmadd_ps(vb2, _mm512_maskz_loadu_ps(mask, v + i), _mm512_mul_ps(_mm512_mul_ps(vomb2, gi), gi));
    _mm512_mask_storeu_ps(m + i, mask, mi);
    _mm512_mask_storeu_ps(v + i, mask, vi);
    const __m512 denom = _mm512_add_ps(_mm512_maskz_sqrt_ps(mask, _mm512_mul_ps(vi, vbc2)), veps);
    const __m512 u = _mm512_fmadd_ps(vwd, pi, _mm512_div_ps(_mm512_mul_ps(mi, vbc1), denom));
    _mm512_mask_storeu_ps(g + i, mask, u);
    add_squares(pi, p_lo, p_hi);
    add_squares(u, u_lo, u_hi);
  }
  sums[0] = horizontal_sum(p_lo, p_hi);
  sums[1] = horizontal_sum(u_lo, u_hi);
}

}  // namespace

const PieceKernels& kernels() {
  static const PieceKernels k{&sum_squares<float>,  &sum_squares<uint16_t>, &stage1<float>,
                              &stage1<uint16_t>,    &Loops::stage2_f32,   &Loops::stage2_bf16};
  return k;
}

}  // namespace groupbert::lamb::avx512

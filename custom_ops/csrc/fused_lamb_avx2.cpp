// Fused LAMB CPU kernels for x86-64 with AVX2 and FMA, compiled with -mavx2 -mfma only
// (custom_ops/CMakeLists.txt) and called only when the CPU has them (cpu_capability.h).
// Stage 1 and the sums of squares in intrinsics, 8 lanes per step (the portable loop's
// std::sqrt does not vectorise, and left stage 1 compute-bound at 1.35x the 40 B/param
// floor on a Zen 3 CPU); the tail of fewer than 8 elements runs the portable loop.
// Stage 2 is the portable loop, which the compiler vectorises for AVX2.
#include <immintrin.h>

#include "fused_lamb_cpu_impl.h"

namespace groupbert::lamb::avx2 {
namespace {

struct Isa {};
using Loops = PortableLoops<Isa>;

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m256i words = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));  // bf16 is the top half of fp32
}

// Squares accumulate in two double vectors (lanes 0-3, 4-7).
inline void add_squares(__m256 x, __m256d& lo, __m256d& hi) {
  const __m256d a = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
  const __m256d b = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
  lo = _mm256_fmadd_pd(a, a, lo);
  hi = _mm256_fmadd_pd(b, b, hi);
}

inline double horizontal_sum(__m256d lo, __m256d hi) {
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, _mm256_add_pd(lo, hi));
  return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
}

template <typename T>
double sum_squares(const T* x, int64_t b, int64_t e) {
  __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
  int64_t i = b;
  for (; i + 8 <= e; i += 8) add_squares(load8(x + i), lo, hi);
  return horizontal_sum(lo, hi) + Loops::sum_squares(x, i, e);
}

template <typename P>
void stage1(const P* p, float* g, float* m, float* v, int64_t b, int64_t e, float wd, const Stage1Scalars& k,
            double* sums) {
  const __m256 vb1 = _mm256_set1_ps(k.beta1), vb2 = _mm256_set1_ps(k.beta2), vomb1 = _mm256_set1_ps(k.one_minus_beta1),
               vomb2 = _mm256_set1_ps(k.one_minus_beta2), vbc1 = _mm256_set1_ps(k.bias_correction1),
               vbc2 = _mm256_set1_ps(k.bias_correction2), veps = _mm256_set1_ps(k.eps),
               vscale = _mm256_set1_ps(k.grad_scale), vwd = _mm256_set1_ps(wd);
  __m256d p_lo = _mm256_setzero_pd(), p_hi = _mm256_setzero_pd(), u_lo = _mm256_setzero_pd(),
          u_hi = _mm256_setzero_pd();
  int64_t i = b;
  for (; i + 8 <= e; i += 8) {
    const __m256 pi = load8(p + i);
    const __m256 gi = _mm256_mul_ps(_mm256_loadu_ps(g + i), vscale);
    const __m256 mi = _mm256_fmadd_ps(vb1, _mm256_loadu_ps(m + i), _mm256_mul_ps(vomb1, gi));
    const __m256 vi = _mm256_fmadd_ps(vb2, _mm256_loadu_ps(v + i), _mm256_mul_ps(_mm256_mul_ps(vomb2, gi), gi));
    _mm256_storeu_ps(m + i, mi);
    _mm256_storeu_ps(v + i, vi);
    const __m256 denom = _mm256_add_ps(_mm256_sqrt_ps(_mm256_mul_ps(vi, vbc2)), veps);
    const __m256 u = _mm256_fmadd_ps(vwd, pi, _mm256_div_ps(_mm256_mul_ps(mi, vbc1), denom));
    _mm256_storeu_ps(g + i, u);
    add_squares(pi, p_lo, p_hi);
    add_squares(u, u_lo, u_hi);
  }
  double tail[2];
  Loops::stage1(p, g, m, v, i, e, wd, k, tail);
  sums[0] = horizontal_sum(p_lo, p_hi) + tail[0];
  sums[1] = horizontal_sum(u_lo, u_hi) + tail[1];
}

}  // namespace

const PieceKernels& kernels() {
  static const PieceKernels k{&sum_squares<float>, &sum_squares<uint16_t>, &stage1<float>,
                              &stage1<uint16_t>,   &Loops::stage2_f32,   &Loops::stage2_bf16};
  return k;
}

}  // namespace groupbert::lamb::avx2

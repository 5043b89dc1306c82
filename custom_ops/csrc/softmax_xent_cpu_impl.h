// The softmax cross-entropy's CPU loops, compiled into every variant
// (softmax_xent_{generic,avx2,avx512}.cpp) with that variant's flags. They are written
// once on GCC vectors of 16 floats, which become one AVX-512 register, two AVX2 ones or
// four SSE2 ones, with an exp of their own (std::exp does not vectorise). Every variant
// splits a row into the same 16 lanes and adds them in the same order; they differ only
// where the target fuses a multiply-add (avx2, avx512) and the baseline cannot. Internal
// linkage (anonymous namespace), as in grouped_conv1d_cpu_impl.h.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "bf16_round.h"
#include "softmax_xent_cpu.h"

namespace groupbert::xent {
namespace {

constexpr int kLanes = 16;
typedef float Floats __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t Ints __attribute__((vector_size(kLanes * sizeof(int32_t))));
typedef uint32_t Words __attribute__((vector_size(kLanes * sizeof(uint32_t))));
typedef uint16_t Halves __attribute__((vector_size(kLanes * sizeof(uint16_t))));

constexpr float kExpLow = -87.33654f, kExpHigh = 88.72283f;

// exp of 16 lanes by Cephes' expf: x = n ln 2 + r with |r| <= ln 2 / 2 (ln 2 in two parts,
// so r is exact), exp(r) a degree-7 polynomial, times 2^n built in the exponent bits
// (as 2^(n/2) · 2^(n − n/2), each a normal float). Within 2 ulp of the correctly rounded
// exp on [kExpLow, kExpHigh]; 0 below (no subnormal results), +inf above, NaN for NaN.
inline Floats exp16(Floats x) {
  Floats c = x < kExpLow ? Floats{} + kExpLow : x;
  c = c > kExpHigh ? Floats{} + kExpHigh : c;
  const Floats round = Floats{} + 12582912.0f;  // 1.5 · 2^23: adding it rounds to an integer
  const Floats n = (c * 1.44269504088896341f + round) - round;
  Floats r = c - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  Floats p = Floats{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const Ints ni = __builtin_convertvector(n, Ints);
  const Ints half = ni >> 1;
  Floats a, b;
  const Words wa = (Words)((half + 127) << 23), wb = (Words)((ni - half + 127) << 23);
  std::memcpy(&a, &wa, sizeof a);
  std::memcpy(&b, &wb, sizeof b);
  Floats y = p * a * b;
  y = x < kExpLow ? Floats{} : y;
  y = x > kExpHigh ? Floats{} + INFINITY : y;
  return x != x ? x : y;
}

// 16 scores from p (fp32 or bf16); `count` < 16 reads that many and fills the rest.
inline Floats load16(const float* p) {
  Floats v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline Floats load16(const uint16_t* p) {
  Halves h;
  std::memcpy(&h, p, sizeof h);
  const Words w = __builtin_convertvector(h, Words) << 16;  // bf16 is the top half of fp32
  Floats v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}
template <typename T>
inline Floats load_tail(const T* p, int64_t count, float fill) {
  T lanes[kLanes];
  std::memcpy(lanes, p, count * sizeof(T));
  Floats v = load16(lanes);
  for (int64_t i = count; i < kLanes; ++i) v[i] = fill;
  return v;
}

inline void store16(float* p, Floats v, int64_t count) { std::memcpy(p, &v, count * sizeof(float)); }
inline void store16(uint16_t* p, Floats v, int64_t count) {
  const Halves h = __builtin_convertvector(bf16_bits<Words>(v), Halves);  // rounded to nearest even
  std::memcpy(p, &h, count * sizeof(uint16_t));
}

// The loops as static members of a class templated on the variant's `struct Isa`, so
// every symbol compiled here names the variant it was compiled for (the objdump test
// in tests/test_grouped_conv1d.py reads the names).
template <class Isa>
struct RowLoops {
  template <typename T>
  static void row_stats(const T* x, int64_t columns, int64_t b, int64_t e, float* stats) {
    const int64_t full = columns / kLanes * kLanes;
    for (int64_t r = b; r < e; ++r) {
      const T* row = x + r * columns;
      Floats top = Floats{} - INFINITY;
      for (int64_t c = 0; c < full; c += kLanes) {
        const Floats v = load16(row + c);
        top = v > top ? v : top;  // a NaN is not kept here: the sum below carries it
      }
      if (full < columns) {
        const Floats v = load_tail(row + full, columns - full, -INFINITY);
        top = v > top ? v : top;
      }
      float most = top[0];
      for (int i = 1; i < kLanes; ++i) most = top[i] > most ? top[i] : most;
      // A row of -inf has no finite maximum (its exp(x − max) would be NaN): it sums to 0.
      const float shift = std::isfinite(most) ? most : 0.0f;
      // Summed in blocks of kBlock vectors, each block's sum added to the row's: about
      // kBlock + columns / (16 kBlock) additions per lane where one running sum would take
      // columns / 16 (1908 for BERT's vocabulary, whose rounding then showed in the loss).
      constexpr int64_t kBlock = 32 * kLanes;
      Floats sum{};
      for (int64_t block = 0; block < full; block += kBlock) {
        const int64_t end = block + kBlock < full ? block + kBlock : full;
        Floats part{};
        for (int64_t c = block; c < end; c += kLanes) part += exp16(load16(row + c) - shift);
        sum += part;
      }
      if (full < columns) sum += exp16(load_tail(row + full, columns - full, -INFINITY) - shift);
      float total = 0.0f;
      for (int i = 0; i < kLanes; ++i) total += sum[i];
      stats[2 * r] = shift;
      stats[2 * r + 1] = std::log(total);
    }
  }

  template <typename T>
  static void grad(const T* x, const float* stats, const int64_t* target, const float* scale, int64_t columns,
                   int64_t b, int64_t e, T* dx) {
    const int64_t full = columns / kLanes * kLanes;
    Ints lane;
    for (int i = 0; i < kLanes; ++i) lane[i] = i;
    for (int64_t r = b; r < e; ++r) {
      const T* row = x + r * columns;
      T* out = dx + r * columns;
      const float shift = stats[2 * r], log_sum = stats[2 * r + 1], s = scale[r];
      // The target as an int32 column, -1 when outside the row (an ignored row).
      const int32_t t = target[r] >= 0 && target[r] < columns ? static_cast<int32_t>(target[r]) : -1;
      for (int64_t c = 0; c < full; c += kLanes) {
        const Floats g = exp16((load16(row + c) - shift) - log_sum) * s;
        store16(out + c, lane + static_cast<int32_t>(c) == t ? g - s : g, kLanes);
      }
      if (full < columns) {
        const Floats g = exp16((load_tail(row + full, columns - full, 0.0f) - shift) - log_sum) * s;
        store16(out + full, lane + static_cast<int32_t>(full) == t ? g - s : g, columns - full);
      }
    }
  }

  static const RowKernels& kernels() {
    static const RowKernels k{&row_stats<float>, &row_stats<uint16_t>, &grad<float>, &grad<uint16_t>};
    return k;
  }
};

}  // namespace
}  // namespace groupbert::xent

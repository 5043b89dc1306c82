// The CPU kernels of GroupedConv1d, written once and compiled once per instruction set.
// Each variant file (grouped_conv1d_{generic,avx2,avx512}.cpp) defines, in an anonymous
// namespace, a `struct Isa` with
//
//   kVectorBytes      bytes of one vector register (16, 32 or 64)
//   kRegisters        vector registers (16 or 32)
//   kAccumulators     vector registers a micro-kernel may fill with accumulators
//   kInputStationary  whether K = 7 may run input-stationary (it needs ~24 registers)
//   half_to_float(src, dst, n), float_to_half(src, dst, n)   fp16 conversions
//   store_half(v, dst)  a GCC vector of 4, 8 or 16 floats rounded to fp16 and stored
//
// then includes this file and returns make_kernels<Isa>() from its kernels().
// Everything here has internal linkage (anonymous namespace) and every function is a
// member or instance of a template on Isa: no function compiled with one variant's flags
// can be merged with another variant's copy at link time, and each names its variant.
//
// Letters as in grouped_conv1d_cpu.h. A work item is a tile of T = kTileRows sequence
// positions of one batch row; for each group in turn its input window (T + K - 1 rows
// of C channels) is gathered, masked and converted to the accumulation type (fp32;
// fp64 for float64) into the worker's scratch, then micro-kernels accumulate output
// rows in registers. x is read row by row (contiguous H) and the packed weights
// (G*K*C*CP values, 344 KiB at GroupBERT base) stay in L2; group-major order read x
// with an H-element stride and ran 1.5x slower.
//
// A row of CP lanes is NV vectors of VW lanes (VW = the register's lanes, at most CP),
// so the blocking follows the register file rather than letting the compiler split
// oversized vectors (which, with one build for AVX-512, collapsed on AVX2 CPUs):
//
//   output-stationary (every K, every ISA): lane blocks of NB <= 2 vectors, TM rows x NB
//     accumulators; for each (k, c) the NB weight vectors are loaded once and each of
//     the TM input values broadcast for them. AVX2 at C = 16: 4 rows x 2 ymm.
//   input-stationary (K = 7 where (7 + TS) NV + 1 registers fit: AVX-512 up to C = 32):
//     channel c's 7 weight vectors stay in registers and each input value is broadcast
//     once for the 7 outputs it feeds (22 broadcasts per 112 FMAs instead of 112; 15%
//     faster on the AVX-512 Xeon).
//
// From L1 on a Zen 4 core, the AVX2 output-stationary forward and grad-weight blocks ran
// at 110 GFLOP/s of the core's 112 GFLOP/s FMA peak (a standalone test); the
// input-stationary blocking split into 8-lane halves to fit 16 ymm ran at 86-102.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "bf16_round.h"
#include "grouped_conv1d_cpu.h"

namespace groupbert::conv {
namespace {

template <typename T, int N>
struct Lanes {
  typedef T type __attribute__((vector_size(N * sizeof(T))));
};

// Storage types of x, weight and the results, and the type they accumulate in.
struct F32 {
  using type = float;
  using acc = float;
};
struct F64 {
  using type = double;
  using acc = double;
};
struct BF16 {
  using type = uint16_t;
  using acc = float;
};
struct F16 {
  using type = uint16_t;
  using acc = float;
};

// fp16 <-> fp32 in integer arithmetic only, so the result does not depend on the
// floating-point environment (denormals-are-zero); round to nearest even, as torch's
// conversion. The generic variant uses these; the x86 ones use F16C.
inline float portable_half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0x1fu) {
    bits = sign | 0x7f800000u | (mantissa << 13);  // inf, NaN
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: mantissa * 2^-24, normalised for fp32
    int top = 31 - __builtin_clz(mantissa);
    bits = sign | (static_cast<uint32_t>(top + 103) << 23) | ((mantissa << (23 - top)) & 0x7fffffu);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint16_t portable_float_to_half(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  const uint32_t sign = (bits >> 16) & 0x8000u, magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((magnitude >> 13) & 0x3ffu));
  if (magnitude >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // 65520 and up round to inf
  uint32_t q, rest, half;
  if (magnitude < 0x38800000u) {  // below 2^-14: a subnormal half, in units of 2^-24
    if (magnitude <= 0x33000000u) return static_cast<uint16_t>(sign);  // up to 2^-25 (a tie) rounds to 0
    const uint32_t shift = 126u - (magnitude >> 23), significand = (magnitude & 0x7fffffu) | 0x800000u;
    q = significand >> shift;
    rest = significand & ((1u << shift) - 1u);
    half = 1u << (shift - 1u);
  } else {  // normal: rebias the exponent, keep 10 mantissa bits
    q = (magnitude - 0x38000000u) >> 13;
    rest = magnitude & 0x1fffu;
    half = 0x1000u;
  }
  q += (rest > half || (rest == half && (q & 1u))) ? 1u : 0u;  // a carry may reach the exponent: still right
  return static_cast<uint16_t>(sign | q);
}

template <class Isa, class Storage, int CP>
struct ConvKernel {
  using scalar_t = typename Storage::type;
  using acc_t = typename Storage::acc;
  static constexpr int kRegisterLanes = Isa::kVectorBytes / static_cast<int>(sizeof(acc_t));
  static constexpr int VW = CP < kRegisterLanes ? CP : kRegisterLanes;  // lanes per vector
  static constexpr int NV = CP / VW;                                    // vectors per row
  using V = typename Lanes<acc_t, VW>::type;
  static constexpr int64_t T = kTileRows;
  static constexpr int clamp_rows(int rows) { return rows < 1 ? 1 : (rows > T ? T : rows); }

  // Output-stationary blocking: a lane block is NB <= 2 vectors of a row (LB blocks per
  // row), a micro-tile TM x NB accumulators (TM a power of two <= T). Wider blocks
  // leave too few rows to reuse each weight vector (C = 64 on AVX2 had 1 row of 8).
  static constexpr int NB = NV < 2 ? NV : 2;
  static constexpr int LB = NV / NB;
  static constexpr int TM = clamp_rows(Isa::kAccumulators / NB);
  // Grad-weight blocks: CB input channels x NB accumulators, at most 8 independent
  // chains per grad-output vector (the FMA latency x throughput needs about 8).
  static constexpr int CB = std::min({CP, 8, Isa::kAccumulators / NB});

  // Input-stationary blocking (K = 7 where the register file holds it): whole rows,
  // TS rows of NV accumulators, the KT weight (or grad-output) vectors of one channel
  // and a broadcast: (KT + TS) NV + 1 registers. AVX-512 at C = 16: 16 + 7 + 1 = 24.
  static constexpr int TS = clamp_rows(Isa::kAccumulators / NV);
  template <int KT>
  static constexpr bool input_stationary() {
    return Isa::kInputStationary && KT > 0 && (KT + TS) * NV + 1 <= Isa::kRegisters;
  }

  // Converts the n <= CP channels at src into a row of CP lanes (zero-filled).
  static void load_row(const scalar_t* src, int64_t n, acc_t* dst) {
    if constexpr (std::is_same_v<Storage, F16>) {
      Isa::half_to_float(src, dst, n);
    } else if constexpr (std::is_same_v<Storage, BF16>) {
      for (int64_t i = 0; i < n; ++i) {
        const uint32_t bits = static_cast<uint32_t>(src[i]) << 16;  // bf16 is the top half of fp32
        std::memcpy(dst + i, &bits, sizeof bits);
      }
    } else {
      std::memcpy(dst, src, n * sizeof(acc_t));
    }
    for (int64_t i = n; i < CP; ++i) dst[i] = 0;
  }
  // A whole row (n = CP), with sizes known at compile time: bf16 widens VW lanes at a
  // time (a bit shift: bf16 is the top half of fp32).
  static void load_full_row(const scalar_t* src, acc_t* dst) {
    if constexpr (std::is_same_v<Storage, BF16>) {
      using U16 = typename Lanes<uint16_t, VW>::type;
      using U32 = typename Lanes<uint32_t, VW>::type;
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) {
        U16 h;
        std::memcpy(&h, src + v * VW, sizeof h);
        const U32 bits = __builtin_convertvector(h, U32) << 16;
        std::memcpy(dst + v * VW, &bits, sizeof bits);
      }
    } else {
      load_row(src, CP, dst);
    }
  }

  // Stores the first n lanes of N vectors (a row or a lane block), rounding to nearest even.
  template <int N>
  static void store_lanes(const V (&row)[N], int64_t n, scalar_t* dst) {
    constexpr int kLanes = N * VW;
    if (n == kLanes) {  // the common case, with sizes known at compile time
      if constexpr (std::is_same_v<Storage, BF16>) {
        using U32 = typename Lanes<uint32_t, VW>::type;
        using U16 = typename Lanes<uint16_t, VW>::type;
#pragma GCC unroll 8
        for (int v = 0; v < N; ++v) {
          const U16 h = __builtin_convertvector(bf16_bits<U32>(row[v]), U16);
          std::memcpy(dst + v * VW, &h, sizeof h);
        }
        return;
      } else if constexpr (std::is_same_v<Storage, F16>) {
#pragma GCC unroll 8
        for (int v = 0; v < N; ++v) Isa::store_half(row[v], dst + v * VW);
        return;
      } else {
        std::memcpy(dst, row, sizeof row);
        return;
      }
    }
    if constexpr (std::is_same_v<Storage, F32> || std::is_same_v<Storage, F64>) {
      std::memcpy(dst, row, n * sizeof(acc_t));
    } else {
      alignas(64) acc_t values[kLanes < 16 ? 16 : kLanes];  // room for the 8- and 16-lane conversions
      std::memcpy(values, row, sizeof row);
      if constexpr (std::is_same_v<Storage, F16>) {
        Isa::float_to_half(values, dst, n);
      } else {
        for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<uint16_t>(bf16_bits<uint32_t, float>(values[i]));
      }
    }
  }

  using Passes = SequencePasses<Isa>;

  // Window rows r = 0 .. R-1 of group g: input row s0 - P + r of batch row b, masked
  // (`mask` and `ids` point at the batch row; null when absent), of sequence `id` only,
  // zero outside [0, S).
  static void gather(const scalar_t* in, const bool* mask, const int64_t* ids, int64_t id, int64_t b, int64_t s0,
                     int64_t g, int64_t R, const Shape& sh, acc_t* window) {
    for (int64_t r = 0; r < R; ++r) {
      const int64_t s = s0 - sh.P + r;
      const bool live = s >= 0 && s < sh.S && Passes::live(mask, ids, id, s);
      acc_t* dst = window + r * CP;
      if (!live) {
        std::memset(dst, 0, CP * sizeof(acc_t));
      } else if (sh.C == CP) {
        load_full_row(in + (b * sh.S + s) * sh.H + g * sh.C, dst);
      } else {
        load_row(in + (b * sh.S + s) * sh.H + g * sh.C, sh.C, dst);
      }
    }
  }

  // Work items are tiles of rows and each runs the G groups in turn, reading one line
  // per row per group: H apart, beyond the hardware prefetchers' reach. While group g
  // runs, this prefetches group g's lines of the n flat rows from `first` (clamped to
  // the tensor): the rows the next tile will read (131 -> 156 GFLOP/s forward, one
  // core, cache flushed, on the AVX-512 Xeon).
  static void prefetch_rows(const scalar_t* t, int64_t first, int64_t n, int64_t g, const Shape& sh) {
    const int64_t end = std::min(sh.B * sh.S, first + n);
    for (int64_t row = first; row < end; ++row) __builtin_prefetch(t + row * sh.H + g * sh.C);
  }

  // Input-stationary: acc[t] (TS rows) += conv of window rows t .. t + K - 1 with the
  // group's packed weights wg ((K, C, NV) vectors): channel c's KT weight vectors stay
  // in registers and each input value is broadcast once for the KT outputs it feeds.
  template <int KT>
  static inline void micro_conv_is(const acc_t* window, const V* wg, int64_t C, V (&acc)[TS][NV]) {
    for (int64_t c = 0; c < C; ++c) {
      V w[KT][NV];
#pragma GCC unroll 16
      for (int k = 0; k < KT; ++k)
#pragma GCC unroll 8
        for (int v = 0; v < NV; ++v) w[k][v] = wg[(k * C + c) * NV + v];
      const acc_t* xc = window + c;
#pragma GCC unroll 32
      for (int r = 0; r < TS + KT - 1; ++r) {
        const acc_t xv = xc[r * CP];
#pragma GCC unroll 16
        for (int k = 0; k < KT; ++k)
          if (r - k >= 0 && r - k < TS)
#pragma GCC unroll 8
            for (int v = 0; v < NV; ++v) acc[r - k][v] += w[k][v] * xv;
      }
    }
  }

  // Output-stationary: acc[t] (TM rows of lane block lb) += the same, looping over
  // (k, c); the NB weight vectors of (k, c) are loaded once for the TM broadcasts.
  template <int KT>
  static inline void micro_conv_os(const acc_t* window, const V* wg, int64_t K, int64_t C, int lb,
                                   V (&acc)[TM][NB]) {
    const int64_t taps = KT > 0 ? KT : K;
    for (int64_t k = 0; k < taps; ++k) {
      for (int64_t c = 0; c < C; ++c) {
        V w[NB];
#pragma GCC unroll 8
        for (int v = 0; v < NB; ++v) w[v] = wg[(k * C + c) * NV + lb * NB + v];
        const acc_t* xc = window + k * CP + c;
#pragma GCC unroll 16
        for (int t = 0; t < TM; ++t) {
          const acc_t xv = xc[t * CP];
#pragma GCC unroll 8
          for (int v = 0; v < NB; ++v) acc[t][v] += w[v] * xv;
        }
      }
    }
  }

  // Stores the rows t0 .. t0 + R - 1 of a micro-tile (N vectors each, from lane `lane0`)
  // that the pass writes: without per-row checks when it writes the whole item tile
  // (write == nullptr; 5.5 -> 5.1 ms forward, one core, on the AVX-512 Xeon).
  template <int R, int N>
  static inline void store_tile(const V (&acc)[R][N], int64_t t0, int64_t lane0, const bool* write, scalar_t* og,
                                const Shape& sh) {
    const int64_t n = std::min<int64_t>(N * VW, sh.C - lane0);
    if (n <= 0) return;  // a block of padded lanes only
    if (write == nullptr) {
#pragma GCC unroll 16
      for (int t = 0; t < R; ++t) store_lanes(acc[t], n, og + (t0 + t) * sh.H + lane0);
    } else {
      for (int64_t t = 0; t < R && t0 + t < T; ++t)
        if (write[t0 + t]) store_lanes(acc[t], n, og + (t0 + t) * sh.H + lane0);
    }
  }

  // Whether the pass writes any of the rows t0 .. t0 + R - 1 (micro-tiles it does not
  // write are not computed: a tile at a sequence boundary costs little more than one).
  static bool writes_any(const bool* write, int64_t t0, int64_t R) {
    if (write == nullptr) return true;
    for (int64_t t = t0; t < t0 + R && t < T; ++t)
      if (write[t]) return true;
    return false;
  }

  // The rows of a tile that are written as zero (masked grad-input rows, padding of
  // packed sequences) and, per pass, the rows it writes. `write` stays null where the
  // pass writes every row of a whole tile.
  struct TileRows {
    bool zero[T] = {};
    bool any_zero = false;
    bool write_rows[T] = {};
    const bool* write = nullptr;

    TileRows(const bool* out_mask, const int64_t* ids, int64_t rows) {
      for (int64_t t = 0; t < rows; ++t) {
        zero[t] = ids != nullptr ? ids[t] == 0 : out_mask != nullptr && !out_mask[t];
        any_zero = any_zero || zero[t];
      }
    }
    // Rows of pass `id` (kAnySequence: every row not written as zero).
    void start_pass(const int64_t* ids, int64_t id, int64_t rows) {
      bool all = rows == T;
      for (int64_t t = 0; t < T; ++t) {
        write_rows[t] = t < rows && (ids != nullptr ? ids[t] == id : !zero[t]);
        all = all && write_rows[t];
      }
      write = all ? nullptr : write_rows;
    }
  };

  template <int KT>
  static void conv(const ConvCall& call, int64_t begin, int64_t end, void* scratch) {
    const Shape& sh = call.shape;
    const int64_t S = sh.S, H = sh.H, C = sh.C, K = sh.K, P = sh.P, G = sh.G;
    const auto* in = static_cast<const scalar_t*>(call.in);
    auto* out = static_cast<scalar_t*>(call.out);
    const V* weights = static_cast<const V*>(call.weights);
    acc_t* window = static_cast<acc_t*>(scratch);
    const int64_t n_tiles = (S + T - 1) / T;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / n_tiles, s0 = (item % n_tiles) * T;
      const int64_t rows = std::min(T, S - s0);
      const bool* in_mask = call.in_mask == nullptr ? nullptr : call.in_mask + b * S;
      const int64_t* ids = call.sequence_ids == nullptr ? nullptr : call.sequence_ids + b * S;
      const int64_t* tile_ids = ids == nullptr ? nullptr : ids + s0;
      TileRows tile(call.out_mask == nullptr ? nullptr : call.out_mask + b * S + s0, tile_ids, rows);
      for (int64_t t = 0; t < rows && tile.any_zero; ++t)
        if (tile.zero[t]) std::memset(out + (b * S + s0 + t) * H, 0, H * sizeof(scalar_t));
      const Passes passes(tile_ids, rows);
      for (int p = 0; p < passes.count; ++p) {
        tile.start_pass(tile_ids, passes.ids[p], rows);
        const bool* write = tile.write;
        for (int64_t g = 0; g < G; ++g) {
          gather(in, in_mask, ids, passes.ids[p], b, s0, g, T + K - 1, sh, window);
          prefetch_rows(in, b * S + s0 + T + P, T, g, sh);  // the rows the next tile adds
          const V* wg = weights + g * K * C * NV;
          scalar_t* og = out + (b * S + s0) * H + g * C;
          if constexpr (input_stationary<KT>()) {
            for (int64_t t0 = 0; t0 < T; t0 += TS) {
              if (!writes_any(write, t0, TS)) continue;
              V acc[TS][NV] = {};
              micro_conv_is<KT>(window + t0 * CP, wg, C, acc);
              store_tile(acc, t0, 0, write, og, sh);
            }
          } else {
            for (int64_t t0 = 0; t0 < T; t0 += TM) {
              if (!writes_any(write, t0, TM)) continue;
              for (int lb = 0; lb < LB && lb * NB * VW < C; ++lb) {
                V acc[TM][NB] = {};
                micro_conv_os<KT>(window + t0 * CP, wg, K, C, lb, acc);
                store_tile(acc, t0, lb * NB * VW, write, og, sh);
              }
            }
          }
        }
      }
    }
  }

  template <int KT>
  static void grad_weight(const GradWeightCall& call, int64_t worker, int64_t begin, int64_t end, void* scratch) {
    const Shape& sh = call.shape;
    const int64_t S = sh.S, C = sh.C, K = sh.K, P = sh.P, G = sh.G;
    const auto* x = static_cast<const scalar_t*>(call.x);
    const auto* gout = static_cast<const scalar_t*>(call.gout);
    V* partial = static_cast<V*>(call.partials) + worker * G * K * CP * NV;
    acc_t* window = static_cast<acc_t*>(scratch);
    acc_t* go_tile = window + (T + K - 1) * CP;  // T rows of grad_out, unmasked
    const int64_t n_tiles = (S + T - 1) / T;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / n_tiles, s0 = (item % n_tiles) * T;
      const int64_t rows = std::min(T, S - s0);
      const bool* mask = call.mask == nullptr ? nullptr : call.mask + b * S;
      const int64_t* ids = call.sequence_ids == nullptr ? nullptr : call.sequence_ids + b * S;
      const Passes passes(ids == nullptr ? nullptr : ids + s0, rows);
      for (int p = 0; p < passes.count; ++p) {
        const int64_t id = passes.ids[p];
        for (int64_t g = 0; g < G; ++g) {
          gather(x, mask, ids, id, b, s0, g, T + K - 1, sh, window);
          for (int64_t t = 0; t < T; ++t) {  // grad_out rows of the pass, unmasked
            if (t < rows && (ids == nullptr || ids[s0 + t] == id))
              load_row(gout + (b * S + s0 + t) * sh.H + g * C, C, go_tile + t * CP);
            else
              std::memset(go_tile + t * CP, 0, CP * sizeof(acc_t));
          }
          prefetch_rows(x, b * S + s0 + T + P, T, g, sh);
          prefetch_rows(gout, b * S + s0 + T, T, g, sh);
          V* gw = partial + g * K * CP * NV;  // [k][c][v]
          const V* go = reinterpret_cast<const V*>(go_tile);
          if constexpr (input_stationary<KT>()) {
            // Input-stationary, as in micro_conv_is: x[r][c] is broadcast once and feeds
            // the K taps k (output rows r - k), one accumulator per tap.
            for (int64_t t0 = 0; t0 < T; t0 += TS) {
              V gr[TS][NV];
#pragma GCC unroll 16
              for (int t = 0; t < TS; ++t)
#pragma GCC unroll 8
                for (int v = 0; v < NV; ++v) gr[t][v] = go[(t0 + t) * NV + v];
              for (int64_t c = 0; c < C; ++c) {
                V a[KT][NV] = {};
                const acc_t* xc = window + t0 * CP + c;
#pragma GCC unroll 32
                for (int r = 0; r < TS + KT - 1; ++r) {
                  const acc_t xv = xc[r * CP];
#pragma GCC unroll 16
                  for (int k = 0; k < KT; ++k)
                    if (r - k >= 0 && r - k < TS)
#pragma GCC unroll 8
                      for (int v = 0; v < NV; ++v) a[k][v] += gr[r - k][v] * xv;
                }
#pragma GCC unroll 16
                for (int k = 0; k < KT; ++k)
#pragma GCC unroll 8
                  for (int v = 0; v < NV; ++v) gw[(k * CP + c) * NV + v] += a[k][v];
              }
            }
          } else {
            // Output-stationary: for a tap k, CB input channels and lane block lb, CB x NB
            // accumulators over the T positions; each grad-output vector is loaded once
            // per block and each input value broadcast once per lane block. Padded
            // channels (c >= C) read zero lanes.
            for (int lb = 0; lb < LB && lb * NB * VW < C; ++lb) {
              for (int64_t k = 0; k < K; ++k) {
                for (int64_t c0 = 0; c0 < C; c0 += CB) {
                  V a[CB][NB] = {};
                  const acc_t* xr = window + k * CP + c0;
#pragma GCC unroll 4
                  for (int64_t t = 0; t < T; ++t) {
                    V gr[NB];
#pragma GCC unroll 8
                    for (int v = 0; v < NB; ++v) gr[v] = go[t * NV + lb * NB + v];
#pragma GCC unroll 8
                    for (int i = 0; i < CB; ++i) {
                      const acc_t xv = xr[t * CP + i];
#pragma GCC unroll 8
                      for (int v = 0; v < NB; ++v) a[i][v] += gr[v] * xv;
                    }
                  }
#pragma GCC unroll 8
                  for (int i = 0; i < CB; ++i)
#pragma GCC unroll 8
                    for (int v = 0; v < NB; ++v) gw[(k * CP + c0 + i) * NV + lb * NB + v] += a[i][v];
                }
              }
            }
          }
        }
      }
    }
  }
};

// Calls f(std::integral_constant<int, KT>) with KT = 7 for GroupBERT's kernel width,
// whose loops are unrolled over the taps, and KT = 0 (taps in a runtime loop) otherwise.
template <typename F>
void with_kernel_width(int64_t K, F&& f) {
  if (K == 7) return f(std::integral_constant<int, 7>{});
  return f(std::integral_constant<int, 0>{});
}

// Calls f(std::integral_constant<int, CP>) for the lane count that holds C channels.
template <typename F>
void with_lanes(int64_t C, F&& f) {
  if (C <= 4) return f(std::integral_constant<int, 4>{});
  if (C <= 8) return f(std::integral_constant<int, 8>{});
  if (C <= 16) return f(std::integral_constant<int, 16>{});
  if (C <= 32) return f(std::integral_constant<int, 32>{});
  return f(std::integral_constant<int, 64>{});
}

template <typename F>
void with_storage(Dtype dtype, F&& f) {
  switch (dtype) {
    case Dtype::kFloat:
      return f(F32{});
    case Dtype::kDouble:
      return f(F64{});
    case Dtype::kBFloat16:
      return f(BF16{});
    case Dtype::kHalf:
      return f(F16{});
  }
}

template <class Isa>
void conv_items(const ConvCall& call, int64_t begin, int64_t end, void* scratch) {
  with_storage(call.dtype, [&](auto storage) {
    with_lanes(call.shape.C, [&](auto lanes) {
      with_kernel_width(call.shape.K, [&](auto kt) {
        ConvKernel<Isa, decltype(storage), decltype(lanes)::value>::template conv<decltype(kt)::value>(call, begin,
                                                                                                         end, scratch);
      });
    });
  });
}

template <class Isa>
void grad_weight_items(const GradWeightCall& call, int64_t worker, int64_t begin, int64_t end, void* scratch) {
  with_storage(call.dtype, [&](auto storage) {
    with_lanes(call.shape.C, [&](auto lanes) {
      with_kernel_width(call.shape.K, [&](auto kt) {
        ConvKernel<Isa, decltype(storage), decltype(lanes)::value>::template grad_weight<decltype(kt)::value>(
            call, worker, begin, end, scratch);
      });
    });
  });
}

template <class Isa>
Kernels make_kernels() {
  return Kernels{&conv_items<Isa>, &grad_weight_items<Isa>};
}

}  // namespace
}  // namespace groupbert::conv

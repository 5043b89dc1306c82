// GroupedConv1d in bf16 on AVX512-BF16 (grouped_conv1d_avx512_bf16.h), compiled with
// the AVX-512 flags plus -mavx512bf16 only (custom_ops/CMakeLists.txt) and called only
// at the avx512_bf16 level (cpu_capability.h). Letters as in grouped_conv1d_cpu.h.
//
// vdpbf16ps multiplies 16 pairs of bf16 by 16 other pairs exactly and adds both
// products to 16 fp32 lanes: 32 multiply-adds per instruction where an fp32 FMA does 16,
// at the same rate on Zen 4 (one zmm instruction per cycle). The AVX-512 kernels widen
// bf16 to fp32 and run FMAs; oneDNN's bf16 convolution runs vdpbf16ps and beat them on
// this project's Zen 4 (0.83x torch, fwd + bwd at GroupBERT base): this is that
// arithmetic in our channels-last layout. A product of two bf16 is exact in fp32, so
// the results differ from the widening kernels only in the order of the fp32 sums.
//
// Lanes hold output channels, the pairs a reduction index:
//
//   forward      lanes j, pairs of input channels (c, c + 1) at one tap: the pair of an
//                input row is one 32-bit word of the channels-last row, broadcast to the
//                lanes; the weight register holds (w[j][c][k], w[j][c + 1][k]) per lane j.
//                K = 7 runs input-stationary, one lane register (16 output channels) at
//                a time: per channel pair the 7 weight registers stay and each of the 22
//                window rows' pair is broadcast once for the 7 outputs it feeds (16 + 7 +
//                1 = 24 registers), read in place from x when every window row is live
//                (no gather: 4.4 -> 3.6 ms forward, one core, standalone). Other K run
//                output-stationary on a gathered window: a micro-tile of TM rows x NB
//                registers of accumulators, per (tap, channel pair) NB weight loads feed
//                TM * NB products, the pair broadcast from memory inside the instruction
//                ({1to16}).
//   grad-input   the same kernel on grad_out, lanes c, pairs (j, j + 1), with the weight
//                transposed within each group and flipped along K (packed by the caller).
//   grad-weight  the reduction runs over positions, so the pairs are two consecutive
//                rows: lanes j hold (gout[s][j], gout[s + 1][j]), and the broadcast word
//                (x[s + k - P][c], x[s + k - P + 1][c]) of channel c, made once per item
//                for every window row by interleaving rows r and r + 1. Items of 32
//                positions (16 pairs; 64 at C > 32); CB input channels x NB registers of
//                accumulators over the item for one tap, then added to the worker's fp32
//                partial.
//
// Standalone on one Zen 4 core (GroupBERT base, B = 32, bf16), a register-only vdpbf16ps
// loop reads 234 GFLOP/s (one zmm instruction per cycle at 3.65 GHz; FMA: 117): the
// forward runs at 190-195 (in place), grad-weight at 155-160 (its pairing of rows and
// the partial's updates); without gathers and stores the forward loop ran at 224.
//
// Masks, packed sequences (SequencePasses), the prefetch of the next tile's lines and
// the rows written are as in the other vector kernels (grouped_conv1d_cpu_impl.h).
// Everything here is in this variant's namespace or an anonymous one: nothing compiled
// with these flags can be the copy another variant's caller gets.
#include "grouped_conv1d_avx512_bf16.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "bf16_round.h"

namespace groupbert::conv::avx512_bf16 {
namespace {

struct Variant {};  // names this variant's copy of SequencePasses
using Passes = SequencePasses<Variant>;

template <typename T, int N>
struct Lanes {
  typedef T type __attribute__((vector_size(N * sizeof(T))));
};

// One register of VW fp32 lanes (VW = 4, 8 or 16: xmm, ymm or zmm) and the bf16 pair
// products into it. The pair x is broadcast to every lane.
template <int VW>
struct Vec;

template <>
struct Vec<16> {
  using F = __m512;
  using Pairs = __m512i;
  static F zero() { return _mm512_setzero_ps(); }
  static Pairs load(const uint32_t* p) { return _mm512_loadu_si512(p); }
  // acc + the products of w's pairs with the pair at x, broadcast from memory inside the
  // instruction ({1to16}; GCC 12 emits a separate vpbroadcastd for the intrinsic).
  static F dot(F acc, Pairs w, const uint32_t* x) {
    asm("vdpbf16ps %[x]%{1to16%}, %[w], %[acc]" : [acc] "+v"(acc) : [w] "v"(w), [x] "m"(*x));
    return acc;
  }
  static void add_to(float* p, F v) { _mm512_storeu_ps(p, _mm512_add_ps(_mm512_loadu_ps(p), v)); }
  // The pair at x (two bf16, 4-byte aligned or not) in every lane, for several products.
  static Pairs broadcast(const void* x) {
    uint32_t v;
    std::memcpy(&v, x, sizeof v);
    return _mm512_set1_epi32(static_cast<int>(v));
  }
  static F dot(F acc, Pairs w, Pairs x) { return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x); }
};

template <>
struct Vec<8> {
  using F = __m256;
  using Pairs = __m256i;
  static F zero() { return _mm256_setzero_ps(); }
  static Pairs load(const uint32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static F dot(F acc, Pairs w, const uint32_t* x) {
    asm("vdpbf16ps %[x]%{1to8%}, %[w], %[acc]" : [acc] "+v"(acc) : [w] "v"(w), [x] "m"(*x));
    return acc;
  }
  static void add_to(float* p, F v) { _mm256_storeu_ps(p, _mm256_add_ps(_mm256_loadu_ps(p), v)); }
  static Pairs broadcast(const void* x) {
    uint32_t v;
    std::memcpy(&v, x, sizeof v);
    return _mm256_set1_epi32(static_cast<int>(v));
  }
  static F dot(F acc, Pairs w, Pairs x) { return _mm256_dpbf16_ps(acc, (__m256bh)w, (__m256bh)x); }
};

template <>
struct Vec<4> {
  using F = __m128;
  using Pairs = __m128i;
  static F zero() { return _mm_setzero_ps(); }
  static Pairs load(const uint32_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
  static F dot(F acc, Pairs w, const uint32_t* x) {
    asm("vdpbf16ps %[x]%{1to4%}, %[w], %[acc]" : [acc] "+v"(acc) : [w] "v"(w), [x] "m"(*x));
    return acc;
  }
  static void add_to(float* p, F v) { _mm_storeu_ps(p, _mm_add_ps(_mm_loadu_ps(p), v)); }
  static Pairs broadcast(const void* x) {
    uint32_t v;
    std::memcpy(&v, x, sizeof v);
    return _mm_set1_epi32(static_cast<int>(v));
  }
  static F dot(F acc, Pairs w, Pairs x) { return _mm_dpbf16_ps(acc, (__m128bh)w, (__m128bh)x); }
};

template <int CP>
struct DotKernel {
  static constexpr int VW = CP < 16 ? CP : 16;  // fp32 lanes per register
  static constexpr int NV = CP / VW;            // registers per row of CP lanes
  static constexpr int NB = NV < 2 ? NV : 2;    // registers per lane block
  static constexpr int LB = NV / NB;            // lane blocks per row
  // Accumulators of the 32 zmm registers; the others hold the weight or grad-output
  // pairs of one step. 16 rows x 1 zmm at C = 16, 8 x 2 at C = 32 and 64.
  static constexpr int kAccumulators = 16;
  static constexpr int TM = kAccumulators / NB;             // rows of a micro-tile
  static constexpr int CB = std::min(CP, kAccumulators / NB);  // grad-weight input channels per block
  static constexpr int64_t PAIRS = CP / 2;                   // pair words in a window row of CP bf16
  static constexpr int64_t T = kConvTileRows, TW = grad_weight_tile_rows(CP);
  static_assert(T % TM == 0, "micro-tiles split the item's rows");
  using X = Vec<VW>;
  using F = typename X::F;
  using Pairs = typename X::Pairs;

  // Stores the first n <= VW lanes of v rounded to bf16 (nearest even, as torch rounds).
  static void store_bf16(uint16_t* dst, F v, int64_t n) {
    using Floats = typename Lanes<float, VW>::type;
    using Words = typename Lanes<uint32_t, VW>::type;
    using Halves = typename Lanes<uint16_t, VW>::type;
    Floats f;
    std::memcpy(&f, &v, sizeof f);
    const Halves h = __builtin_convertvector(bf16_bits<Words>(f), Halves);
    if (n == VW) {
      std::memcpy(dst, &h, sizeof h);
    } else {
      for (int64_t i = 0; i < n; ++i) dst[i] = h[i];
    }
  }

  // While group g runs, its lines of the n flat rows from `first` (those the next item
  // reads; the rows are H apart, out of the hardware prefetchers' reach).
  static void prefetch_rows(const uint16_t* t, int64_t first, int64_t n, int64_t g, const Shape& sh) {
    const int64_t end = std::min(sh.B * sh.S, first + n);
    for (int64_t row = first; row < end; ++row) __builtin_prefetch(t + row * sh.H + g * sh.C);
  }

  // Window rows r = 0 .. R - 1 of group g: input row s0 - P + r of batch row b, CP bf16
  // each, zero where masked, of another sequence, outside [0, S) or past C.
  static void gather(const uint16_t* in, const bool* mask, const int64_t* ids, int64_t id, int64_t b, int64_t s0,
                     int64_t g, int64_t R, const Shape& sh, uint16_t* window) {
    for (int64_t r = 0; r < R; ++r) {
      const int64_t s = s0 - sh.P + r;
      uint16_t* dst = window + r * CP;
      if (!(s >= 0 && s < sh.S && Passes::live(mask, ids, id, s))) {
        std::memset(dst, 0, CP * sizeof(uint16_t));
      } else if (sh.C == CP) {
        std::memcpy(dst, in + (b * sh.S + s) * sh.H + g * sh.C, CP * sizeof(uint16_t));
      } else {
        const uint16_t* src = in + (b * sh.S + s) * sh.H + g * sh.C;
        for (int64_t c = 0; c < CP; ++c) dst[c] = c < sh.C ? src[c] : 0;
      }
    }
  }

  // acc[t] (TM rows, lane block lb) += the taps of window rows t .. t + K - 1 (pair words
  // `xw`, PAIRS per row) times the group's packed weights wg ((K, PAIRS, CP) words).
  static inline void micro_conv(const uint32_t* xw, const uint32_t* wg, int64_t K, int64_t n_pairs, int lb,
                                F (&acc)[TM][NB]) {
    for (int64_t k = 0; k < K; ++k) {
      for (int64_t i = 0; i < n_pairs; ++i) {
        Pairs w[NB];
#pragma GCC unroll 4
        for (int v = 0; v < NB; ++v) w[v] = X::load(wg + (k * PAIRS + i) * CP + (lb * NB + v) * VW);
        const uint32_t* xc = xw + k * PAIRS + i;
#pragma GCC unroll 16
        for (int t = 0; t < TM; ++t)
#pragma GCC unroll 4
          for (int v = 0; v < NB; ++v) acc[t][v] = X::dot(acc[t][v], w[v], xc + t * PAIRS);
      }
    }
  }

  // Input-stationary where the T rows' accumulators of one lane register, the KT
  // weight registers of a channel pair and a broadcast fit the 32 registers (K = 7: 24).
  template <int KT>
  static constexpr bool input_stationary() {
    return KT > 0 && T + KT + 1 <= 32;
  }

  // acc[t] (the T rows, lanes lb * VW ..) += the KT taps of rows t .. t + KT - 1 of
  // `rows` (bf16 rows `stride` elements apart: x in place or the gathered window) times
  // the group's packed weights wg. Each row's pair is broadcast once for the KT outputs
  // it feeds; each weight register serves T rows (C = 32, 64: one lane register at a
  // time, so the weights are read once per 16 rows rather than 8).
  template <int KT>
  static inline void micro_conv_is(const uint16_t* rows, int64_t stride, const uint32_t* wg, int64_t n_pairs, int lb,
                                   F (&acc)[T]) {
    for (int64_t i = 0; i < n_pairs; ++i) {
      Pairs w[KT];
#pragma GCC unroll 16
      for (int k = 0; k < KT; ++k) w[k] = X::load(wg + (k * PAIRS + i) * CP + lb * VW);
      const uint16_t* p = rows + 2 * i;
#pragma GCC unroll 32
      for (int r = 0; r < T + KT - 1; ++r) {
        const Pairs xv = X::broadcast(p + r * stride);
#pragma GCC unroll 16
        for (int k = 0; k < KT; ++k)
          if (r - k >= 0 && r - k < T) acc[r - k] = X::dot(acc[r - k], w[k], xv);
      }
    }
  }

  // KT = K where the taps are unrolled (7), 0 otherwise.
  template <int KT>
  static void conv(const ConvCall& call, int64_t begin, int64_t end, void* scratch) {
    const Shape& sh = call.shape;
    const int64_t S = sh.S, H = sh.H, C = sh.C, K = sh.K, P = sh.P, G = sh.G;
    const int64_t n_pairs = (C + 1) / 2;  // pair words that hold a channel
    const int64_t R = T + K - 1;          // window rows
    const auto* in = static_cast<const uint16_t*>(call.in);
    const auto* weights = static_cast<const uint32_t*>(call.weights);
    auto* out = static_cast<uint16_t*>(call.out);
    auto* window = static_cast<uint16_t*>(scratch);
    const auto* window_pairs = reinterpret_cast<const uint32_t*>(window);
    const int64_t n_tiles = (S + T - 1) / T;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / n_tiles, s0 = (item % n_tiles) * T, rows = std::min(T, S - s0);
      const bool* in_mask = call.in_mask == nullptr ? nullptr : call.in_mask + b * S;
      const bool* out_mask = call.out_mask == nullptr ? nullptr : call.out_mask + b * S;
      const int64_t* ids = call.sequence_ids == nullptr ? nullptr : call.sequence_ids + b * S;
      // Rows written as zero: masked (grad-input) or padding between packed sequences.
      bool zero[T] = {};
      for (int64_t t = 0; t < rows; ++t) {
        zero[t] = ids != nullptr ? ids[s0 + t] == 0 : out_mask != nullptr && !out_mask[s0 + t];
        if (zero[t]) std::memset(out + (b * S + s0 + t) * H, 0, H * sizeof(uint16_t));
      }
      const Passes passes(ids == nullptr ? nullptr : ids + s0, rows);
      for (int p = 0; p < passes.count; ++p) {
        const int64_t id = passes.ids[p];
        bool write[T] = {};  // the rows this pass writes
        bool every_row = rows == T;
        for (int64_t t = 0; t < T; ++t) {
          write[t] = t < rows && (ids != nullptr ? ids[s0 + t] == id : !zero[t]);
          every_row = every_row && write[t];
        }
        // Every window row inside [0, S) and live, and C even (no pair word reaches into
        // the next group): the input-stationary kernel reads x in place, no gather.
        bool in_place = C % 2 == 0 && s0 - P >= 0 && s0 + T + P <= S;
        for (int64_t r = 0; r < R && in_place && (in_mask != nullptr || ids != nullptr); ++r)
          in_place = Passes::live(in_mask, ids, id, s0 - P + r);
        for (int64_t g = 0; g < G; ++g) {
          const uint32_t* wg = weights + g * K * PAIRS * CP;
          uint16_t* og = out + (b * S + s0) * H + g * C;
          if constexpr (input_stationary<KT>()) {
            if (!in_place) gather(in, in_mask, ids, id, b, s0, g, R, sh, window);
            prefetch_rows(in, b * S + s0 + T + P, T, g, sh);  // the rows the next item adds
            for (int lb = 0; lb < NV && lb * VW < C; ++lb) {
              F acc[T];
#pragma GCC unroll 16
              for (int t = 0; t < T; ++t) acc[t] = X::zero();
              if (in_place)
                micro_conv_is<KT>(in + (b * S + s0 - P) * H + g * C, H, wg, n_pairs, lb, acc);
              else
                micro_conv_is<KT>(window, CP, wg, n_pairs, lb, acc);
              const int64_t n = std::min<int64_t>(VW, C - lb * VW);
#pragma GCC unroll 16
              for (int t = 0; t < T; ++t)
                if (every_row || write[t]) store_bf16(og + t * H + lb * VW, acc[t], n);
            }
            continue;
          }
          gather(in, in_mask, ids, id, b, s0, g, R, sh, window);
          prefetch_rows(in, b * S + s0 + T + P, T, g, sh);  // the rows the next item adds
          for (int64_t t0 = 0; t0 < T; t0 += TM) {
            bool any = false;
            for (int64_t t = t0; t < t0 + TM; ++t) any = any || write[t];
            if (!any) continue;  // a micro-tile this pass does not write (at a sequence boundary)
            for (int lb = 0; lb < LB && lb * NB * VW < C; ++lb) {
              F acc[TM][NB];
#pragma GCC unroll 16
              for (int t = 0; t < TM; ++t)
#pragma GCC unroll 4
                for (int v = 0; v < NB; ++v) acc[t][v] = X::zero();
              micro_conv(window_pairs + t0 * PAIRS, wg, K, n_pairs, lb, acc);
#pragma GCC unroll 16
              for (int t = 0; t < TM; ++t) {
                if (!every_row && !write[t0 + t]) continue;
#pragma GCC unroll 4
                for (int v = 0; v < NB; ++v) {
                  const int64_t lane0 = (lb * NB + v) * VW, n = std::min<int64_t>(VW, C - lane0);
                  if (n > 0) store_bf16(og + (t0 + t) * H + lane0, acc[t][v], n);
                }
              }
            }
          }
        }
      }
    }
  }

  // A row of C bf16 (null: zeros) zero-extended to CP 32-bit words, 16 per zmm. The
  // maskz_ forms because GCC 12 warns inside the unmasked ones (_mm512_undefined_*, GCC
  // bug 105593), as in grouped_conv1d_avx512.cpp.
  static constexpr int NW = (CP + 15) / 16;
  static void widen(const uint16_t* row, int64_t C, __m512i (&w)[NW]) {
#pragma GCC unroll 4
    for (int q = 0; q < NW; ++q) {
      const int64_t n = std::clamp<int64_t>(C - 16 * q, 0, 16);
      w[q] = row == nullptr || n == 0 ? _mm512_setzero_si512()
                            : _mm512_maskz_cvtepu16_epi32(
                                  0xffff, _mm256_maskz_loadu_epi16(__mmask16((1u << n) - 1u), row + 16 * q));
    }
  }
  // dst[c] = the pair of words lo[c] (low half) and hi[c] (high half), CP of them.
  static void store_pairs(const __m512i (&lo)[NW], const __m512i (&hi)[NW], uint32_t* dst) {
#pragma GCC unroll 4
    for (int q = 0; q < NW; ++q) {
      const __m512i v = _mm512_or_si512(lo[q], _mm512_maskz_slli_epi32(0xffff, hi[q], 16));
      if constexpr (CP >= 16)
        _mm512_storeu_si512(dst + 16 * q, v);
      else
        _mm512_mask_storeu_epi32(dst, __mmask16((1u << CP) - 1u), v);
    }
  }

  static void grad_weight(const GradWeightCall& call, int64_t worker, int64_t begin, int64_t end, void* scratch) {
    const Shape& sh = call.shape;
    const int64_t S = sh.S, H = sh.H, C = sh.C, K = sh.K, P = sh.P, G = sh.G;
    const auto* x = static_cast<const uint16_t*>(call.x);
    const auto* gout = static_cast<const uint16_t*>(call.gout);
    float* partial = static_cast<float*>(call.partials) + worker * G * K * CP * CP;
    // Scratch: x pairs (TW + K - 2 rows of CP words: rows r and r + 1 of the window),
    // grad_out pairs (TW / 2 rows: positions 2m and 2m + 1), the window's row pointers.
    const int64_t x_pair_rows = TW + K - 2;
    auto* x_pairs = static_cast<uint32_t*>(scratch);
    uint32_t* g_pairs = x_pairs + x_pair_rows * CP;
    auto** x_rows = reinterpret_cast<const uint16_t**>(g_pairs + TW / 2 * CP);
    const int64_t n_tiles = (S + TW - 1) / TW;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / n_tiles, s0 = (item % n_tiles) * TW, rows = std::min(TW, S - s0);
      const bool* mask = call.mask == nullptr ? nullptr : call.mask + b * S;
      const int64_t* ids = call.sequence_ids == nullptr ? nullptr : call.sequence_ids + b * S;
      const Passes passes(ids == nullptr ? nullptr : ids + s0, rows);
      for (int p = 0; p < passes.count; ++p) {
        const int64_t id = passes.ids[p];
        // grad_out row s0 + t of this pass (unmasked: x carries the mask), null for a zero row.
        auto gout_row = [&](int64_t t, int64_t offset) -> const uint16_t* {
          return t < rows && (ids == nullptr || ids[s0 + t] == id) ? gout + (b * S + s0 + t) * H + offset : nullptr;
        };
        for (int64_t g = 0; g < G; ++g) {
          const int64_t offset = g * C;
          for (int64_t r = 0; r < x_pair_rows + 1; ++r) {  // window row r: input row s0 - P + r
            const int64_t s = s0 - P + r;
            const bool live = s >= 0 && s < S && Passes::live(mask, ids, id, s);
            x_rows[r] = live ? x + (b * S + s) * H + offset : nullptr;
          }
          __m512i row[NW], next[NW];
          widen(x_rows[0], C, row);
          for (int64_t r = 0; r < x_pair_rows; ++r) {
            widen(x_rows[r + 1], C, next);
            store_pairs(row, next, x_pairs + r * CP);
#pragma GCC unroll 4
            for (int q = 0; q < NW; ++q) row[q] = next[q];
          }
          for (int64_t m = 0; m < TW / 2; ++m) {
            widen(gout_row(2 * m, offset), C, row);
            widen(gout_row(2 * m + 1, offset), C, next);
            store_pairs(row, next, g_pairs + m * CP);
          }
          prefetch_rows(x, b * S + s0 + TW + P, TW, g, sh);
          prefetch_rows(gout, b * S + s0 + TW, TW, g, sh);
          float* pg = partial + g * K * CP * CP;  // [k][c][j]
          for (int lb = 0; lb < LB && lb * NB * VW < C; ++lb) {
            for (int64_t k = 0; k < K; ++k) {
              for (int64_t c0 = 0; c0 < C; c0 += CB) {
                F acc[CB][NB];
#pragma GCC unroll 16
                for (int i = 0; i < CB; ++i)
#pragma GCC unroll 4
                  for (int v = 0; v < NB; ++v) acc[i][v] = X::zero();
                // Pair m of positions (2m, 2m + 1) meets input rows 2m + k and 2m + k + 1.
#pragma GCC unroll 2
                for (int64_t m = 0; m < TW / 2; ++m) {
                  Pairs gv[NB];
#pragma GCC unroll 4
                  for (int v = 0; v < NB; ++v) gv[v] = X::load(g_pairs + m * CP + (lb * NB + v) * VW);
                  const uint32_t* xr = x_pairs + (2 * m + k) * CP + c0;
#pragma GCC unroll 16
                  for (int i = 0; i < CB; ++i)
#pragma GCC unroll 4
                    for (int v = 0; v < NB; ++v) acc[i][v] = X::dot(acc[i][v], gv[v], xr + i);
                }
#pragma GCC unroll 16
                for (int i = 0; i < CB; ++i)
#pragma GCC unroll 4
                  for (int v = 0; v < NB; ++v) X::add_to(pg + (k * CP + c0 + i) * CP + (lb * NB + v) * VW, acc[i][v]);
              }
            }
          }
        }
      }
    }
  }
};

// Calls f(std::integral_constant<int, CP>) for the lane count that holds C channels.
template <typename Fn>
void with_lanes(int64_t C, Fn&& f) {
  if (C <= 4) return f(std::integral_constant<int, 4>{});
  if (C <= 8) return f(std::integral_constant<int, 8>{});
  if (C <= 16) return f(std::integral_constant<int, 16>{});
  if (C <= 32) return f(std::integral_constant<int, 32>{});
  return f(std::integral_constant<int, 64>{});
}

}  // namespace

size_t scratch_bytes(const Shape& shape) {
  const int64_t CP = lanes_for(shape.C), K = shape.K;
  const size_t conv = static_cast<size_t>((kConvTileRows + K - 1) * CP) * sizeof(uint16_t);
  const int64_t TW = grad_weight_tile_rows(CP);
  const size_t grad_weight = static_cast<size_t>((TW + K - 2 + TW / 2) * CP) * sizeof(uint32_t) +
                             static_cast<size_t>(TW + K - 1) * sizeof(const uint16_t*);
  return std::max(conv, grad_weight) + 64;
}

void conv_items(const ConvCall& call, int64_t begin, int64_t end, void* scratch) {
  with_lanes(call.shape.C, [&](auto lanes) {
    if (call.shape.K == 7)
      DotKernel<decltype(lanes)::value>::template conv<7>(call, begin, end, scratch);
    else
      DotKernel<decltype(lanes)::value>::template conv<0>(call, begin, end, scratch);
  });
}

void grad_weight_items(const GradWeightCall& call, int64_t worker, int64_t begin, int64_t end, void* scratch) {
  with_lanes(call.shape.C, [&](auto lanes) {
    DotKernel<decltype(lanes)::value>::grad_weight(call, worker, begin, end, scratch);
  });
}

}  // namespace groupbert::conv::avx512_bf16

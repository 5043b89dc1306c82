// GroupedConv1d on AMX tiles (Intel Sapphire Rapids and later), bf16, 16 channels per
// group, written once on a tile backend and compiled twice (as grouped_conv1d_cpu_impl.h
// is per instruction set):
//
//   grouped_conv1d_amx.cpp           the hardware tiles (AMX instructions), AVX-512 flags
//   grouped_conv1d_amx_emulated.cpp  the tile instructions emulated in C++, baseline flags:
//                                    the same kernels, testable on any CPU
//                                    (GROUPBERT_AMX=emulate, a test switch)
//
// Each file defines, in an anonymous namespace of its own namespace, a `struct Tiles` with
//
//   configure(const amx::TileConfig&)  LDTILECFG: tile shapes from the 64-byte configuration
//   zero<t>(), load<t>(base, stride), store<t>(base, stride)   TILEZERO, TILELOADD, TILESTORED
//   dot<c, a, b>()                   TDPBF16PS: tile c += tile a . tile b (bf16 pairs, fp32 sums)
//   release()                        TILERELEASE
//
// then includes this file and returns AmxKernels<Tiles>::table() from its kernels().
// Every function here is a member of that template (anonymous namespace), so each copy
// is compiled with its file's flags and named by its file's namespace (the objdump test
// of tests/test_grouped_conv1d.py reads those names).
//
// Letters as in grouped_conv1d_cpu.h: B batch, S sequence, H hidden, K kernel width
// (odd), P = K / 2, G = H / 16 groups.
//
// One 16 x 16 fp32 output tile (16 positions x 16 output channels of a group) is a sum
// of NQ = ceil(K / 2) tile products A(16 x 32) . B(32 x 16), one per pair of taps:
//   A[t][i] = window[t + 2q + i / 16][i % 16]   (window row r = input row s0 - P + r),
//   B[i][j] = w(g, j, c = i % 16, k = 2q + i / 16), zero for k >= K,
// so row t of A is 64 contiguous bytes of the window (two 16-channel rows) and A loads
// straight from it with a 32-byte stride. B is packed once per call in the VNNI layout
// TDPBF16PS reads (pairs of consecutive i interleaved). TDPBF16PS multiplies bf16 pairs
// and accumulates in fp32.
//
// Work items are (batch row, tile of 16 positions), shared out by grouped_conv1d.cpp. Per item
// (and per packed sequence in it, SequencePasses in grouped_conv1d_cpu.h)
// the groups go in blocks of 8: their windows are gathered (masked, zero outside [0, S)),
// then their tile products run and the results go to fp32 buffers, then those are
// rounded and stored. Batching keeps the tile loads away from the vector stores that
// wrote their data (a tile load right after them waited; 1.5x slower, prototype).
// Grad-weight contracts over positions instead: see grad_weight_items.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>

#include "bf16_round.h"
#include "grouped_conv1d_amx.h"

namespace groupbert::conv {
namespace {

template <class Tiles>
struct AmxKernels {
  // Names this copy of the shared templates (SequencePasses).
  using Passes = SequencePasses<Tiles>;

  static constexpr int64_t C = amx::kChannels;
  static constexpr int64_t T = 16;           // positions per tile (tile rows)
  static constexpr int64_t kGroupBlock = 8;  // groups gathered before their products run
  static constexpr int kTileBytes = 64;      // bytes per tile row

  // GCC vector types: 16 lanes, so each op is one AVX-512 instruction where the file's
  // flags allow it (the emulated copy splits them).
  typedef float Floats __attribute__((vector_size(64)));
  typedef uint32_t Words __attribute__((vector_size(64)));
  typedef uint16_t Halves __attribute__((vector_size(32)));

  // One output row: 16 fp32 values rounded to bf16.
  static void store_bf16_row(uint16_t* dst, const float* src) {
    Floats v;
    std::memcpy(&v, src, sizeof(v));
    const Halves h = __builtin_convertvector(bf16_bits<Words>(v), Halves);
    std::memcpy(dst, &h, sizeof(h));
  }

  static void tile_products(const uint16_t* window, const uint16_t* packed, int64_t NQ, float* result) {
    Tiles::template zero<0>();
    for (int64_t q = 0; q < NQ; ++q) {
      Tiles::template load<1>(window + 2 * q * C, C * sizeof(uint16_t));  // 64-byte rows, 32 apart
      Tiles::template load<2>(packed + q * T * 2 * C, kTileBytes);
      Tiles::template dot<0, 1, 2>();
    }
    Tiles::template store<0>(result, kTileBytes);
  }

  // Grad-weight tile products of one group over 32 positions: for each tap k,
  // C_k (16 j x 16 c, in the partial) += A (gout transposed) . B_k (input row pairs from
  // row k on: `even` rows (2m, 2m + 1) for even k, `odd` rows (2m + 1, 2m + 2) for odd k).
  static void grad_weight_products(const uint32_t* a, const uint32_t* even, const uint32_t* odd, int64_t K,
                                   float* partial) {
    Tiles::template load<1>(a, kTileBytes);
    for (int64_t k = 0; k < K; ++k) {
      float* c_k = partial + k * C * C;
      Tiles::template load<0>(c_k, kTileBytes);
      Tiles::template load<2>((k % 2 == 0 ? even : odd) + k / 2 * C, kTileBytes);
      Tiles::template dot<0, 1, 2>();
      Tiles::template store<0>(c_k, kTileBytes);
    }
  }

  // 16 x 16 transpose of 32-bit words (rows as vectors): four rounds that swap the
  // off-diagonal blocks of size 8, 4, 2, 1, each a two-source shuffle per row.
  template <int D, int... L>
  static Words mix_low(Words a, Words b, std::integer_sequence<int, L...>) {
    return __builtin_shufflevector(a, b, ((L & D) ? 16 + L - D : L)...);
  }
  template <int D, int... L>
  static Words mix_high(Words a, Words b, std::integer_sequence<int, L...>) {
    return __builtin_shufflevector(a, b, ((L & D) ? 16 + L : L + D)...);
  }
  template <int D>
  static void transpose_round(Words* rows) {
    for (int i = 0; i < 16; ++i)
      if (!(i & D)) {
        const Words a = rows[i], b = rows[i + D];
        rows[i] = mix_low<D>(a, b, std::make_integer_sequence<int, 16>{});
        rows[i + D] = mix_high<D>(a, b, std::make_integer_sequence<int, 16>{});
      }
  }
  static void transpose16(Words* rows) {
    transpose_round<8>(rows);
    transpose_round<4>(rows);
    transpose_round<2>(rows);
    transpose_round<1>(rows);
  }

  // The 32-bit word of each channel holding rows a (low half) and b (high half): a VNNI pair.
  static Words pair_rows(const uint16_t* a, const uint16_t* b) {
    Halves ha = {}, hb = {};
    if (a != nullptr) std::memcpy(&ha, a, sizeof(ha));
    if (b != nullptr) std::memcpy(&hb, b, sizeof(hb));
    return __builtin_convertvector(ha, Words) | (__builtin_convertvector(hb, Words) << 16);
  }

  // Scratch of the convolution: per group of a block, the window (T + 2 NQ - 1 rows of
  // 16 bf16) and the fp32 result tile.
  static int64_t conv_window_rows(int64_t K) { return T + 2 * ((K + 1) / 2) - 1; }
  static size_t conv_scratch(int64_t K) {
    return kGroupBlock * (conv_window_rows(K) * C * sizeof(uint16_t) + T * C * sizeof(float));
  }
  // Scratch of grad-weight: per group of a block, A (16 rows of 16 words) and the even
  // and odd pair rows (T + K / 2 each), then the 2 (T + K / 2) + 1 input row pointers.
  static int64_t grad_weight_pairs(int64_t K) { return T + K / 2; }
  static size_t grad_weight_scratch(int64_t K) {
    return kGroupBlock * (T + 2 * grad_weight_pairs(K)) * sizeof(Words) +
           (2 * grad_weight_pairs(K) + 1) * sizeof(const uint16_t*);
  }

  static size_t scratch_bytes(int64_t K) { return std::max(conv_scratch(K), grad_weight_scratch(K)) + 64; }

  // B tiles for every (group, tap pair): packed[((g * NQ + q) * 16 + i / 2) * 32 + j * 2 + i % 2].
  static void pack_weights(const uint16_t* weight, bool transposed, int64_t G, int64_t K, uint16_t* packed) {
    const int64_t NQ = (K + 1) / 2;
    std::memset(packed, 0, amx::packed_weight_elements(G, K) * sizeof(uint16_t));
    for (int64_t g = 0; g < G; ++g)
      for (int64_t q = 0; q < NQ; ++q)
        for (int64_t i = 0; i < 2 * C; ++i) {
          const int64_t k = 2 * q + i / C, c = i % C;
          if (k >= K) continue;
          for (int64_t j = 0; j < C; ++j) {
            packed[((g * NQ + q) * T + i / 2) * 2 * C + j * 2 + i % 2] =
                transposed ? weight[((g * C + c) * C + j) * K + (K - 1 - k)] : weight[((g * C + j) * C + c) * K + k];
          }
        }
  }

  static void conv_items(const ConvCall& call, int64_t begin, int64_t end, void* scratch) {
    const Shape& sh = call.shape;
    const int64_t S = sh.S, H = sh.H, K = sh.K, G = sh.G, P = sh.P, NQ = (K + 1) / 2;
    const int64_t window_rows = conv_window_rows(K);  // rows from T + K - 1 on meet zero weights, and are zeroed
    const auto* in = static_cast<const uint16_t*>(call.in);
    const auto* packed = static_cast<const uint16_t*>(call.weights);
    auto* out = static_cast<uint16_t*>(call.out);
    uint16_t* windows = static_cast<uint16_t*>(scratch);
    float* results = reinterpret_cast<float*>(windows + kGroupBlock * window_rows * C);
    const int64_t n_tiles = (S + T - 1) / T;
    Tiles::configure(amx::kTileConfig);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / n_tiles, s0 = (item % n_tiles) * T, rows = std::min(T, S - s0);
      const bool* in_mask = call.in_mask == nullptr ? nullptr : call.in_mask + b * S;
      const bool* out_mask = call.out_mask == nullptr ? nullptr : call.out_mask + b * S;
      const int64_t* ids = call.sequence_ids == nullptr ? nullptr : call.sequence_ids + b * S;
      // Rows written as zero: masked (grad-input) or padding between packed sequences.
      for (int64_t t = 0; t < rows; ++t)
        if (ids != nullptr ? ids[s0 + t] == 0 : out_mask != nullptr && !out_mask[s0 + t])
          std::memset(out + (b * S + s0 + t) * H, 0, H * sizeof(uint16_t));
      const Passes passes(ids == nullptr ? nullptr : ids + s0, rows);
      for (int p = 0; p < passes.count; ++p) {
        const int64_t id = passes.ids[p];
        for (int64_t g0 = 0; g0 < G; g0 += kGroupBlock) {
          const int64_t n_groups = std::min(kGroupBlock, G - g0);
          for (int64_t gi = 0; gi < n_groups; ++gi)
            for (int64_t r = 0; r < window_rows; ++r) {
              const int64_t s = s0 - P + r;
              const bool live = r < T + K - 1 && s >= 0 && s < S && Passes::live(in_mask, ids, id, s);
              uint16_t* dst = windows + (gi * window_rows + r) * C;
              if (live)
                std::memcpy(dst, in + (b * S + s) * H + (g0 + gi) * C, C * sizeof(uint16_t));
              else
                std::memset(dst, 0, C * sizeof(uint16_t));
            }
          for (int64_t gi = 0; gi < n_groups; ++gi)
            tile_products(windows + gi * window_rows * C, packed + (g0 + gi) * NQ * T * 2 * C, NQ,
                          results + gi * T * C);
          for (int64_t gi = 0; gi < n_groups; ++gi)
            for (int64_t t = 0; t < rows; ++t) {
              const bool write = ids != nullptr ? ids[s0 + t] == id : out_mask == nullptr || out_mask[s0 + t];
              if (write) store_bf16_row(out + (b * S + s0 + t) * H + (g0 + gi) * C, results + (gi * T + t) * C);
            }
        }
      }
    }
    Tiles::release();
  }

  // Grad-weight items are (batch row, 32 positions): one TDPBF16PS contracts 32 positions
  // in 16 pairs. Per group, A is gout transposed: row j holds the pairs (gout[2r][j],
  // gout[2r + 1][j]), i.e. the 16 x 16 transpose of the pair words; B_k is the VNNI
  // pairs of masked input rows from window row k on.
  static void grad_weight_items(const GradWeightCall& call, int64_t worker, int64_t begin, int64_t end,
                                void* scratch) {
    constexpr int64_t TW = amx::kGradWeightTileRows;
    const Shape& sh = call.shape;
    const int64_t S = sh.S, H = sh.H, K = sh.K, G = sh.G, P = sh.P;
    const int64_t n_pairs = grad_weight_pairs(K);  // rows of `even` and `odd` that taps reach
    const int64_t n_tiles = (S + TW - 1) / TW;
    const auto* gout_bits = static_cast<const uint16_t*>(call.gout);
    const auto* x_bits = static_cast<const uint16_t*>(call.x);
    // Per group of a block: A (16 words x 16 rows), then the even and odd pair rows.
    const int64_t block_words = (T + 2 * n_pairs) * C;
    Words* buffer = static_cast<Words*>(scratch);
    const uint16_t** x_rows = reinterpret_cast<const uint16_t**>(buffer + kGroupBlock * block_words / C);
    float* worker_partial = static_cast<float*>(call.partials) + worker * G * K * C * C;
    Tiles::configure(amx::kTileConfig);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / n_tiles, s0 = (item % n_tiles) * TW;
      const bool* mask = call.mask == nullptr ? nullptr : call.mask + b * S;
      const int64_t* ids = call.sequence_ids == nullptr ? nullptr : call.sequence_ids + b * S;
      const Passes passes(ids == nullptr ? nullptr : ids + s0, std::min(TW, S - s0));
      for (int p = 0; p < passes.count; ++p) {
        const int64_t id = passes.ids[p];
        // grad_out row s of this pass (nullptr: a zero row).
        auto gout_row = [&](int64_t s, int64_t offset) -> const uint16_t* {
          return s < S && (ids == nullptr || ids[s] == id) ? gout_bits + (b * S + s) * H + offset : nullptr;
        };
        for (int64_t g0 = 0; g0 < G; g0 += kGroupBlock) {
          const int64_t n_groups = std::min(kGroupBlock, G - g0);
          for (int64_t gi = 0; gi < n_groups; ++gi) {
            const int64_t offset = (g0 + gi) * C;
            Words* a = buffer + gi * block_words / C;
            for (int64_t r = 0; r < T; ++r)
              a[r] = pair_rows(gout_row(s0 + 2 * r, offset), gout_row(s0 + 2 * r + 1, offset));
            transpose16(a);
            for (int64_t r = 0; r < 2 * n_pairs + 1; ++r) {  // window row r: input row s0 - P + r
              const int64_t s = s0 - P + r;
              const bool live = r < TW + K - 1 && s >= 0 && s < S && Passes::live(mask, ids, id, s);
              x_rows[r] = live ? x_bits + (b * S + s) * H + offset : nullptr;
            }
            Words* even = a + T;
            Words* odd = even + n_pairs;
            for (int64_t m = 0; m < n_pairs; ++m) {
              even[m] = pair_rows(x_rows[2 * m], x_rows[2 * m + 1]);
              odd[m] = pair_rows(x_rows[2 * m + 1], x_rows[2 * m + 2]);
            }
          }
          for (int64_t gi = 0; gi < n_groups; ++gi) {
            const uint32_t* a = reinterpret_cast<const uint32_t*>(buffer + gi * block_words / C);
            grad_weight_products(a, a + T * C, a + (T + n_pairs) * C, K, worker_partial + (g0 + gi) * K * C * C);
          }
        }
      }
    }
    Tiles::release();
  }

  static const amx::TileKernels& table() {
    static const amx::TileKernels kernels{&pack_weights, &scratch_bytes, &conv_items, &grad_weight_items};
    return kernels;
  }
};

}  // namespace
}  // namespace groupbert::conv

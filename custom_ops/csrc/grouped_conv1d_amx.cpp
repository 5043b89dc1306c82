// GroupedConv1d on AMX tiles (Intel Sapphire Rapids and later), bf16, 16 channels per
// group. Letters as in grouped_conv1d.cpp: B batch, S sequence, H hidden, K kernel
// width (odd), P = K / 2, G = H / 16 groups.
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
// Work items are (batch row, tile of 16 positions), shared by parallel_chunks. Per item
// the groups go in blocks of 8: their windows are gathered (masked, zero outside [0, S)),
// then their tile products run and the results go to fp32 buffers, then those are
// rounded and stored. Batching keeps the tile loads away from the vector stores that
// wrote their data (a tile load right after them waited; 1.5x slower, prototype).
// Grad-weight contracts over positions instead: see grad_weight_bf16.
#include "grouped_conv1d_amx.h"

#include <ATen/Parallel.h>
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include "bf16_round.h"
#include "parallel.h"

namespace groupbert::amx {
namespace {

constexpr int64_t T = 16;           // positions per tile (tile rows)
constexpr int64_t kGroupBlock = 8;  // groups gathered before their products run
constexpr int kTileBytes = 64;      // bytes per tile row

// Linux: a process must ask for the AMX tile data state before using it.
constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;

bool cpu_and_os_support() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const bool amx_bf16 = edx & (1u << 22), amx_tile = edx & (1u << 24);
  if (!amx_bf16 || !amx_tile) return false;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

// Palette 1: tile 0 accumulates (16 rows of 16 fp32), tile 1 holds A, tile 2 holds B.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// GCC vector types: 16 lanes, so each op is one AVX-512 instruction.
typedef float Floats __attribute__((vector_size(64)));
typedef uint32_t Words __attribute__((vector_size(64)));
typedef uint16_t Halves __attribute__((vector_size(32)));

// One output row: 16 fp32 values rounded to bf16.
inline void store_bf16_row(uint16_t* dst, const float* src) {
  Floats v;
  std::memcpy(&v, src, sizeof(v));
  const Halves h = __builtin_convertvector(bf16_bits<Words>(v), Halves);
  std::memcpy(dst, &h, sizeof(h));
}

// B tiles for every (group, tap pair): packed[((g * NQ + q) * 16 + i / 2) * 32 + j * 2 + i % 2].
std::vector<uint16_t> pack_weights(const c10::BFloat16* weight, bool transposed, int64_t G, int64_t K, int64_t NQ) {
  constexpr int64_t C = kChannels;
  std::vector<uint16_t> packed(G * NQ * 2 * T * C, 0);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t q = 0; q < NQ; ++q)
      for (int64_t i = 0; i < 2 * C; ++i) {
        const int64_t k = 2 * q + i / C, c = i % C;
        if (k >= K) continue;
        for (int64_t j = 0; j < C; ++j) {
          const c10::BFloat16 w = transposed ? weight[((g * C + c) * C + j) * K + (K - 1 - k)]
                                             : weight[((g * C + j) * C + c) * K + k];
          packed[((g * NQ + q) * T + i / 2) * 2 * C + j * 2 + i % 2] = w.x;
        }
      }
  return packed;
}

__attribute__((target("amx-tile,amx-bf16"))) void tile_products(const uint16_t* window, const uint16_t* packed,
                                                                   int64_t NQ, float* result) {
  _tile_zero(0);
  for (int64_t q = 0; q < NQ; ++q) {
    _tile_loadd(1, window + 2 * q * kChannels, kChannels * sizeof(uint16_t));  // 64-byte rows, 32 apart
    _tile_loadd(2, packed + q * T * 2 * kChannels, kTileBytes);
    _tile_dpbf16ps(0, 1, 2);
  }
  _tile_stored(0, result, kTileBytes);
}

// Grad-weight tile products of one group over 32 positions: for each tap k,
// C_k (16 j x 16 c, in the partial) += A (gout transposed) . B_k (input row pairs from
// row k on: `even` rows (2m, 2m + 1) for even k, `odd` rows (2m + 1, 2m + 2) for odd k).
__attribute__((target("amx-tile,amx-bf16"))) void grad_weight_products(const uint32_t* a, const uint32_t* even,
                                                                          const uint32_t* odd, int64_t K,
                                                                          float* partial) {
  _tile_loadd(1, a, kTileBytes);
  for (int64_t k = 0; k < K; ++k) {
    float* c_k = partial + k * kChannels * kChannels;
    _tile_loadd(0, c_k, kTileBytes);
    _tile_loadd(2, (k % 2 == 0 ? even : odd) + k / 2 * kChannels, kTileBytes);
    _tile_dpbf16ps(0, 1, 2);
    _tile_stored(0, c_k, kTileBytes);
  }
}

// 16 x 16 transpose of 32-bit words (rows as vectors): four rounds that swap the
// off-diagonal blocks of size 8, 4, 2, 1, each a two-source shuffle per row.
template <int D, int... L>
inline Words mix_low(Words a, Words b, std::integer_sequence<int, L...>) {
  return __builtin_shufflevector(a, b, ((L & D) ? 16 + L - D : L)...);
}
template <int D, int... L>
inline Words mix_high(Words a, Words b, std::integer_sequence<int, L...>) {
  return __builtin_shufflevector(a, b, ((L & D) ? 16 + L : L + D)...);
}
template <int D>
inline void transpose_round(Words* rows) {
  for (int i = 0; i < 16; ++i)
    if (!(i & D)) {
      const Words a = rows[i], b = rows[i + D];
      rows[i] = mix_low<D>(a, b, std::make_integer_sequence<int, 16>{});
      rows[i + D] = mix_high<D>(a, b, std::make_integer_sequence<int, 16>{});
    }
}
inline void transpose16(Words* rows) {
  transpose_round<8>(rows);
  transpose_round<4>(rows);
  transpose_round<2>(rows);
  transpose_round<1>(rows);
}

// The 32-bit word of each channel holding rows a (low half) and b (high half): a VNNI pair.
inline Words pair_rows(const uint16_t* a, const uint16_t* b) {
  Halves ha = {}, hb = {};
  if (a != nullptr) std::memcpy(&ha, a, sizeof(ha));
  if (b != nullptr) std::memcpy(&hb, b, sizeof(hb));
  return __builtin_convertvector(ha, Words) | (__builtin_convertvector(hb, Words) << 16);
}

__attribute__((target("amx-tile"))) void load_tile_config() {
  TileConfig config;
  for (int tile = 0; tile < 3; ++tile) {
    config.bytes_per_row[tile] = kTileBytes;
    config.rows[tile] = T;
  }
  _tile_loadconfig(&config);
}

__attribute__((target("amx-tile"))) void release_tiles() { _tile_release(); }

}  // namespace

bool amx_usable() {
  static const bool supported = cpu_and_os_support();
  const char* env = std::getenv("GROUPBERT_AMX");
  return supported && !(env != nullptr && std::strcmp(env, "0") == 0);
}

void conv_bf16(const c10::BFloat16* in, const bool* in_mask, const bool* out_mask, const c10::BFloat16* weight,
               bool transposed, c10::BFloat16* out, int64_t B, int64_t S, int64_t H, int64_t K) {
  constexpr int64_t C = kChannels;
  const int64_t G = H / C, P = K / 2, NQ = (K + 1) / 2;
  const int64_t window_rows = T + 2 * NQ - 1;  // rows from T + K - 1 on meet zero weights, and are zeroed
  const std::vector<uint16_t> packed = pack_weights(weight, transposed, G, K, NQ);
  const int64_t n_tiles = (S + T - 1) / T, n_items = B * n_tiles;
  const int64_t n_workers = worker_count(n_items, G * T * C * C * K);
  parallel_chunks(n_items, n_workers, [&](int64_t, int64_t begin, int64_t end) {
    std::vector<uint16_t> windows(kGroupBlock * window_rows * C);
    std::vector<float> results(kGroupBlock * T * C);
    load_tile_config();
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / n_tiles, s0 = (item % n_tiles) * T, rows = std::min(T, S - s0);
      for (int64_t g0 = 0; g0 < G; g0 += kGroupBlock) {
        const int64_t n_groups = std::min(kGroupBlock, G - g0);
        for (int64_t gi = 0; gi < n_groups; ++gi)
          for (int64_t r = 0; r < window_rows; ++r) {
            const int64_t s = s0 - P + r;
            const bool live = r < T + K - 1 && s >= 0 && s < S && (in_mask == nullptr || in_mask[b * S + s]);
            uint16_t* dst = windows.data() + (gi * window_rows + r) * C;
            if (live)
              std::memcpy(dst, in + (b * S + s) * H + (g0 + gi) * C, C * sizeof(uint16_t));
            else
              std::memset(dst, 0, C * sizeof(uint16_t));
          }
        for (int64_t gi = 0; gi < n_groups; ++gi)
          tile_products(windows.data() + gi * window_rows * C, packed.data() + (g0 + gi) * NQ * T * 2 * C, NQ,
                        results.data() + gi * T * C);
        for (int64_t gi = 0; gi < n_groups; ++gi)
          for (int64_t t = 0; t < rows; ++t) {
            const bool live = out_mask == nullptr || out_mask[b * S + s0 + t];
            uint16_t* dst = reinterpret_cast<uint16_t*>(out + (b * S + s0 + t) * H + (g0 + gi) * C);
            if (live)
              store_bf16_row(dst, results.data() + (gi * T + t) * C);
            else
              std::memset(dst, 0, C * sizeof(uint16_t));
          }
      }
    }
    release_tiles();
  });
}

// Grad-weight items are (batch row, 32 positions): one TDPBF16PS contracts 32 positions
// in 16 pairs. Per group, A is gout transposed: row j holds the pairs (gout[2r][j],
// gout[2r + 1][j]), i.e. the 16 x 16 transpose of the pair words; B_k is the VNNI
// pairs of masked input rows from window row k on.
void grad_weight_bf16(const c10::BFloat16* gout, const c10::BFloat16* x, const bool* mask, float* partial,
                      int64_t n_workers, int64_t B, int64_t S, int64_t H, int64_t K) {
  constexpr int64_t C = kChannels, TW = 2 * T;  // positions per item
  const int64_t G = H / C, P = K / 2;
  const int64_t n_pairs = T + K / 2;  // rows of `even` and `odd` that taps reach
  const int64_t n_tiles = (S + TW - 1) / TW, n_items = B * n_tiles;
  const uint16_t* gout_bits = reinterpret_cast<const uint16_t*>(gout);
  const uint16_t* x_bits = reinterpret_cast<const uint16_t*>(x);
  parallel_chunks(n_items, n_workers, [&](int64_t worker, int64_t begin, int64_t end) {
    // Per group of a block: A (16 words x 16 rows), then the even and odd pair rows.
    const int64_t block_words = (T + 2 * n_pairs) * C;
    std::vector<Words> buffer(kGroupBlock * block_words / C);
    std::vector<const uint16_t*> x_rows(2 * n_pairs + 1);
    float* worker_partial = partial + worker * G * K * C * C;
    load_tile_config();
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / n_tiles, s0 = (item % n_tiles) * TW;
      for (int64_t g0 = 0; g0 < G; g0 += kGroupBlock) {
        const int64_t n_groups = std::min(kGroupBlock, G - g0);
        for (int64_t gi = 0; gi < n_groups; ++gi) {
          const int64_t offset = (g0 + gi) * C;
          Words* a = buffer.data() + gi * block_words / C;
          for (int64_t r = 0; r < T; ++r) {
            const int64_t s = s0 + 2 * r;
            a[r] = pair_rows(s < S ? gout_bits + (b * S + s) * H + offset : nullptr,
                             s + 1 < S ? gout_bits + (b * S + s + 1) * H + offset : nullptr);
          }
          transpose16(a);
          for (int64_t r = 0; r < 2 * n_pairs + 1; ++r) {  // window row r: input row s0 - P + r
            const int64_t s = s0 - P + r;
            const bool live = r < TW + K - 1 && s >= 0 && s < S && (mask == nullptr || mask[b * S + s]);
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
          const uint32_t* a = reinterpret_cast<const uint32_t*>(buffer.data() + gi * block_words / C);
          grad_weight_products(a, a + T * C, a + (T + n_pairs) * C, K, worker_partial + (g0 + gi) * K * C * C);
        }
      }
    }
    release_tiles();
  });
}

}  // namespace groupbert::amx

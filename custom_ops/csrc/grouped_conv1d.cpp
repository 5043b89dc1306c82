// GroupedConv1d: the grouped 1-D convolution over the sequence of GroupBERT's
// convolution module (GroupBERT paper, section 3.2: kernel 7, 16 channels per group,
// "same" zero padding), on channels-last activations, with an optional padding mask.
//
// Letters: B batch, S sequence, H hidden, G = H / C groups, C channels per group,
// K kernel width (odd), P = K / 2 padding each side.
//
//   x      (B, S, H)  contiguous, channels-last (what the dense layers produce)
//   weight (H, C, K)  exactly torch.nn.functional.conv1d's weight with groups = G
//   mask   (B, S)     optional, bool or x's dtype with values 0/1
//   out    (B, S, H)  out[b, s, g*C + j] = sum_k sum_c weight[g*C + j, c, k]
//                                                    * xm[b, s + k - P, g*C + c]
// where xm = x * mask[..., None], zero outside [0, S). No bias: the graph adds it.
//
// CPU kernels: one output row of a group is C lanes (16 fp32 = one AVX-512 register).
// A work item is a tile of T sequence positions of one batch row; for each group in
// turn its input window (T + K - 1 rows of C channels) is gathered, masked and
// converted to the accumulation type, and T output rows accumulate in registers.
// For K = 7 the
// taps are unrolled "input-stationary": channel c's K weight vectors sit in registers
// and each input value is broadcast once for the K outputs it feeds (22 broadcasts
// per 112 FMAs instead of 112; 15% faster). Other K loop over (k, c), loading each
// weight vector once per tile. Threads take chunks of (batch, tile) items, so x is read
// row by row (contiguous H) and the packed weights (G*K*C vectors, 344 KiB at
// GroupBERT base) stay in L2; group-major order read x with an H-element stride
// and ran 1.5x slower.
// C is rounded up to a lane count CP in {4, 8, 16, 32, 64}; padded lanes hold zero
// weights and are never stored. bf16 is widened to fp32 on load: an AVX512-BF16
// (vdpbf16ps) variant measured slower on the development CPU (docs/custom_ops.md).
// bf16 with C = 16 runs all three passes on AMX tiles where the CPU has them
// (grouped_conv1d_amx.cpp).
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

#ifdef GROUPBERT_WITH_CUDA
// c10's stream header is what at::cuda::getCurrentCUDAStream forwards to, without
// pulling in the cuBLAS/cuSPARSE headers of ATen/cuda/CUDAContext.h.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "grouped_conv1d_cuda.h"
#endif

#include "bf16_round.h"
#include "grouped_conv1d_amx.h"
#include "parallel.h"

namespace groupbert {
namespace {

constexpr int64_t kMaxChannelsPerGroup = 64;

// ---------------------------------------------------------------------------------
// Input checks (shared by the CPU and CUDA kernels).
// ---------------------------------------------------------------------------------

struct ConvShape {
  int64_t B, S, H, C, K, G, P;
};

ConvShape check_inputs(const char* op, const at::Tensor& x, const at::Tensor& weight,
                       const std::optional<at::Tensor>& mask) {
  TORCH_CHECK(x.dim() == 3, op, ": x must be (B, S, H), got shape ", x.sizes(),
              " (weight ", weight.sizes(), ")");
  TORCH_CHECK(weight.dim() == 3, op, ": weight must be (H, C, K) like conv1d's, got shape ",
              weight.sizes(), " for x ", x.sizes());
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kBFloat16, op,
              ": x must be float32, float64 or bfloat16, got ", dtype, " (x ", x.sizes(), ")");
  TORCH_CHECK(weight.scalar_type() == dtype, op, ": weight dtype ", weight.scalar_type(),
              " differs from x dtype ", dtype, " (weight ", weight.sizes(), ", x ", x.sizes(), ")");
  TORCH_CHECK(weight.device() == x.device(), op, ": weight is on ", weight.device(),
              " but x is on ", x.device());
  ConvShape s{};
  s.B = x.size(0);
  s.S = x.size(1);
  s.H = x.size(2);
  s.C = weight.size(1);
  s.K = weight.size(2);
  TORCH_CHECK(weight.size(0) == s.H, op, ": weight ", weight.sizes(),
              " must have H = x.size(2) output channels, x is ", x.sizes());
  TORCH_CHECK(s.C >= 1 && s.H % s.C == 0, op, ": channels per group C = weight.size(1) must divide H; weight ",
              weight.sizes(), ", x ", x.sizes());
  TORCH_CHECK(s.C <= kMaxChannelsPerGroup, op, ": at most ", kMaxChannelsPerGroup,
              " channels per group are supported; weight ", weight.sizes(), ", x ", x.sizes());
  TORCH_CHECK(s.K >= 1 && s.K % 2 == 1, op, ": kernel width K = weight.size(2) must be odd for "
              "'same' padding; weight ", weight.sizes(), ", x ", x.sizes());
  s.G = s.H / s.C;
  s.P = s.K / 2;
  if (mask.has_value()) {
    const auto& m = *mask;
    TORCH_CHECK(m.dim() == 2 && m.size(0) == s.B && m.size(1) == s.S, op, ": mask must be (B, S) = (",
                s.B, ", ", s.S, "), got shape ", m.sizes(), " for x ", x.sizes());
    TORCH_CHECK(m.scalar_type() == at::kBool || m.scalar_type() == dtype, op,
                ": mask must be bool or x's dtype ", dtype, ", got ", m.scalar_type(), " (mask ",
                m.sizes(), ", x ", x.sizes(), ")");
    TORCH_CHECK(m.device() == x.device(), op, ": mask is on ", m.device(), " but x is on ", x.device());
  }
  return s;
}

// The mask as a contiguous bool tensor (undefined when absent): values are 0/1.
at::Tensor bool_mask(const std::optional<at::Tensor>& mask) {
  if (!mask.has_value()) return at::Tensor();
  if (mask->scalar_type() == at::kBool) return mask->contiguous();
  return mask->ne(0).contiguous();
}

// ---------------------------------------------------------------------------------
// CPU kernels.
// ---------------------------------------------------------------------------------

// CP lanes of acc_t as one GCC/Clang vector: with -march=native on AVX-512 a
// 16 x fp32 vector is one zmm register and `acc += w * scalar` one broadcast FMA.
template <typename acc_t, int CP>
struct Lanes {
  typedef acc_t type __attribute__((vector_size(CP * sizeof(acc_t))));
};

// Sequence positions per tile: 16 accumulators of 64 bytes fill half the AVX-512
// register file, leaving room for K = 7 weight vectors and the broadcast operand
// (20 rows measured slower: spills, and S = 128 wastes a partial tile).
template <typename acc_t, int CP>
constexpr int64_t tile_rows() {
  constexpr int64_t t = 1024 / (CP * static_cast<int64_t>(sizeof(acc_t)));
  return t < 4 ? 4 : (t > 16 ? 16 : t);
}

// Loads n <= CP channels, zero-filling the rest; converts bf16 to fp32 exactly.
template <typename acc_t, int CP, typename scalar_t>
inline typename Lanes<acc_t, CP>::type load_lanes(const scalar_t* src, int64_t n) {
  using V = typename Lanes<acc_t, CP>::type;
  if (n == CP) {
    if constexpr (std::is_same_v<scalar_t, acc_t>) {
      V v;
      std::memcpy(&v, src, sizeof(V));
      return v;
    } else if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
      static_assert(std::is_same_v<acc_t, float>, "bf16 accumulates in fp32");
      using U16 = typename Lanes<uint16_t, CP>::type;
      using U32 = typename Lanes<uint32_t, CP>::type;
      U16 h;
      std::memcpy(&h, src, sizeof(U16));
      U32 w = __builtin_convertvector(h, U32) << 16;  // bf16 is the top half of fp32
      V v;
      std::memcpy(&v, &w, sizeof(V));
      return v;
    }
  }
  V v = {};
  for (int64_t i = 0; i < n; ++i) v[i] = static_cast<acc_t>(src[i]);
  return v;
}

// Stores the first n lanes; fp32 -> bf16 rounds to nearest even (NaN stays NaN),
// matching c10::BFloat16's conversion.
template <typename acc_t, int CP, typename scalar_t>
inline void store_lanes(scalar_t* dst, const typename Lanes<acc_t, CP>::type& v, int64_t n) {
  using V = typename Lanes<acc_t, CP>::type;
  if (n == CP) {
    if constexpr (std::is_same_v<scalar_t, acc_t>) {
      std::memcpy(dst, &v, sizeof(V));
      return;
    } else if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
      using U16 = typename Lanes<uint16_t, CP>::type;
      using U32 = typename Lanes<uint32_t, CP>::type;
      const U16 h = __builtin_convertvector(bf16_bits<U32>(v), U16);
      std::memcpy(dst, &h, sizeof(U16));
      return;
    }
  }
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<scalar_t>(v[i]);
}

// Work items are tiles of rows, and each runs the G groups in turn, reading one line
// per row per group: H apart, beyond the hardware prefetchers' reach. While group g
// runs, this prefetches group g's lines of the n flat rows from `first` (clamped to
// the tensor): the rows the next tile will read.
template <typename scalar_t>
inline void prefetch_rows(const scalar_t* t, int64_t first, int64_t n, int64_t g, const ConvShape& sh) {
  const int64_t end = std::min(sh.B * sh.S, first + n);
  for (int64_t row = first; row < end; ++row) __builtin_prefetch(t + row * sh.H + g * sh.C);
}

// out = conv(in masked by in_mask) with packed weights, then rows zeroed by out_mask.
// wpk: (G, K, C, CP) vectors, wpk[g][k][c] = the CP output lanes fed by input channel c
// at tap k. Serves the forward pass and, with flipped transposed weights, grad-input.
template <typename scalar_t, typename acc_t, int CP, int KT>
void conv_cl_kernel(const scalar_t* in, const bool* in_mask, const bool* out_mask,
                    const typename Lanes<acc_t, CP>::type* wpk, scalar_t* out,
                    const ConvShape& sh) {
  using V = typename Lanes<acc_t, CP>::type;
  constexpr int64_t T = tile_rows<acc_t, CP>();
  const int64_t B = sh.B, S = sh.S, H = sh.H, C = sh.C, K = sh.K, P = sh.P, G = sh.G;
  const int64_t n_tiles = (S + T - 1) / T, n_items = B * n_tiles;
  const int64_t n_workers = worker_count(n_items, G * T * C * CP * K);
  parallel_chunks(n_items, n_workers, [=, &sh](int64_t, int64_t begin, int64_t end) {
    std::vector<V> window(T + K - 1);  // (T + K - 1) input rows of one group, masked
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / n_tiles, s0 = (item % n_tiles) * T;
      const int64_t rows = std::min(T, S - s0);
      bool all_live = rows == T;
      if (all_live && out_mask != nullptr)
        for (int64_t s = s0; s < s0 + T; ++s) all_live = all_live && out_mask[b * S + s];
      for (int64_t g = 0; g < G; ++g) {
        for (int64_t r = 0; r < T + K - 1; ++r) {
          const int64_t s = s0 - P + r;
          const bool live = s >= 0 && s < S && (in_mask == nullptr || in_mask[b * S + s]);
          window[r] = live ? load_lanes<acc_t, CP>(in + (b * S + s) * H + g * C, C) : V{};
        }
        prefetch_rows(in, b * S + s0 + T + P, T, g, sh);  // the rows the next tile adds
        V acc[T] = {};
        const V* wg = wpk + g * K * C;
        if constexpr (KT > 0) {
          // Input-stationary: each input value x[r][c] is broadcast once and feeds the
          // K outputs r - k it touches, with channel c's K weight vectors in registers.
          for (int64_t c = 0; c < C; ++c) {
            V w[KT];
#pragma GCC unroll 16
            for (int64_t k = 0; k < KT; ++k) w[k] = wg[k * C + c];
            const acc_t* xc = reinterpret_cast<const acc_t*>(window.data()) + c;
#pragma GCC unroll 32
            for (int64_t r = 0; r < T + KT - 1; ++r) {
              const acc_t xv = xc[r * CP];
#pragma GCC unroll 16
              for (int64_t k = 0; k < KT; ++k)
                if (r - k >= 0 && r - k < T) acc[r - k] += w[k] * xv;
            }
          }
        } else {
          for (int64_t k = 0; k < K; ++k) {
            for (int64_t c = 0; c < C; ++c) {
              const V w = wg[k * C + c];
              const acc_t* xc = reinterpret_cast<const acc_t*>(window.data() + k) + c;
#pragma GCC unroll 16
              for (int64_t t = 0; t < T; ++t) acc[t] += w * xc[t * CP];
            }
          }
        }
        scalar_t* og = out + (b * S + s0) * H + g * C;
        if (all_live) {
#pragma GCC unroll 16
          for (int64_t t = 0; t < T; ++t) store_lanes<acc_t, CP>(og + t * H, acc[t], C);
        } else {
          for (int64_t t = 0; t < rows; ++t) {
            const bool live = out_mask == nullptr || out_mask[b * S + s0 + t];
            store_lanes<acc_t, CP>(og + t * H, live ? acc[t] : V{}, C);
          }
        }
      }
    }
  });
}

// gw(G, K, CP, CP) = sum over (b, s) of gout[b, s, g-lanes] * xm[b, s + k - P, g*C + c].
// Each of the n_workers workers adds its (b, tile) items into its own zeroed partial
// buffer for every group (G*K*CP vectors, 344 KiB at GroupBERT base: L2 resident), so
// no two threads write the same memory; the caller sums the partials.
template <typename scalar_t, typename acc_t, int CP, int KT>
void grad_weight_kernel(const scalar_t* gout, const scalar_t* x, const bool* in_mask,
                        typename Lanes<acc_t, CP>::type* gw_partial, int64_t n_workers,
                        const ConvShape& sh) {
  using V = typename Lanes<acc_t, CP>::type;
  constexpr int64_t T = tile_rows<acc_t, CP>();
  constexpr int64_t CB = CP < 8 ? CP : 8;  // independent FMA chains per (k, c) block
  const int64_t B = sh.B, S = sh.S, H = sh.H, C = sh.C, K = sh.K, P = sh.P, G = sh.G;
  const int64_t n_tiles = (S + T - 1) / T, n_items = B * n_tiles;
  parallel_chunks(n_items, n_workers, [=, &sh](int64_t worker, int64_t begin, int64_t end) {
    std::vector<V> window(T + K - 1);
    {
      V* gw_split = gw_partial + worker * G * K * CP;
      for (int64_t item = begin; item < end; ++item) {
        const int64_t b = item / n_tiles, s0 = (item % n_tiles) * T;
        for (int64_t g = 0; g < G; ++g) {
          for (int64_t r = 0; r < T + K - 1; ++r) {
            const int64_t s = s0 - P + r;
            const bool live = s >= 0 && s < S && (in_mask == nullptr || in_mask[b * S + s]);
            window[r] = live ? load_lanes<acc_t, CP>(x + (b * S + s) * H + g * C, C) : V{};
          }
          prefetch_rows(x, b * S + s0 + T + P, T, g, sh);
          prefetch_rows(gout, b * S + s0 + T, T, g, sh);
          V go[T];
          for (int64_t t = 0; t < T; ++t)
            go[t] = s0 + t < S ? load_lanes<acc_t, CP>(gout + (b * S + s0 + t) * H + g * C, C) : V{};
          V* gw = gw_split + g * K * CP;
          if constexpr (KT > 0) {
            // Input-stationary, as in conv_cl_kernel: x[r][c] is broadcast once and
            // feeds the K taps k (output rows r - k), one accumulator per tap.
            for (int64_t c = 0; c < C; ++c) {
              V a[KT] = {};
              const acc_t* xc = reinterpret_cast<const acc_t*>(window.data()) + c;
#pragma GCC unroll 32
              for (int64_t r = 0; r < T + KT - 1; ++r) {
                const acc_t xv = xc[r * CP];
#pragma GCC unroll 16
                for (int64_t k = 0; k < KT; ++k)
                  if (r - k >= 0 && r - k < T) a[k] += go[r - k] * xv;
              }
#pragma GCC unroll 16
              for (int64_t k = 0; k < KT; ++k) gw[k * CP + c] += a[k];
            }
          } else {
            for (int64_t k = 0; k < K; ++k) {
              // Padded channels c >= C read zero lanes of the window: harmless.
              for (int64_t c0 = 0; c0 < CP; c0 += CB) {
                V a[CB] = {};
                const acc_t* xc = reinterpret_cast<const acc_t*>(window.data() + k) + c0;
#pragma GCC unroll 16
                for (int64_t t = 0; t < T; ++t) {
#pragma GCC unroll 8
                  for (int64_t i = 0; i < CB; ++i) a[i] += go[t] * xc[t * CP + i];
                }
#pragma GCC unroll 8
                for (int64_t i = 0; i < CB; ++i) gw[k * CP + c0 + i] += a[i];
              }
            }
          }
        }
      }
    }
  });
}

// Packed weights for conv_cl_kernel. Forward: wpk[g][k][c][j] = weight[g*C + j][c][k].
// Grad-input, grad_x[s, g*C + c] = sum_k sum_j weight[g*C + j, c, k] * gout[s + P - k, g*C + j],
// is the forward kernel on gout with the weight transposed within each group and
// flipped along K: wpk[g][K-1-k][j][c] = weight[g*C + j][c][k].
template <typename scalar_t, typename acc_t, int CP>
std::vector<typename Lanes<acc_t, CP>::type> pack_weights(const scalar_t* w, const ConvShape& sh, bool grad_input) {
  // A vector of V, not of acc_t: the kernels load whole aligned V's from it.
  std::vector<typename Lanes<acc_t, CP>::type> packed(sh.G * sh.K * sh.C);
  acc_t* p = reinterpret_cast<acc_t*>(packed.data());
  for (int64_t g = 0; g < sh.G; ++g)
    for (int64_t j = 0; j < sh.C; ++j)
      for (int64_t c = 0; c < sh.C; ++c)
        for (int64_t k = 0; k < sh.K; ++k) {
          const int64_t at = grad_input ? ((g * sh.K + (sh.K - 1 - k)) * sh.C + j) * CP + c
                                        : ((g * sh.K + k) * sh.C + c) * CP + j;
          p[at] = static_cast<acc_t>(w[((g * sh.C + j) * sh.C + c) * sh.K + k]);
        }
  return packed;
}

template <typename scalar_t>
using acc_type = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

// Calls f(std::integral_constant<int, KT>) with KT = K for GroupBERT's K = 7, whose
// kernels are unrolled over the taps, and KT = 0 (taps in a runtime loop) otherwise.
template <typename F>
void with_kernel_width(int64_t K, F&& f) {
  if (K == 7) return f(std::integral_constant<int, 7>{});
  return f(std::integral_constant<int, 0>{});
}

// Calls f(std::integral_constant<int, CP>) for the lane count CP that holds C channels.
template <typename F>
void dispatch_lanes(int64_t C, F&& f) {
  if (C <= 4) return f(std::integral_constant<int, 4>{});
  if (C <= 8) return f(std::integral_constant<int, 8>{});
  if (C <= 16) return f(std::integral_constant<int, 16>{});
  if (C <= 32) return f(std::integral_constant<int, 32>{});
  return f(std::integral_constant<int, 64>{});
}

// bf16 with 16 channels per group (GroupBERT's) runs on AMX tiles where the CPU has them
// (grouped_conv1d_amx.cpp): 1.5x to 2x the AVX-512 kernels there.
bool uses_amx(const at::Tensor& x, const ConvShape& sh) {
  return x.scalar_type() == at::kBFloat16 && sh.C == amx::kChannels && amx::amx_usable();
}

at::Tensor grouped_conv1d_cpu(const at::Tensor& x_in, const at::Tensor& weight_in,
                              const std::optional<at::Tensor>& mask) {
  const ConvShape sh = check_inputs("grouped_conv1d", x_in, weight_in, mask);
  const at::Tensor x = x_in.contiguous(), weight = weight_in.contiguous(), m = bool_mask(mask);
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  if (out.numel() == 0) return out;
  const bool* mp = m.defined() ? m.const_data_ptr<bool>() : nullptr;
  if (uses_amx(x, sh)) {
    amx::conv_bf16(x.const_data_ptr<c10::BFloat16>(), mp, nullptr, weight.const_data_ptr<c10::BFloat16>(),
                   /*transposed=*/false, out.mutable_data_ptr<c10::BFloat16>(), sh.B, sh.S, sh.H, sh.K);
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "grouped_conv1d", [&] {
    using acc_t = acc_type<scalar_t>;
    dispatch_lanes(sh.C, [&](auto lanes) {
      constexpr int CP = decltype(lanes)::value;
      const auto wpk = pack_weights<scalar_t, acc_t, CP>(weight.const_data_ptr<scalar_t>(), sh, /*grad_input=*/false);
      with_kernel_width(sh.K, [&](auto kt) {
        conv_cl_kernel<scalar_t, acc_t, CP, decltype(kt)::value>(
            x.const_data_ptr<scalar_t>(), mp, nullptr, wpk.data(), out.mutable_data_ptr<scalar_t>(), sh);
      });
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> grouped_conv1d_backward_cpu(
    const at::Tensor& grad_out_in, const at::Tensor& x_in, const at::Tensor& weight_in,
    const std::optional<at::Tensor>& mask, std::array<bool, 2> output_mask) {
  const ConvShape sh = check_inputs("grouped_conv1d_backward", x_in, weight_in, mask);
  TORCH_CHECK(grad_out_in.sizes() == x_in.sizes() && grad_out_in.scalar_type() == x_in.scalar_type(),
              "grouped_conv1d_backward: grad_out ", grad_out_in.sizes(), " ", grad_out_in.scalar_type(),
              " must match x ", x_in.sizes(), " ", x_in.scalar_type());
  const at::Tensor gout = grad_out_in.contiguous(), x = x_in.contiguous(),
                   weight = weight_in.contiguous(), m = bool_mask(mask);
  const bool* mp = m.defined() ? m.const_data_ptr<bool>() : nullptr;
  at::Tensor grad_x, grad_w;
  if (output_mask[0]) grad_x = at::empty_like(x, at::MemoryFormat::Contiguous);
  if (output_mask[1]) grad_w = at::empty_like(weight, at::MemoryFormat::Contiguous);
  // grad-weight partials: one per worker (per thread, or one when the work is small).
  const int64_t n_split = worker_count(sh.B * sh.S, sh.H * sh.C * sh.K);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "grouped_conv1d_backward", [&] {
    using acc_t = acc_type<scalar_t>;
    dispatch_lanes(sh.C, [&](auto lanes) {
      constexpr int CP = decltype(lanes)::value;
      if (grad_x.defined() && grad_x.numel() > 0 && uses_amx(x, sh)) {
        amx::conv_bf16(gout.const_data_ptr<c10::BFloat16>(), nullptr, mp, weight.const_data_ptr<c10::BFloat16>(),
                       /*transposed=*/true, grad_x.mutable_data_ptr<c10::BFloat16>(), sh.B, sh.S, sh.H, sh.K);
      } else if (grad_x.defined() && grad_x.numel() > 0) {
        const auto wpk = pack_weights<scalar_t, acc_t, CP>(weight.const_data_ptr<scalar_t>(), sh, /*grad_input=*/true);
        with_kernel_width(sh.K, [&](auto kt) {
          conv_cl_kernel<scalar_t, acc_t, CP, decltype(kt)::value>(
              gout.const_data_ptr<scalar_t>(), nullptr, mp, wpk.data(), grad_x.mutable_data_ptr<scalar_t>(), sh);
        });
      }
      if (grad_w.defined()) {
        // (n_split, G, K, CP, CP) partials, zeroed here; fp32 for bf16 (acc_t).
        std::vector<typename Lanes<acc_t, CP>::type> partial(n_split * sh.G * sh.K * CP);
        const bool amx = uses_amx(x, sh);  // its partials hold [j][c], not [c][j]
        if (x.numel() > 0 && amx)
          amx::grad_weight_bf16(gout.const_data_ptr<c10::BFloat16>(), x.const_data_ptr<c10::BFloat16>(), mp,
                                reinterpret_cast<float*>(partial.data()), n_split, sh.B, sh.S, sh.H, sh.K);
        else if (x.numel() > 0)
          with_kernel_width(sh.K, [&](auto kt) {
            grad_weight_kernel<scalar_t, acc_t, CP, decltype(kt)::value>(
                gout.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(), mp, partial.data(), n_split, sh);
          });
        scalar_t* gw = grad_w.mutable_data_ptr<scalar_t>();
        for (int64_t g = 0; g < sh.G; ++g)
          for (int64_t j = 0; j < sh.C; ++j)
            for (int64_t c = 0; c < sh.C; ++c)
              for (int64_t k = 0; k < sh.K; ++k) {
                acc_t sum = 0;
                for (int64_t split = 0; split < n_split; ++split)
                  sum += amx ? partial[((split * sh.G + g) * sh.K + k) * CP + j][c]
                             : partial[((split * sh.G + g) * sh.K + k) * CP + c][j];
                gw[((g * sh.C + j) * sh.C + c) * sh.K + k] = static_cast<scalar_t>(sum);
              }
      }
    });
  });
  return {grad_x, grad_w};
}

#ifdef GROUPBERT_WITH_CUDA
// ---------------------------------------------------------------------------------
// CUDA: the kernels live in grouped_conv1d_cuda.cu behind raw-pointer launchers.
// ---------------------------------------------------------------------------------

cuda_ops::ConvDims cuda_dims(const ConvShape& sh) { return cuda_ops::ConvDims{sh.B, sh.S, sh.H, sh.C, sh.K}; }

bool is_bf16(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16; }

at::Tensor grouped_conv1d_cuda(const at::Tensor& x_in, const at::Tensor& weight_in,
                               const std::optional<at::Tensor>& mask) {
  const ConvShape sh = check_inputs("grouped_conv1d", x_in, weight_in, mask);
  TORCH_CHECK(x_in.scalar_type() != at::kDouble, "grouped_conv1d: the CUDA kernel takes float32 or bfloat16");
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous(), weight = weight_in.contiguous(), m = bool_mask(mask);
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  if (out.numel() == 0) return out;
  const bool* mp = m.defined() ? m.const_data_ptr<bool>() : nullptr;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (is_bf16(x)) {
    C10_CUDA_CHECK(cuda_ops::grouped_conv1d_forward_bf16(x.const_data_ptr(), weight.const_data_ptr(), mp,
                                                         out.mutable_data_ptr(), cuda_dims(sh), stream));
  } else {
    C10_CUDA_CHECK(cuda_ops::grouped_conv1d_forward_f32(x.const_data_ptr<float>(), weight.const_data_ptr<float>(),
                                                        mp, out.mutable_data_ptr<float>(), cuda_dims(sh), stream));
  }
  return out;
}

std::tuple<at::Tensor, at::Tensor> grouped_conv1d_backward_cuda(
    const at::Tensor& grad_out_in, const at::Tensor& x_in, const at::Tensor& weight_in,
    const std::optional<at::Tensor>& mask, std::array<bool, 2> output_mask) {
  const ConvShape sh = check_inputs("grouped_conv1d_backward", x_in, weight_in, mask);
  TORCH_CHECK(x_in.scalar_type() != at::kDouble,
              "grouped_conv1d_backward: the CUDA kernel takes float32 or bfloat16");
  TORCH_CHECK(grad_out_in.sizes() == x_in.sizes() && grad_out_in.scalar_type() == x_in.scalar_type(),
              "grouped_conv1d_backward: grad_out ", grad_out_in.sizes(), " ", grad_out_in.scalar_type(),
              " must match x ", x_in.sizes(), " ", x_in.scalar_type());
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor gout = grad_out_in.contiguous(), x = x_in.contiguous(),
                   weight = weight_in.contiguous(), m = bool_mask(mask);
  const bool* mp = m.defined() ? m.const_data_ptr<bool>() : nullptr;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const auto dims = cuda_dims(sh);
  at::Tensor grad_x, grad_w;
  if (output_mask[0]) {
    grad_x = at::empty_like(x, at::MemoryFormat::Contiguous);
    if (grad_x.numel() > 0 && is_bf16(x)) {
      C10_CUDA_CHECK(cuda_ops::grouped_conv1d_grad_input_bf16(gout.const_data_ptr(), weight.const_data_ptr(), mp,
                                                              grad_x.mutable_data_ptr(), dims, stream));
    } else if (grad_x.numel() > 0) {
      C10_CUDA_CHECK(cuda_ops::grouped_conv1d_grad_input_f32(gout.const_data_ptr<float>(),
                                                             weight.const_data_ptr<float>(), mp,
                                                             grad_x.mutable_data_ptr<float>(), dims, stream));
    }
  }
  if (output_mask[1]) {
    // fp32 accumulation buffer, cast to the weight dtype at the end.
    at::Tensor gw32 = at::zeros(weight.sizes(), weight.options().dtype(at::kFloat));
    if (x.numel() > 0 && is_bf16(x)) {
      C10_CUDA_CHECK(cuda_ops::grouped_conv1d_grad_weight_bf16(gout.const_data_ptr(), x.const_data_ptr(), mp,
                                                               gw32.mutable_data_ptr<float>(), dims, stream));
    } else if (x.numel() > 0) {
      C10_CUDA_CHECK(cuda_ops::grouped_conv1d_grad_weight_f32(gout.const_data_ptr<float>(), x.const_data_ptr<float>(),
                                                              mp, gw32.mutable_data_ptr<float>(), dims, stream));
    }
    grad_w = gw32.to(weight.scalar_type());
  }
  return {grad_x, grad_w};
}
#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(groupbert, m) {
  // Autograd and fake kernels are registered from Python; torch imports this module
  // to find them when the op is traced before anyone imported it.
  m.set_python_module("custom_ops.grouped_conv1d");
  m.def("grouped_conv1d(Tensor x, Tensor weight, Tensor? mask=None) -> Tensor");
  m.def(
      "grouped_conv1d_backward(Tensor grad_out, Tensor x, Tensor weight, Tensor? mask, "
      "bool[2] output_mask) -> (Tensor, Tensor)");
  // Whether bf16 calls with 16 channels per group run on AMX tiles now.
  m.def("grouped_conv1d_amx_usable() -> bool", [] { return amx::amx_usable(); });
}

TORCH_LIBRARY_IMPL(groupbert, CPU, m) {
  m.impl("grouped_conv1d", &grouped_conv1d_cpu);
  m.impl("grouped_conv1d_backward", &grouped_conv1d_backward_cpu);
}

#ifdef GROUPBERT_WITH_CUDA
TORCH_LIBRARY_IMPL(groupbert, CUDA, m) {
  m.impl("grouped_conv1d", &grouped_conv1d_cuda);
  m.impl("grouped_conv1d_backward", &grouped_conv1d_backward_cuda);
}
#endif

}  // namespace groupbert

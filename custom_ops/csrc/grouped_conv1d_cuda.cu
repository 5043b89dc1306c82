// CUDA kernels of GroupedConv1d (forward, grad-input, grad-weight), fp32 and bf16
// with fp32 accumulation. Plain CUDA, no torch headers: see grouped_conv1d_cuda.h for
// the layouts and grouped_conv1d.cpp for the checks and the registration.
//
// A block owns a tile of kTileRows sequence positions of one batch row and a chunk of
// CH = C * max(1, 64 / C) channels (whole groups). It stages the masked input window
// ((kTileRows + K - 1) x CH) and the chunk's weights, laid out (C, K, CH) so a warp
// reads consecutive words, in shared memory as fp32. Thread (h, y) then accumulates
// kTileRows / kRowsY output rows of channel h in registers.
//
// Packed sequences (ids, (B, S) int64, or nullptr): the block also stages, per output
// row t and tap k, a factor f[t][k] = 1 where input row s0 + t + k - P has row t's id
// and that id is not 0, else 0. The convolution sums each tap over the channels first
// and scales the partial by f once per (row, tap); grad-weight scales each product.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "grouped_conv1d_cuda.h"

namespace groupbert {
namespace cuda_ops {
namespace {

constexpr int kTileRows = 32;  // sequence positions per block
constexpr int kRowsY = 4;      // threads along the tile; each computes kTileRows / kRowsY rows
constexpr int kRowsPerThread = kTileRows / kRowsY;
constexpr int kDefaultSharedBytes = 48 * 1024;

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

int channels_per_block(int64_t C) { return static_cast<int>(C * (C < 64 ? 64 / C : 1)); }

// f[t][k] for the rows of this tile (see the top of the file).
__device__ void stage_sequence_factors(const int64_t* __restrict__ ids, int64_t b, int64_t s0, ConvDims d,
                                       float* f_s, int tid, int n_threads) {
  const int K = static_cast<int>(d.K), P = K / 2;
  for (int i = tid; i < kTileRows * K; i += n_threads) {
    const int t = i / K, k = i % K;
    const int64_t s = s0 + t, src = s + k - P;
    const bool same = s < d.S && src >= 0 && src < d.S && ids[b * d.S + s] != 0 &&
                      ids[b * d.S + src] == ids[b * d.S + s];
    f_s[i] = same ? 1.0f : 0.0f;
  }
}

// out[b, s, h] = sum_k sum_c w_s[c][k][h] * in[b, s + k - P, g*C + c], g = h / C.
// Forward: w_s[c][k][h] = weight[h][c][k], the input masked, every output stored.
// Grad-input (kGradInput): grad_x[s, g*C + c'] = sum_k sum_j weight[g*C + j][c'][k] *
// gout[s + P - k, g*C + j], i.e. w_s[j][K-1-k][g*C + c'] = weight[g*C + j][c'][k] on
// the unmasked gradient, then masked rows of grad_x are zero.
template <typename T, bool kGradInput>
__global__ void conv_kernel(const T* __restrict__ in, const T* __restrict__ weight, const bool* __restrict__ mask,
                            const int64_t* __restrict__ ids, T* __restrict__ out, ConvDims d, int CH) {
  extern __shared__ float smem[];
  const int C = static_cast<int>(d.C), K = static_cast<int>(d.K), P = K / 2;
  const int64_t S = d.S, H = d.H;
  const int64_t b = blockIdx.z, s0 = static_cast<int64_t>(blockIdx.y) * kTileRows;
  const int64_t h0 = static_cast<int64_t>(blockIdx.x) * CH;
  const int ch_here = static_cast<int>(H - h0 < CH ? H - h0 : CH);  // whole groups: CH and H are multiples of C
  const int window_rows = kTileRows + K - 1;
  float* x_s = smem;                     // (window_rows, CH)
  float* w_s = smem + window_rows * CH;  // (C, K, CH)
  float* f_s = w_s + C * K * CH;         // (kTileRows, K), with ids
  const int tid = threadIdx.y * blockDim.x + threadIdx.x, n_threads = blockDim.x * blockDim.y;
  if (ids != nullptr) stage_sequence_factors(ids, b, s0, d, f_s, tid, n_threads);

  for (int i = tid; i < window_rows * CH; i += n_threads) {
    const int r = i / CH, hl = i % CH;
    const int64_t s = s0 - P + r;
    const bool live = hl < ch_here && s >= 0 && s < S && (kGradInput || mask == nullptr || mask[b * S + s]);
    x_s[i] = live ? to_float(in[(b * S + s) * H + h0 + hl]) : 0.0f;
  }
  for (int i = tid; i < C * K * CH; i += n_threads) {
    const int hl = i % CH, ck = i / CH, c = ck / K, k = ck % K;
    float v = 0.0f;
    if (hl < ch_here) {
      const int64_t h = h0 + hl, g0 = h - h % C;
      v = kGradInput ? to_float(weight[((g0 + c) * C + (h - g0)) * K + (K - 1 - k)])
                     : to_float(weight[(h * C + c) * K + k]);
    }
    w_s[i] = v;
  }
  __syncthreads();

  const int hl = threadIdx.x, group_col = (hl / C) * C;
  float acc[kRowsPerThread] = {};
  for (int k = 0; k < K; ++k) {
    float tap[kRowsPerThread] = {};
    for (int c = 0; c < C; ++c) {
      const float w = w_s[(c * K + k) * CH + hl];
      const float* xc = x_s + k * CH + group_col + c;
#pragma unroll
      for (int r = 0; r < kRowsPerThread; ++r) tap[r] += w * xc[(threadIdx.y + r * kRowsY) * CH];
    }
#pragma unroll
    for (int r = 0; r < kRowsPerThread; ++r)
      acc[r] += ids == nullptr ? tap[r] : f_s[(threadIdx.y + r * kRowsY) * K + k] * tap[r];
  }
  if (hl >= ch_here) return;
#pragma unroll
  for (int r = 0; r < kRowsPerThread; ++r) {
    const int64_t s = s0 + threadIdx.y + r * kRowsY;
    if (s >= S) break;
    const bool live = !kGradInput || mask == nullptr || mask[b * S + s];
    out[(b * S + s) * H + h0 + hl] = from_float<T>(live ? acc[r] : 0.0f);
  }
}

// grad_w32[h][c][k] += sum over this block's (b, tile) items of
// gout[b, s, h] * xm[b, s + k - P, g*C + c]. Each block keeps a partial for its channel
// chunk in shared memory (every entry owned by one thread) and adds it once, atomically.
template <typename T>
__global__ void grad_weight_kernel(const T* __restrict__ gout, const T* __restrict__ x,
                                   const bool* __restrict__ mask, const int64_t* __restrict__ ids,
                                   float* __restrict__ grad_w32, ConvDims d, int CH) {
  extern __shared__ float smem[];
  const int C = static_cast<int>(d.C), K = static_cast<int>(d.K), P = K / 2;
  const int64_t S = d.S, H = d.H;
  const int64_t n_tiles = (S + kTileRows - 1) / kTileRows, n_items = d.B * n_tiles;
  const int64_t h0 = static_cast<int64_t>(blockIdx.x) * CH;
  const int ch_here = static_cast<int>(H - h0 < CH ? H - h0 : CH);
  const int window_rows = kTileRows + K - 1, n_entries = C * K * CH;
  float* x_s = smem;                        // (window_rows, CH)
  float* g_s = x_s + window_rows * CH;      // (kTileRows, CH)
  float* part = g_s + kTileRows * CH;       // (C, K, CH)
  float* f_s = part + n_entries;            // (kTileRows, K), with ids
  const int tid = threadIdx.y * blockDim.x + threadIdx.x, n_threads = blockDim.x * blockDim.y;

  for (int e = tid; e < n_entries; e += n_threads) part[e] = 0.0f;
  for (int64_t item = blockIdx.y; item < n_items; item += gridDim.y) {
    const int64_t b = item / n_tiles, s0 = (item % n_tiles) * kTileRows;
    __syncthreads();  // the previous item is done with x_s, g_s and f_s
    if (ids != nullptr) stage_sequence_factors(ids, b, s0, d, f_s, tid, n_threads);
    for (int i = tid; i < window_rows * CH; i += n_threads) {
      const int r = i / CH, hl = i % CH;
      const int64_t s = s0 - P + r;
      const bool live = hl < ch_here && s >= 0 && s < S && (mask == nullptr || mask[b * S + s]);
      x_s[i] = live ? to_float(x[(b * S + s) * H + h0 + hl]) : 0.0f;
    }
    for (int i = tid; i < kTileRows * CH; i += n_threads) {
      const int t = i / CH, hl = i % CH;
      const int64_t s = s0 + t;
      g_s[i] = hl < ch_here && s < S ? to_float(gout[(b * S + s) * H + h0 + hl]) : 0.0f;
    }
    __syncthreads();
    for (int e = tid; e < n_entries; e += n_threads) {
      const int hl = e % CH, ck = e / CH, c = ck / K, k = ck % K;
      const float* xc = x_s + k * CH + (hl / C) * C + c;
      float sum = 0.0f;
      if (ids == nullptr) {
#pragma unroll 8
        for (int t = 0; t < kTileRows; ++t) sum += g_s[t * CH + hl] * xc[t * CH];
      } else {
#pragma unroll 8
        for (int t = 0; t < kTileRows; ++t) sum += f_s[t * K + k] * g_s[t * CH + hl] * xc[t * CH];
      }
      part[e] += sum;
    }
  }
  __syncthreads();
  for (int e = tid; e < n_entries; e += n_threads) {
    const int hl = e % CH, ck = e / CH, c = ck / K, k = ck % K;
    if (hl < ch_here) atomicAdd(&grad_w32[((h0 + hl) * C + c) * K + k], part[e]);
  }
}

template <typename Kernel>
cudaError_t allow_shared(Kernel kernel, size_t bytes) {
  if (bytes <= kDefaultSharedBytes) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
}

template <typename T, bool kGradInput>
cudaError_t launch_conv(const T* in, const T* weight, const bool* mask, const int64_t* ids, T* out, ConvDims d,
                        cudaStream_t stream) {
  const int CH = channels_per_block(d.C);
  const size_t shared = sizeof(float) * ((kTileRows + d.K - 1) * CH + d.C * d.K * CH + kTileRows * d.K);
  auto kernel = conv_kernel<T, kGradInput>;
  if (cudaError_t err = allow_shared(kernel, shared); err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>((d.H + CH - 1) / CH), static_cast<unsigned>((d.S + kTileRows - 1) / kTileRows),
                  static_cast<unsigned>(d.B));
  kernel<<<grid, dim3(CH, kRowsY), shared, stream>>>(in, weight, mask, ids, out, d, CH);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_grad_weight(const T* gout, const T* x, const bool* mask, const int64_t* ids, float* grad_w32,
                               ConvDims d, cudaStream_t stream) {
  const int CH = channels_per_block(d.C);
  const size_t shared = sizeof(float) * ((2 * kTileRows + d.K - 1) * CH + d.C * d.K * CH + kTileRows * d.K);
  auto kernel = grad_weight_kernel<T>;
  if (cudaError_t err = allow_shared(kernel, shared); err != cudaSuccess) return err;
  int device = 0, n_sm = 1;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
  if (cudaError_t err = cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, device); err != cudaSuccess)
    return err;
  // About four blocks per SM in all: enough to fill the GPU, few partials to add.
  const int64_t chunks = (d.H + CH - 1) / CH, n_items = d.B * ((d.S + kTileRows - 1) / kTileRows);
  int64_t slices = (4 * static_cast<int64_t>(n_sm) + chunks - 1) / chunks;
  slices = slices < n_items ? slices : n_items;
  const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>(slices > 0 ? slices : 1));
  kernel<<<grid, dim3(CH, kRowsY), shared, stream>>>(gout, x, mask, ids, grad_w32, d, CH);
  return cudaGetLastError();
}

}  // namespace

cudaError_t grouped_conv1d_forward_f32(const float* x, const float* weight, const bool* mask, const int64_t* ids,
                                       float* out, ConvDims dims, cudaStream_t stream) {
  return launch_conv<float, false>(x, weight, mask, ids, out, dims, stream);
}

cudaError_t grouped_conv1d_forward_bf16(const void* x, const void* weight, const bool* mask, const int64_t* ids,
                                        void* out, ConvDims dims, cudaStream_t stream) {
  return launch_conv<__nv_bfloat16, false>(static_cast<const __nv_bfloat16*>(x),
                                           static_cast<const __nv_bfloat16*>(weight), mask, ids,
                                           static_cast<__nv_bfloat16*>(out), dims, stream);
}

cudaError_t grouped_conv1d_grad_input_f32(const float* grad_out, const float* weight, const bool* mask,
                                          const int64_t* ids, float* grad_x, ConvDims dims, cudaStream_t stream) {
  return launch_conv<float, true>(grad_out, weight, mask, ids, grad_x, dims, stream);
}

cudaError_t grouped_conv1d_grad_input_bf16(const void* grad_out, const void* weight, const bool* mask,
                                           const int64_t* ids, void* grad_x, ConvDims dims, cudaStream_t stream) {
  return launch_conv<__nv_bfloat16, true>(static_cast<const __nv_bfloat16*>(grad_out),
                                          static_cast<const __nv_bfloat16*>(weight), mask, ids,
                                          static_cast<__nv_bfloat16*>(grad_x), dims, stream);
}

cudaError_t grouped_conv1d_grad_weight_f32(const float* grad_out, const float* x, const bool* mask,
                                           const int64_t* ids, float* grad_w32, ConvDims dims, cudaStream_t stream) {
  return launch_grad_weight<float>(grad_out, x, mask, ids, grad_w32, dims, stream);
}

cudaError_t grouped_conv1d_grad_weight_bf16(const void* grad_out, const void* x, const bool* mask,
                                            const int64_t* ids, float* grad_w32, ConvDims dims, cudaStream_t stream) {
  return launch_grad_weight<__nv_bfloat16>(static_cast<const __nv_bfloat16*>(grad_out),
                                           static_cast<const __nv_bfloat16*>(x), mask, ids, grad_w32, dims, stream);
}

}  // namespace cuda_ops
}  // namespace groupbert

// CUDA kernels of the fused LAMB step (semantics in fused_lamb.cpp). Plain CUDA
// and raw pointers only: fused_lamb.cpp validates the tensors and calls the
// launchers at the bottom of this file on the current stream.
//
// One block per chunk of kCudaChunk elements. A block walks the segments its chunk
// meets (usually one or two) and writes one partial sum per piece into slot
// chunk + segment of the workspace (see fused_lamb_cuda.h); a warp per segment
// then adds the slots of its chunks in a fixed order. No atomics: the norms are
// bit-identical run to run.
#include <cuda_runtime.h>

#include "fused_lamb_cuda.h"

namespace groupbert::lamb::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarp = 32;

__device__ __forceinline__ float bf16_bits_to_float(uint16_t b) {
  return __uint_as_float(static_cast<uint32_t>(b) << 16);
}

__device__ __forceinline__ float load(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float load(const uint16_t* p, int64_t i) { return bf16_bits_to_float(p[i]); }

// Last segment starting at or before `index` (skips empty segments starting there).
__device__ int64_t find_segment(const int64_t* seg, int64_t n, int64_t index) {
  int64_t lo = 0, hi = n;  // answer in [lo, hi)
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (seg[mid] <= index) lo = mid; else hi = mid;
  }
  return lo;
}

// Deterministic tree reduction of WIDTH doubles per thread over the block;
// thread 0 gets the result.
template <int WIDTH>
__device__ void block_sum(double (&x)[WIDTH], double (*shared)[kThreads]) {
  for (int k = 0; k < WIDTH; ++k) shared[k][threadIdx.x] = x[k];
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) {
      for (int k = 0; k < WIDTH; ++k) shared[k][threadIdx.x] += shared[k][threadIdx.x + stride];
    }
    __syncthreads();
  }
  for (int k = 0; k < WIDTH; ++k) x[k] = shared[k][0];
  __syncthreads();  // shared is reused by the next piece
}

// Visits the pieces of this block's chunk: fn(segment, begin, end).
template <typename Fn>
__device__ void for_each_piece(const int64_t* seg, int64_t n, int64_t total, Fn&& fn) {
  __shared__ int64_t first;
  const int64_t lo = static_cast<int64_t>(blockIdx.x) * kCudaChunk;
  const int64_t hi = min(lo + kCudaChunk, total);
  if (threadIdx.x == 0) first = find_segment(seg, n, lo);
  __syncthreads();
  for (int64_t s = first; s < n && seg[s] < hi; ++s) {
    const int64_t b = max(seg[s], lo), e = min(seg[s + 1], hi);
    if (b < e) fn(s, b, e);
  }
}

template <typename T>
__global__ void sq_norms_kernel(const T* buf, const int64_t* seg, int64_t n, int64_t total, double* partials) {
  __shared__ double shared[1][kThreads];
  for_each_piece(seg, n, total, [&](int64_t s, int64_t b, int64_t e) {
    double acc[1] = {0.0};
    for (int64_t i = b + threadIdx.x; i < e; i += kThreads) {
      const float x = load(buf, i);
      acc[0] += static_cast<double>(x) * x;
    }
    block_sum<1>(acc, shared);
    if (threadIdx.x == 0) partials[blockIdx.x + s] = acc[0];
  });
}

template <typename P>
__global__ void stage1_kernel(const P* param, float* grad, float* exp_avg, float* exp_avg_sq, const int64_t* seg,
                              const float* weight_decay, int64_t n, int64_t total, float beta1, float beta2,
                              float omb1, float omb2, float bc1, float bc2, float eps, float grad_scale,
                              double* partials) {
  __shared__ double shared[2][kThreads];
  for_each_piece(seg, n, total, [&](int64_t s, int64_t b, int64_t e) {
    const float wd = weight_decay[s];
    double acc[2] = {0.0, 0.0};
    for (int64_t i = b + threadIdx.x; i < e; i += kThreads) {
      const float p = load(param, i);
      const float g = grad[i] * grad_scale;
      const float m = beta1 * exp_avg[i] + omb1 * g;
      const float v = beta2 * exp_avg_sq[i] + omb2 * g * g;
      exp_avg[i] = m;
      exp_avg_sq[i] = v;
      const float u = (m * bc1) / (sqrtf(v * bc2) + eps) + wd * p;
      grad[i] = u;
      acc[0] += static_cast<double>(p) * p;
      acc[1] += static_cast<double>(u) * u;
    }
    block_sum<2>(acc, shared);
    if (threadIdx.x == 0) {
      partials[(blockIdx.x + s) * 2] = acc[0];
      partials[(blockIdx.x + s) * 2 + 1] = acc[1];
    }
  });
}

// One warp per segment: lane l adds the slots of chunks l, l + 32, ... in order,
// then a fixed shuffle tree; out (N, width) fp32.
__global__ void reduce_kernel(const double* partials, int width, const int64_t* seg, int64_t n, float* out) {
  const int64_t s = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (s >= n) return;
  const int64_t b = seg[s], e = seg[s + 1];
  for (int k = 0; k < width; ++k) {
    double acc = 0.0;
    if (e > b) {
      for (int64_t c = b / kCudaChunk + lane; c <= (e - 1) / kCudaChunk; c += kWarp) {
        acc += partials[(c + s) * width + k];
      }
    }
    for (int offset = kWarp / 2; offset > 0; offset /= 2) acc += __shfl_down_sync(0xffffffffU, acc, offset);
    if (lane == 0) out[s * width + k] = static_cast<float>(acc);
  }
}

// lr * trust ratio per segment (the expression of step_scale in fused_lamb.cpp).
__global__ void scale_kernel(const float* norms, const bool* use_trust, int64_t n, float lr, float max_trust,
                             float* scale) {
  const int64_t s = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (s >= n) return;
  double trust = 1.0;
  const float p_sq = norms[2 * s], u_sq = norms[2 * s + 1];
  if (use_trust[s] && p_sq > 0.0f && u_sq > 0.0f) {
    trust = sqrt(static_cast<double>(p_sq)) / sqrt(static_cast<double>(u_sq));
    if (max_trust > 0.0f && trust > max_trust) trust = max_trust;
  }
  scale[s] = static_cast<float>(static_cast<double>(lr) * trust);
}

__global__ void stage2_fp32_kernel(float* param, const float* update, const int64_t* seg, int64_t n, int64_t total,
                                   const float* scale) {
  for_each_piece(seg, n, total, [&](int64_t s, int64_t b, int64_t e) {
    const float a = scale[s];
    for (int64_t i = b + threadIdx.x; i < e; i += kThreads) param[i] -= a * update[i];
  });
}

__global__ void stage2_bf16_kernel(uint16_t* param, const float* update, const int64_t* seg, int64_t n, int64_t total,
                                   const float* scale, uint32_t key) {
  for_each_piece(seg, n, total, [&](int64_t s, int64_t b, int64_t e) {
    const float a = scale[s];
    for (int64_t i = b + threadIdx.x; i < e; i += kThreads) {
      const float updated = bf16_bits_to_float(param[i]) - a * update[i];
      param[i] = bf16_bits_stochastic(__float_as_uint(updated), rounding_bits(key, static_cast<uint32_t>(i)));
    }
  });
}

// Workspace layout: [partials: (chunks + N) * 2 doubles][scales: N floats].
double* partials_of(void* workspace) { return static_cast<double*>(workspace); }
float* scales_of(void* workspace, int64_t total, int64_t n) {
  return reinterpret_cast<float*>(partials_of(workspace) + (num_chunks(total, kCudaChunk) + n) * 2);
}

unsigned grid_of(int64_t total) { return static_cast<unsigned>(num_chunks(total, kCudaChunk)); }
unsigned warps_grid(int64_t n) { return static_cast<unsigned>((n * kWarp + kThreads - 1) / kThreads); }

}  // namespace

size_t workspace_bytes(int64_t total, int64_t num_segments) {
  return static_cast<size_t>((num_chunks(total, kCudaChunk) + num_segments) * 2) * sizeof(double) +
         static_cast<size_t>(num_segments) * sizeof(float) + 16;
}

void sq_norms(const void* buf, bool buf_bf16, const int64_t* segments, int64_t num_segments, int64_t total,
              float* out, void* workspace, cudaStream_t stream) {
  if (num_segments == 0) return;
  double* partials = partials_of(workspace);
  if (total > 0) {
    if (buf_bf16) {
      sq_norms_kernel<<<grid_of(total), kThreads, 0, stream>>>(static_cast<const uint16_t*>(buf), segments,
                                                              num_segments, total, partials);
    } else {
      sq_norms_kernel<<<grid_of(total), kThreads, 0, stream>>>(static_cast<const float*>(buf), segments,
                                                              num_segments, total, partials);
    }
  }
  reduce_kernel<<<warps_grid(num_segments), kThreads, 0, stream>>>(partials, 1, segments, num_segments, out);
}

void stage1(const void* param, bool param_bf16, float* grad, float* exp_avg, float* exp_avg_sq,
            const int64_t* segments, const float* weight_decay, int64_t num_segments, int64_t total, float beta1,
            float beta2, float one_minus_beta1, float one_minus_beta2, float bias_correction1,
            float bias_correction2, float eps, float grad_scale,
            float* norms_out, void* workspace, cudaStream_t stream) {
  if (num_segments == 0) return;
  double* partials = partials_of(workspace);
  if (total > 0) {
    if (param_bf16) {
      stage1_kernel<<<grid_of(total), kThreads, 0, stream>>>(
          static_cast<const uint16_t*>(param), grad, exp_avg, exp_avg_sq, segments, weight_decay, num_segments, total,
          beta1, beta2, one_minus_beta1, one_minus_beta2, bias_correction1, bias_correction2, eps, grad_scale,
          partials);
    } else {
      stage1_kernel<<<grid_of(total), kThreads, 0, stream>>>(
          static_cast<const float*>(param), grad, exp_avg, exp_avg_sq, segments, weight_decay, num_segments, total,
          beta1, beta2, one_minus_beta1, one_minus_beta2, bias_correction1, bias_correction2, eps, grad_scale,
          partials);
    }
  }
  reduce_kernel<<<warps_grid(num_segments), kThreads, 0, stream>>>(partials, 2, segments, num_segments, norms_out);
}

void stage2(void* param, bool param_bf16, const float* update, const int64_t* segments, const float* norms,
            const bool* use_trust_ratio, int64_t num_segments, int64_t total, float lr, float max_trust_ratio,
            uint32_t rounding_key, void* workspace, cudaStream_t stream) {
  if (num_segments == 0 || total == 0) return;
  float* scale = scales_of(workspace, total, num_segments);
  scale_kernel<<<static_cast<unsigned>((num_segments + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      norms, use_trust_ratio, num_segments, lr, max_trust_ratio, scale);
  if (param_bf16) {
    stage2_bf16_kernel<<<grid_of(total), kThreads, 0, stream>>>(static_cast<uint16_t*>(param), update, segments,
                                                               num_segments, total, scale, rounding_key);
  } else {
    stage2_fp32_kernel<<<grid_of(total), kThreads, 0, stream>>>(static_cast<float*>(param), update, segments,
                                                               num_segments, total, scale);
  }
}

}  // namespace groupbert::lamb::cuda

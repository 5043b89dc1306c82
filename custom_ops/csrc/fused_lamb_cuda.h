// Shared between fused_lamb.cpp (checks, op registration), its CPU kernel variants
// (fused_lamb_cpu.h) and fused_lamb_cuda.cu (CUDA kernels): the chunking of the flat buffers, the
// counter-based random numbers of stochastic rounding, and the CUDA launchers.
// No torch headers, so nvcc compiles the .cu file on its own (`make cuda-check`).
#pragma once

#include <cstdint>

// Internal linkage (static): the CPU kernel variants, compiled with different target
// flags, each keep their own copy rather than share whichever the linker picks.
#ifdef __CUDACC__
#define GROUPBERT_HD static __host__ __device__ __forceinline__
#else
#define GROUPBERT_HD static inline
#endif

namespace groupbert::lamb {

// The flat buffers are cut into fixed chunks that may straddle segment
// boundaries. Chunk c and segment s meet in at most one "piece", and the partial
// sums of that piece live in slot c + s: pieces are ordered by both c and s, so
// the slots are distinct, and (num_chunks + num_segments) slots always suffice.
// Summing each segment's slots in chunk order makes the norms independent of the
// thread count and bit-identical run to run.
constexpr int64_t kCpuChunk = 16384;
constexpr int64_t kCudaChunk = 4096;

GROUPBERT_HD int64_t num_chunks(int64_t total, int64_t chunk) { return (total + chunk - 1) / chunk; }

// Counter-based random bits for stochastic rounding: the "lowbias32" integer
// hash (Wellons, "Prospecting for hash functions", 2018), applied twice to
// (element index xor a per-call key). The CPU and CUDA kernels and the pure-torch
// fallback (custom_ops/lamb.py) produce the same bits for the same seed.
GROUPBERT_HD uint32_t lowbias32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

GROUPBERT_HD uint32_t rounding_key(uint64_t seed) {
  return lowbias32(static_cast<uint32_t>(seed) ^ lowbias32(static_cast<uint32_t>(seed >> 32) ^ 0x85ebca6bU));
}

GROUPBERT_HD uint32_t rounding_bits(uint32_t key, uint32_t index) {
  return lowbias32(lowbias32(index ^ key) ^ 0x27d4eb2dU);
}

// fp32 bits -> bf16 bits, rounding up with probability (dropped bits / 2^16): the
// expected value of the result equals the fp32 input (unbiased). NaN stays NaN.
GROUPBERT_HD uint16_t bf16_bits_stochastic(uint32_t f32_bits, uint32_t random) {
  if ((f32_bits & 0x7fffffffU) > 0x7f800000U) return static_cast<uint16_t>((f32_bits >> 16) | 0x0040U);
  return static_cast<uint16_t>((f32_bits + (random & 0xffffU)) >> 16);
}

}  // namespace groupbert::lamb

#if defined(__CUDACC__) || defined(GROUPBERT_WITH_CUDA)
#include <cuda_runtime_api.h>

// Raw-pointer launchers (fused_lamb_cuda.cu). Every buffer is on the device;
// `segments` holds num_segments + 1 int64 offsets, `total` = segments[num_segments].
// `workspace` holds lamb_cuda_workspace_bytes(total, num_segments) bytes.
namespace groupbert::lamb::cuda {

size_t workspace_bytes(int64_t total, int64_t num_segments);

// out[s] = sum of buf[i]^2 over segment s (fp32 (N,)).
void sq_norms(const void* buf, bool buf_bf16, const int64_t* segments, int64_t num_segments, int64_t total,
              float* out, void* workspace, cudaStream_t stream);

// Adam moments + LAMB update written into grad; norms_out (N, 2) = [sum p^2, sum u^2].
void stage1(const void* param, bool param_bf16, float* grad, float* exp_avg, float* exp_avg_sq,
            const int64_t* segments, const float* weight_decay, int64_t num_segments, int64_t total,
            float beta1, float beta2, float one_minus_beta1, float one_minus_beta2, float bias_correction1,
            float bias_correction2, float eps,
            float grad_scale, float* norms_out, void* workspace, cudaStream_t stream);

// param -= lr * trust(norms) * update, per segment; bf16 params round stochastically.
void stage2(void* param, bool param_bf16, const float* update, const int64_t* segments, const float* norms,
            const bool* use_trust_ratio, int64_t num_segments, int64_t total, float lr, float max_trust_ratio,
            uint32_t rounding_key, void* workspace, cudaStream_t stream);

}  // namespace groupbert::lamb::cuda
#endif

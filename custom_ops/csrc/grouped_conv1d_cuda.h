// Raw-pointer launchers of the GroupedConv1d CUDA kernels (grouped_conv1d_cuda.cu).
// No torch headers on either side, so nvcc alone compiles the kernels (make cuda-check);
// grouped_conv1d.cpp checks the inputs and calls these under GROUPBERT_WITH_CUDA.
//
// Layouts (B batch, S sequence, H hidden, C channels per group, K odd kernel width):
//   x, out, grad_out, grad_x (B, S, H) contiguous; weight (H, C, K) like conv1d's;
//   mask (B, S) bool or nullptr; ids (B, S) int64 sequence ids of packed rows (0 on
//   padding; input rows feed only output rows of their own id) or nullptr, never both;
//   grad_w32 (H, C, K) fp32, zeroed by the caller.
// bf16 pointers are __nv_bfloat16 (passed as void* so the caller needs no cuda_bf16.h).
// Each launcher returns the launch status (cudaGetLastError).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace groupbert {
namespace cuda_ops {

struct ConvDims {
  int64_t B, S, H, C, K;
};

cudaError_t grouped_conv1d_forward_f32(const float* x, const float* weight, const bool* mask, const int64_t* ids,
                                       float* out, ConvDims dims, cudaStream_t stream);
cudaError_t grouped_conv1d_forward_bf16(const void* x, const void* weight, const bool* mask, const int64_t* ids,
                                        void* out, ConvDims dims, cudaStream_t stream);

cudaError_t grouped_conv1d_grad_input_f32(const float* grad_out, const float* weight, const bool* mask,
                                          const int64_t* ids, float* grad_x, ConvDims dims, cudaStream_t stream);
cudaError_t grouped_conv1d_grad_input_bf16(const void* grad_out, const void* weight, const bool* mask,
                                           const int64_t* ids, void* grad_x, ConvDims dims, cudaStream_t stream);

cudaError_t grouped_conv1d_grad_weight_f32(const float* grad_out, const float* x, const bool* mask,
                                           const int64_t* ids, float* grad_w32, ConvDims dims, cudaStream_t stream);
cudaError_t grouped_conv1d_grad_weight_bf16(const void* grad_out, const void* x, const bool* mask,
                                            const int64_t* ids, float* grad_w32, ConvDims dims, cudaStream_t stream);

}  // namespace cuda_ops
}  // namespace groupbert

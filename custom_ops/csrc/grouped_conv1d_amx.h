// GroupedConv1d on AMX tiles, for bf16 activations with 16 channels per group (the
// GroupBERT shape): the forward pass, grad-input and grad-weight. Called by
// grouped_conv1d.cpp, which falls back to its AVX-512 kernels when amx_usable() is false.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

namespace groupbert::amx {

// Channels per group the AMX kernels take: one 16 x 16 output tile per group.
constexpr int64_t kChannels = 16;

// True when the CPU has AMX-BF16, the OS gave this process the tile state, and the
// environment does not set GROUPBERT_AMX=0 (read on every call, for A/B runs).
bool amx_usable();

// out[b, s, g*16 + j] = sum over (k, c) of w(g, j, c, k) * xm[b, s + k - K/2, g*16 + c],
// xm = in masked by in_mask (rows outside [0, S) are zero); rows where out_mask is 0 are
// zeroed. weight is (H, 16, K) like conv1d's; with `transposed` the kernel uses
// w(g, j, c, k) = weight[g*16 + c][j][K - 1 - k], which makes it grad-input (in = gout).
// Products in bf16, sums in fp32, the result rounded to nearest even.
void conv_bf16(const c10::BFloat16* in, const bool* in_mask, const bool* out_mask, const c10::BFloat16* weight,
               bool transposed, c10::BFloat16* out, int64_t B, int64_t S, int64_t H, int64_t K);

// Grad-weight: partial[(((worker * G + g) * K + k) * 16 + j) * 16 + c] += sum over (b, s)
// of gout[b, s, g*16 + j] * xm[b, s + k - K/2, g*16 + c], xm = x masked by mask. Each of
// the n_workers workers adds into its own zeroed partial (j and c swapped against the
// AVX-512 kernel's), and the caller sums them.
void grad_weight_bf16(const c10::BFloat16* gout, const c10::BFloat16* x, const bool* mask, float* partial,
                      int64_t n_workers, int64_t B, int64_t S, int64_t H, int64_t K);

}  // namespace groupbert::amx

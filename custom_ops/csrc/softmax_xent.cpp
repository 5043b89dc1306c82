// The softmax cross-entropy of rows of scores (N, C), in two ops that never hold an
// (N, C) fp32 array:
//
//   softmax_xent_stats(scores) -> stats (N, 2) fp32    [m, log Σ_c exp(scores[r, c] − m)],
//       m the row's maximum
//   softmax_xent_grad(scores, stats, target, scale) -> dscores (N, C), the scores' dtype
//       (softmax(scores[r]) − one_hot(target[r])) · scale[r], rounded once
//
// The loss of a row is stats[r][1] − (scores[r, target[r]] − m), the log-probability as
// ATen's log_softmax computes it (custom_ops/softmax_xent.py). For
// the MLM loss, (N, C) is (masked positions, vocabulary), the largest activation of a
// BERT step; where F.cross_entropy casts bf16 scores to an fp32 copy, writes fp32
// log-probabilities, and its backward reads and writes them twice more before the cast
// back, these read the bf16 scores twice forward and once backward and write the bf16
// gradient once. fp32 and bf16 scores; every row is computed in fp32 on one thread, so
// the results do not depend on the thread count.
//
// This file holds the checks, the threads and the registration; the row kernels are
// compiled per instruction set (softmax_xent_cpu.h) and picked at run time
// (cpu_capability.h).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#include "cpu_capability.h"
#include "softmax_xent_cpu.h"

namespace groupbert::xent {
namespace {

const RowKernels& cpu_kernels() {
  switch (cpu::capability()) {
#ifdef GROUPBERT_X86_KERNELS
    case cpu::Capability::kAvx512Bf16:  // no bf16 products here: the AVX-512 loops
    case cpu::Capability::kAvx512:
      return avx512::kernels();
    case cpu::Capability::kAvx2:
      return avx2::kernels();
#endif
    default:
      return generic::kernels();
  }
}

void check_scores(const at::Tensor& scores) {
  TORCH_CHECK_VALUE(scores.dim() == 2 && scores.is_contiguous(),
                    "groupbert softmax_xent: `scores` must be a contiguous (N, C) array, got shape ", scores.sizes(),
                    " strides ", scores.strides());
  TORCH_CHECK_VALUE(scores.scalar_type() == at::kFloat || scores.scalar_type() == at::kBFloat16,
                    "groupbert softmax_xent: `scores` has dtype ", scores.scalar_type(),
                    ", which this op does not take (float32 or bfloat16)");
  TORCH_CHECK_VALUE(scores.is_cpu(), "groupbert softmax_xent: runs on the CPU, `scores` is on ", scores.device());
}

// `t` of shape (N) (width 0) or (N, width), contiguous, on the CPU.
void check_rows(const at::Tensor& t, const char* name, const at::Tensor& scores, at::ScalarType dtype,
                int64_t width = 0) {
  const bool shape = width == 0 ? t.dim() == 1 && t.size(0) == scores.size(0)
                                : t.dim() == 2 && t.size(0) == scores.size(0) && t.size(1) == width;
  TORCH_CHECK_VALUE(shape && t.scalar_type() == dtype && t.is_contiguous() && t.is_cpu(), "groupbert softmax_xent: `",
                    name, "` must be a contiguous ", dtype, " CPU tensor of shape (", scores.size(0),
                    width == 0 ? "" : ", 2", "), got ", t.scalar_type(), " ", t.sizes(), " on ", t.device());
}

// Rows per task: about 64k elements each, so a small call stays on one thread.
int64_t grain(int64_t columns) { return std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, columns)); }

at::Tensor stats_cpu(const at::Tensor& scores) {
  check_scores(scores);
  const int64_t rows = scores.size(0), columns = scores.size(1);
  at::Tensor stats = at::empty({rows, 2}, scores.options().dtype(at::kFloat));
  const RowKernels& k = cpu_kernels();
  const bool bf16 = scores.scalar_type() == at::kBFloat16;
  const void* x = scores.data_ptr();
  float* out = stats.data_ptr<float>();
  at::parallel_for(0, rows, grain(columns), [&](int64_t b, int64_t e) {
    if (bf16) {
      k.row_stats_bf16(static_cast<const uint16_t*>(x), columns, b, e, out);
    } else {
      k.row_stats_f32(static_cast<const float*>(x), columns, b, e, out);
    }
  });
  return stats;
}

at::Tensor grad_cpu(const at::Tensor& scores, const at::Tensor& stats, const at::Tensor& target,
                    const at::Tensor& scale) {
  check_scores(scores);
  check_rows(stats, "stats", scores, at::kFloat, 2);
  check_rows(target, "target", scores, at::kLong);
  check_rows(scale, "scale", scores, at::kFloat);
  const int64_t rows = scores.size(0), columns = scores.size(1);
  at::Tensor dx = at::empty_like(scores);
  const RowKernels& k = cpu_kernels();
  const float* l = stats.data_ptr<float>();
  const int64_t* t = target.data_ptr<int64_t>();
  const float* s = scale.data_ptr<float>();
  const bool bf16 = scores.scalar_type() == at::kBFloat16;
  const void* x = scores.data_ptr();
  void* out = dx.data_ptr();
  at::parallel_for(0, rows, grain(columns), [&](int64_t b, int64_t e) {
    if (bf16) {
      k.grad_bf16(static_cast<const uint16_t*>(x), l, t, s, columns, b, e, static_cast<uint16_t*>(out));
    } else {
      k.grad_f32(static_cast<const float*>(x), l, t, s, columns, b, e, static_cast<float*>(out));
    }
  });
  return dx;
}

}  // namespace
}  // namespace groupbert::xent

// Fake (shape) kernels are registered in Python, custom_ops/softmax_xent.py.
TORCH_LIBRARY_FRAGMENT(groupbert, m) {
  m.set_python_module("custom_ops.softmax_xent");
  m.def("softmax_xent_stats(Tensor scores) -> Tensor");
  m.def("softmax_xent_grad(Tensor scores, Tensor stats, Tensor target, Tensor scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(groupbert, CPU, m) {
  m.impl("softmax_xent_stats", &groupbert::xent::stats_cpu);
  m.impl("softmax_xent_grad", &groupbert::xent::grad_cpu);
}

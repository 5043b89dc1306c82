// Fused LAMB step (You et al., "Large Batch Optimization for Deep Learning:
// Training BERT in 76 minutes", ICLR 2020, Algorithm 2) on flat buffers.
//
// Every parameter tensor of the model lives in one flat buffer; `segments`
// (int64, N + 1 offsets) says where each of the N tensors starts. The step is
// split in two passes so that the per-tensor norms can be all-reduced in between
// (replicated tensor sharding: each replica runs both passes on its shard of the
// buffers, with the segment table clipped to the shard):
//
//   lamb_sq_norms(buf, segments) -> (N,)           sum x^2 per segment (grad clipping)
//   lamb_stage1(param, grad!, m!, v!, ...) -> (N, 2)  Adam moments; update u written
//                                                   into grad; [sum p^2, sum u^2]
//   lamb_stage2(param!, u, segments, norms, ...)    p -= lr * trust * u
//
// Together the two passes move 40 bytes per fp32 parameter (read g, m, v, p;
// write m, v, u; read p, u; write p), the floor for an unfused-moment LAMB.
// Sums of squares accumulate in double; chunk partials are reduced in a fixed
// order (see fused_lamb_cuda.h), so results do not depend on the thread count.
//
// This file holds the checks, the chunk traversal, the threads and the registration;
// the CPU kernels of one piece of a segment are compiled per instruction set
// (fused_lamb_cpu.h) and picked at run time (cpu_capability.h).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu_capability.h"
#include "fused_lamb_cpu.h"

#ifdef GROUPBERT_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#endif
#include "fused_lamb_cuda.h"

namespace groupbert::lamb {
namespace {

// ---------------------------------------------------------------- input checks

void check_flat(const at::Tensor& t, const char* name, int64_t total, std::initializer_list<at::ScalarType> dtypes) {
  TORCH_CHECK_VALUE(t.dim() == 1 && t.is_contiguous(), "groupbert lamb: `", name,
              "` must be a contiguous 1-D buffer, got shape ", t.sizes(), " strides ", t.strides());
  TORCH_CHECK_VALUE(std::find(dtypes.begin(), dtypes.end(), t.scalar_type()) != dtypes.end(), "groupbert lamb: `", name,
              "` has dtype ", t.scalar_type(), ", which this op does not take");
  TORCH_CHECK_VALUE(t.numel() == total, "groupbert lamb: `", name, "` has ", t.numel(),
              " elements but the segment table covers ", total);
}

// Validates the segment table (on CPU it is read here anyway) and returns N.
int64_t check_segments(const at::Tensor& segments, const at::Tensor& like) {
  TORCH_CHECK_VALUE(segments.dim() == 1 && segments.numel() >= 1 && segments.scalar_type() == at::kLong &&
                  segments.is_contiguous(),
              "groupbert lamb: `segments` must be a contiguous int64 1-D tensor of N + 1 offsets, got ",
              segments.scalar_type(), " ", segments.sizes());
  TORCH_CHECK_VALUE(segments.device() == like.device(), "groupbert lamb: `segments` is on ", segments.device(),
              " but the buffers are on ", like.device());
  const int64_t n = segments.numel() - 1;
  if (segments.is_cpu()) {
    const int64_t* seg = segments.data_ptr<int64_t>();
    TORCH_CHECK_VALUE(seg[0] == 0, "groupbert lamb: `segments[0]` must be 0, got ", seg[0]);
    for (int64_t s = 0; s < n; ++s) {
      TORCH_CHECK_VALUE(seg[s + 1] >= seg[s], "groupbert lamb: `segments` must be non-decreasing, but segments[", s + 1,
                  "] = ", seg[s + 1], " < segments[", s, "] = ", seg[s]);
    }
    TORCH_CHECK_VALUE(seg[n] == like.numel(), "groupbert lamb: the segment table covers ", seg[n],
                " elements but the buffers hold ", like.numel());
  }
  return n;
}

void check_per_segment(const at::Tensor& t, const char* name, int64_t n, at::ScalarType dtype, const at::Tensor& like) {
  TORCH_CHECK_VALUE(t.dim() == 1 && t.numel() == n && t.scalar_type() == dtype && t.is_contiguous(), "groupbert lamb: `",
              name, "` must be a contiguous ", dtype, " tensor of shape (", n, "), got ", t.scalar_type(), " ",
              t.sizes());
  TORCH_CHECK_VALUE(t.device() == like.device(), "groupbert lamb: `", name, "` is on ", t.device(),
              " but the buffers are on ", like.device());
}

// ------------------------------------------------------------- chunk traversal

// Calls fn(chunk, segment, begin, end) for every non-empty piece of every chunk,
// chunks spread over threads; pieces of one chunk run on one thread, in order.
template <typename Fn>
void for_each_piece(const int64_t* seg, int64_t n, int64_t total, Fn&& fn) {
  const int64_t chunks = num_chunks(total, kCpuChunk);
  at::parallel_for(0, chunks, 1, [&](int64_t c_begin, int64_t c_end) {
    for (int64_t c = c_begin; c < c_end; ++c) {
      const int64_t lo = c * kCpuChunk, hi = std::min(lo + kCpuChunk, total);
      // Last segment starting at or before lo: skips empty segments that start there.
      int64_t s = std::upper_bound(seg, seg + n + 1, lo) - seg - 1;
      for (; s < n && seg[s] < hi; ++s) {
        const int64_t b = std::max(seg[s], lo), e = std::min(seg[s + 1], hi);
        if (b < e) fn(c, s, b, e);
      }
    }
  });
}

// Sums the per-piece partials (slot c + s, `width` doubles each) of every
// segment in chunk order into out (N, width) fp32.
void reduce_pieces(const std::vector<double>& partials, int width, const int64_t* seg, int64_t n, float* out) {
  for (int64_t s = 0; s < n; ++s) {
    for (int k = 0; k < width; ++k) {
      double acc = 0.0;
      if (seg[s + 1] > seg[s]) {
        for (int64_t c = seg[s] / kCpuChunk; c <= (seg[s + 1] - 1) / kCpuChunk; ++c) {
          acc += partials[(c + s) * width + k];
        }
      }
      out[s * width + k] = static_cast<float>(acc);
    }
  }
}

std::vector<double> make_partials(int64_t total, int64_t n, int width) {
  return std::vector<double>(static_cast<size_t>((num_chunks(total, kCpuChunk) + n) * width), 0.0);
}

// ------------------------------------------------------------------ CPU kernels

// The piece kernels of the level in use.
const PieceKernels& cpu_kernels() {
  switch (cpu::capability()) {
#ifdef GROUPBERT_X86_KERNELS
    case cpu::Capability::kAvx512Bf16:  // no bf16 products in LAMB: the AVX-512 kernels
    case cpu::Capability::kAvx512:
      return avx512::kernels();
    case cpu::Capability::kAvx2:
      return avx2::kernels();
#endif
    default:
      return generic::kernels();
  }
}

at::Tensor sq_norms_cpu(const at::Tensor& buf, const at::Tensor& segments) {
  const int64_t n = check_segments(segments, buf);
  check_flat(buf, "buf", buf.numel(), {at::kFloat, at::kBFloat16});
  const int64_t* seg = segments.data_ptr<int64_t>();
  const int64_t total = buf.numel();
  auto partials = make_partials(total, n, 1);
  const bool bf16 = buf.scalar_type() == at::kBFloat16;
  const void* data = buf.data_ptr();
  const PieceKernels& kernels = cpu_kernels();
  for_each_piece(seg, n, total, [&](int64_t c, int64_t s, int64_t b, int64_t e) {
    partials[c + s] = bf16 ? kernels.sum_squares_bf16(static_cast<const uint16_t*>(data), b, e)
                           : kernels.sum_squares_f32(static_cast<const float*>(data), b, e);
  });
  at::Tensor out = at::empty({n}, buf.options().dtype(at::kFloat));
  reduce_pieces(partials, 1, seg, n, out.data_ptr<float>());
  return out;
}

// Per-segment lr * trust ratio, in double (the fallback in custom_ops/lamb.py
// computes the same expression).
double step_scale(float p_sq, float u_sq, bool use_trust, double lr, double max_trust) {
  double trust = 1.0;
  if (use_trust && p_sq > 0.0f && u_sq > 0.0f) {
    trust = std::sqrt(static_cast<double>(p_sq)) / std::sqrt(static_cast<double>(u_sq));
    if (max_trust > 0.0 && trust > max_trust) trust = max_trust;
  }
  return lr * trust;
}

void check_stage1(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                  const at::Tensor& exp_avg_sq, const at::Tensor& weight_decay, int64_t n, int64_t step) {
  const int64_t total = param.numel();
  check_flat(param, "param", total, {at::kFloat, at::kBFloat16});
  check_flat(grad, "grad", total, {at::kFloat});
  check_flat(exp_avg, "exp_avg", total, {at::kFloat});
  check_flat(exp_avg_sq, "exp_avg_sq", total, {at::kFloat});
  for (const at::Tensor* t : {&grad, &exp_avg, &exp_avg_sq}) {
    TORCH_CHECK_VALUE(t->device() == param.device(), "groupbert lamb: every buffer must be on ", param.device(),
                ", found one on ", t->device());
  }
  check_per_segment(weight_decay, "weight_decay", n, at::kFloat, param);
  TORCH_CHECK_VALUE(step >= 1, "groupbert lamb: `step` counts from 1 (bias correction), got ", step);
}

Stage1Scalars stage1_scalars(double beta1, double beta2, double eps, int64_t step, double grad_scale) {
  return {static_cast<float>(beta1),
          static_cast<float>(beta2),
          static_cast<float>(1.0 - beta1),
          static_cast<float>(1.0 - beta2),
          static_cast<float>(1.0 / (1.0 - std::pow(beta1, static_cast<double>(step)))),
          static_cast<float>(1.0 / (1.0 - std::pow(beta2, static_cast<double>(step)))),
          static_cast<float>(eps),
          static_cast<float>(grad_scale)};
}

at::Tensor stage1_cpu(const at::Tensor& param, at::Tensor& grad, at::Tensor& exp_avg, at::Tensor& exp_avg_sq,
                      const at::Tensor& segments, const at::Tensor& weight_decay, double beta1, double beta2,
                      double eps, int64_t step, double grad_scale) {
  const int64_t n = check_segments(segments, param);
  check_stage1(param, grad, exp_avg, exp_avg_sq, weight_decay, n, step);
  const Stage1Scalars k = stage1_scalars(beta1, beta2, eps, step, grad_scale);
  const int64_t total = param.numel();
  const int64_t* seg = segments.data_ptr<int64_t>();
  const float* wd = weight_decay.data_ptr<float>();
  float* g = grad.data_ptr<float>();
  float* m = exp_avg.data_ptr<float>();
  float* v = exp_avg_sq.data_ptr<float>();
  const bool bf16 = param.scalar_type() == at::kBFloat16;
  const void* p = param.data_ptr();
  auto partials = make_partials(total, n, 2);
  const PieceKernels& kernels = cpu_kernels();
  for_each_piece(seg, n, total, [&](int64_t c, int64_t s, int64_t b, int64_t e) {
    double* sums = &partials[(c + s) * 2];
    if (bf16) {
      kernels.stage1_bf16(static_cast<const uint16_t*>(p), g, m, v, b, e, wd[s], k, sums);
    } else {
      kernels.stage1_f32(static_cast<const float*>(p), g, m, v, b, e, wd[s], k, sums);
    }
  });
  at::Tensor norms = at::empty({n, 2}, param.options().dtype(at::kFloat));
  reduce_pieces(partials, 2, seg, n, norms.data_ptr<float>());
  return norms;
}

void check_stage2(const at::Tensor& param, const at::Tensor& update, const at::Tensor& norms,
                  const at::Tensor& use_trust_ratio, int64_t n) {
  const int64_t total = param.numel();
  check_flat(param, "param", total, {at::kFloat, at::kBFloat16});
  check_flat(update, "update", total, {at::kFloat});
  TORCH_CHECK_VALUE(update.device() == param.device(), "groupbert lamb: `update` is on ", update.device(),
              " but `param` is on ", param.device());
  TORCH_CHECK_VALUE(norms.dim() == 2 && norms.size(0) == n && norms.size(1) == 2 && norms.scalar_type() == at::kFloat &&
                  norms.is_contiguous() && norms.device() == param.device(),
              "groupbert lamb: `norms` must be the contiguous fp32 (", n, ", 2) output of lamb_stage1 on ",
              param.device(), ", got ", norms.scalar_type(), " ", norms.sizes(), " on ", norms.device());
  TORCH_CHECK_VALUE(use_trust_ratio.scalar_type() == at::kBool || use_trust_ratio.scalar_type() == at::kByte,
              "groupbert lamb: `use_trust_ratio` must be bool or uint8, got ", use_trust_ratio.scalar_type());
  check_per_segment(use_trust_ratio, "use_trust_ratio", n, use_trust_ratio.scalar_type(), param);
}

void stage2_cpu(at::Tensor& param, const at::Tensor& update, const at::Tensor& segments, const at::Tensor& norms,
                const at::Tensor& use_trust_ratio, double lr, double max_trust_ratio, int64_t seed) {
  const int64_t n = check_segments(segments, param);
  check_stage2(param, update, norms, use_trust_ratio, n);
  const int64_t total = param.numel();
  const int64_t* seg = segments.data_ptr<int64_t>();
  const float* nrm = norms.data_ptr<float>();
  const at::Tensor trust_flags = use_trust_ratio.to(at::kBool);
  const bool* use_trust = trust_flags.data_ptr<bool>();
  std::vector<float> scale(static_cast<size_t>(n));
  for (int64_t s = 0; s < n; ++s) {
    scale[s] = static_cast<float>(step_scale(nrm[2 * s], nrm[2 * s + 1], use_trust[s], lr, max_trust_ratio));
  }
  const float* u = update.data_ptr<float>();
  const PieceKernels& kernels = cpu_kernels();
  if (param.scalar_type() == at::kFloat) {
    float* p = param.data_ptr<float>();
    for_each_piece(seg, n, total, [&](int64_t, int64_t s, int64_t b, int64_t e) { kernels.stage2_f32(p, u, b, e, scale[s]); });
  } else {
    uint16_t* p = static_cast<uint16_t*>(param.data_ptr());
    const uint32_t key = rounding_key(static_cast<uint64_t>(seed));
    for_each_piece(seg, n, total,
                   [&](int64_t, int64_t s, int64_t b, int64_t e) { kernels.stage2_bf16(p, u, b, e, scale[s], key); });
  }
}

// ----------------------------------------------------------------- CUDA glue

#ifdef GROUPBERT_WITH_CUDA
at::Tensor cuda_workspace(const at::Tensor& like, int64_t n) {
  return at::empty({static_cast<int64_t>(cuda::workspace_bytes(like.numel(), n))}, like.options().dtype(at::kByte));
}

at::Tensor sq_norms_cuda(const at::Tensor& buf, const at::Tensor& segments) {
  const int64_t n = check_segments(segments, buf);
  check_flat(buf, "buf", buf.numel(), {at::kFloat, at::kBFloat16});
  const c10::cuda::CUDAGuard guard(buf.device());
  at::Tensor out = at::empty({n}, buf.options().dtype(at::kFloat));
  at::Tensor ws = cuda_workspace(buf, n);
  cuda::sq_norms(buf.data_ptr(), buf.scalar_type() == at::kBFloat16, segments.data_ptr<int64_t>(), n, buf.numel(),
                 out.data_ptr<float>(), ws.data_ptr(), c10::cuda::getCurrentCUDAStream());
  return out;
}

at::Tensor stage1_cuda(const at::Tensor& param, at::Tensor& grad, at::Tensor& exp_avg, at::Tensor& exp_avg_sq,
                       const at::Tensor& segments, const at::Tensor& weight_decay, double beta1, double beta2,
                       double eps, int64_t step, double grad_scale) {
  const int64_t n = check_segments(segments, param);
  check_stage1(param, grad, exp_avg, exp_avg_sq, weight_decay, n, step);
  const Stage1Scalars k = stage1_scalars(beta1, beta2, eps, step, grad_scale);
  const c10::cuda::CUDAGuard guard(param.device());
  at::Tensor norms = at::empty({n, 2}, param.options().dtype(at::kFloat));
  at::Tensor ws = cuda_workspace(param, n);
  cuda::stage1(param.data_ptr(), param.scalar_type() == at::kBFloat16, grad.data_ptr<float>(),
               exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(), segments.data_ptr<int64_t>(),
               weight_decay.data_ptr<float>(), n, param.numel(), k.beta1, k.beta2, k.one_minus_beta1,
               k.one_minus_beta2, k.bias_correction1, k.bias_correction2, k.eps, k.grad_scale,
               norms.data_ptr<float>(), ws.data_ptr(), c10::cuda::getCurrentCUDAStream());
  return norms;
}

void stage2_cuda(at::Tensor& param, const at::Tensor& update, const at::Tensor& segments, const at::Tensor& norms,
                 const at::Tensor& use_trust_ratio, double lr, double max_trust_ratio, int64_t seed) {
  const int64_t n = check_segments(segments, param);
  check_stage2(param, update, norms, use_trust_ratio, n);
  const c10::cuda::CUDAGuard guard(param.device());
  const at::Tensor trust_flags = use_trust_ratio.to(at::kBool).contiguous();
  at::Tensor ws = cuda_workspace(param, n);
  cuda::stage2(param.data_ptr(), param.scalar_type() == at::kBFloat16, update.data_ptr<float>(),
               segments.data_ptr<int64_t>(), norms.data_ptr<float>(), trust_flags.data_ptr<bool>(), n, param.numel(),
               static_cast<float>(lr), static_cast<float>(max_trust_ratio),
               rounding_key(static_cast<uint64_t>(seed)), ws.data_ptr(), c10::cuda::getCurrentCUDAStream());
}
#endif

}  // namespace
}  // namespace groupbert::lamb

// Fake (shape) kernels are registered in Python, custom_ops/lamb.py.
TORCH_LIBRARY_FRAGMENT(groupbert, m) {
  m.set_python_module("custom_ops.lamb");
  m.def("lamb_sq_norms(Tensor buf, Tensor segments) -> Tensor");
  m.def(
      "lamb_stage1(Tensor param, Tensor(a!) grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, Tensor segments, "
      "Tensor weight_decay, float beta1, float beta2, float eps, int step, float grad_scale) -> Tensor");
  m.def(
      "lamb_stage2(Tensor(a!) param, Tensor update, Tensor segments, Tensor norms, Tensor use_trust_ratio, "
      "float lr, float max_trust_ratio, int seed) -> ()");
}

TORCH_LIBRARY_IMPL(groupbert, CPU, m) {
  m.impl("lamb_sq_norms", &groupbert::lamb::sq_norms_cpu);
  m.impl("lamb_stage1", &groupbert::lamb::stage1_cpu);
  m.impl("lamb_stage2", &groupbert::lamb::stage2_cpu);
}

#ifdef GROUPBERT_WITH_CUDA
TORCH_LIBRARY_IMPL(groupbert, CUDA, m) {
  m.impl("lamb_sq_norms", &groupbert::lamb::sq_norms_cuda);
  m.impl("lamb_stage1", &groupbert::lamb::stage1_cuda);
  m.impl("lamb_stage2", &groupbert::lamb::stage2_cuda);
}
#endif

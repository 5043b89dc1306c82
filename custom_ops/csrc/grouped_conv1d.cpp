// GroupedConv1d: the grouped 1-D convolution over the sequence of GroupBERT's
// convolution module (GroupBERT paper, section 3.2: kernel 7, 16 channels per group,
// "same" zero padding), on channels-last activations, with an optional padding mask.
//
// Letters: B batch, S sequence, H hidden, G = H / C groups, C channels per group,
// K kernel width (odd), P = K / 2 padding each side.
//
//   x      (B, S, H)  channels-last (what the dense layers produce)
//   weight (H, C, K)  exactly torch.nn.functional.conv1d's weight with groups = G
//   mask   (B, S)     optional, bool or x's dtype holding only 0 and 1
//   sequence_ids (B, S) optional, int64: packed sequences (Graphcore's packed BERT), 0 on
//                      padding; not together with mask
//   out    (B, S, H)  out[b, s, g*C + j] = sum_k sum_c weight[g*C + j, c, k]
//                                                    * xm[b, s + k - P, g*C + c]
// where xm = x * mask[..., None], zero outside [0, S). No bias: the graph adds it.
// The mask marks padding: a value other than 0 or 1 is an error on every path (the
// kernels skip masked rows rather than multiply them). With sequence_ids the term of
// input row s + k - P counts only where its id equals row s's and is not 0: each packed
// sequence is convolved as if alone, its boundaries zero padded, and rows of id 0 are 0.
//
// This file holds the checks, the choice of kernel, the work sharing and the
// registration. The CPU kernels are one source (grouped_conv1d_cpu_impl.h) compiled
// per instruction set (grouped_conv1d_{generic,avx2,avx512}.cpp), plus for bf16 the
// AVX512-BF16 dot products (grouped_conv1d_avx512_bf16.cpp, the avx512_bf16 level) and
// AMX tiles (grouped_conv1d_amx.cpp); cpu_capability.h picks the level at run time. The
// CUDA kernels live in grouped_conv1d_cuda.cu. The session's kernel policy
// (session/kernels.py) may call torch's convolution instead of this op.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#ifdef GROUPBERT_WITH_CUDA
// c10's stream header is what at::cuda::getCurrentCUDAStream forwards to, without
// pulling in the cuBLAS/cuSPARSE headers of ATen/cuda/CUDAContext.h.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "grouped_conv1d_cuda.h"
#endif

#include "cpu_capability.h"
#include "grouped_conv1d_amx.h"
#include "grouped_conv1d_cpu.h"
#ifdef GROUPBERT_X86_KERNELS
#include "grouped_conv1d_avx512_bf16.h"
#endif
#include "parallel.h"

namespace groupbert {
namespace {

using conv::kMaxChannelsPerGroup;

// ---------------------------------------------------------------------------------
// Input checks (shared by the CPU and CUDA kernels). Wrong inputs are the caller's
// mistake: ValueError in Python (TORCH_CHECK_VALUE), naming the shapes involved.
// ---------------------------------------------------------------------------------

conv::Shape check_inputs(const char* op, const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& mask, const std::optional<at::Tensor>& sequence_ids) {
  TORCH_CHECK_VALUE(x.dim() == 3, op, ": x must be (B, S, H), got shape ", x.sizes(), " (weight ", weight.sizes(),
                    ")");
  TORCH_CHECK_VALUE(weight.dim() == 3, op, ": weight must be (H, C, K) like conv1d's, got shape ", weight.sizes(),
                    " for x ", x.sizes());
  const auto dtype = x.scalar_type();
  TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kBFloat16 || dtype == at::kHalf, op,
                    ": x must be float32, float64, bfloat16 or float16, got ", dtype, " (x ", x.sizes(), ")");
  TORCH_CHECK_VALUE(weight.scalar_type() == dtype, op, ": weight dtype ", weight.scalar_type(), " differs from x dtype ",
                    dtype, " (weight ", weight.sizes(), ", x ", x.sizes(), ")");
  TORCH_CHECK_VALUE(weight.device() == x.device(), op, ": weight is on ", weight.device(), " but x is on ",
                    x.device());
  conv::Shape s{};
  s.B = x.size(0);
  s.S = x.size(1);
  s.H = x.size(2);
  s.C = weight.size(1);
  s.K = weight.size(2);
  TORCH_CHECK_VALUE(weight.size(0) == s.H, op, ": weight ", weight.sizes(),
                    " must have H = x.size(2) output channels, x is ", x.sizes());
  TORCH_CHECK_VALUE(s.C >= 1 && s.H % s.C == 0, op, ": channels per group C = weight.size(1) must divide H; weight ",
                    weight.sizes(), ", x ", x.sizes());
  TORCH_CHECK_VALUE(s.C <= kMaxChannelsPerGroup, op, ": at most ", kMaxChannelsPerGroup,
                    " channels per group are supported; weight ", weight.sizes(), ", x ", x.sizes());
  TORCH_CHECK_VALUE(s.K >= 1 && s.K % 2 == 1, op,
                    ": kernel width K = weight.size(2) must be odd for 'same' padding; weight ", weight.sizes(), ", x ",
                    x.sizes());
  s.G = s.H / s.C;
  s.P = s.K / 2;
  if (mask.has_value()) {
    const auto& m = *mask;
    TORCH_CHECK_VALUE(m.dim() == 2 && m.size(0) == s.B && m.size(1) == s.S, op, ": mask must be (B, S) = (", s.B,
                      ", ", s.S, "), got shape ", m.sizes(), " for x ", x.sizes());
    TORCH_CHECK_VALUE(m.scalar_type() == at::kBool || m.scalar_type() == dtype, op, ": mask must be bool or x's dtype ",
                      dtype, ", got ", m.scalar_type(), " (mask ", m.sizes(), ", x ", x.sizes(), ")");
    TORCH_CHECK_VALUE(m.device() == x.device(), op, ": mask is on ", m.device(), " but x is on ", x.device());
  }
  if (sequence_ids.has_value()) {
    const auto& ids = *sequence_ids;
    TORCH_CHECK_VALUE(!mask.has_value(), op, ": pass either mask or sequence_ids, not both (sequence id 0 marks ",
                      "padding)");
    TORCH_CHECK_VALUE(ids.dim() == 2 && ids.size(0) == s.B && ids.size(1) == s.S, op,
                      ": sequence_ids must be (B, S) = (", s.B, ", ", s.S, "), got shape ", ids.sizes(), " for x ",
                      x.sizes());
    TORCH_CHECK_VALUE(ids.scalar_type() == at::kLong, op, ": sequence_ids must be int64, got ", ids.scalar_type(),
                      "; pass sequence_ids.long()");
    TORCH_CHECK_VALUE(ids.device() == x.device(), op, ": sequence_ids is on ", ids.device(), " but x is on ",
                      x.device());
  }
  return s;
}

// The sequence ids as a contiguous int64 tensor (undefined when absent).
at::Tensor contiguous_ids(const std::optional<at::Tensor>& sequence_ids) {
  return sequence_ids.has_value() ? sequence_ids->contiguous() : at::Tensor();
}

template <typename T>
const T* data_or_null(const at::Tensor& t) {
  return t.defined() ? t.const_data_ptr<T>() : nullptr;
}

void check_grad_out(const at::Tensor& grad_out, const at::Tensor& x) {
  TORCH_CHECK_VALUE(grad_out.sizes() == x.sizes() && grad_out.scalar_type() == x.scalar_type(),
                    "grouped_conv1d_backward: grad_out ", grad_out.sizes(), " ", grad_out.scalar_type(), " must match x ",
                    x.sizes(), " ", x.scalar_type());
}

// The mask as a contiguous bool tensor (undefined when absent). A float mask must hold
// only 0 and 1: the kernels skip masked rows, they do not scale them, so 0.5 would
// silently act as 1. On the CPU the check names the first bad value. On a GPU the device
// checks it (a device-side assert, with this message): reading the answer back would stop
// the host until the device's queue had drained, twice per convolution layer and
// micro-batch. (The session passes the model's mask as bool, checked when it was fed.)
at::Tensor bool_mask(const char* op, const std::optional<at::Tensor>& mask) {
  if (!mask.has_value()) return at::Tensor();
  if (mask->scalar_type() == at::kBool) return mask->contiguous();
  const at::Tensor bad = mask->ne(0).logical_and(mask->ne(1));
  if (!mask->is_cpu()) {
    at::_assert_async(bad.any().logical_not(), std::string(op) +
                                                   ": mask must hold only 0 and 1 (it marks padded positions); pass "
                                                   "mask != 0 to treat every non-zero value as 1");
    return mask->ne(0).contiguous();
  }
  if (bad.any().item<bool>()) {
    const at::Tensor where = bad.nonzero()[0].cpu();
    const int64_t b = where[0].item<int64_t>(), s = where[1].item<int64_t>();
    TORCH_CHECK_VALUE(false, op, ": mask must hold only 0 and 1 (it marks padded positions), found ",
                      (*mask)[b][s].item<double>(), " at (b, s) = (", b, ", ", s, "); pass mask != 0 to treat every ",
                      "non-zero value as 1");
  }
  return mask->ne(0).contiguous();
}

// ---------------------------------------------------------------------------------
// torch's convolution, for fp16 and float64 on CUDA (no CUDA kernel of ours for them).
// ---------------------------------------------------------------------------------

at::Tensor masked(const at::Tensor& x, const std::optional<at::Tensor>& mask) {
  return mask.has_value() ? x * mask->unsqueeze(-1).to(x.scalar_type()) : x;
}

at::Tensor torch_forward(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& mask,
                         const conv::Shape& sh) {
  bool_mask("grouped_conv1d", mask);  // the same 0/1 check as the kernels
  const at::Tensor out = at::conv1d(masked(x, mask).transpose(1, 2), weight, {}, 1, sh.P, 1, sh.G);  // (B, H, S)
  return out.transpose(1, 2).contiguous();                                                             // (B, S, H)
}

std::tuple<at::Tensor, at::Tensor> torch_backward(const at::Tensor& grad_out, const at::Tensor& x,
                                                  const at::Tensor& weight, const std::optional<at::Tensor>& mask,
                                                  std::array<bool, 2> output_mask, const conv::Shape& sh) {
  bool_mask("grouped_conv1d_backward", mask);
  auto [grad_xm, grad_w, unused] = at::convolution_backward(
      grad_out.transpose(1, 2), masked(x, mask).transpose(1, 2), weight, std::nullopt, {1}, {sh.P}, {1}, false, {0},
      sh.G, {output_mask[0], output_mask[1], false});
  at::Tensor grad_x;
  if (output_mask[0]) grad_x = masked(grad_xm.transpose(1, 2), mask).contiguous();  // padded rows get no gradient
  return {grad_x, output_mask[1] ? grad_w.contiguous() : at::Tensor()};
}

// ---------------------------------------------------------------------------------
// CPU: dispatch to the kernel variant of the current level, work shared by threads.
// ---------------------------------------------------------------------------------

const conv::Kernels& cpu_kernels() {
  switch (cpu::capability()) {
#ifdef GROUPBERT_X86_KERNELS
    case cpu::Capability::kAvx512Bf16:  // fp32, fp16, float64; bf16 takes uses_dot_bf16's kernels
    case cpu::Capability::kAvx512:
      return conv::avx512::kernels();
    case cpu::Capability::kAvx2:
      return conv::avx2::kernels();
#endif
    default:
      return conv::generic::kernels();
  }
}

conv::Dtype kernel_dtype(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kDouble:
      return conv::Dtype::kDouble;
    case at::kBFloat16:
      return conv::Dtype::kBFloat16;
    case at::kHalf:
      return conv::Dtype::kHalf;
    default:
      return conv::Dtype::kFloat;
  }
}

// bf16 with 16 channels per group (GroupBERT's) runs on AMX tiles where the CPU has them
// (grouped_conv1d_amx.cpp): 1.5x to 2x the AVX-512 kernels there. Null otherwise; the
// emulated tiles under GROUPBERT_AMX=emulate (tests).
const conv::amx::TileKernels* amx_kernels(const at::Tensor& x, const conv::Shape& sh) {
  if (x.scalar_type() != at::kBFloat16 || sh.C != conv::amx::kChannels) return nullptr;
  switch (cpu::amx_tiles()) {
    case cpu::AmxTiles::kHardware:
#ifdef GROUPBERT_X86_KERNELS
      return &conv::amx::kernels();
#else
      return nullptr;  // not reached: amx_tiles() offers no hardware tiles without the x86 variants
#endif
    case cpu::AmxTiles::kEmulated:
      return &conv::amx_emulated::kernels();
    case cpu::AmxTiles::kNone:
      break;
  }
  return nullptr;
}

// bf16 at the avx512_bf16 level, where no AMX tiles take the shape, runs on bf16 pair
// dot products (grouped_conv1d_avx512_bf16.cpp) instead of widening to fp32: at
// GroupBERT base on one Zen 4 core (process CPU time), forward 4.1 against 8.0 ms, and
// fwd + bwd from 0.72-0.79x to 1.33-1.46x torch's oneDNN convolution (docs/custom_ops.md).
// Callers ask only where amx_kernels() gave none.
bool uses_dot_bf16(const at::Tensor& x) {
#ifdef GROUPBERT_X86_KERNELS
  return x.scalar_type() == at::kBFloat16 && cpu::capability() == cpu::Capability::kAvx512Bf16;
#else
  return false;
#endif
}

// A 64-byte aligned scratch buffer for one worker's chunk of items.
class Scratch {
 public:
  explicit Scratch(size_t bytes) : storage_(bytes + 64) {
    void* p = storage_.data();
    size_t space = storage_.size();
    data_ = std::align(64, bytes, p, space);
  }
  void* data() const { return data_; }

 private:
  std::vector<std::byte> storage_;
  void* data_;
};

// Packed weights of the vector kernels, (G, K, C, CP) in the accumulation type:
// forward wpk[g][k][c][j] = weight[g*C + j][c][k]. Grad-input,
// grad_x[s, g*C + c] = sum_k sum_j weight[g*C + j, c, k] * gout[s + P - k, g*C + j],
// is the forward kernel on gout with the weight transposed within each group and
// flipped along K: wpk[g][K-1-k][j][c] = weight[g*C + j][c][k].
at::Tensor pack_weights(const at::Tensor& weight, const conv::Shape& sh, bool grad_input) {
  const int64_t CP = conv::lanes_for(sh.C);
  const auto acc = weight.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor w = weight.to(acc).view({sh.G, sh.C, sh.C, sh.K});  // (G, j, c, K)
  at::Tensor packed = at::zeros({sh.G, sh.K, sh.C, CP}, weight.options().dtype(acc));
  if (grad_input)
    packed.narrow(3, 0, sh.C).copy_(w.flip(3).permute({0, 3, 1, 2}));  // [g][K-1-k][j][c]
  else
    packed.narrow(3, 0, sh.C).copy_(w.permute({0, 3, 2, 1}));  // [g][k][c][j]
  return packed;
}

#ifdef GROUPBERT_X86_KERNELS
// Packed weights of the AVX512-BF16 kernels: bf16 pairs (G, K, CP / 2, CP, 2), where
// [g][k][i][l][e] multiplies reduction index 2i + e into lane l at tap k (zero past C).
// Forward: lanes j, reduction c, weight[g*C + j][c][k]. Grad-input: lanes c, reduction
// j, the tap flipped: at K-1-k, weight[g*C + j][c][k]. A loop over the bits, groups
// shared out (the tensor ops' permuted copies cost more than a small call's convolution).
at::Tensor pack_pair_weights(const at::Tensor& weight, const conv::Shape& sh, bool grad_input) {
  const int64_t C = sh.C, K = sh.K, CP = conv::lanes_for(C);
  at::Tensor packed = at::zeros({sh.G, K, CP / 2, CP, 2}, weight.options());
  const auto* w = static_cast<const uint16_t*>(weight.const_data_ptr());  // contiguous (H, C, K)
  auto* out = static_cast<uint16_t*>(packed.mutable_data_ptr());
  // Written in order, read with a stride: the faster of the two orders (the other
  // scatters the writes over K blocks).
  const int64_t lane_stride = grad_input ? K : C * K, reduction_stride = grad_input ? C * K : K;
  at::parallel_for(0, sh.G, 1, [&](int64_t g_begin, int64_t g_end) {
    for (int64_t g = g_begin; g < g_end; ++g)
      for (int64_t k = 0; k < K; ++k) {
        const uint16_t* src = w + g * C * C * K + (grad_input ? K - 1 - k : k);
        uint16_t* dst = out + (g * K + k) * CP * CP;  // [i][l][e]
        for (int64_t i = 0; i < (C + 1) / 2; ++i)
          for (int64_t l = 0; l < C; ++l)
            for (int64_t e = 0; e < 2 && 2 * i + e < C; ++e)
              dst[(i * CP + l) * 2 + e] = src[(2 * i + e) * reduction_stride + l * lane_stride];
      }
  });
  return packed;
}
#endif

// out = conv(in masked by in_mask), rows zeroed by out_mask, sequences kept apart by
// `ids`: the forward pass, or grad-input with `grad_input` weights.
void run_conv(const at::Tensor& in, const bool* in_mask, const bool* out_mask, const int64_t* ids,
              const at::Tensor& weight, bool grad_input, at::Tensor& out, const conv::Shape& sh) {
  if (const conv::amx::TileKernels* amx = amx_kernels(in, sh)) {
    at::Tensor packed = at::empty({static_cast<int64_t>(conv::amx::packed_weight_elements(sh.G, sh.K))},
                                  weight.options());
    amx->pack_weights(static_cast<const uint16_t*>(weight.const_data_ptr()), grad_input, sh.G, sh.K,
                      static_cast<uint16_t*>(packed.mutable_data_ptr()));
    const conv::ConvCall call{in.const_data_ptr(), in_mask, out_mask, ids, packed.const_data_ptr(),
                              out.mutable_data_ptr(), sh, conv::Dtype::kBFloat16};
    const int64_t n_items = sh.B * ((sh.S + conv::amx::kConvTileRows - 1) / conv::amx::kConvTileRows);
    const size_t scratch = amx->scratch_bytes(sh.K);
    parallel_chunks(n_items, worker_count(n_items, sh.G * conv::amx::kConvTileRows * sh.C * sh.C * sh.K),
                    [&](int64_t, int64_t begin, int64_t end) {
                      Scratch buffer(scratch);
                      amx->conv_items(call, begin, end, buffer.data());
                    });
    return;
  }
#ifdef GROUPBERT_X86_KERNELS
  if (uses_dot_bf16(in)) {
    const at::Tensor packed = pack_pair_weights(weight, sh, grad_input);
    const conv::ConvCall call{in.const_data_ptr(), in_mask, out_mask, ids, packed.const_data_ptr(),
                              out.mutable_data_ptr(), sh, conv::Dtype::kBFloat16};
    const int64_t tile = conv::avx512_bf16::kConvTileRows;
    const int64_t n_items = sh.B * ((sh.S + tile - 1) / tile);
    const size_t scratch = conv::avx512_bf16::scratch_bytes(sh);
    parallel_chunks(n_items, worker_count(n_items, sh.G * tile * sh.C * sh.C * sh.K),
                    [&](int64_t, int64_t begin, int64_t end) {
                      Scratch buffer(scratch);
                      conv::avx512_bf16::conv_items(call, begin, end, buffer.data());
                    });
    return;
  }
#endif
  const at::Tensor packed = pack_weights(weight, sh, grad_input);
  const conv::Kernels& kernels = cpu_kernels();
  const conv::ConvCall call{in.const_data_ptr(), in_mask, out_mask, ids, packed.const_data_ptr(),
                            out.mutable_data_ptr(), sh, kernel_dtype(in)};
  const int64_t n_items = sh.B * ((sh.S + conv::kTileRows - 1) / conv::kTileRows);
  const int64_t CP = conv::lanes_for(sh.C);
  parallel_chunks(n_items, worker_count(n_items, sh.G * conv::kTileRows * sh.C * CP * sh.K),
                  [&](int64_t, int64_t begin, int64_t end) {
                    Scratch buffer(conv::scratch_bytes(sh));
                    kernels.conv(call, begin, end, buffer.data());
                  });
}

// grad_w[g*C + j][c][k] = sum over (b, s) of gout[b, s, g*C + j] * xm[b, s + k - P, g*C + c].
// The items are cut into 4 chunks per worker, fixed by their count, and each chunk's
// items are added in order into the chunk's own zeroed partial (G*K*CP*CP values, 344 KiB
// at GroupBERT base: L2 resident), whichever thread takes it, so no two threads write the
// same memory; the partials are summed in chunk order at the end, so the gradient is the
// same run to run (with partials per worker it varied with which chunks each took).
at::Tensor run_grad_weight(const at::Tensor& gout, const at::Tensor& x, const bool* mask, const int64_t* ids,
                           const at::Tensor& weight, const conv::Shape& sh) {
  const conv::amx::TileKernels* amx = amx_kernels(x, sh);
  [[maybe_unused]] const bool dot_bf16 = amx == nullptr && uses_dot_bf16(x);  // x86-64 only
  const int64_t CP = conv::lanes_for(sh.C);
#ifdef GROUPBERT_X86_KERNELS
  const int64_t tile = amx != nullptr ? conv::amx::kGradWeightTileRows
                       : dot_bf16 ? conv::avx512_bf16::grad_weight_tile_rows(sh.C)
                                  : conv::kTileRows;
#else
  const int64_t tile = amx != nullptr ? conv::amx::kGradWeightTileRows : conv::kTileRows;
#endif
  const int64_t n_items = sh.B * ((sh.S + tile - 1) / tile);
  const int64_t n_workers = worker_count(sh.B * sh.S, sh.H * sh.C * sh.K);
  const int64_t n_split = std::max<int64_t>(1, std::min(n_items, n_workers == 1 ? 1 : 4 * n_workers));
  const auto acc = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor partials = at::zeros({n_split, sh.G, sh.K, CP, CP}, x.options().dtype(acc));
  const conv::GradWeightCall call{gout.const_data_ptr(), x.const_data_ptr(), mask, ids, partials.mutable_data_ptr(),
                                  sh, kernel_dtype(x)};
  if (x.numel() == 0) {
    // nothing to sum: the gradient is zero
  } else if (amx != nullptr) {
    const size_t scratch = amx->scratch_bytes(sh.K);
    parallel_fixed_chunks(n_items, n_split, n_workers, [&](int64_t chunk, int64_t begin, int64_t end) {
      Scratch buffer(scratch);
      amx->grad_weight_items(call, chunk, begin, end, buffer.data());
    });
#ifdef GROUPBERT_X86_KERNELS
  } else if (dot_bf16) {
    const size_t scratch = conv::avx512_bf16::scratch_bytes(sh);
    parallel_chunks(n_items, n_split, [&](int64_t worker, int64_t begin, int64_t end) {
      Scratch buffer(scratch);
      conv::avx512_bf16::grad_weight_items(call, worker, begin, end, buffer.data());
    });
#endif
  } else {
    const conv::Kernels& kernels = cpu_kernels();
    parallel_fixed_chunks(n_items, n_split, n_workers, [&](int64_t chunk, int64_t begin, int64_t end) {
      Scratch buffer(conv::scratch_bytes(sh));
      kernels.grad_weight(call, chunk, begin, end, buffer.data());
    });
  }
  // (G, K, c, j) -> (G, j, c, K); the AMX partials hold (G, K, j, c).
  const at::Tensor sum = partials.sum(0).narrow(2, 0, sh.C).narrow(3, 0, sh.C);
  const at::Tensor gw = amx != nullptr ? sum.permute({0, 2, 3, 1}) : sum.permute({0, 3, 2, 1});
  return gw.reshape({sh.H, sh.C, sh.K}).to(weight.scalar_type()).contiguous();
}

at::Tensor grouped_conv1d_cpu(const at::Tensor& x_in, const at::Tensor& weight_in,
                              const std::optional<at::Tensor>& mask, const std::optional<at::Tensor>& sequence_ids) {
  const conv::Shape sh = check_inputs("grouped_conv1d", x_in, weight_in, mask, sequence_ids);
  const at::Tensor x = x_in.contiguous(), weight = weight_in.contiguous(), m = bool_mask("grouped_conv1d", mask),
                   ids = contiguous_ids(sequence_ids);
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  if (out.numel() == 0) return out;
  run_conv(x, data_or_null<bool>(m), nullptr, data_or_null<int64_t>(ids), weight, /*grad_input=*/false, out, sh);
  return out;
}

std::tuple<at::Tensor, at::Tensor> grouped_conv1d_backward_cpu(
    const at::Tensor& grad_out_in, const at::Tensor& x_in, const at::Tensor& weight_in,
    const std::optional<at::Tensor>& mask, std::array<bool, 2> output_mask,
    const std::optional<at::Tensor>& sequence_ids) {
  const conv::Shape sh = check_inputs("grouped_conv1d_backward", x_in, weight_in, mask, sequence_ids);
  check_grad_out(grad_out_in, x_in);
  const at::Tensor gout = grad_out_in.contiguous(), x = x_in.contiguous(), weight = weight_in.contiguous(),
                   m = bool_mask("grouped_conv1d_backward", mask), ids = contiguous_ids(sequence_ids);
  const bool* mp = data_or_null<bool>(m);
  const int64_t* idp = data_or_null<int64_t>(ids);
  at::Tensor grad_x, grad_w;
  if (output_mask[0]) {
    grad_x = at::empty_like(x, at::MemoryFormat::Contiguous);
    if (grad_x.numel() > 0) run_conv(gout, nullptr, mp, idp, weight, /*grad_input=*/true, grad_x, sh);
  }
  if (output_mask[1]) grad_w = run_grad_weight(gout, x, mp, idp, weight, sh);
  return {grad_x, grad_w};
}

#ifdef GROUPBERT_WITH_CUDA
// ---------------------------------------------------------------------------------
// CUDA: the kernels live in grouped_conv1d_cuda.cu behind raw-pointer launchers.
// ---------------------------------------------------------------------------------

cuda_ops::ConvDims cuda_dims(const conv::Shape& sh) { return cuda_ops::ConvDims{sh.B, sh.S, sh.H, sh.C, sh.K}; }

bool is_bf16(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16; }

// The CUDA kernels take fp32 and bf16. fp16 and float64 run torch's convolution, which
// cannot keep packed sequences apart: with sequence ids fp16 runs the fp32 kernels on
// widened copies (sums in fp32 and one rounding, as the fp16 CPU kernels) and float64 is
// refused rather than silently computed in fp32.
bool cuda_kernel_dtype(const at::Tensor& x) {
  return x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16;
}

void check_cuda_sequence_dtype(const char* op, const at::Tensor& x) {
  TORCH_CHECK_VALUE(x.scalar_type() != at::kDouble, op, ": sequence_ids on CUDA take float32, bfloat16 or float16 x, ",
                    "got float64 (x ", x.sizes(), "); run float64 on the CPU");
}

at::Tensor grouped_conv1d_cuda(const at::Tensor& x_in, const at::Tensor& weight_in,
                               const std::optional<at::Tensor>& mask, const std::optional<at::Tensor>& sequence_ids) {
  const conv::Shape sh = check_inputs("grouped_conv1d", x_in, weight_in, mask, sequence_ids);
  if (!cuda_kernel_dtype(x_in)) {
    if (!sequence_ids.has_value()) return torch_forward(x_in, weight_in, mask, sh);
    check_cuda_sequence_dtype("grouped_conv1d", x_in);
    return grouped_conv1d_cuda(x_in.to(at::kFloat), weight_in.to(at::kFloat), mask, sequence_ids)
        .to(x_in.scalar_type());
  }
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous(), weight = weight_in.contiguous(), m = bool_mask("grouped_conv1d", mask),
                   ids = contiguous_ids(sequence_ids);
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  if (out.numel() == 0) return out;
  const bool* mp = data_or_null<bool>(m);
  const int64_t* idp = data_or_null<int64_t>(ids);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (is_bf16(x)) {
    C10_CUDA_CHECK(cuda_ops::grouped_conv1d_forward_bf16(x.const_data_ptr(), weight.const_data_ptr(), mp, idp,
                                                         out.mutable_data_ptr(), cuda_dims(sh), stream));
  } else {
    C10_CUDA_CHECK(cuda_ops::grouped_conv1d_forward_f32(x.const_data_ptr<float>(), weight.const_data_ptr<float>(),
                                                        mp, idp, out.mutable_data_ptr<float>(), cuda_dims(sh), stream));
  }
  return out;
}

std::tuple<at::Tensor, at::Tensor> grouped_conv1d_backward_cuda(
    const at::Tensor& grad_out_in, const at::Tensor& x_in, const at::Tensor& weight_in,
    const std::optional<at::Tensor>& mask, std::array<bool, 2> output_mask,
    const std::optional<at::Tensor>& sequence_ids) {
  const conv::Shape sh = check_inputs("grouped_conv1d_backward", x_in, weight_in, mask, sequence_ids);
  check_grad_out(grad_out_in, x_in);
  if (!cuda_kernel_dtype(x_in)) {
    if (!sequence_ids.has_value()) return torch_backward(grad_out_in, x_in, weight_in, mask, output_mask, sh);
    check_cuda_sequence_dtype("grouped_conv1d_backward", x_in);
    auto [grad_x, grad_w] = grouped_conv1d_backward_cuda(grad_out_in.to(at::kFloat), x_in.to(at::kFloat),
                                                         weight_in.to(at::kFloat), mask, output_mask, sequence_ids);
    return {grad_x.defined() ? grad_x.to(x_in.scalar_type()) : grad_x,
            grad_w.defined() ? grad_w.to(x_in.scalar_type()) : grad_w};
  }
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor gout = grad_out_in.contiguous(), x = x_in.contiguous(), weight = weight_in.contiguous(),
                   m = bool_mask("grouped_conv1d_backward", mask), ids = contiguous_ids(sequence_ids);
  const bool* mp = data_or_null<bool>(m);
  const int64_t* idp = data_or_null<int64_t>(ids);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const auto dims = cuda_dims(sh);
  at::Tensor grad_x, grad_w;
  if (output_mask[0]) {
    grad_x = at::empty_like(x, at::MemoryFormat::Contiguous);
    if (grad_x.numel() > 0 && is_bf16(x)) {
      C10_CUDA_CHECK(cuda_ops::grouped_conv1d_grad_input_bf16(gout.const_data_ptr(), weight.const_data_ptr(), mp,
                                                              idp, grad_x.mutable_data_ptr(), dims, stream));
    } else if (grad_x.numel() > 0) {
      C10_CUDA_CHECK(cuda_ops::grouped_conv1d_grad_input_f32(gout.const_data_ptr<float>(),
                                                             weight.const_data_ptr<float>(), mp, idp,
                                                             grad_x.mutable_data_ptr<float>(), dims, stream));
    }
  }
  if (output_mask[1]) {
    // fp32 accumulation buffer, cast to the weight dtype at the end.
    at::Tensor gw32 = at::zeros(weight.sizes(), weight.options().dtype(at::kFloat));
    if (x.numel() > 0 && is_bf16(x)) {
      C10_CUDA_CHECK(cuda_ops::grouped_conv1d_grad_weight_bf16(gout.const_data_ptr(), x.const_data_ptr(), mp, idp,
                                                               gw32.mutable_data_ptr<float>(), dims, stream));
    } else if (x.numel() > 0) {
      C10_CUDA_CHECK(cuda_ops::grouped_conv1d_grad_weight_f32(gout.const_data_ptr<float>(), x.const_data_ptr<float>(),
                                                              mp, idp, gw32.mutable_data_ptr<float>(), dims, stream));
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
  m.def("grouped_conv1d(Tensor x, Tensor weight, Tensor? mask=None, Tensor? sequence_ids=None) -> Tensor");
  m.def(
      "grouped_conv1d_backward(Tensor grad_out, Tensor x, Tensor weight, Tensor? mask, "
      "bool[2] output_mask, Tensor? sequence_ids=None) -> (Tensor, Tensor)");
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

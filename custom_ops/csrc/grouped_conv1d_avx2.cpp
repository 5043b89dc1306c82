// GroupedConv1d CPU kernels for x86-64 with AVX2, FMA and F16C, compiled with
// -mavx2 -mfma -mf16c only (custom_ops/CMakeLists.txt) and called only when the CPU has
// them (cpu_capability.h). 16 ymm registers: the micro-kernels are output-stationary
// with 8 accumulators (at C = 16, 4 rows x 2 ymm for the forward pass and grad-input,
// 4 channels x 2 ymm for grad-weight), the weight or grad-output vectors and one
// broadcast beside them. From L1 on a Zen 4 core these ran at 110 GFLOP/s of its
// 112 GFLOP/s FMA peak; the AVX-512 variant's input-stationary K = 7 blocking needs 24
// registers and, split into halves to fit, ran at 86-102 (docs/custom_ops.md).
// bf16 and fp16 are stored as such and converted to fp32 in registers (F16C for fp16).
#include <cstdint>

#include "f16c_convert.h"
#include "grouped_conv1d_cpu.h"

namespace groupbert::conv::avx2 {
namespace {

struct Isa : F16cConversions<Isa> {
  static constexpr int kVectorBytes = 32;
  static constexpr int kRegisters = 16;
  static constexpr int kAccumulators = 8;
  static constexpr bool kInputStationary = false;
};

}  // namespace
}  // namespace groupbert::conv::avx2

#include "grouped_conv1d_cpu_impl.h"

namespace groupbert::conv::avx2 {

const Kernels& kernels() {
  static const Kernels k = make_kernels<Isa>();
  return k;
}

}  // namespace groupbert::conv::avx2

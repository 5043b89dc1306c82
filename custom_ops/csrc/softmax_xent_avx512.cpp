// The softmax cross-entropy's CPU loops (softmax_xent_cpu_impl.h) compiled with
// the AVX-512 F/BW/VL/DQ flags
// (custom_ops/CMakeLists.txt), called only where the CPU has them (cpu_capability.h).
#include "softmax_xent_cpu_impl.h"

namespace groupbert::xent::avx512 {
namespace {
struct Isa {};
}  // namespace

const RowKernels& kernels() { return RowLoops<Isa>::kernels(); }

}  // namespace groupbert::xent::avx512

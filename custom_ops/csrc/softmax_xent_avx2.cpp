// The softmax cross-entropy's CPU loops (softmax_xent_cpu_impl.h) compiled with
// -mavx2 -mfma -mf16c (custom_ops/CMakeLists.txt), called
// only where the CPU has them (cpu_capability.h).
#include "softmax_xent_cpu_impl.h"

namespace groupbert::xent::avx2 {
namespace {
struct Isa {};
}  // namespace

const RowKernels& kernels() { return RowLoops<Isa>::kernels(); }

}  // namespace groupbert::xent::avx2

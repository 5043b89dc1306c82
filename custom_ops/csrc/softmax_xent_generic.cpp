// The softmax cross-entropy's CPU loops (softmax_xent_cpu_impl.h) compiled with
// the target's baseline flags: CPUs without AVX2, other architectures, and
// GROUPBERT_CPU_CAPABILITY=generic.
#include "softmax_xent_cpu_impl.h"

namespace groupbert::xent::generic {
namespace {
struct Isa {};
}  // namespace

const RowKernels& kernels() { return RowLoops<Isa>::kernels(); }

}  // namespace groupbert::xent::generic

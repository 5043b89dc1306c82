// Fused LAMB CPU kernels in portable C++ (fused_lamb_cpu_impl.h), compiled with the
// target's baseline flags: CPUs without AVX2, other architectures, and
// GROUPBERT_CPU_CAPABILITY=generic.
#include "fused_lamb_cpu_impl.h"

namespace groupbert::lamb::generic {
namespace {
struct Isa {};
using Loops = PortableLoops<Isa>;
}  // namespace

const PieceKernels& kernels() {
  static const PieceKernels k{&Loops::sum_squares<float>, &Loops::sum_squares<uint16_t>,
                              &Loops::stage1<float>,      &Loops::stage1<uint16_t>,
                              &Loops::stage2_f32,         &Loops::stage2_bf16};
  return k;
}

}  // namespace groupbert::lamb::generic

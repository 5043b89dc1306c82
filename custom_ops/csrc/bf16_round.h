// fp32 -> bf16 rounding on GCC vector types (or scalars), shared by the CPU kernel
// variants. Internal linkage (anonymous namespace): each variant keeps the copy compiled
// with its own target flags, never another's.
#pragma once

#include <cstring>

namespace groupbert {
namespace {

// The bf16 bits of fp32 lanes v, in the low half of each 32-bit lane: rounded to nearest
// even, NaN kept NaN (0x7FC0), as c10::BFloat16 converts. Floats and Words are GCC
// vectors of the same number of floats and uint32_t, or float and uint32_t.
template <typename Words, typename Floats>
inline Words bf16_bits(const Floats& v) {
  Words u;
  std::memcpy(&u, &v, sizeof(u));
  const Words rounded = (u + (0x7FFFu + ((u >> 16) & 1u))) >> 16;
  return v != v ? Words{} + 0x7FC0u : rounded;
}

}  // namespace
}  // namespace groupbert

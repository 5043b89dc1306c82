// Which CPU kernel variant the compiled ops run: detected once from CPUID and the OS's
// saved register state, lowered on request by GROUPBERT_CPU_CAPABILITY (as ATen's
// ATEN_CPU_CAPABILITY lowers torch's), so every variant can be tested and benchmarked
// on one machine. The library is one portable build: each variant is compiled with its
// own target flags (custom_ops/CMakeLists.txt) and only called when this says so.
#pragma once

#include <string>
#include <vector>

namespace groupbert::cpu {

// Ordered: a CPU that runs one level runs every lower one.
enum class Capability : int {
  kGeneric = 0,  // portable C++ (any CPU, any architecture)
  kAvx2 = 1,     // x86-64 with AVX2, FMA and F16C (Haswell, Zen 1 and later)
  kAvx512 = 2,   // x86-64 with AVX-512 F, BW, VL and DQ (Skylake-SP, Zen 4 and later)
  kAvx512Bf16 = 3,  // avx512 plus AVX512-BF16 (vdpbf16ps: Cooper Lake, Sapphire Rapids, Zen 4 and later)
};

const char* name(Capability capability);

// The best level this CPU and OS support (CPUID and XGETBV, read once).
Capability hardware_capability();

// The level the kernels use now: hardware_capability(), lowered to
// GROUPBERT_CPU_CAPABILITY (generic, avx2, avx512 or avx512_bf16) when that names a
// lower one (avx512 on a CPU with AVX512-BF16: the AVX-512 kernels without bf16 products),
// then to the highest level at or below it whose kernels passed their known-answer run
// in a child process (kernel_check.h; run once per level and process, at first use).
// The variable is read on every call, so tests and benchmarks can switch levels;
// a level above the hardware's is clamped to it, an unknown name is an error.
Capability capability();

// Which tiles bf16 convolutions with 16 channels per group run on.
enum class AmxTiles {
  kNone,      // none: the level's vector kernels run
  kHardware,  // the CPU's AMX tiles
  kEmulated,  // the tile instructions emulated in C++ (GROUPBERT_AMX=emulate, for tests)
};

// kHardware when the CPU has AMX-BF16, Linux granted this process the tile state
// (arch_prctl, asked once), the level in use is avx512 or above (the AMX kernels use
// AVX-512 around the tiles), the tiles passed their known-answer run (kernel_check.h) and
// GROUPBERT_AMX is neither "0" nor "emulate"; kEmulated whenever GROUPBERT_AMX is
// "emulate", on any CPU and level. GROUPBERT_AMX is read on every call.
AmxTiles amx_tiles();

// amx_tiles() in words, with the reason when it is kNone: "hardware", "emulated
// (GROUPBERT_AMX=emulate)", or e.g. "off: this CPU has no AMX-BF16".
std::string amx_state();

// The levels this machine can run, lowest first (e.g. generic, avx2, avx512, avx512_bf16).
std::vector<std::string> supported_capabilities();

// The features the dispatch looked at, e.g. "avx2 fma f16c avx512f avx512bw avx512vl
// avx512dq avx512bf16" (AMX only when the OS granted the tiles).
std::string features();

}  // namespace groupbert::cpu

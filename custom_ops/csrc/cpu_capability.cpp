// CPU feature detection and the choice of kernel variant (cpu_capability.h), and the
// ops that report it to Python: groupbert::cpu_capability, cpu_capabilities,
// cpu_features. Compiled with the baseline flags of the target, like every file that
// is not a kernel variant.
#include "cpu_capability.h"

#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cctype>
#include <cstdlib>
#include <cstring>

// GROUPBERT_X86_KERNELS: CMake built the x86 variants (x86-64 targets only); without
// them every CPU runs the generic kernels, whatever it supports.
#ifdef GROUPBERT_X86_KERNELS
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace groupbert::cpu {
namespace {

struct Features {
  bool avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false, avx512bf16 = false;
  bool amx = false;  // AMX-TILE and AMX-BF16, with the tile state granted by the OS
};

#ifdef GROUPBERT_X86_KERNELS
// Linux: a process must ask for the AMX tile data state before it touches a tile.
constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;

// XCR0: the register state the OS saves on a context switch. AVX needs the SSE and
// YMM halves (bits 1, 2); AVX-512 also the opmask and both ZMM parts (bits 5, 6, 7).
uint64_t xcr0() {
  uint32_t eax = 0, edx = 0;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<uint64_t>(edx) << 32) | eax;
}

Features detect() {
  Features f;
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool osxsave = c & (1u << 27), avx = c & (1u << 28);
  if (!osxsave || !avx) return f;
  const uint64_t xcr = xcr0();
  const bool os_avx = (xcr & 0x6) == 0x6, os_avx512 = (xcr & 0xe6) == 0xe6;
  if (!os_avx) return f;
  f.fma = c & (1u << 12);
  f.f16c = c & (1u << 29);
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return f;
  f.avx2 = b & (1u << 5);
  if (os_avx512) {
    f.avx512f = b & (1u << 16);
    f.avx512dq = b & (1u << 17);
    f.avx512bw = b & (1u << 30);
    f.avx512vl = b & (1u << 31);
  }
  const bool amx_bf16 = d & (1u << 22), amx_tile = d & (1u << 24);
  unsigned a1 = 0, b1 = 0, c1 = 0, d1 = 0;
  if (os_avx512 && __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1)) f.avx512bf16 = a1 & (1u << 5);
  f.amx = amx_bf16 && amx_tile && syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return f;
}
#else
Features detect() { return Features{}; }
#endif

const Features& features_once() {
  static const Features f = detect();
  return f;
}

Capability from_features(const Features& f) {
  const bool avx512 = f.avx2 && f.fma && f.f16c && f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq;
  if (avx512 && f.avx512bf16) return Capability::kAvx512Bf16;
  if (avx512) return Capability::kAvx512;
  if (f.avx2 && f.fma && f.f16c) return Capability::kAvx2;
  return Capability::kGeneric;
}

constexpr Capability kAll[] = {Capability::kGeneric, Capability::kAvx2, Capability::kAvx512, Capability::kAvx512Bf16};

}  // namespace

const char* name(Capability capability) {
  switch (capability) {
    case Capability::kGeneric:
      return "generic";
    case Capability::kAvx2:
      return "avx2";
    case Capability::kAvx512:
      return "avx512";
    case Capability::kAvx512Bf16:
      return "avx512_bf16";
  }
  return "generic";
}

Capability hardware_capability() {
  static const Capability best = from_features(features_once());
  return best;
}

Capability capability() {
  const Capability best = hardware_capability();
  const char* env = std::getenv("GROUPBERT_CPU_CAPABILITY");
  if (env == nullptr || env[0] == '\0') return best;
  std::string wanted(env);
  for (char& ch : wanted) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  for (Capability level : kAll) {
    if (wanted == name(level)) return static_cast<int>(level) < static_cast<int>(best) ? level : best;
  }
  TORCH_CHECK_VALUE(false, "GROUPBERT_CPU_CAPABILITY=", env, " is not a kernel level: use generic, avx2 or avx512 ",
                    "(or avx512_bf16: avx512 with bf16 dot products), or unset it for the best this CPU runs, ",
                    name(best));
  return best;  // not reached
}

bool amx_usable() {
  if (!features_once().amx || static_cast<int>(capability()) < static_cast<int>(Capability::kAvx512)) return false;
  const char* env = std::getenv("GROUPBERT_AMX");
  return !(env != nullptr && std::strcmp(env, "0") == 0);
}

std::vector<std::string> supported_capabilities() {
  std::vector<std::string> out;
  for (Capability level : kAll) {
    if (static_cast<int>(level) <= static_cast<int>(hardware_capability())) out.emplace_back(name(level));
  }
  return out;
}

std::string features() {
  const Features& f = features_once();
  std::string out;
  const std::pair<bool, const char*> named[] = {
      {f.avx2, "avx2"},         {f.fma, "fma"},           {f.f16c, "f16c"},         {f.avx512f, "avx512f"},
      {f.avx512bw, "avx512bw"}, {f.avx512vl, "avx512vl"}, {f.avx512dq, "avx512dq"}, {f.avx512bf16, "avx512bf16"},
      {f.amx, "amx-bf16"},
  };
  for (const auto& [present, feature] : named) {
    if (!present) continue;
    if (!out.empty()) out += ' ';
    out += feature;
  }
  return out;
}

}  // namespace groupbert::cpu

TORCH_LIBRARY_FRAGMENT(groupbert, m) {
  // The kernel level the ops run now (GROUPBERT_CPU_CAPABILITY applied).
  m.def("cpu_capability() -> str", [] { return std::string(groupbert::cpu::name(groupbert::cpu::capability())); });
  // Every level this machine can run, lowest first.
  m.def("cpu_capabilities() -> str[]", [] { return groupbert::cpu::supported_capabilities(); });
  // The CPU features the dispatch detected.
  m.def("cpu_features() -> str", [] { return groupbert::cpu::features(); });
}

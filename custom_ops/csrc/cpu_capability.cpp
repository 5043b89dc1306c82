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

#include "kernel_check.h"

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
  bool amx_cpu = false;  // AMX-TILE and AMX-BF16 (CPUID)
  bool amx = false;      // and the tile state granted by the OS
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
  f.amx_cpu = amx_bf16 && amx_tile;
  f.amx = f.amx_cpu && syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
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

namespace {

// The level GROUPBERT_CPU_CAPABILITY asks for, clamped to the hardware's.
Capability requested_capability() {
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

Path path_of(Capability level) {
  return level == Capability::kAvx2 ? Path::kAvx2 : level == Capability::kAvx512 ? Path::kAvx512 : Path::kAvx512Bf16;
}

Capability lower(Capability level) { return static_cast<Capability>(static_cast<int>(level) - 1); }

}  // namespace

Capability capability() {
  Capability level = requested_capability();
  while (level != Capability::kGeneric) {
    const auto instead = [level] {
      return std::string("the compiled ops fall back to the ") + name(lower(level)) + " level";
    };
    if (passed_check(path_of(level), instead)) break;
    level = lower(level);
  }
  return level;
}

namespace {

struct AmxChoice {
  AmxTiles tiles;
  std::string why_not;  // for kNone
};

AmxChoice choose_amx() {
  const char* env = std::getenv("GROUPBERT_AMX");
  if (env != nullptr && std::strcmp(env, "emulate") == 0) return {AmxTiles::kEmulated, ""};
  if (env != nullptr && std::strcmp(env, "0") == 0) return {AmxTiles::kNone, "GROUPBERT_AMX=0 turns the tiles off"};
#ifndef GROUPBERT_X86_KERNELS
  return {AmxTiles::kNone, "this library has no hardware AMX kernels (another architecture, or built with "
                           "GROUPBERT_X86_VARIANTS=OFF)"};
#endif
  const Features& f = features_once();
  if (!f.amx_cpu) return {AmxTiles::kNone, "this CPU has no AMX-BF16"};
  if (!f.amx) return {AmxTiles::kNone, "Linux did not grant this process the AMX tile state (arch_prctl)"};
  const Capability level = capability();
  if (static_cast<int>(level) < static_cast<int>(Capability::kAvx512))
    return {AmxTiles::kNone,
            std::string("the kernels run at the ") + name(level) + " level, below the avx512 the tiles need"};
  const auto instead = [level] {
    return std::string("bf16 convolutions run the ") + name(level) + " kernels instead";
  };
  if (!passed_check(Path::kAmx, instead)) return {AmxTiles::kNone, "the tiles failed their known-answer run"};
  return {AmxTiles::kHardware, ""};
}

}  // namespace

AmxTiles amx_tiles() { return choose_amx().tiles; }

std::string amx_state() {
  const AmxChoice choice = choose_amx();
  switch (choice.tiles) {
    case AmxTiles::kHardware:
      return "hardware";
    case AmxTiles::kEmulated:
      return "emulated (GROUPBERT_AMX=emulate)";
    case AmxTiles::kNone:
      break;
  }
  return "off: " + choice.why_not;
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
  // Which tiles bf16 convolutions with 16 channels per group run on: "hardware",
  // "emulated (...)" or "off: <why>".
  m.def("amx_state() -> str", [] { return groupbert::cpu::amx_state(); });
  // The known-answer runs of this process so far, one line per path (kernel_check.h).
  m.def("kernel_checks() -> str[]", [] { return groupbert::cpu::check_results(); });
}

// Known-answer runs of the instruction-set paths, in a child process, before first use.
//
// CPUID and XGETBV say what a CPU and its OS promise; a path compiled for it can still
// fault or compute wrongly where the promise is not kept (a hypervisor that reports a
// feature it traps, an OS that does not save a register state) or where our code or the
// compiler is wrong about the instructions: the AMX path, a default on every AMX CPU,
// raised SIGILL on the first tile instruction for every bf16 GroupBERT run there
// (issue 51). So before a path is first used, a tiny problem with an exact answer runs
// through its kernels in a forked child (one thread, no torch, plain buffers); a child
// killed by a signal, or a wrong answer, takes the path out for the rest of the process
// (the next level down runs) with one `note:` line on stderr saying why.
#pragma once

#include <functional>
#include <string>
#include <vector>

namespace groupbert::cpu {

// The paths that can fault: each vector level above generic (the convolution and LAMB
// kernels compiled with its flags) and the AMX tiles.
enum class Path { kAvx2, kAvx512, kAvx512Bf16, kAmx };

const char* path_name(Path path);

// True when `path` computed the known answer in a child process. Checked once per process
// (thread-safe; later calls read the outcome without a lock); the failure prints
// "note: <why>; <instead()>" on stderr, where `instead` says what runs in its place.
bool passed_check(Path path, const std::function<std::string()>& instead);

// One line per path checked so far in this process: "avx512: passed",
// "amx: failed: killed by SIGILL (illegal instruction)".
std::vector<std::string> check_results();

}  // namespace groupbert::cpu

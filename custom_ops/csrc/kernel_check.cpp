// Known-answer runs of the instruction-set paths in a child process (kernel_check.h).
// Compiled with the baseline flags: everything here runs on any CPU; only the kernels
// called in the child use the path's instructions.
//
// The problem: B = 2, S = 37 (two full tiles of 16 and a partial one), 3 groups of 16
// channels, K = 7, a padding mask, integer inputs (x in -2..2, weights and grad_out in
// -1..1). Every product and partial sum is then an integer of magnitude at most 224, exact
// in fp32 whatever the order of the sums, and exact in bf16 (integers up to 256 are):
// every correct kernel returns exactly these bits, in fp32 and bf16. LAMB's stage 1 and
// sums of squares are compared with a double computation to 1e-5.
#include "kernel_check.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iterator>
#include <memory>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#ifdef GROUPBERT_X86_KERNELS
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "fused_lamb_cpu.h"
#include "grouped_conv1d_amx.h"
#include "grouped_conv1d_avx512_bf16.h"
#include "grouped_conv1d_cpu.h"
#include "softmax_xent_cpu.h"
#endif

namespace groupbert::cpu {
namespace {

constexpr Path kPaths[] = {Path::kAvx2, Path::kAvx512, Path::kAvx512Bf16, Path::kAmx};

struct Outcome {
  bool checked = false, passed = false;
  std::string why;  // of a failure
};

std::mutex mutex;  // held while a path is checked
Outcome outcomes[std::size(kPaths)];
// Per path: 0 not checked yet, 1 passed, 2 failed (the per-call read of capability()).
std::atomic<int> verdicts[std::size(kPaths)];

#ifdef GROUPBERT_X86_KERNELS

// ------------------------------------------------------------------ the problem

constexpr int64_t kB = 2, kS = 37, kC = 16, kG = 3, kH = kC * kG, kK = 7, kP = kK / 2;

// Buffers 64-byte aligned, as torch's allocator gives the ops' tensors (the kernels load
// packed weights with aligned instructions).
template <typename T>
struct Aligned64 {
  using value_type = T;
  Aligned64() = default;
  template <typename U>
  explicit Aligned64(const Aligned64<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const Aligned64<U>&) const { return true; }
  template <typename U>
  bool operator!=(const Aligned64<U>&) const { return false; }
};
template <typename T>
using Array = std::vector<T, Aligned64<T>>;

uint16_t bf16_of_integer(float v) {  // exact for the problem's integers
  uint32_t word;
  std::memcpy(&word, &v, sizeof(word));
  return static_cast<uint16_t>(word >> 16);
}
float float_of_bf16(uint16_t bits) {
  const uint32_t word = static_cast<uint32_t>(bits) << 16;
  float v;
  std::memcpy(&v, &word, sizeof(v));
  return v;
}

struct Problem {
  conv::Shape shape{kB, kS, kH, kC, kK, kG, kP};
  Array<float> x, w, gout;                // (B, S, H), (H, C, K), (B, S, H)
  std::unique_ptr<bool[]> mask;           // (B, S)
  Array<float> out, grad_w;               // the answers: (B, S, H), (G, j, c, K)
  Array<uint16_t> x16, w16, gout16;        // the same in bf16

  Problem() : x(kB * kS * kH), w(kH * kC * kK), gout(kB * kS * kH), mask(new bool[kB * kS]) {
    for (int64_t i = 0; i < kB * kS * kH; ++i) {
      x[i] = static_cast<float>((i * 7 + i / kH * 3) % 5 - 2);
      gout[i] = static_cast<float>((i * 5 + i / kH) % 3 - 1);
    }
    for (int64_t i = 0; i < kH * kC * kK; ++i) w[i] = static_cast<float>((i * 11 + i / kK) % 3 - 1);
    for (int64_t b = 0; b < kB; ++b)
      for (int64_t s = 0; s < kS; ++s) mask[b * kS + s] = !(s % 9 == 4 || (b == 1 && s >= kS - 5));
    for (float f : x) x16.push_back(bf16_of_integer(f));
    for (float f : w) w16.push_back(bf16_of_integer(f));
    for (float f : gout) gout16.push_back(bf16_of_integer(f));
    out.assign(kB * kS * kH, 0.0f);
    grad_w.assign(kH * kC * kK, 0.0f);
    for (int64_t b = 0; b < kB; ++b)
      for (int64_t s = 0; s < kS; ++s)
        for (int64_t g = 0; g < kG; ++g)
          for (int64_t j = 0; j < kC; ++j)
            for (int64_t c = 0; c < kC; ++c)
              for (int64_t k = 0; k < kK; ++k) {
                const int64_t r = s + k - kP;
                if (r < 0 || r >= kS || !mask[b * kS + r]) continue;
                const float xm = x[(b * kS + r) * kH + g * kC + c];
                out[(b * kS + s) * kH + g * kC + j] += w[((g * kC + j) * kC + c) * kK + k] * xm;
                grad_w[((g * kC + j) * kC + c) * kK + k] += gout[(b * kS + s) * kH + g * kC + j] * xm;
              }
  }
};

// `bytes` zeroed bytes.
struct Buffer {
  Array<unsigned char> storage;
  void* data;
  explicit Buffer(size_t bytes) : storage(bytes, 0), data(storage.data()) {}
};

// Throws the first difference from the answer, naming it.
void expect(const char* what, int64_t n, const Array<float>& want, const std::function<float(int64_t)>& got) {
  for (int64_t i = 0; i < n; ++i)
    if (got(i) != want[i])
      throw std::runtime_error(std::string(what) + " computed " + std::to_string(got(i)) + " at element " +
                               std::to_string(i) + " where the answer is " + std::to_string(want[i]));
}

int64_t items(int64_t rows) { return kB * ((kS + rows - 1) / rows); }

// f(g, k, c, j, index of w[g*C + j][c][k]) over every weight: the packings' loop.
template <typename F>
void for_each_weight(const F& f) {
  for (int64_t g = 0; g < kG; ++g)
    for (int64_t k = 0; k < kK; ++k)
      for (int64_t c = 0; c < kC; ++c)
        for (int64_t j = 0; j < kC; ++j) f(g, k, c, j, ((g * kC + j) * kC + c) * kK + k);
}

// The convolution's output against the answer: fp32, or bf16 bits.
void expect_out(const std::string& name, const Buffer& out, bool bf16, const Problem& p) {
  expect((name + " convolution").c_str(), kB * kS * kH, p.out, [&](int64_t i) {
    return bf16 ? float_of_bf16(static_cast<const uint16_t*>(out.data)[i]) : static_cast<const float*>(out.data)[i];
  });
}

// Grad-weight partials (G, K, 16, 16) against the answer: [c][j] (`output_minor`, the
// vector kernels') or [j][c] (the AMX tiles').
void expect_grad_weight(const std::string& name, const Buffer& partials, bool output_minor, const Problem& p) {
  const auto* sums = static_cast<const float*>(partials.data);
  expect((name + " grad-weight").c_str(), kH * kC * kK, p.grad_w, [&](int64_t i) {
    const int64_t g = i / (kC * kC * kK), j = i / (kC * kK) % kC, c = i / kK % kC, k = i % kK;
    return sums[((g * kK + k) * kC + (output_minor ? c : j)) * kC + (output_minor ? j : c)];
  });
}

// The vector kernels of a level: fp32 and bf16 forward and grad-weight, weights packed
// (G, K, C, CP) in fp32: [g][k][c][j] = w[g*C + j][c][k].
void check_vector_conv(const conv::Kernels& kernels, const char* level) {
  const Problem p;
  Array<float> packed(kG * kK * kC * kC);
  for_each_weight([&](int64_t g, int64_t k, int64_t c, int64_t j, int64_t w) {
    packed[((g * kK + k) * kC + c) * kC + j] = p.w[w];
  });
  for (const bool bf16 : {false, true}) {
    const conv::Dtype dtype = bf16 ? conv::Dtype::kBFloat16 : conv::Dtype::kFloat;
    const void* x = bf16 ? static_cast<const void*>(p.x16.data()) : p.x.data();
    const void* gout = bf16 ? static_cast<const void*>(p.gout16.data()) : p.gout.data();
    Buffer out(kB * kS * kH * sizeof(float)), scratch(conv::scratch_bytes(p.shape)),
        partials(kG * kK * kC * kC * sizeof(float));
    kernels.conv(conv::ConvCall{x, p.mask.get(), nullptr, nullptr, packed.data(), out.data, p.shape, dtype}, 0,
                 items(conv::kTileRows), scratch.data);
    const std::string name = std::string(level) + (bf16 ? " bf16" : " fp32");
    expect_out(name, out, bf16, p);
    kernels.grad_weight(conv::GradWeightCall{gout, x, p.mask.get(), nullptr, partials.data, p.shape, dtype}, 0, 0,
                        items(conv::kTileRows), scratch.data);
    expect_grad_weight(name, partials, true, p);
  }
}

// The AVX512-BF16 kernels: weights as bf16 pairs (G, K, C/2, C, 2): [g][k][i][l][e] =
// w[g*C + l][2i + e][k]; grad-weight partials [g][k][c][j].
void check_dot_bf16_conv() {
  const Problem p;
  Array<uint16_t> packed(kG * kK * kC * kC);
  for_each_weight([&](int64_t g, int64_t k, int64_t c, int64_t j, int64_t w) {
    packed[((g * kK + k) * (kC / 2) + c / 2) * kC * 2 + j * 2 + c % 2] = p.w16[w];
  });
  Buffer out(kB * kS * kH * sizeof(uint16_t)), scratch(conv::avx512_bf16::scratch_bytes(p.shape)),
      partials(kG * kK * kC * kC * sizeof(float));
  conv::avx512_bf16::conv_items(conv::ConvCall{p.x16.data(), p.mask.get(), nullptr, nullptr, packed.data(), out.data,
                                               p.shape, conv::Dtype::kBFloat16},
                                0, items(conv::avx512_bf16::kConvTileRows), scratch.data);
  expect_out("avx512_bf16", out, true, p);
  conv::avx512_bf16::grad_weight_items(
      conv::GradWeightCall{p.gout16.data(), p.x16.data(), p.mask.get(), nullptr, partials.data, p.shape,
                           conv::Dtype::kBFloat16},
      0, 0, items(conv::avx512_bf16::grad_weight_tile_rows(kC)), scratch.data);
  expect_grad_weight("avx512_bf16", partials, true, p);
}

// The AMX tiles: the forward pass and grad-weight (partials [g][k][j][c]).
void check_amx_conv() {
  const Problem p;
  const conv::amx::TileKernels& kernels = conv::amx::kernels();
  Array<uint16_t> packed(conv::amx::packed_weight_elements(kG, kK));
  kernels.pack_weights(p.w16.data(), false, kG, kK, packed.data());
  Buffer out(kB * kS * kH * sizeof(uint16_t)), scratch(kernels.scratch_bytes(kK)),
      partials(kG * kK * kC * kC * sizeof(float));
  kernels.conv_items(conv::ConvCall{p.x16.data(), p.mask.get(), nullptr, nullptr, packed.data(), out.data, p.shape,
                                    conv::Dtype::kBFloat16},
                     0, items(conv::amx::kConvTileRows), scratch.data);
  expect_out("AMX", out, true, p);
  kernels.grad_weight_items(conv::GradWeightCall{p.gout16.data(), p.x16.data(), p.mask.get(), nullptr, partials.data,
                                                 p.shape, conv::Dtype::kBFloat16},
                            0, 0, items(conv::amx::kGradWeightTileRows), scratch.data);
  expect_grad_weight("AMX", partials, false, p);
}

// LAMB's stage 1 and sums of squares of a level (37 elements: full vectors and a tail)
// against the same arithmetic in double.
void check_lamb(const lamb::PieceKernels& kernels, const char* level) {
  constexpr int64_t n = 37;
  Array<float> p(n), g(n), m(n), v(n);
  for (int64_t i = 0; i < n; ++i) {
    p[i] = 0.5f - 0.03f * static_cast<float>(i);
    g[i] = 0.01f * static_cast<float>(i % 7) - 0.02f;
    m[i] = 0.001f * static_cast<float>(i % 5);
    v[i] = 1e-4f * static_cast<float>(i % 3 + 1);
  }
  const lamb::Stage1Scalars k{0.9f, 0.999f, 0.1f, 0.001f, 1.0f / 0.1f, 1.0f / 0.001f, 1e-6f, 0.5f};
  const float wd = 0.01f;
  double want_p2 = 0.0, want_u2 = 0.0;
  std::vector<double> want_u(n);
  for (int64_t i = 0; i < n; ++i) {
    const double gi = static_cast<double>(g[i]) * k.grad_scale;
    const double mi = k.beta1 * static_cast<double>(m[i]) + k.one_minus_beta1 * gi;
    const double vi = k.beta2 * static_cast<double>(v[i]) + k.one_minus_beta2 * gi * gi;
    want_u[i] = mi * k.bias_correction1 / (std::sqrt(vi * k.bias_correction2) + k.eps) + wd * p[i];
    want_p2 += static_cast<double>(p[i]) * p[i];
    want_u2 += want_u[i] * want_u[i];
  }
  double sums[2] = {0.0, 0.0};
  kernels.stage1_f32(p.data(), g.data(), m.data(), v.data(), 0, n, wd, k, sums);
  const auto near = [](double a, double b) { return std::fabs(a - b) <= 1e-5 * std::fabs(b) + 1e-7; };
  for (int64_t i = 0; i < n; ++i)
    if (!near(g[i], want_u[i]))
      throw std::runtime_error(std::string(level) + " LAMB stage 1 computed " + std::to_string(g[i]) + " at element " +
                               std::to_string(i) + " where the answer is " + std::to_string(want_u[i]));
  const double p2 = kernels.sum_squares_f32(p.data(), 0, n);
  if (!near(sums[0], want_p2) || !near(sums[1], want_u2) || !near(p2, want_p2))
    throw std::runtime_error(std::string(level) + " LAMB sums of squares computed " + std::to_string(sums[0]) + ", " +
                             std::to_string(sums[1]) + ", " + std::to_string(p2) + " where the answers are " +
                             std::to_string(want_p2) + ", " + std::to_string(want_u2));
}

// The softmax cross-entropy's row statistics and gradient of a level, fp32 and bf16
// scores (2 rows of 37 columns: two full vectors and a tail; eighths, exact in bf16),
// against the same arithmetic in double: the statistics to 1e-5, the gradient to its
// dtype's rounding.
void check_xent(const xent::RowKernels& kernels, const char* level) {
  constexpr int64_t rows = 2, columns = 37;
  Array<float> x(rows * columns), dx(rows * columns);
  Array<uint16_t> x16(rows * columns), dx16(rows * columns);
  for (int64_t i = 0; i < rows * columns; ++i) {
    x[i] = static_cast<float>((i * 7) % 41 - 20) / 8.0f;
    uint32_t bits;
    std::memcpy(&bits, &x[i], sizeof bits);
    x16[i] = static_cast<uint16_t>(bits >> 16);
  }
  const int64_t target[rows] = {3, 36};
  const float scale[rows] = {0.5f, -2.0f};
  const auto fail = [&](const std::string& what, double got, double want) {
    throw std::runtime_error(std::string(level) + " softmax cross-entropy " + what + " computed " +
                             std::to_string(got) + " where the answer is " + std::to_string(want));
  };
  for (const bool bf16 : {false, true}) {
    float stats[2 * rows];
    if (bf16) {
      kernels.row_stats_bf16(x16.data(), columns, 0, rows, stats);
      kernels.grad_bf16(x16.data(), stats, target, scale, columns, 0, rows, dx16.data());
    } else {
      kernels.row_stats_f32(x.data(), columns, 0, rows, stats);
      kernels.grad_f32(x.data(), stats, target, scale, columns, 0, rows, dx.data());
    }
    for (int64_t r = 0; r < rows; ++r) {
      const float* row = x.data() + r * columns;
      double top = row[0], sum = 0.0;
      for (int64_t c = 1; c < columns; ++c) top = std::max(top, static_cast<double>(row[c]));
      for (int64_t c = 0; c < columns; ++c) sum += std::exp(row[c] - top);
      if (std::fabs(stats[2 * r] - top) > 1e-5 || std::fabs(stats[2 * r + 1] - std::log(sum)) > 1e-5)
        fail("row statistics", stats[2 * r + 1], std::log(sum));
      for (int64_t c = 0; c < columns; ++c) {
        const double want = (std::exp(row[c] - top) / sum - (c == target[r] ? 1.0 : 0.0)) * scale[r];
        double got = dx[r * columns + c];
        if (bf16) {
          const uint32_t bits = static_cast<uint32_t>(dx16[r * columns + c]) << 16;
          float f;
          std::memcpy(&f, &bits, sizeof f);
          got = f;
        }
        if (std::fabs(got - want) > (bf16 ? 1.0 / 128 : 1e-5) * std::fabs(want) + 1e-7)
          fail(bf16 ? "bf16 gradient" : "gradient", got, want);
      }
    }
  }
}

// What a path runs: everything its level uses (avx512_bf16 runs the avx512 kernels for
// all but the bf16 convolution).
void run_known_answer(Path path) {
  switch (path) {
    case Path::kAvx2:
      check_vector_conv(conv::avx2::kernels(), "avx2");
      check_lamb(lamb::avx2::kernels(), "avx2");
      check_xent(xent::avx2::kernels(), "avx2");
      return;
    case Path::kAvx512:
      check_vector_conv(conv::avx512::kernels(), "avx512");
      check_lamb(lamb::avx512::kernels(), "avx512");
      check_xent(xent::avx512::kernels(), "avx512");
      return;
    case Path::kAvx512Bf16:
      check_vector_conv(conv::avx512::kernels(), "avx512");
      check_lamb(lamb::avx512::kernels(), "avx512");
      check_xent(xent::avx512::kernels(), "avx512");
      check_dot_bf16_conv();
      return;
    case Path::kAmx:
      check_amx_conv();
      return;
  }
}

// GROUPBERT_KERNEL_CHECK_FAULT (tests only): a comma-separated list of paths whose child
// raises SIGILL before it runs ("avx512_bf16"), or computes a wrong answer ("amx:wrong").
const char* injected_fault(Path path) {
  const char* env = std::getenv("GROUPBERT_KERNEL_CHECK_FAULT");
  if (env == nullptr) return nullptr;
  const std::string list = "," + std::string(env) + ",", name = path_name(path);
  if (list.find("," + name + ":wrong,") != std::string::npos) return "wrong";
  if (list.find("," + name + ",") != std::string::npos) return "signal";
  return nullptr;
}

// The child: one thread (fork copies only the caller's), no torch, no OpenMP. Exit 0 on
// the answer; otherwise the reason goes down `report` and the exit status is 1.
[[noreturn]] void child(Path path, int report) {
  for (int sig : {SIGILL, SIGSEGV, SIGBUS, SIGFPE}) std::signal(sig, SIG_DFL);  // no Python faulthandler
  std::string why;
  try {
    const char* fault = injected_fault(path);
    if (fault != nullptr && std::strcmp(fault, "signal") == 0) std::raise(SIGILL);
    run_known_answer(path);
    if (fault != nullptr) throw std::runtime_error("an injected wrong answer (GROUPBERT_KERNEL_CHECK_FAULT)");
  } catch (const std::exception& e) {
    why = e.what();
  } catch (...) {
    why = "an unknown exception";
  }
  if (!why.empty()) {
    const ssize_t unused = write(report, why.data(), why.size());
    (void)unused;
  }
  _exit(why.empty() ? 0 : 1);
}

std::string signal_name(int sig) {
  const char* name = sig == SIGILL    ? "SIGILL"
                     : sig == SIGSEGV ? "SIGSEGV"
                     : sig == SIGBUS  ? "SIGBUS"
                     : sig == SIGFPE  ? "SIGFPE"
                     : sig == SIGABRT ? "SIGABRT"
                     : sig == SIGKILL ? "SIGKILL"
                                      : nullptr;
  return (name != nullptr ? std::string(name) : "signal " + std::to_string(sig)) + " (" + strsignal(sig) + ")";
}

Outcome check_in_child(Path path) {
  int pipe_fds[2];
  if (pipe(pipe_fds) != 0) return {true, true, ""};
  std::fflush(nullptr);  // nothing buffered is written twice
  const pid_t pid = fork();
  if (pid == 0) {
    close(pipe_fds[0]);
    child(path, pipe_fds[1]);
  }
  close(pipe_fds[1]);
  if (pid < 0) {
    close(pipe_fds[0]);
    std::fprintf(stderr, "note: could not start a child process to check the %s kernels (%s); they run unchecked\n",
                 path_name(path), std::strerror(errno));
    return {true, true, ""};
  }
  // The child needs milliseconds; one that runs 30 s is stopped and counted as failed.
  int status = 0;
  bool timed_out = false;
  for (int waited_ms = 0;; ++waited_ms) {
    const pid_t done = waitpid(pid, &status, WNOHANG);
    if (done == pid) break;
    if (done < 0 && errno != EINTR) {  // e.g. SIGCHLD ignored: the status is lost
      close(pipe_fds[0]);
      return {true, true, ""};
    }
    if (waited_ms == 30000) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      timed_out = true;
      break;
    }
    const timespec ms{0, 1000000};
    nanosleep(&ms, nullptr);
  }
  std::string message;
  char chunk[512];
  for (ssize_t got; (got = read(pipe_fds[0], chunk, sizeof(chunk))) > 0;) message.append(chunk, got);
  close(pipe_fds[0]);
  if (timed_out) return {true, false, "did not finish in 30 s"};
  if (WIFSIGNALED(status)) return {true, false, "was killed by " + signal_name(WTERMSIG(status))};
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return {true, true, ""};
  if (message.empty()) message = "exit status " + std::to_string(status);
  return {true, false, "computed a wrong answer: " + message};
}

#else

Outcome check_in_child(Path) { return {true, true, ""}; }  // no instruction-set paths

#endif

}  // namespace

const char* path_name(Path path) {
  switch (path) {
    case Path::kAvx2:
      return "avx2";
    case Path::kAvx512:
      return "avx512";
    case Path::kAvx512Bf16:
      return "avx512_bf16";
    case Path::kAmx:
      return "amx";
  }
  return "?";
}

bool passed_check(Path path, const std::function<std::string()>& instead) {
  std::atomic<int>& verdict = verdicts[static_cast<int>(path)];
  if (const int known = verdict.load(std::memory_order_acquire); known != 0) return known == 1;
  const std::lock_guard<std::mutex> lock(mutex);
  Outcome& outcome = outcomes[static_cast<int>(path)];
  if (!outcome.checked) {
    outcome = check_in_child(path);
    if (!outcome.passed) {
      std::fprintf(stderr, "note: the %s kernels failed their known-answer run: a child process running them %s; %s\n",
                   path_name(path), outcome.why.c_str(), instead().c_str());
      std::fflush(stderr);
    }
    verdict.store(outcome.passed ? 1 : 2, std::memory_order_release);
  }
  return outcome.passed;
}

std::vector<std::string> check_results() {
  const std::lock_guard<std::mutex> lock(mutex);
  std::vector<std::string> lines;
  for (Path path : kPaths) {
    const Outcome& outcome = outcomes[static_cast<int>(path)];
    if (outcome.checked)
      lines.push_back(std::string(path_name(path)) + (outcome.passed ? ": passed" : ": failed: " + outcome.why));
  }
  return lines;
}

}  // namespace groupbert::cpu

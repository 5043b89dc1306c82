// Work sharing for the CPU kernels: chunks of work items taken by one worker per
// thread of at::parallel_for.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace groupbert {

// Scalar multiply-adds a thread should get before another is woken (~30 us): tiny
// calls (gradcheck's, a few hundred per check) then run on the calling thread.
constexpr int64_t kMinFmasPerTask = 1 << 20;

// Runs f(worker, begin, end) over [0, n) in chunks taken from a shared counter by
// n_workers workers, one per thread of at::parallel_for. Unlike parallel_for's static
// split, a thread slowed by another process on its core leaves its chunks to the
// others instead of holding up the whole call (the development VM was shared). Each
// chunk is a 1/(2 n_workers) share of what is left ("guided"), so the chunks shrink
// towards the end and the workers finish together.
template <typename F>
void parallel_chunks(int64_t n, int64_t n_workers, const F& f) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, n_workers, 1, [&](int64_t worker_begin, int64_t worker_end) {
    for (int64_t worker = worker_begin; worker < worker_end; ++worker) {
      int64_t begin = next.load();
      while (begin < n) {
        const int64_t end = begin + std::max<int64_t>(1, (n - begin) / (2 * n_workers));
        if (next.compare_exchange_weak(begin, end)) {  // else begin is reloaded
          f(worker, begin, end);
          begin = next.load();
        }
      }
    }
  });
}

// Runs f(chunk, begin, end) for each of the `chunks` equal parts of [0, n) (the first
// n % chunks one item longer), taken from a shared counter by n_workers workers, one per
// thread of at::parallel_for. Which thread runs a chunk varies with timing, what a chunk
// covers does not: sums kept per chunk and added up in chunk order are the same run to
// run (a worker's share of parallel_chunks' chunks is not).
template <typename F>
void parallel_fixed_chunks(int64_t n, int64_t chunks, int64_t n_workers, const F& f) {
  std::atomic<int64_t> next{0};
  const int64_t size = n / chunks, longer = n % chunks;
  at::parallel_for(0, n_workers, 1, [&](int64_t worker_begin, int64_t worker_end) {
    for (int64_t worker = worker_begin; worker < worker_end; ++worker) {
      for (int64_t c = next++; c < chunks; c = next++) {
        const int64_t begin = c * size + std::min(c, longer);
        f(c, begin, begin + size + (c < longer ? 1 : 0));
      }
    }
  });
}

// Workers for `items` work items of `fmas_per_item` multiply-adds each: one per thread,
// fewer when there is too little work to share.
inline int64_t worker_count(int64_t items, int64_t fmas_per_item) {
  const int64_t by_work = items * fmas_per_item / kMinFmasPerTask;
  return std::max<int64_t>(1, std::min<int64_t>({at::get_num_threads(), by_work, items}));
}

}  // namespace groupbert

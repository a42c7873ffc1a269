// A pass's loop over weight tiles (or row blocks) dealt to the threads so that they finish together (every tier
// includes it; no ISA code here).
//
// at::parallel_for gives each thread an equal run of items once: a decode pass then lasts as long as its slowest
// thread, and on a shared host one thread is often held up (a vCPU descheduled, a slower memory path) while the
// other waits at the pass's end. parallel_items starts the same way, each thread walking its run up (one stream
// of the weight per thread), and a thread that runs out takes the upper half of what is left of the largest other
// run and walks that up as its own. Which thread runs an item never changes the item's arithmetic (each caller's
// items are independent: a tile's or row block's columns), so the bits are those of at::parallel_for.
// (Measured in docs/performance.md, "Threads that finish together".)
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

namespace {

// A thread's items [lo, hi) not yet taken, as lo | hi << 32, on a cache line of its own (its owner takes an item
// with a compare-exchange on it each time).
struct alignas(64) ItemRun {
  std::atomic<uint64_t> v;
  static uint64_t pack(uint64_t lo, uint64_t hi) { return lo | hi << 32; }
};

// f(next) once on each thread of the pass: next() gives the thread's next item of [0, n), -1 when none is left.
// The thread's work before its first next() (its buffers) happens once.
template <class F>
void parallel_items(int64_t n, F&& f) {
  const int64_t threads = at::in_parallel_region() ? 1 : std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1) {
    int64_t i = 0;
    f([&]() -> int64_t { return i < n ? i++ : -1; });
    return;
  }
  std::unique_ptr<ItemRun[]> runs(new ItemRun[threads]);
  for (int64_t r = 0; r < threads; ++r) runs[r].v = ItemRun::pack(n * r / threads, n * (r + 1) / threads);
  at::parallel_for(0, threads, 1, [&](int64_t b, int64_t e) {
    for (int64_t me = b; me < e; ++me) {
      std::atomic<uint64_t>& mine = runs[me].v;
      f([&]() -> int64_t {
        for (;;) {
          uint64_t old = mine.load(std::memory_order_relaxed);
          const uint64_t lo = old & 0xffffffffu, hi = old >> 32;
          if (lo < hi) {
            if (mine.compare_exchange_weak(old, ItemRun::pack(lo + 1, hi))) return static_cast<int64_t>(lo);
            continue;
          }
          int64_t victim = -1;  // the largest other run of at least two items (one item: its owner takes it)
          uint64_t most = 1;
          for (int64_t r = 0; r < threads; ++r) {
            const uint64_t v = runs[r].v.load(std::memory_order_relaxed);
            if (r != me && (v >> 32) - std::min(v >> 32, v & 0xffffffffu) > most) {
              most = (v >> 32) - (v & 0xffffffffu);
              victim = r;
            }
          }
          if (victim < 0) return -1;
          std::atomic<uint64_t>& theirs = runs[victim].v;
          uint64_t o = theirs.load(std::memory_order_relaxed);
          const uint64_t olo = o & 0xffffffffu, ohi = o >> 32;
          if (ohi < olo + 2) continue;  // taken meanwhile: look again
          const uint64_t mid = olo + (ohi - olo + 1) / 2;
          // the upper half becomes this thread's run (its own is empty: no other thread writes it meanwhile)
          if (theirs.compare_exchange_weak(o, ItemRun::pack(olo, mid))) mine.store(ItemRun::pack(mid, ohi));
        }
      });
    }
  });
}

}  // namespace

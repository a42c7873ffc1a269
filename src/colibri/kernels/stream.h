// Software prefetch for the weight streams of the decode kernels (every tier includes it; no ISA code here).
// A decode pass reads each weight byte once, straight from DRAM. The hardware prefetcher alone keeps too few
// lines in flight there: a q4 tile's bytes interleave with a scale row on another page every group, and the dot
// form walks several rows side by side, so its streams restart every few KiB. Fetching the bytes a fixed
// distance ahead of their use keeps the loads of a thread overlapped (the measured gain per kind and tier is in
// docs/performance.md, "Prefetch distance").
#pragma once

#include <cstdint>

namespace {

constexpr int64_t kStreamAhead = 4096;  // bytes (the distances tried: docs/performance.md)
// Passes of at most kDirectRows rows (decode, speculation's verify) read the stored weights straight, with no
// laid-out copy (every tier's linear and int8 kernels).
constexpr int64_t kDirectRows = 4;

// The line kStreamAhead bytes past p (in the same stream: tiles and weight rows are laid out consecutively, so
// past a tile's or row's end this is the next one's start).
inline void prefetch_ahead(const void* p) { __builtin_prefetch(static_cast<const char*>(p) + kStreamAhead); }

// Every line of [p, p + bytes): a q4 tile's next scale row (its own page: a group's row of the table is [Np, 2]).
inline void prefetch_span(const void* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(static_cast<const char*>(p) + b);
}

}  // namespace

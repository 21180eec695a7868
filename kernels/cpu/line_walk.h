// LineWalk: the cache lines of a strided weight block in memory order, for
// the direct (small-group) kernels' look-ahead prefetch (gemm_exec.cc).
//
// Why: a direct kernel reads its 32-column strip down kc rows, one weight row
// (4-8 KiB) per step. Served on demand that pattern gets about half of the
// streaming bandwidth (rows a page apart defeat the hardware prefetchers),
// and with fp8 the other half of every line is needed again by the next
// strip. So each kernel call pulls its share of the *next* reduction chunk
// into L2, one or two lines per step, row by row and left to right; DRAM then
// sees long sequential runs. Pure address arithmetic, kept small and passed by
// value so that it lives in registers; the kernel issues the prefetch.
#ifndef FP8MOE_KERNELS_CPU_LINE_WALK_H_
#define FP8MOE_KERNELS_CPU_LINE_WALK_H_

#include <cstddef>
#include <cstdint>

namespace fp8moe::internal {

// Prefetches every cache line of [p, p + bytes), from the line of its first
// byte to that of its last (an unaligned piece spans one line more than
// bytes / 64). kRw: 0 to read, 1 to write.
template <int kRw = 0>
inline void PrefetchLines(const void* p, size_t bytes) {
  if (bytes == 0) return;
  const uintptr_t first = reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63};
  const uintptr_t last = reinterpret_cast<uintptr_t>(p) + bytes - 1;
  for (uintptr_t line = first; line <= last; line += 64) {
    __builtin_prefetch(reinterpret_cast<const void*>(line), kRw, 3);
  }
}

struct LineWalk {
  // The block: rows `ld` bytes apart; each row holds `nseg` segments of
  // `seg_lines` lines, segment s starting s * seg_delta bytes after segment 0.
  size_t ld = 0;
  ptrdiff_t seg_delta = 0;
  uint32_t seg_lines = 1, nseg = 1;

  // Position. Hot (every step): the next line, the end of its segment, lines
  // still to visit. Cold (once a segment): the segment's start and index.
  const uint8_t* cur = nullptr;
  const uint8_t* seg_end = nullptr;
  int64_t left = 0;
  const uint8_t* seg_start = nullptr;
  uint32_t s = 0;

  // Positions the walk at flat line j (row-major over rows x segments x
  // lines) of the block whose row 0, segment 0 starts at seg0, with `count`
  // lines to visit.
  void Start(const uint8_t* seg0, int64_t j, int64_t count) {
    const int64_t per_row = static_cast<int64_t>(nseg) * seg_lines;
    const int64_t row = j / per_row, r = j % per_row;
    s = static_cast<uint32_t>(r / seg_lines);
    const uint32_t line = static_cast<uint32_t>(r % seg_lines);
    seg_start = seg0 + static_cast<size_t>(row) * ld + static_cast<ptrdiff_t>(s) * seg_delta;
    cur = seg_start + size_t{line} * 64;
    seg_end = seg_start + size_t{seg_lines} * 64;
    left = count;
  }

  // The next line to visit, or nullptr once `count` lines were visited.
  // Few registers and one predictable branch in the kernels' inner loops.
  const uint8_t* Next() {
    if (left <= 0) return nullptr;
    --left;
    const uint8_t* line = cur;
    cur += 64;
    if (cur == seg_end) [[unlikely]] NextSegment();
    return line;
  }

 private:
  // Inline: a call from a kernel's loop would spill every vector register
  // (all are caller-saved).
  void NextSegment() {
    if (++s == nseg) {
      s = 0;
      seg_start += static_cast<ptrdiff_t>(ld) - static_cast<ptrdiff_t>(nseg - 1) * seg_delta;
    } else {
      seg_start += seg_delta;
    }
    cur = seg_start;
    seg_end = seg_start + size_t{seg_lines} * 64;
  }
};

// How a direct kernel call prefetches: `per_step` lines of the next chunk's
// walk per reduction step into L2, and on an item's first (cold) chunk, where
// nothing was prefetched, its own rows `cold_rows` ahead into L1.
struct DirectPrefetch {
  LineWalk walk;
  uint32_t per_step = 0;
  uint32_t cold_rows = 0;

  // One reduction step's prefetches (row: the step's first weight row, ldb
  // bytes between rows; rows_per_step: 1, or 2 for the pair kernels;
  // row_bytes: the strip's width, one line per 64 bytes of it).
  inline void Step(const uint8_t* row, size_t ldb, size_t rows_per_step, size_t row_bytes = 64) {
    if (cold_rows != 0) {
      for (size_t r = 0; r < rows_per_step; ++r) {
        for (size_t off = 0; off < row_bytes; off += 64) {
          __builtin_prefetch(row + (cold_rows + r) * ldb + off, 0, 3);
        }
      }
    }
    for (uint32_t u = 0; u < per_step; ++u) {
      if (const uint8_t* line = walk.Next()) __builtin_prefetch(line, 0, 2);
    }
  }
};

}  // namespace fp8moe::internal

#endif  // FP8MOE_KERNELS_CPU_LINE_WALK_H_

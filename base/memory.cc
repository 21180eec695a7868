#include "fp8moe/memory.h"

#include <unistd.h>

#include <atomic>
#include <cctype>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>

namespace fp8moe {
namespace {
std::atomic<int64_t> g_in_use{0};
std::atomic<int64_t> g_peak{0};
std::atomic<int64_t> g_allocations{0};

// The cap and its source; set once lazily (env or MemAvailable) unless
// SetMemoryCap ran first.
struct Cap {
  std::mutex mu;
  bool known = false;
  uint64_t bytes = 0;
  std::string source;
};
Cap& TheCap() {
  static Cap* cap = new Cap;  // never destroyed: tensors may outlive statics
  return *cap;
}

// MemAvailable of /proc/meminfo in bytes, or 0.
uint64_t MemAvailable() {
  std::FILE* f = std::fopen("/proc/meminfo", "r");
  if (f == nullptr) return 0;
  char line[256];
  uint64_t kib = 0;
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    unsigned long long v = 0;
    if (std::sscanf(line, "MemAvailable: %llu kB", &v) == 1) {
      kib = v;
      break;
    }
  }
  std::fclose(f);
  return kib > std::numeric_limits<uint64_t>::max() / 1024 ? 0 : kib * 1024;
}

uint64_t PhysicalMemory() {
  const long pages = sysconf(_SC_PHYS_PAGES), size = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || size <= 0) return 0;
  return static_cast<uint64_t>(pages) * static_cast<uint64_t>(size);
}

// Fills in the default cap on first use (the caller holds the lock).
void EnsureCap(Cap& c) {
  if (c.known) return;
  c.known = true;
  if (const char* env = std::getenv("FP8MOE_MEMORY_CAP"); env != nullptr && *env != '\0') {
    Result<uint64_t> v = ParseByteSize(env);
    if (v.ok()) {
      c.bytes = *v;
      c.source = "FP8MOE_MEMORY_CAP";
      return;
    }
    // A bad value must not silently mean "no cap": warn once and fall back
    // to the machine's available memory.
    std::fprintf(stderr, "fp8moe: ignoring FP8MOE_MEMORY_CAP: %s\n",
                 v.status().message().c_str());
  }
  if (const uint64_t avail = MemAvailable(); avail > 0) {
    c.bytes = avail;
    c.source = "the machine's available memory (MemAvailable)";
    return;
  }
  c.bytes = PhysicalMemory();
  c.source = "the machine's physical memory";
}

}  // namespace

MemoryStats GetMemoryStats() {
  return {g_in_use.load(), g_peak.load(), g_allocations.load()};
}

void ResetMemoryPeak() { g_peak.store(g_in_use.load()); }

void SetMemoryCap(uint64_t bytes, std::string_view source) {
  Cap& c = TheCap();
  std::lock_guard<std::mutex> lock(c.mu);
  c.known = true;
  c.bytes = bytes;
  c.source = std::string(source);
}

uint64_t MemoryCap() {
  Cap& c = TheCap();
  std::lock_guard<std::mutex> lock(c.mu);
  EnsureCap(c);
  return c.bytes;
}

std::string MemoryCapSource() {
  Cap& c = TheCap();
  std::lock_guard<std::mutex> lock(c.mu);
  EnsureCap(c);
  return c.source;
}

std::string FormatBytes(uint64_t bytes) {
  static const char* const kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  std::string s = std::to_string(bytes) + " bytes";
  if (bytes < 1024) return s;
  double v = static_cast<double>(bytes);
  int u = -1;
  while (v >= 1024.0 && u < 5) {
    v /= 1024.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), " (%.3g %s)", v, kUnits[u]);
  return s + buf;
}

Result<uint64_t> ParseByteSize(std::string_view text) {
  const std::string bad = "invalid byte size '" + std::string(text) +
                          "'; write a whole number of bytes with an optional K, M, G or T "
                          "suffix (powers of 1024), e.g. 8G or 512MiB; 0 means no cap";
  uint64_t v = 0;
  const char* begin = text.data();
  const char* end = begin + text.size();
  const auto [p, ec] = std::from_chars(begin, end, v);
  if (ec == std::errc::result_out_of_range) return InvalidArgument(bad + " (too large)");
  if (ec != std::errc() || p == begin) return InvalidArgument(bad);
  std::string suffix(p, end);
  for (char& ch : suffix) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  int shift = -1;
  if (suffix.empty() || suffix == "B") shift = 0;
  const char* const kPrefixes = "KMGT";
  for (int i = 0; i < 4; ++i) {
    const std::string c(1, kPrefixes[i]);
    if (suffix == c || suffix == c + "B" || suffix == c + "IB") shift = 10 * (i + 1);
  }
  if (shift < 0) return InvalidArgument(bad);
  if (shift > 0 && v > (std::numeric_limits<uint64_t>::max() >> shift)) {
    return InvalidArgument(bad + " (too large)");
  }
  return v << shift;
}

Status CheckMemoryRequest(std::string_view what, uint64_t bytes) {
  const uint64_t cap = MemoryCap();
  if (cap == 0) return OkStatus();
  const int64_t used_signed = g_in_use.load(std::memory_order_relaxed);
  const uint64_t used = used_signed > 0 ? static_cast<uint64_t>(used_signed) : 0;
  const uint64_t room = used >= cap ? 0 : cap - used;
  if (bytes <= room) return OkStatus();
  return ResourceExhausted(
      std::string(what) + " needs " + FormatBytes(bytes) + " but the memory cap is " +
      FormatBytes(cap) + ", from " + MemoryCapSource() + ", and " + FormatBytes(used) +
      " are in use; make the request smaller or raise the cap (--memory-cap or "
      "FP8MOE_MEMORY_CAP)");
}

namespace internal {

void TrackAllocation(int64_t bytes) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  const int64_t now = g_in_use.fetch_add(bytes) + bytes;
  int64_t peak = g_peak.load();
  while (now > peak && !g_peak.compare_exchange_weak(peak, now)) {
  }
}

void TrackRelease(int64_t bytes) { g_in_use.fetch_sub(bytes); }

}  // namespace internal
}  // namespace fp8moe

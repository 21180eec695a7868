// A process-wide watchdog for blocking communication calls: a call arms a
// deadline on entry and disarms it on return; if the deadline passes first,
// the watchdog thread calls the client's OnTimeout (which ends the job). No
// allocation per call: a fixed table of slots.
#ifndef FP8MOE_DISTRIBUTED_WATCHDOG_H_
#define FP8MOE_DISTRIBUTED_WATCHDOG_H_

#include <cstdint>

namespace fp8moe::internal {

class WatchdogClient {
 public:
  virtual ~WatchdogClient() = default;
  // Called on the watchdog thread when `what` has not returned within
  // `seconds`. Must not return (it aborts the job).
  [[noreturn]] virtual void OnTimeout(const char* what, double seconds) = 0;
};

// Arms a deadline for the lifetime of the scope (only the outermost scope of
// a thread arms; seconds <= 0 arms nothing). `what` must be a string literal.
class WatchdogScope {
 public:
  WatchdogScope(WatchdogClient* client, const char* what, double seconds);
  ~WatchdogScope();
  WatchdogScope(const WatchdogScope&) = delete;
  WatchdogScope& operator=(const WatchdogScope&) = delete;

 private:
  int slot_ = -1;
};

}  // namespace fp8moe::internal

#endif  // FP8MOE_DISTRIBUTED_WATCHDOG_H_

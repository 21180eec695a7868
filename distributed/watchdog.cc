#include "distributed/watchdog.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>

namespace fp8moe::internal {
namespace {

using Clock = std::chrono::steady_clock;
// How often the thread looks at the table; a deadline is noticed at most
// this late.
constexpr auto kPoll = std::chrono::milliseconds(200);

struct Slot {
  bool active = false;
  Clock::time_point deadline;
  WatchdogClient* client = nullptr;
  const char* what = nullptr;
  double seconds = 0;
};

class Watchdog {
 public:
  // Leaked on purpose: the thread sleeps until the process ends and must
  // never be joined or destroyed during static destruction.
  static Watchdog& Get() {
    static Watchdog* w = new Watchdog;
    return *w;
  }

  int Arm(WatchdogClient* client, const char* what, double seconds) {
    std::lock_guard lock(mu_);
    if (!thread_started_) {
      std::thread([this] { Run(); }).detach();
      thread_started_ = true;
    }
    for (int i = 0; i < static_cast<int>(slots_.size()); ++i) {
      if (!slots_[i].active) {
        slots_[i] = {true,
                     Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                        std::chrono::duration<double>(seconds)),
                     client, what, seconds};
        // No notify: the thread wakes at least every kPoll anyway, so arming
        // (once per collective) never costs a context switch.
        return i;
      }
    }
    return -1;  // more concurrent calls than slots: this one runs unguarded
  }

  void Disarm(int slot) {
    std::lock_guard lock(mu_);
    slots_[slot].active = false;
    // No notify: a stale wake-up only re-scans the table.
  }

 private:
  void Run() {
    std::unique_lock lock(mu_);
    for (;;) {
      Clock::time_point earliest = Clock::time_point::max();
      for (const Slot& s : slots_) {
        if (s.active && s.deadline < earliest) earliest = s.deadline;
      }
      const Clock::time_point now = Clock::now();
      if (now < earliest) {
        cv_.wait_until(lock, std::min(earliest, now + kPoll));
        continue;
      }
      for (const Slot& s : slots_) {
        if (s.active && s.deadline <= Clock::now()) {
          WatchdogClient* client = s.client;
          const char* what = s.what;
          const double seconds = s.seconds;
          lock.unlock();
          client->OnTimeout(what, seconds);  // does not return
        }
      }
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::array<Slot, 64> slots_{};
  bool thread_started_ = false;
};

thread_local int scope_depth = 0;

}  // namespace

WatchdogScope::WatchdogScope(WatchdogClient* client, const char* what, double seconds) {
  if (scope_depth++ == 0 && seconds > 0) slot_ = Watchdog::Get().Arm(client, what, seconds);
}

WatchdogScope::~WatchdogScope() {
  if (slot_ >= 0) Watchdog::Get().Disarm(slot_);
  --scope_depth;
}

}  // namespace fp8moe::internal

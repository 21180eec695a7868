// The MPI communicator: point-to-point on MPI_Isend / MPI_Irecv, the ring
// collectives on top of them (distributed/ring.cc), or the library's own
// collectives (CollectiveAlgorithm::kLibrary), every blocking call under the
// watchdog (distributed/watchdog.h).
#include <mpi.h>
#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include <climits>
#include <ctime>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "distributed/reduce.h"
#include "distributed/ring.h"
#include "distributed/watchdog.h"
#include "fp8moe/dist.h"
#include "fp8moe/mpi.h"

namespace fp8moe {

namespace {

// DoWaitAll's polling (see there): polls that only spin, how long a wait
// yields the core between polls before it sleeps between them (0 where the
// ranks of this machine outnumber its cores: MpiRuntime::Start decides),
// the sleep.
constexpr int kSpinPolls = 200;
constexpr double kYieldSeconds = 0.005;
constexpr long kPollSleepNs = 50'000;
// How long a rank whose wait timed out lets the others report theirs before
// it ends the job (OnTimeout).
constexpr time_t kTimeoutReportSeconds = 1;
double g_yield_seconds = kYieldSeconds;

std::string MpiError(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(text, static_cast<size_t>(len));
}

Status FromMpi(int code, const char* what) {
  if (code == MPI_SUCCESS) return OkStatus();
  return Internal(std::string("MPI ") + what + " failed: " + MpiError(code));
}

// ---- SIGTERM report: the launcher ends the job after another rank failed ----
char g_term_message[256];
size_t g_term_length = 0;

extern "C" void OnTerminate(int) {
  // Only async-signal-safe calls here. SIGPIPE is blocked while this runs
  // (sa_mask): if the launcher already closed our stderr, the write fails
  // with EPIPE and the rank still exits with code 1.
  if (g_term_length > 0) {
    ssize_t ignored = write(STDERR_FILENO, g_term_message, g_term_length);
    (void)ignored;
  }
  _exit(1);
}

void InstallTerminationReport(int rank, int size) {
  const int n = std::snprintf(
      g_term_message, sizeof(g_term_message),
      // A leading newline: the line may cut into a progress line ("\r...").
      "\nfp8moe rank %d/%d: terminated by SIGTERM: the launcher is ending the job (Ctrl-C "
      "or a signal to mpirun, or another rank failed or timed out: see its message)\n",
      rank, size);
  g_term_length = n > 0 ? static_cast<size_t>(n) : 0;
  struct sigaction sa;
  std::memset(&sa, 0, sizeof(sa));
  sa.sa_handler = OnTerminate;
  sigemptyset(&sa.sa_mask);
  sigaddset(&sa.sa_mask, SIGPIPE);
  sigaction(SIGTERM, &sa, nullptr);
}

// bf16 sum as an MPI user op (MPI has no bf16): inout = in + inout, each
// addition rounded to bf16, the same Combine the ring uses.
extern "C" void Bf16SumOp(void* in, void* inout, int* len, MPI_Datatype*) {
  internal::Combine(DType::kBF16, ReduceOp::kSum, in, inout, inout, *len);
}

MPI_Op Bf16Sum() {
  static MPI_Op op = [] {
    MPI_Op o;
    MPI_Op_create(&Bf16SumOp, /*commute=*/1, &o);
    return o;
  }();
  return op;
}

// A predefined MPI type of the element's size, for moving bytes.
MPI_Datatype MoveType(DType dtype) {
  switch (DTypeSize(dtype)) {
    case 1: return MPI_UINT8_T;
    case 2: return MPI_UINT16_T;
    case 4: return MPI_UINT32_T;
    default: return MPI_UINT64_T;
  }
}

// The MPI type and op of a supported reduction.
void ReduceTypeOp(DType dtype, ReduceOp op, MPI_Datatype* type, MPI_Op* mpi_op) {
  if (dtype == DType::kBF16) {
    *type = MPI_UINT16_T;
    *mpi_op = Bf16Sum();
    return;
  }
  *type = dtype == DType::kF32 ? MPI_FLOAT : dtype == DType::kU32 ? MPI_UINT32_T : MPI_INT64_T;
  *mpi_op = op == ReduceOp::kSum ? MPI_SUM : MPI_MAX;
}

Status CheckIntCounts(const char* what, int64_t total) {
  if (total > INT_MAX) {
    return InvalidArgument(std::string(what) + " with the MPI library's collective: " +
                           std::to_string(total) +
                           " elements exceed MPI's int displacements; use the ring");
  }
  return OkStatus();
}

class MpiCommunicator final : public Communicator, public internal::WatchdogClient {
 public:
  MpiCommunicator(MPI_Comm comm, int rank, int size, const CommOptions& options)
      : Communicator(rank, size, options.algorithm), comm_(comm), options_(options) {}
  ~MpiCommunicator() override { MPI_Comm_free(&comm_); }

  std::string_view name() const override { return "mpi"; }

  [[noreturn]] void Abort(int exit_code, std::string_view message) override {
    Report(message);
    EndJob(exit_code);
  }

  [[noreturn]] void OnTimeout(const char* what, double seconds) override {
    char msg[256];
    std::snprintf(msg, sizeof(msg),
                  "%s did not finish within %g s (a peer rank died or hangs); ending the job",
                  what, seconds);
    Report(msg);
    // Every rank that waits on the same dead or hung peer times out at about
    // the same moment: they entered the call together, give or take their
    // compute skew and the watchdog's 200 ms poll. The first to call
    // MPI_Abort has the launcher end the others, which lost their message
    // when it came first. So each prints first and then gives the others
    // this long to print theirs.
    timespec grace{kTimeoutReportSeconds, 0};
    nanosleep(&grace, nullptr);
    EndJob(1);
  }

 protected:
  Status DoAllGather(const void* send, void* recv, const Blocks& blocks,
                     DType dtype) override {
    internal::WatchdogScope watch(this, "all-gather", options_.timeout_seconds);
    if (algorithm() == CollectiveAlgorithm::kRing) {
      return internal::RingAllGather(*this, send, recv, blocks, dtype);
    }
    CountSent(RingAllGatherBytes(blocks.total, size(), rank(),
                                 static_cast<int64_t>(DTypeSize(dtype))));
    const int64_t elem = static_cast<int64_t>(DTypeSize(dtype));
    const void* in_place = static_cast<uint8_t*>(recv) + blocks.offsets[rank()] * elem;
    const void* src = send == in_place ? MPI_IN_PLACE : send;
    if (blocks.equal) {
      const int n = static_cast<int>(blocks.counts[0] * elem);
      return FromMpi(MPI_Allgather(src, n, MPI_BYTE, recv, n, MPI_BYTE, comm_), "Allgather");
    }
    FP8MOE_RETURN_IF_ERROR(CheckIntCounts("all-gather", blocks.total));
    std::vector<int> counts(size()), displs(size());
    for (int r = 0; r < size(); ++r) {
      counts[r] = static_cast<int>(blocks.counts[r]);
      displs[r] = static_cast<int>(blocks.offsets[r]);
    }
    const MPI_Datatype type = MoveType(dtype);
    return FromMpi(MPI_Allgatherv(src, counts[rank()], type, recv, counts.data(),
                                  displs.data(), type, comm_),
                   "Allgatherv");
  }

  Status DoReduceScatter(const void* send, void* recv, const Blocks& blocks, DType dtype,
                         ReduceOp op) override {
    internal::WatchdogScope watch(this, "reduce-scatter", options_.timeout_seconds);
    if (algorithm() == CollectiveAlgorithm::kRing) {
      return internal::RingReduceScatter(*this, send, recv, blocks, dtype, op, scratch_);
    }
    CountSent(RingReduceScatterBytes(blocks.total, size(), rank(),
                                     static_cast<int64_t>(DTypeSize(dtype))));
    MPI_Datatype type;
    MPI_Op mpi_op;
    ReduceTypeOp(dtype, op, &type, &mpi_op);
    if (blocks.equal) {
      return FromMpi(MPI_Reduce_scatter_block(send, recv, static_cast<int>(blocks.counts[0]),
                                              type, mpi_op, comm_),
                     "Reduce_scatter_block");
    }
    FP8MOE_RETURN_IF_ERROR(CheckIntCounts("reduce-scatter", blocks.total));
    std::vector<int> counts(size());
    for (int r = 0; r < size(); ++r) counts[r] = static_cast<int>(blocks.counts[r]);
    return FromMpi(MPI_Reduce_scatter(send, recv, counts.data(), type, mpi_op, comm_),
                   "Reduce_scatter");
  }

  Status DoAllReduce(const void* send, void* recv, int64_t count, DType dtype,
                     ReduceOp op) override {
    internal::WatchdogScope watch(this, "all-reduce", options_.timeout_seconds);
    if (algorithm() == CollectiveAlgorithm::kRing) {
      return internal::RingAllReduce(*this, send, recv, count, dtype, op, scratch_);
    }
    CountSent(RingAllReduceBytes(count, size(), rank(), static_cast<int64_t>(DTypeSize(dtype))));
    MPI_Datatype type;
    MPI_Op mpi_op;
    ReduceTypeOp(dtype, op, &type, &mpi_op);
    return FromMpi(MPI_Allreduce(send == recv ? MPI_IN_PLACE : send, recv,
                                 static_cast<int>(count), type, mpi_op, comm_),
                   "Allreduce");
  }

  Status DoBarrier() override {
    internal::WatchdogScope watch(this, "barrier", options_.timeout_seconds);
    return FromMpi(MPI_Barrier(comm_), "Barrier");
  }

  Result<std::unique_ptr<Communicator>> DoSplit(int color, int key,
                                                const std::vector<int64_t>&,
                                                const std::vector<int64_t>&) override {
    internal::WatchdogScope watch(this, "split", options_.timeout_seconds);
    MPI_Comm split;
    FP8MOE_RETURN_IF_ERROR(FromMpi(MPI_Comm_split(comm_, color, key, &split), "Comm_split"));
    MPI_Comm_set_errhandler(split, MPI_ERRORS_RETURN);
    int rank = 0, size = 1;
    MPI_Comm_rank(split, &rank);
    MPI_Comm_size(split, &size);
    return std::unique_ptr<Communicator>(new MpiCommunicator(split, rank, size, options_));
  }

  Result<CommRequest> DoISend(const void* buf, int64_t bytes, int peer, int tag) override {
    const int slot = NewSlot(-1);
    const int err = MPI_Isend(buf, static_cast<int>(bytes), MPI_BYTE, peer, tag, comm_,
                              &slots_[slot].request);
    if (err != MPI_SUCCESS) {
      FreeSlot(slot);
      return FromMpi(err, "Isend");
    }
    return CommRequest{static_cast<uint64_t>(slot) + 1};
  }

  Result<CommRequest> DoIRecv(void* buf, int64_t bytes, int peer, int tag) override {
    const int slot = NewSlot(bytes);
    const int err = MPI_Irecv(buf, static_cast<int>(bytes), MPI_BYTE, peer, tag, comm_,
                              &slots_[slot].request);
    if (err != MPI_SUCCESS) {
      FreeSlot(slot);
      return FromMpi(err, "Irecv");
    }
    return CommRequest{static_cast<uint64_t>(slot) + 1};
  }

  Status DoWaitAll(std::span<CommRequest> requests) override {
    internal::WatchdogScope watch(this, "a point-to-point wait", options_.timeout_seconds);
    requests_.clear();
    statuses_.resize(requests.size());
    std::vector<int>& slots = wait_slots_;
    slots.clear();
    for (CommRequest& r : requests) {
      if (r.handle == 0) continue;
      const uint64_t slot = r.handle - 1;
      if (slot >= slots_.size() || !slots_[slot].used) {
        return InvalidArgument("wait: request " + std::to_string(r.handle) +
                               " is not pending on this rank");
      }
      slots.push_back(static_cast<int>(slot));
      requests_.push_back(slots_[slot].request);
      r.handle = 0;
    }
    // MPI_Waitall spins on the CPU until the peer answers. Where ranks
    // share cores with each other or with other work (oversubscribed, a
    // busy machine) the spinning rank takes the core its peer needs to get
    // there: measured on 2 busy cores, the trainer's 2-rank compute took 2x
    // the 1-rank time of the same half batch. A sleep between polls gives
    // the core back but costs latency on every wait: nanosleep(50 us) sleeps
    // ~100 us (timer slack), and a training step waits ~30 times; a 2-rank
    // step of the default model took 1.15-1.2x the step of 2 ranks that
    // yield instead (docs/distributed.md). So: spin a little, then
    // sched_yield between polls (the core goes to whoever else is ready on
    // it, and the poll resumes at once when nobody is), and only a wait
    // longer than g_yield_seconds (a peer writing a checkpoint, a slow rank)
    // sleeps between polls, so a rank that waits long burns no core. Where
    // this machine's ranks outnumber its cores, a yielding rank still takes
    // its turns on a core a peer needs (4 ranks on 2 cores were slower in 5
    // of 6 runs), so there every wait past the spin sleeps, as before.
    int done = 0;
    int err = MPI_Testall(static_cast<int>(requests_.size()), requests_.data(), &done,
                          statuses_.data());
    timespec start{};
    for (int polls = 0; err == MPI_SUCCESS && done == 0; ++polls) {
      if (polls == kSpinPolls) clock_gettime(CLOCK_MONOTONIC, &start);
      if (polls >= kSpinPolls) {
        timespec now{};
        clock_gettime(CLOCK_MONOTONIC, &now);
        const double waited = static_cast<double>(now.tv_sec - start.tv_sec) +
                              1e-9 * static_cast<double>(now.tv_nsec - start.tv_nsec);
        if (waited < g_yield_seconds) {
          sched_yield();
        } else {
          timespec ts{0, kPollSleepNs};
          nanosleep(&ts, nullptr);
        }
      }
      err = MPI_Testall(static_cast<int>(requests_.size()), requests_.data(), &done,
                        statuses_.data());
    }
    Status result = OkStatus();
    for (size_t i = 0; i < slots.size(); ++i) {
      const Slot& s = slots_[slots[i]];
      if (err == MPI_ERR_IN_STATUS && statuses_[i].MPI_ERROR != MPI_SUCCESS && result.ok()) {
        result = FromMpi(statuses_[i].MPI_ERROR, s.expected_bytes >= 0 ? "receive" : "send");
      }
      if (s.expected_bytes >= 0 && result.ok()) {
        int got = 0;
        MPI_Get_count(&statuses_[i], MPI_BYTE, &got);
        if (got != s.expected_bytes) {
          result = InvalidArgument("receive of " + std::to_string(s.expected_bytes) +
                                   " bytes from rank " + std::to_string(statuses_[i].MPI_SOURCE) +
                                   " matched a message of " + std::to_string(got) + " bytes");
        }
      }
      FreeSlot(slots[i]);
    }
    if (result.ok() && err != MPI_SUCCESS && err != MPI_ERR_IN_STATUS) {
      result = FromMpi(err, "Waitall");
    }
    return result;
  }

 private:
  struct Slot {
    MPI_Request request = MPI_REQUEST_NULL;
    int64_t expected_bytes = -1;  // receives: the size they must get
    bool used = false;
  };
  int NewSlot(int64_t expected_bytes) {
    int slot;
    if (!free_.empty()) {
      slot = free_.back();
      free_.pop_back();
    } else {
      slot = static_cast<int>(slots_.size());
      slots_.emplace_back();
    }
    slots_[slot] = {MPI_REQUEST_NULL, expected_bytes, true};
    return slot;
  }
  void FreeSlot(int slot) {
    slots_[slot].used = false;
    free_.push_back(slot);
  }

  // "fp8moe rank R/N: message" on stderr, flushed.
  void Report(std::string_view message) const {
    std::fprintf(stderr, "fp8moe rank %d/%d: %.*s\n", rank(), size(),
                 static_cast<int>(message.size()), message.data());
    std::fflush(stderr);
  }
  [[noreturn]] void EndJob(int exit_code) {
    MPI_Abort(comm_, exit_code);
    std::_Exit(exit_code);  // MPI_Abort does not return; if it did, still end
  }

  MPI_Comm comm_;
  CommOptions options_;
  internal::RingScratch scratch_;
  std::vector<Slot> slots_;
  std::vector<int> free_;
  // WaitAll's arrays, kept to avoid allocating per call.
  std::vector<MPI_Request> requests_;
  std::vector<MPI_Status> statuses_;
  std::vector<int> wait_slots_;
};

bool g_runtime_started = false;

}  // namespace

std::string MpiLibraryVersion() {
  char text[MPI_MAX_LIBRARY_VERSION_STRING];
  int len = 0;
  MPI_Get_library_version(text, &len);
  std::string s(text, static_cast<size_t>(len));
  const size_t nl = s.find_first_of(std::string("\r\n\0", 3));
  return nl == std::string::npos ? s : s.substr(0, nl);
}

struct MpiRuntime::ExitBarrier {
  MPI_Comm comm = MPI_COMM_NULL;
};

Result<std::unique_ptr<MpiRuntime>> MpiRuntime::Start(const MpiRuntimeOptions& options) {
  if (g_runtime_started) {
    return FailedPrecondition("MPI runtime: already started in this process (MPI can be "
                              "initialised once)");
  }
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized) {
    return FailedPrecondition("MPI runtime: MPI was initialised outside fp8moe");
  }
  int provided = 0;
  const int err = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
  if (err != MPI_SUCCESS) return FromMpi(err, "Init_thread");
  g_runtime_started = true;
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (provided < MPI_THREAD_MULTIPLE) {
    // The watchdog would call MPI_Abort from its own thread; without
    // MPI_THREAD_MULTIPLE that is not allowed. Refuse rather than risk it.
    MPI_Finalize();
    return FailedPrecondition(
        "MPI runtime: the MPI library gives no MPI_THREAD_MULTIPLE (got level " +
        std::to_string(provided) + "); fp8moe's watchdog needs it");
  }
  if (options.report_termination) InstallTerminationReport(rank, size);
  // BarrierWithin's communicator, made now: duplicating is collective.
  auto exit_barrier = std::make_unique<ExitBarrier>();
  if (const int dup = MPI_Comm_dup(MPI_COMM_WORLD, &exit_barrier->comm); dup != MPI_SUCCESS) {
    MPI_Finalize();
    return FromMpi(dup, "Comm_dup");
  }
  MPI_Comm_set_errhandler(exit_barrier->comm, MPI_ERRORS_RETURN);
  // The ranks on this machine against its cores (DoWaitAll's polling).
  MPI_Comm local;
  if (MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &local) ==
      MPI_SUCCESS) {
    int local_size = 1;
    MPI_Comm_size(local, &local_size);
    MPI_Comm_free(&local);
    const long cores = sysconf(_SC_NPROCESSORS_ONLN);
    g_yield_seconds = cores > 0 && local_size > cores ? 0.0 : kYieldSeconds;
  }
  return std::unique_ptr<MpiRuntime>(new MpiRuntime(rank, size, std::move(exit_barrier)));
}

MpiRuntime::MpiRuntime(int rank, int size, std::unique_ptr<ExitBarrier> exit_barrier)
    : rank_(rank), size_(size), exit_barrier_(std::move(exit_barrier)) {}

MpiRuntime::~MpiRuntime() {
  MPI_Comm_free(&exit_barrier_->comm);
  MPI_Finalize();
}

bool MpiRuntime::BarrierWithin(double seconds) {
  MPI_Request request;
  if (MPI_Ibarrier(exit_barrier_->comm, &request) != MPI_SUCCESS) return false;
  timespec start{};
  clock_gettime(CLOCK_MONOTONIC, &start);
  for (;;) {
    int done = 0;
    if (MPI_Test(&request, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) return false;
    if (done) return true;
    timespec now{};
    clock_gettime(CLOCK_MONOTONIC, &now);
    const double waited = static_cast<double>(now.tv_sec - start.tv_sec) +
                          1e-9 * static_cast<double>(now.tv_nsec - start.tv_nsec);
    if (waited >= seconds) return false;
    timespec poll{0, 1'000'000};  // 1 ms: a rank that waits here burns no core
    nanosleep(&poll, nullptr);
  }
}

Result<std::unique_ptr<Communicator>> MpiRuntime::World(const CommOptions& options) {
  MPI_Comm comm;
  FP8MOE_RETURN_IF_ERROR(FromMpi(MPI_Comm_dup(MPI_COMM_WORLD, &comm), "Comm_dup"));
  MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
  return std::unique_ptr<Communicator>(new MpiCommunicator(comm, rank_, size_, options));
}

}  // namespace fp8moe

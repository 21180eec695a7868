// The MPI communicator: one rank per process under mpirun (library
// fp8moe::mpi, built when MPI is found; link it only where MPI is wanted).
// This header does not include <mpi.h>.
//
//   if (fp8moe::LaunchedByMpi()) {
//     auto runtime = fp8moe::MpiRuntime::Start();   // MPI_Init_thread
//     auto comm = (*runtime)->World(options);       // all ranks of the job
//     ... train on *comm ...
//   }                                               // MPI_Finalize
//
// Faults: every blocking call (collective, Barrier, WaitAll) runs under a
// watchdog with options.timeout_seconds; when it expires (a peer died or
// hangs) the rank prints "fp8moe rank R/N: ... did not finish within T s",
// waits a second for the other ranks waiting on the same peer to print
// theirs, and calls MPI_Abort, which ends every rank. A rank that the launcher
// terminates because another rank failed prints that it was terminated
// (SIGTERM) before it exits. docs/distributed.md has the measured behaviour.
#ifndef FP8MOE_MPI_H_
#define FP8MOE_MPI_H_

#include <memory>
#include <string>

#include "fp8moe/communicator.h"
#include "fp8moe/status.h"

namespace fp8moe {

// True when an MPI launcher started this process (Open MPI's mpirun, MPICH's
// hydra or Slurm's PMI name a rank in the environment). Reads the
// environment only: MPI stays uninitialised. Defined in the core library
// (fp8moe), so a build without MPI can ask too.
bool LaunchedByMpi();

// The MPI library's version line, e.g. "Open MPI v4.1.4, ...". Valid before
// MPI_Init.
std::string MpiLibraryVersion();

struct MpiRuntimeOptions {
  // Print "fp8moe rank R/N: terminated by signal ..." when the launcher ends
  // this rank with SIGTERM (because another rank failed).
  bool report_termination = true;
};

// Owns MPI's initialisation for the process: Start() calls MPI_Init_thread
// (MPI_THREAD_MULTIPLE: the watchdog thread may call MPI_Abort while the
// main thread waits inside MPI); the destructor calls MPI_Finalize. One per
// process, and it cannot be started again after it ends (MPI's rule).
// Destroy every communicator before the runtime.
class MpiRuntime {
 public:
  static Result<std::unique_ptr<MpiRuntime>> Start(const MpiRuntimeOptions& options = {});
  ~MpiRuntime();
  MpiRuntime(const MpiRuntime&) = delete;
  MpiRuntime& operator=(const MpiRuntime&) = delete;

  int world_rank() const { return rank_; }
  int world_size() const { return size_; }

  // A communicator over every rank of the job (its own duplicate of
  // MPI_COMM_WORLD, errors returned as Status). Collective: every rank calls
  // it, in the same order.
  Result<std::unique_ptr<Communicator>> World(const CommOptions& options = {});

  // For a rank that is about to exit with an error it has printed: waits at
  // most `seconds` (> 0) until every rank of the job has called this too,
  // and returns true when they all did. Where all ranks fail together, none
  // then exits (and so has the launcher end the others) before every one
  // has printed. A barrier on a duplicate of MPI_COMM_WORLD of its own, so a
  // rank may call it while its peers wait in a collective on another
  // communicator. false: the time ran out, the others are busy elsewhere
  // (the error is this rank's alone) and the barrier stays pending: end the
  // job (Communicator::Abort) rather than return to MPI_Finalize.
  bool BarrierWithin(double seconds);

 private:
  struct ExitBarrier;  // the communicator of BarrierWithin (holds an MPI_Comm)
  MpiRuntime(int rank, int size, std::unique_ptr<ExitBarrier> exit_barrier);
  int rank_, size_;
  std::unique_ptr<ExitBarrier> exit_barrier_;
};

}  // namespace fp8moe

#endif  // FP8MOE_MPI_H_

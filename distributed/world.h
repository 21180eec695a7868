// The ranks this process runs with, for the commands that communicate (bench
// comm, train). Two implementations, chosen at build time by CMake:
// world_mpi.cc (MPI found: MPI under mpirun, one rank otherwise) and
// world_single.cc (built without MPI: always one rank). Library
// fp8moe_world, for the command and its benches; not installed.
#ifndef FP8MOE_DISTRIBUTED_WORLD_H_
#define FP8MOE_DISTRIBUTED_WORLD_H_

#include <memory>
#include <string>

#include "fp8moe/communicator.h"
#include "fp8moe/status.h"

namespace fp8moe {

class World {
 public:
  virtual ~World() = default;
  // A communicator over every rank (collective under MPI: all ranks call it).
  virtual Result<std::unique_ptr<Communicator>> Open(const CommOptions& options) = 0;
  // "mpi (Open MPI v4.1.4 ...), 4 ranks" or "single rank (...)".
  virtual std::string Describe() const = 0;
  // A failing rank's wait, after it printed its error, for every rank to
  // fail too (MpiRuntime::BarrierWithin): true when all came within
  // `seconds`; false means end the job (Communicator::Abort). One rank: true.
  virtual bool BarrierWithin(double seconds) = 0;
};

// Starts MPI when an MPI launcher started this process, else one rank.
Result<std::unique_ptr<World>> StartWorld();

// For `fp8moe info`: the MPI library linked, or that there is none. Never
// initialises MPI.
std::string MpiInfo();

}  // namespace fp8moe

#endif  // FP8MOE_DISTRIBUTED_WORLD_H_

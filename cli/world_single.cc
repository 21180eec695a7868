// StartWorld without MPI: always one rank.
#include <cstdio>
#include <cstdlib>

#include "cli/world.h"

namespace fp8moe::cli {
namespace {

class SingleWorld final : public World {
 public:
  Result<std::unique_ptr<Communicator>> Open(const CommOptions&) override {
    return MakeSingleRankCommunicator();
  }
  std::string Describe() const override { return "single rank (built without MPI)"; }
};

}  // namespace

Result<std::unique_ptr<World>> StartWorld() {
  // The variables LaunchedByMpi (dist/mpi_communicator.cc) reads, which this
  // build does not have.
  if (std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMIX_RANK") != nullptr ||
      std::getenv("PMI_RANK") != nullptr || std::getenv("PMI_SIZE") != nullptr) {
    return FailedPrecondition(
        "this fp8moe was built without MPI but was started by an MPI launcher; rebuild with "
        "MPI (scripts/setup installs Open MPI) or run it without mpirun");
  }
  return std::unique_ptr<World>(new SingleWorld);
}

std::string MpiInfo() { return "none (built without MPI: one rank only)"; }

}  // namespace fp8moe::cli

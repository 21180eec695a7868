// StartWorld without MPI: always one rank.
#include "distributed/world.h"
#include "fp8moe/mpi.h"

namespace fp8moe {
namespace {

class SingleWorld final : public World {
 public:
  Result<std::unique_ptr<Communicator>> Open(const CommOptions&) override {
    return MakeSingleRankCommunicator();
  }
  std::string Describe() const override { return "single rank (built without MPI)"; }
  bool BarrierWithin(double) override { return true; }
};

}  // namespace

Result<std::unique_ptr<World>> StartWorld() {
  if (LaunchedByMpi()) {
    return FailedPrecondition(
        "this fp8moe was built without MPI but was started by an MPI launcher; rebuild with "
        "MPI (scripts/setup installs Open MPI) or run it without mpirun");
  }
  return std::unique_ptr<World>(new SingleWorld);
}

std::string MpiInfo() { return "none (built without MPI: one rank only)"; }

}  // namespace fp8moe
